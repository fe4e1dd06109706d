// SegmentMatcher: the checks every transport's post() makes of a transfer's segments before
// it moves a byte (transport.h): as many local as remote descs, lengths equal pairwise, every
// non-empty local desc inside one registration of this transport (same kind and device),
// every non-empty remote desc inside one key loaded for the peer. One implementation, so that
// tcp, ucx, verbs and loopback refuse the same things and name them in the same words; each
// transport keeps its own per-registration and per-key data and looks it up by what match()
// returns.
//
// Errors: match() returns kInvalidArgument whose message starts with the transport's name and
// names the segment and what is wrong with it.
// Threads: none of its own and not thread-safe; a transport's matcher is used on the thread
// that registers memory and posts (the owner thread, transport.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "kvtransfer/transport.h"

namespace pd::kvt {

// The addresses one remote key exposes. Only addresses: what kind of memory is behind a key
// is the exposing side's business (it checks the write again when it lands).
struct KeyRange {
  uint64_t addr = 0;
  uint64_t len = 0;
  // True when [a, a + n) lies inside this range and does not wrap around the address space.
  bool covers(uint64_t a, uint64_t n) const { return a >= addr && a + n >= a && a + n <= addr + len; }
};

// One non-empty (local, remote) pair that passed.
struct SegmentMatch {
  size_t index = 0;      // position in the local / remote lists; empty pairs have no match
  MemHandle region = 0;  // the registration that holds local[index]
  size_t key = 0;        // position, in the key list given to match(), of the key holding remote[index]
};

class SegmentMatcher {
 public:
  // `transport` prefixes every message: "tcp transport", "ucx", "verbs", ...
  explicit SegmentMatcher(std::string transport) : transport_(std::move(transport)) {}

  // Mirrors the transport's registrations; a handle is added once, removing an unknown one
  // is a no-op.
  void addRegion(MemHandle handle, const MemDesc& desc);
  void removeRegion(MemHandle handle);
  size_t regionCount() const { return regions_.size(); }

  // Checks a post's lists against the registrations and `keys` (the peer's keys in the
  // transport's own order) and returns one match per non-empty pair, in list order.
  // `peerName` is for the message.
  Result<std::vector<SegmentMatch>> match(const DescList& local, const DescList& remote,
                                          const std::vector<KeyRange>& keys, std::string_view peerName) const;

 private:
  std::string transport_;
  std::vector<std::pair<MemHandle, MemDesc>> regions_;  // few (one per pool): a scan is cheapest
};

}  // namespace pd::kvt
