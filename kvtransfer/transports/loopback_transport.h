// LoopbackTransport: kvt::Transport between transports of the SAME process, by memcpy.
// For unit tests of everything above the transport (agent, FaultTransport) and
// as the conformance suite's reference. A peer in another process is refused at loadPeer.
//
// post() only queues; progress() performs queued copies (owner thread). Destroying a
// transport makes it unreachable: transfers queued to it fail with kUnavailable. Every write
// is checked against the regions the target exposed, like tcp, and write grants are
// receiver-checked like tcp's (caps().receiverFenced): a write under a grant must lie inside
// its ranges, and a revoked grant is refused (revokeWrite takes the lock every sender holds
// while it copies, so no copy under the grant is in progress once it returns).
//
// Threads: as transport.h. Two loopback transports may be driven by two different threads.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "kvtransfer/segment_matcher.h"
#include "kvtransfer/transport.h"
#include "kvtransfer/transport_factory.h"

namespace pd::kvt {

class LoopbackTransport final : public Transport {
 public:
  static Result<std::unique_ptr<Transport>> create(const TransportOptions& options);
  explicit LoopbackTransport(const TransportOptions& options);
  ~LoopbackTransport() override;

  TransportCaps caps() const override;
  Result<MemHandle> registerMemory(const MemDesc& desc) override;
  Status deregisterMemory(MemHandle handle) override;
  Result<std::string> packRemoteKey(MemHandle handle) override;
  Result<std::string> localConnInfo() override;
  Result<PeerId> loadPeer(const PeerInfo& peer) override;
  Status unloadPeer(PeerId peer) override;
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& grant) override;
  Result<std::string> grantWrite(const DescList& ranges) override;
  Status revokeWrite(const std::string& grant) override;
  Status poll(TransferId id) override;
  Status cancel(TransferId id) override;
  bool progress() override;

 private:
  struct Pending {
    TransferId id;
    PeerId peer;
    DescList local, remote;
    uint64_t grant = 0;  // the target's grant token; 0: the region keys
  };
  struct Peer {
    std::string name;
    uint64_t instance;
    std::vector<KeyRange> keys;  // what the peer exposed (addresses in this process)
  };
  // Called by a sender's progress() with the registry lock held (so we cannot be destroyed).
  Status acceptWrite(const MemDesc& remote, uint64_t grant);

  TransportOptions options_;
  uint64_t instance_;
  std::unordered_map<MemHandle, MemDesc> regions_;
  SegmentMatcher matcher_{"loopback transport"};  // mirrors regions_
  std::unordered_map<PeerId, Peer> peers_;
  std::deque<Pending> queue_;
  std::unordered_map<TransferId, std::optional<Status>> outcomes_;
  MemHandle nextHandle_ = 1;
  PeerId nextPeer_ = 1;
  TransferId nextTransfer_ = 1;

  std::mutex mu_;  // guards exposures_ and grants_ (touched by senders' threads)
  std::unordered_map<uint64_t, MemDesc> exposures_;
  std::unordered_map<uint64_t, std::vector<MemDesc>> grants_;  // token -> granted ranges
};

}  // namespace pd::kvt
