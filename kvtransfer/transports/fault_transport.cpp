#include "kvtransfer/transports/fault_transport.h"

#include "common/base/log.h"

namespace pd::kvt {

FaultTransport::FaultTransport(std::unique_ptr<Transport> inner, FaultOptions options)
    : inner_(std::move(inner)), options_(std::move(options)) {}

TransportCaps FaultTransport::caps() const {
  TransportCaps c = inner_->caps();
  if (options_.receiverFenced) c.receiverFenced = *options_.receiverFenced;
  c.name = "fault(" + c.name + ")";
  if (options_.claimCudaButRefuse) {
    c.cudaMemory = true;
    c.cudaStaged = false;
    c.cudaPath = "direct GPU memory (fault: always refused)";
  }
  return c;
}

Result<MemHandle> FaultTransport::registerMemory(const MemDesc& desc) {
  if (options_.claimCudaButRefuse && desc.kind == MemKind::kCuda) {
    return unimplemented("fault transport: registering GPU memory " + toString(desc) + " refused (injected)");
  }
  return inner_->registerMemory(desc);
}

Status FaultTransport::unloadPeer(PeerId peer) {
  killed_.erase(peer);
  return inner_->unloadPeer(peer);
}

Result<TransferId> FaultTransport::post(const DescList& local, const DescList& remote, PeerId peer,
                                        const std::string& grant) {
  if (killed_.count(peer)) {
    return unavailable("fault transport: peer " + std::to_string(peer) + " connection was killed (injected)");
  }
  const int n = posts_++;
  Entry e;
  e.peer = peer;
  e.visibleAt = std::chrono::steady_clock::now() + options_.latency;
  if (options_.failAfterPosts >= 0 && n >= options_.failAfterPosts) {
    e.outcome = internalError("fault transport: transfer failed (injected after " +
                              std::to_string(options_.failAfterPosts) + " posts)");
  } else {
    PD_ASSIGN_OR_RETURN(TransferId inner, inner_->post(local, remote, peer, grant));
    e.innerId = inner;
  }
  TransferId id = nextId_++;
  entries_[id] = std::move(e);
  if (options_.killAfterPosts >= 0 && n == options_.killAfterPosts) killPeer(peer);
  return id;
}

void FaultTransport::killPeer(PeerId peer) {
  PD_LOG(kInfo, "kvt.fault") << "killing the connection to peer " << peer << " (injected)";
  if (options_.killer) {
    options_.killer(peer);
    return;
  }
  killed_.insert(peer);
  for (auto& [id, e] : entries_) {
    if (e.peer != peer || e.outcome) continue;
    if (e.innerId && inner_->cancel(*e.innerId).isOk()) (void)inner_->poll(*e.innerId);  // consume it
    e.innerId.reset();
    e.outcome =
        unavailable("fault transport: connection to peer " + std::to_string(peer) + " killed mid-transfer (injected)");
  }
}

Status FaultTransport::poll(TransferId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return notFound("fault transport: transfer " + std::to_string(id) + " is unknown or already reported");
  }
  Entry& e = it->second;
  if (!e.outcome) {
    Status st = inner_->poll(*e.innerId);
    if (st.inProgress()) return st;
    e.outcome = std::move(st);
    e.innerId.reset();
  }
  if (std::chrono::steady_clock::now() < e.visibleAt) return Status(StatusCode::kInProgress, "");
  Status out = std::move(*e.outcome);
  entries_.erase(it);
  return out;
}

Status FaultTransport::cancel(TransferId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return notFound("fault transport: transfer " + std::to_string(id) + " is unknown");
  Entry& e = it->second;
  if (e.innerId) {
    PD_RETURN_IF_ERROR(inner_->cancel(*e.innerId));
    (void)inner_->poll(*e.innerId);  // reports kCancelled once, so the inner forgets it
  } else if (e.outcome && e.outcome->isOk()) {
    return failedPrecondition("fault transport: transfer " + std::to_string(id) + " already finished");
  }
  e.outcome = cancelled("fault transport: transfer " + std::to_string(id) + " was cancelled");
  e.innerId.reset();
  e.visibleAt = {};
  return Status::ok();
}

}  // namespace pd::kvt
