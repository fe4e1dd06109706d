// Fair admission of connections that have not finished their handshake (docs/security.md
// "Peer hardening"): the slots a FramedServer gives unauthenticated peers.
//
// Why: with one global cap (64), ~80 silent connections from one outsider, reopened as they
// were closed, kept a restarted worker from ever registering. Here one source address holds at
// most `perAddress` slots, and when all `total` are taken the address holding the most gives
// one up, so an outsider cannot starve peers at other addresses. Connections that have sent
// nothing yet go first: a legitimate peer sends its hello as soon as TCP connects, so evicting
// the silent ones also protects a legitimate peer that shares the flooder's address.
//
// Policy, for a new connection from address A:
//   1. A holds perAddress slots: A's oldest silent connection is evicted, or (none silent) the
//      new connection is refused.
//   2. All total slots are taken: the address B holding the most slots gives one up when it
//      holds more than A (its oldest silent connection, else its newest); otherwise the new
//      connection is refused.
// Threads: any thread (one mutex). The caller closes what admit() names; ids are the caller's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

namespace pd::net {

class HandshakeSlots {
 public:
  HandshakeSlots(size_t total, size_t perAddress) : total_(total), perAddress_(perAddress) {}

  struct Admission {
    bool admitted = false;
    uint64_t evict = 0;  // non-zero: close this connection (its slot went to the new one)
  };
  // address: the peer's host (no port).
  Admission admit(uint64_t id, const std::string& address);
  // The connection sent its first byte: it is no longer the first to be evicted.
  void heard(uint64_t id, const std::string& address);
  // The connection finished its handshake or closed. Unknown ids are ignored.
  void release(uint64_t id, const std::string& address);

  size_t held() const;
  size_t heldBy(const std::string& address) const;

 private:
  struct Slot {
    uint64_t id;
    bool heard;
  };
  using Slots = std::deque<Slot>;  // oldest first
  // Takes one slot from `slots` (its oldest silent one; else, when allowNewest, its newest).
  // Returns the evicted id, or 0.
  uint64_t evictFrom(Slots& slots, bool allowNewest);

  const size_t total_;
  const size_t perAddress_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, Slots> byAddress_;
  size_t held_ = 0;
};

}  // namespace pd::net
