// FaultTransport: decorates any Transport and injects the failures the agent and the
// workers must survive (tests only). Everything not injected passes straight through.
//
//   failAfterPosts = N     posts after the first N succeed at post() but their transfer
//                          fails with kInternal ("injected") at poll(); the peer stays alive.
//   latency = d            a transfer's outcome becomes visible no sooner than d after post.
//   killAfterPosts = N     right after forwarding post N+1, the connection is killed: with a
//                          `killer` (e.g. TcpTransport::dropConnections) for real, otherwise
//                          simulated (pending transfers fail with kUnavailable, and the peer
//                          stays dead).
//
// Threads: as transport.h (the decorator adds no threads).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>

#include "kvtransfer/transport.h"

namespace pd::kvt {

struct FaultOptions {
  int failAfterPosts = -1;
  std::chrono::milliseconds latency{0};
  int killAfterPosts = -1;
  std::function<void(PeerId)> killer;  // optional: kills the inner transport's connection
  // caps() claims direct GPU memory but registering kCuda fails with kUnimplemented, as verbs
  // does on a NIC without dma-buf support (the agent must move on to the next transport).
  bool claimCudaButRefuse = false;
  // Overrides caps().receiverFenced (tests of KV fencing: a tcp lane that claims to be
  // one-sided, so its owner must quarantine instead of relying on the receiver's check).
  std::optional<bool> receiverFenced;
};

class FaultTransport final : public Transport {
 public:
  FaultTransport(std::unique_ptr<Transport> inner, FaultOptions options);

  Transport& inner() { return *inner_; }
  int postsSeen() const { return posts_; }

  TransportCaps caps() const override;
  Result<MemHandle> registerMemory(const MemDesc& desc) override;
  Status deregisterMemory(MemHandle handle) override { return inner_->deregisterMemory(handle); }
  Result<std::string> packRemoteKey(MemHandle handle) override { return inner_->packRemoteKey(handle); }
  Result<std::string> localConnInfo() override { return inner_->localConnInfo(); }
  Result<PeerId> loadPeer(const PeerInfo& peer) override { return inner_->loadPeer(peer); }
  bool peerAlive(PeerId peer) const override { return inner_->peerAlive(peer); }
  Result<std::string> peerConnInfo(PeerId peer) override { return inner_->peerConnInfo(peer); }
  Status unloadPeer(PeerId peer) override;
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& grant) override;
  Result<std::string> grantWrite(const DescList& ranges) override { return inner_->grantWrite(ranges); }
  Status revokeWrite(const std::string& grant) override { return inner_->revokeWrite(grant); }
  Status poll(TransferId id) override;
  Status cancel(TransferId id) override;
  bool progress() override { return inner_->progress(); }

 private:
  struct Entry {
    PeerId peer = 0;
    std::optional<TransferId> innerId;  // absent when the failure is injected
    std::optional<Status> outcome;
    std::chrono::steady_clock::time_point visibleAt;
  };
  void killPeer(PeerId peer);

  std::unique_ptr<Transport> inner_;
  FaultOptions options_;
  int posts_ = 0;
  TransferId nextId_ = 1;
  std::unordered_map<TransferId, Entry> entries_;
  std::set<PeerId> killed_;
};

}  // namespace pd::kvt
