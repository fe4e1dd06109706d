// A test-only Transport that connects like an RC queue pair: every peer pair needs one
// endpoint on each side, each connected to the other, and bytes move only when BOTH sides
// loaded each other. It lets the agent's two-step exchange (agent.h) be tested without an RDMA
// device; the verbs transport itself follows the same pairing rules (verbs::PendingQps).
//
// Blobs: localConnInfo() = "offer:<endpoint>" (a fresh endpoint, pending); peerConnInfo(peer) =
// "reply:<our endpoint>:<theirs>"; keys = "key:<addr>:<len>". loadPeer(offer) takes the oldest
// pending endpoint or a fresh one; loadPeer(reply) takes exactly the endpoint it names.
// All transports of one test share a PairedFabric (same process: writes are memcpy).
// A transfer over a pair that is not connected both ways fails with kUnavailable at poll(),
// as an RC WRITE to a QP that never reached RTR ends in a retry-exceeded completion.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvtransfer/transport.h"

namespace pd::kvt::testing {

class PairedTransport;

struct PairedFabric {
  struct Endpoint {
    PairedTransport* owner = nullptr;
    uint64_t remote = 0;  // the endpoint this one is connected to; 0 = not connected
  };
  std::map<uint64_t, Endpoint> endpoints;
  uint64_t next = 1;
};

class PairedTransport final : public Transport {
 public:
  PairedTransport(std::shared_ptr<PairedFabric> fabric, std::string name)
      : fabric_(std::move(fabric)), name_(std::move(name)) {}

  TransportCaps caps() const override {
    TransportCaps c;
    c.name = "paired";
    c.oneSided = true;
    c.details = "test-only RC-like pairs";
    return c;
  }

  Result<MemHandle> registerMemory(const MemDesc& desc) override {
    regions_[nextHandle_] = desc;
    return nextHandle_++;
  }
  Status deregisterMemory(MemHandle h) override {
    return regions_.erase(h) ? Status::ok() : notFound("paired: unknown handle");
  }
  Result<std::string> packRemoteKey(MemHandle h) override {
    auto it = regions_.find(h);
    if (it == regions_.end()) return notFound("paired: unknown handle");
    return "key:" + std::to_string(it->second.addr) + ":" + std::to_string(it->second.len);
  }
  Result<std::string> localConnInfo() override {
    const uint64_t ep = newEndpoint();
    pending_.push_back(ep);
    return "offer:" + std::to_string(ep);
  }

  Result<PeerId> loadPeer(const PeerInfo& info) override {
    unsigned long long theirs = 0, mine = 0;
    uint64_t ep = 0;
    if (std::sscanf(info.connInfo.c_str(), "reply:%llu:%llu", &theirs, &mine) == 2) {
      auto it = std::find(pending_.begin(), pending_.end(), mine);
      if (it == pending_.end())
        return failedPrecondition("paired: reply names endpoint " + std::to_string(mine) + ", not pending here");
      pending_.erase(it);
      ep = mine;
    } else if (std::sscanf(info.connInfo.c_str(), "offer:%llu", &theirs) == 1) {
      if (!pending_.empty()) {
        ep = pending_.front();
        pending_.pop_front();
      } else {
        ep = newEndpoint();
      }
    } else {
      return invalidArgument("paired: bad connection info '" + info.connInfo + "'");
    }
    Peer p;
    p.mine = ep;
    p.theirs = theirs;
    for (const auto& k : info.remoteKeys) {
      unsigned long long addr = 0, len = 0;
      if (std::sscanf(k.c_str(), "key:%llu:%llu", &addr, &len) != 2) return invalidArgument("paired: bad key");
      p.keys.push_back(MemDesc{static_cast<uintptr_t>(addr), static_cast<size_t>(len)});
    }
    fabric_->endpoints[ep].remote = theirs;
    peers_[nextPeer_] = std::move(p);
    return nextPeer_++;
  }
  Result<std::string> peerConnInfo(PeerId peer) override {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return notFound("paired: unknown peer");
    return "reply:" + std::to_string(it->second.mine) + ":" + std::to_string(it->second.theirs);
  }
  Status unloadPeer(PeerId peer) override {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return notFound("paired: unknown peer");
    fabric_->endpoints.erase(it->second.mine);
    peers_.erase(it);
    return Status::ok();
  }

  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& /*grant*/) override {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return notFound("paired: unknown peer");
    if (local.size() != remote.size()) return invalidArgument("paired: segment counts differ");
    for (size_t i = 0; i < local.size(); ++i) {
      bool inKey = false;
      for (const auto& k : it->second.keys) inKey |= k.contains(remote[i]);
      if (!inKey || local[i].len != remote[i].len) return invalidArgument("paired: segment " + std::to_string(i));
    }
    // Delivered only over a pair connected both ways.
    auto& eps = fabric_->endpoints;
    const uint64_t a = it->second.mine, b = it->second.theirs;
    Status outcome;
    auto eb = eps.find(b);
    if (eps.count(a) == 0 || eps[a].remote != b || eb == eps.end() || eb->second.remote != a) {
      outcome = unavailable("paired '" + name_ + "': endpoint " + std::to_string(a) + " <-> " + std::to_string(b) +
                            " is not connected both ways");
    } else {
      for (size_t i = 0; i < local.size(); ++i) std::memcpy(remote[i].ptr(), local[i].ptr(), local[i].len);
    }
    transfers_[nextTransfer_] = outcome;
    return nextTransfer_++;
  }
  Status poll(TransferId id) override {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return notFound("paired: unknown transfer");
    Status s = it->second;
    transfers_.erase(it);
    return s;
  }
  Status cancel(TransferId) override { return failedPrecondition("paired: transfers finish at post"); }
  bool progress() override { return false; }

  size_t pendingEndpoints() const { return pending_.size(); }

 private:
  struct Peer {
    uint64_t mine = 0, theirs = 0;
    std::vector<MemDesc> keys;
  };
  uint64_t newEndpoint() {
    const uint64_t ep = fabric_->next++;
    fabric_->endpoints[ep] = PairedFabric::Endpoint{this, 0};
    return ep;
  }

  std::shared_ptr<PairedFabric> fabric_;
  std::string name_;
  std::deque<uint64_t> pending_;
  std::map<MemHandle, MemDesc> regions_;
  std::map<PeerId, Peer> peers_;
  std::map<TransferId, Status> transfers_;
  uint64_t nextHandle_ = 1, nextPeer_ = 1, nextTransfer_ = 1;
};

}  // namespace pd::kvt::testing
