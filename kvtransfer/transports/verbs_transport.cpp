// libibverbs transport; the contract is in verbs_transport.h, the device-independent logic
// (blobs, work-request planning) in verbs_codec.h.
#include "kvtransfer/transports/verbs_transport.h"

#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <sstream>
#include <vector>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "kvtransfer/device_copy.h"
#include "kvtransfer/segment_matcher.h"
#include "kvtransfer/transports/verbs_codec.h"

namespace pd::kvt {
namespace {

using verbs::WritePlan;

std::string errnoText(int e) { return std::strerror(e); }

enum class Phase { kPosting, kWaiting, kDone, kFailed, kCancelled };
bool terminal(Phase p) { return p == Phase::kDone || p == Phase::kFailed || p == Phase::kCancelled; }

struct Transfer {
  TransferId id = 0;
  PeerId peer = 0;
  Phase phase = Phase::kPosting;
  std::vector<WritePlan> writes;
  size_t totalWrs = 0;
  size_t posted = 0;
  int signaledOutstanding = 0;
  Status error;
  SteadyTime deadline;
};

struct Peer {
  PeerId id = 0;
  std::string name;
  ibv_qp* qp = nullptr;
  uint32_t localPsn = 0;   // ours, for peerConnInfo()
  uint32_t remoteQpn = 0;  // the peer's QP ours is connected to
  std::vector<verbs::PackedKey> keys;
  std::vector<KeyRange> keyRanges;  // keys' addresses, in the same order, for matcher_
  Status failure;
  verbs::SendWindow window{2, 1};  // replaced in loadPeer with the QP's real depth
};

struct PendingQp {
  ibv_qp* qp;
  uint32_t psn;
};

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(const VerbsOptions& o) : opt_(o) {}
  ~VerbsTransport() override;
  Status init(ibv_device* dev);

  TransportCaps caps() const override;
  Result<MemHandle> registerMemory(const MemDesc& desc) override;
  Status deregisterMemory(MemHandle handle) override;
  Result<std::string> packRemoteKey(MemHandle handle) override;
  Result<std::string> localConnInfo() override;
  Result<PeerId> loadPeer(const PeerInfo& peer) override;
  Result<std::string> peerConnInfo(PeerId peer) override;
  Status unloadPeer(PeerId peer) override;
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& grant) override;
  Status poll(TransferId id) override;
  Status cancel(TransferId id) override;
  bool progress() override;

 private:
  Result<PendingQp> createQp();
  verbs::ConnInfo describe(const ibv_qp* qp, uint32_t psn) const;
  Status connectQp(ibv_qp* qp, uint32_t localPsn, const verbs::ConnInfo& remote);
  bool postSome(Transfer* t, Peer* peer);
  void failPeer(Peer* peer, const Status& why);
  void fail(Transfer* t, Status s) {
    if (terminal(t->phase)) return;
    t->phase = Phase::kFailed;
    t->error = std::move(s);
  }
  bool pollSend();

  VerbsOptions opt_;
  Status gpuDirect_;  // ok when kCuda memory can be registered through dma-buf (device 0 probed)
  std::string deviceName_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* sendCq_ = nullptr;
  ibv_port_attr port_{};
  ibv_device_attr dev_{};
  ibv_gid gid_{};
  std::mt19937 rng_{std::random_device{}()};

  std::map<MemHandle, std::pair<MemDesc, ibv_mr*>> regs_;
  SegmentMatcher matcher_{"verbs"};           // mirrors regs_
  verbs::PendingQps pending_;                 // QPs offered by localConnInfo(), oldest first
  std::map<uint32_t, PendingQp> pendingQps_;  // ... by QP number
  std::map<PeerId, std::unique_ptr<Peer>> peers_;
  std::map<uint32_t, PeerId> byQpn_;
  std::map<TransferId, std::unique_ptr<Transfer>> transfers_;
  uint64_t nextHandle_ = 1, nextPeer_ = 1, nextTransfer_ = 1;
};

Status VerbsTransport::init(ibv_device* dev) {
  deviceName_ = ibv_get_device_name(dev);
  ctx_ = ibv_open_device(dev);
  if (!ctx_) return unavailable("verbs: cannot open device " + deviceName_ + ": " + errnoText(errno));
  if (ibv_query_device(ctx_, &dev_) != 0)
    return unavailable("verbs: ibv_query_device(" + deviceName_ + ") failed: " + errnoText(errno));
  if (ibv_query_port(ctx_, opt_.port, &port_) != 0)
    return unavailable("verbs: " + deviceName_ + " has no port " + std::to_string(opt_.port));
  if (port_.state != IBV_PORT_ACTIVE)
    return unavailable("verbs: " + deviceName_ + " port " + std::to_string(opt_.port) + " is not active");
  if (opt_.gidIndex >= 0 && ibv_query_gid(ctx_, opt_.port, opt_.gidIndex, &gid_) != 0)
    return unavailable("verbs: cannot read GID " + std::to_string(opt_.gidIndex) + " of " + deviceName_);
  pd_ = ibv_alloc_pd(ctx_);
  if (!pd_) return unavailable("verbs: ibv_alloc_pd failed: " + errnoText(errno));
  const int cqe = static_cast<int>(std::min<uint32_t>(opt_.maxSendWr * 4, dev_.max_cqe));
  sendCq_ = ibv_create_cq(ctx_, cqe, nullptr, nullptr, 0);
  if (!sendCq_) return unavailable("verbs: ibv_create_cq failed: " + errnoText(errno));
  gpuDirect_ = dmaBufSupported(0);
  PD_LOG(kInfo, "kvt.verbs") << "device " << deviceName_ << " port " << int(opt_.port) << " ("
                             << (port_.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand") << "), max_sge "
                             << dev_.max_sge << ", max_msg_sz " << port_.max_msg_sz;
  return Status::ok();
}

VerbsTransport::~VerbsTransport() {
  for (auto& [id, p] : peers_)
    if (p->qp) ibv_destroy_qp(p->qp);
  for (auto& [qpn, q] : pendingQps_) ibv_destroy_qp(q.qp);
  for (auto& [h, r] : regs_) ibv_dereg_mr(r.second);
  if (sendCq_) ibv_destroy_cq(sendCq_);
  if (pd_) ibv_dealloc_pd(pd_);
  if (ctx_) ibv_close_device(ctx_);
}

TransportCaps VerbsTransport::caps() const {
  TransportCaps c;
  c.name = "verbs";
  c.oneSided = true;
  // GPUDirect through dma-buf (cuMemGetHandleForAddressRange + ibv_reg_dmabuf_mr): no
  // nvidia-peermem needed; registerMemory still says why when the NIC refuses.
  c.cudaMemory = gpuDirect_.isOk();
  if (c.cudaMemory) c.cudaPath = "GPUDirect dma-buf";
  std::ostringstream d;
  d << deviceName_ << " port " << int(opt_.port) << " "
    << (port_.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand") << ", RC QPs";
  c.details = d.str();
  return c;
}

Result<MemHandle> VerbsTransport::registerMemory(const MemDesc& desc) {
  if (desc.len == 0 || desc.addr == 0)
    return invalidArgument("verbs: cannot register " + toString(desc) + ": empty range");
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  ibv_mr* mr = nullptr;
  if (desc.kind == MemKind::kCuda) {
    // GPUDirect RDMA through dma-buf: the NIC maps the device pages; iova = the device
    // address, so peers address the region exactly like host memory.
    if (!gpuDirect_.isOk()) {
      return gpuDirect_.withContext("verbs: cannot register GPU memory " + toString(desc));
    }
    auto h = exportDmaBuf(desc);
    if (!h.ok()) return h.status().withContext("verbs: cannot register GPU memory " + toString(desc));
    mr = ibv_reg_dmabuf_mr(pd_, h->range.offset, desc.len, desc.addr, h->fd, access);
    const int e = errno;
    ::close(h->fd);  // the MR holds its own reference to the dma-buf
    if (!mr) {
      return unimplemented("verbs: ibv_reg_dmabuf_mr of GPU memory " + toString(desc) + " failed (" + errnoText(e) +
                           "); the NIC or its driver lacks dma-buf support");
    }
  } else {
    mr = ibv_reg_mr(pd_, desc.ptr(), desc.len, access);
    if (!mr) return internalError("verbs: ibv_reg_mr of " + toString(desc) + " failed: " + errnoText(errno));
  }
  MemHandle h = nextHandle_++;
  regs_[h] = {desc, mr};
  matcher_.addRegion(h, desc);
  return h;
}

Status VerbsTransport::deregisterMemory(MemHandle handle) {
  auto it = regs_.find(handle);
  if (it == regs_.end()) return notFound("verbs: unknown memory handle " + std::to_string(handle));
  for (auto& [id, t] : transfers_)
    if (!terminal(t->phase))
      for (const WritePlan& w : t->writes)
        for (const verbs::Sge& s : w.sges)
          if (s.lkey == it->second.second->lkey)
            return failedPrecondition("verbs: memory handle " + std::to_string(handle) + " is in use by transfer " +
                                      std::to_string(id));
  ibv_dereg_mr(it->second.second);
  regs_.erase(it);
  matcher_.removeRegion(handle);
  return Status::ok();
}

Result<std::string> VerbsTransport::packRemoteKey(MemHandle handle) {
  auto it = regs_.find(handle);
  if (it == regs_.end()) return notFound("verbs: unknown memory handle " + std::to_string(handle));
  return verbs::encodeKey(verbs::PackedKey{it->second.first.addr, it->second.first.len, it->second.second->rkey});
}

Result<PendingQp> VerbsTransport::createQp() {
  ibv_qp_init_attr qa{};
  qa.send_cq = sendCq_;
  qa.recv_cq = sendCq_;  // nothing is ever received: plain WRITEs consume no receive WR
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 0;
  qa.cap.max_send_wr = std::min<uint32_t>(opt_.maxSendWr, dev_.max_qp_wr);
  qa.cap.max_send_sge = std::min<uint32_t>(opt_.maxSge, dev_.max_sge);
  qa.cap.max_recv_wr = 1;  // a minimal receive queue, never posted to
  qa.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd_, &qa);
  if (!qp) return unavailable("verbs: ibv_create_qp failed: " + errnoText(errno));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = opt_.port;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
  if (int e = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS); e) {
    ibv_destroy_qp(qp);
    return unavailable("verbs: QP RESET->INIT failed: " + errnoText(e));
  }
  return PendingQp{qp, static_cast<uint32_t>(rng_() & 0xffffff)};
}

verbs::ConnInfo VerbsTransport::describe(const ibv_qp* qp, uint32_t psn) const {
  verbs::ConnInfo c;
  c.name = opt_.localName;
  c.lid = port_.lid;
  std::memcpy(c.gid.data(), gid_.raw, 16);
  c.gidIndex = static_cast<uint8_t>(std::max(opt_.gidIndex, 0));
  c.port = opt_.port;
  c.mtu = static_cast<uint8_t>(port_.active_mtu);
  c.qpn = qp->qp_num;
  c.psn = psn;
  return c;
}

Result<std::string> VerbsTransport::localConnInfo() {
  PD_ASSIGN_OR_RETURN(PendingQp q, createQp());
  pending_.offer(q.qp->qp_num);
  pendingQps_[q.qp->qp_num] = q;
  return verbs::encodeConnInfo(describe(q.qp, q.psn));
}

Result<std::string> VerbsTransport::peerConnInfo(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return notFound("verbs: peerConnInfo of unknown peer " + std::to_string(id));
  verbs::ConnInfo c = describe(it->second->qp, it->second->localPsn);
  c.peerQpn = it->second->remoteQpn;
  return verbs::encodeConnInfo(c);
}

Status VerbsTransport::connectQp(ibv_qp* qp, uint32_t localPsn, const verbs::ConnInfo& r) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(port_.active_mtu, r.mtu));
  a.dest_qp_num = r.qpn;
  a.rq_psn = r.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = r.lid;
  a.ah_attr.sl = 0;
  a.ah_attr.port_num = opt_.port;
  if (port_.link_layer == IBV_LINK_LAYER_ETHERNET || r.lid == 0) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, r.gid.data(), 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(std::max(opt_.gidIndex, 0));
    a.ah_attr.grh.hop_limit = 1;
  }
  if (int e = ibv_modify_qp(qp, &a,
                            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return unavailable("verbs: QP INIT->RTR failed: " + errnoText(e));
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.timeout = 14;  // 4.096 us * 2^14 = 67 ms per try; 7 tries: a dead peer is seen in < 1 s
  s.retry_cnt = 7;
  s.rnr_retry = 7;  // no SENDs go out, so no RNR either; the maximum, as before
  s.sq_psn = localPsn;
  s.max_rd_atomic = 1;
  if (int e = ibv_modify_qp(qp, &s,
                            IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                IBV_QP_MAX_QP_RD_ATOMIC))
    return unavailable("verbs: QP RTR->RTS failed: " + errnoText(e));
  return Status::ok();
}

Result<PeerId> VerbsTransport::loadPeer(const PeerInfo& info) {
  PD_ASSIGN_OR_RETURN(verbs::ConnInfo conn, verbs::decodeConnInfo(info.connInfo));
  auto peer = std::make_unique<Peer>();
  peer->name = conn.name.empty() ? info.name : conn.name;
  for (size_t i = 0; i < info.remoteKeys.size(); ++i) {
    auto k = verbs::decodeKey(info.remoteKeys[i]);
    if (!k.ok()) return k.status().withContext("loading peer '" + info.name + "', key " + std::to_string(i));
    peer->keyRanges.push_back(KeyRange{k->addr, k->len});
    peer->keys.push_back(*k);
  }
  // A reply connects the QP we offered it; an offer the oldest pending QP, or a fresh one.
  auto chosen = pending_.choose(conn);
  if (!chosen.ok()) return chosen.status().withContext("loading peer '" + info.name + "'");
  PendingQp q{};
  if (*chosen) {
    q = pendingQps_.at(**chosen);
  } else {
    auto fresh = createQp();
    if (!fresh.ok()) return fresh.status().withContext("loading peer '" + info.name + "'");
    q = *fresh;
  }
  Status s = connectQp(q.qp, q.psn, conn);
  if (!s.isOk()) {
    if (!*chosen) ibv_destroy_qp(q.qp);
    return s.withContext("loading peer '" + info.name + "'");
  }
  if (*chosen) {
    pending_.take(**chosen);
    pendingQps_.erase(**chosen);
  }
  peer->qp = q.qp;
  peer->localPsn = q.psn;
  peer->remoteQpn = conn.qpn;
  peer->window = verbs::SendWindow(std::min<uint32_t>(opt_.maxSendWr, dev_.max_qp_wr), opt_.signalEvery);
  peer->id = nextPeer_++;
  byQpn_[q.qp->qp_num] = peer->id;
  PeerId id = peer->id;
  peers_[id] = std::move(peer);
  return id;
}

void VerbsTransport::failPeer(Peer* peer, const Status& why) {
  if (peer->failure.isOk()) {
    peer->failure = why;
    PD_LOG(kWarn, "kvt.verbs") << why.message();
  }
  for (auto& [id, t] : transfers_)
    if (t->peer == peer->id) fail(t.get(), why);
  if (peer->qp) {
    // Error state flushes the outstanding WRs (their completions come back with an error).
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(peer->qp, &a, IBV_QP_STATE);
  }
}

Status VerbsTransport::unloadPeer(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return notFound("verbs: unknown peer " + std::to_string(id));
  Peer* p = it->second.get();
  for (auto& [tid, t] : transfers_)
    if (t->peer == id) {
      fail(t.get(), unavailable("verbs: peer '" + p->name + "' was unloaded"));
    }
  byQpn_.erase(p->qp->qp_num);
  ibv_destroy_qp(p->qp);  // destroys outstanding WRs with it; no completion will name it
  peers_.erase(it);
  return Status::ok();
}

Result<TransferId> VerbsTransport::post(const DescList& local, const DescList& remote, PeerId peerId,
                                        const std::string& /*grant*/) {
  auto pit = peers_.find(peerId);
  if (pit == peers_.end()) return notFound("verbs: post to unknown peer " + std::to_string(peerId));
  Peer* peer = pit->second.get();
  if (!peer->failure.isOk()) return peer->failure;
  PD_ASSIGN_OR_RETURN(auto matches, matcher_.match(local, remote, peer->keyRanges, peer->name));
  std::vector<verbs::SegmentPair> pairs;
  pairs.reserve(matches.size());
  for (const SegmentMatch& m : matches) {
    const ibv_mr* mr = regs_.at(m.region).second;
    const MemDesc& l = local[m.index];
    pairs.push_back(verbs::SegmentPair{l.addr, mr->lkey, remote[m.index].addr, peer->keys[m.key].rkey, l.len});
  }
  verbs::BatchLimits limits{std::min<uint32_t>(opt_.maxSge, dev_.max_sge), port_.max_msg_sz};
  PD_ASSIGN_OR_RETURN(auto writes, verbs::planWrites(pairs, limits));
  auto t = std::make_unique<Transfer>();
  t->id = nextTransfer_++;
  t->peer = peerId;
  t->writes = std::move(writes);
  t->totalWrs = t->writes.size();
  t->deadline = steadyNow() + opt_.transferTimeout;
  if (t->totalWrs == 0) t->phase = Phase::kDone;
  TransferId id = t->id;
  transfers_[id] = std::move(t);
  return id;
}

// Posts as many of the transfer's WRs as the send queue has room for.
bool VerbsTransport::postSome(Transfer* t, Peer* peer) {
  bool any = false;
  constexpr size_t kChain = 32;
  ibv_send_wr wrs[kChain];
  std::vector<ibv_sge> sges[kChain];
  while (t->posted < t->totalWrs && peer->window.room() > 0) {
    size_t n = 0;
    size_t first = t->posted;
    while (first + n < t->totalWrs && n < kChain && peer->window.room() > 0) {
      const size_t i = first + n;
      ibv_send_wr& wr = wrs[n];
      wr = ibv_send_wr{};
      wr.wr_id = t->id;
      wr.opcode = IBV_WR_RDMA_WRITE;
      const WritePlan& w = t->writes[i];
      sges[n].clear();
      for (const verbs::Sge& s : w.sges) sges[n].push_back(ibv_sge{s.addr, s.len, s.lkey});
      wr.sg_list = sges[n].data();
      wr.num_sge = static_cast<int>(sges[n].size());
      wr.wr.rdma.remote_addr = w.remoteAddr;
      wr.wr.rdma.rkey = w.rkey;
      if (peer->window.onPost(t->id, i, t->totalWrs)) {
        wr.send_flags = IBV_SEND_SIGNALED;
        t->signaledOutstanding++;
      }
      if (n > 0) wrs[n - 1].next = &wr;
      ++n;
    }
    if (n == 0) break;
    ibv_send_wr* bad = nullptr;
    if (int e = ibv_post_send(peer->qp, &wrs[0], &bad); e != 0) {
      failPeer(peer, unavailable("verbs: ibv_post_send to peer '" + peer->name + "' failed: " + errnoText(e)));
      return true;
    }
    t->posted += n;
    any = true;
  }
  if (t->posted == t->totalWrs && t->phase == Phase::kPosting) t->phase = Phase::kWaiting;
  return any;
}

bool VerbsTransport::pollSend() {
  ibv_wc wc[32];
  int n = ibv_poll_cq(sendCq_, 32, wc);
  for (int i = 0; i < n; ++i) {
    auto qit = byQpn_.find(wc[i].qp_num);
    if (qit == byQpn_.end()) continue;
    Peer* peer = peers_[qit->second].get();
    std::optional<verbs::SendWindow::Completed> s = peer->window.onCompletion();
    if (!s) continue;
    auto tit = transfers_.find(s->transfer);
    Transfer* t = tit == transfers_.end() ? nullptr : tit->second.get();
    if (t) t->signaledOutstanding--;
    if (wc[i].status != IBV_WC_SUCCESS) {
      Status why =
          unavailable("verbs: peer '" + peer->name + "': work completion error: " + ibv_wc_status_str(wc[i].status));
      failPeer(peer, why);
      continue;
    }
    if (t && s->last && t->phase == Phase::kWaiting) t->phase = Phase::kDone;
  }
  return n > 0;
}

bool VerbsTransport::progress() {
  bool any = pollSend();
  const SteadyTime now = steadyNow();
  for (auto& [id, tp] : transfers_) {
    Transfer* t = tp.get();
    auto pit = peers_.find(t->peer);
    Peer* peer = pit == peers_.end() ? nullptr : pit->second.get();
    if (t->phase == Phase::kPosting && peer && peer->failure.isOk()) any |= postSome(t, peer);
    if (!terminal(t->phase) && now >= t->deadline) {
      Status why = deadlineExceeded("verbs: transfer " + std::to_string(id) + " not confirmed within " +
                                    std::to_string(opt_.transferTimeout.count()) +
                                    " ms; the QP is closed, re-exchange connection info to reconnect");
      fail(t, why);
      if (peer) failPeer(peer, why);
      any = true;
    }
  }
  return any;
}

Status VerbsTransport::poll(TransferId id) {
  auto it = transfers_.find(id);
  if (it == transfers_.end())
    return notFound("verbs: unknown transfer " + std::to_string(id) +
                    " (never posted, or its outcome was already reported)");
  Transfer* t = it->second.get();
  Status out;
  switch (t->phase) {
    case Phase::kDone:
      out = Status::ok();
      break;
    case Phase::kFailed:
      out = t->error;
      break;
    case Phase::kCancelled:
      out = cancelled("verbs: transfer " + std::to_string(id) + " was cancelled");
      break;
    default:
      return Status(StatusCode::kInProgress, "verbs: transfer " + std::to_string(id) + " in progress");
  }
  transfers_.erase(it);
  return out;
}

Status VerbsTransport::cancel(TransferId id) {
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return notFound("verbs: cancel of unknown transfer " + std::to_string(id));
  Transfer* t = it->second.get();
  if (t->phase == Phase::kDone || t->phase == Phase::kWaiting)
    return failedPrecondition("verbs: transfer " + std::to_string(id) +
                              " has posted its last write; too late to cancel");
  if (!terminal(t->phase)) t->phase = Phase::kCancelled;
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<Transport>> makeVerbsTransport(const VerbsOptions& options) {
  if (options.maxSendWr < 2 || options.maxSge == 0)
    return invalidArgument("verbs: maxSendWr must be >= 2 and maxSge > 0");
  if (options.transferTimeout.count() <= 0) return invalidArgument("verbs: transferTimeout must be > 0");
  int n = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n == 0) {
    // NULL + ENOSYS means the kernel has no RDMA support at all; for the caller it is the same
    // answer (no device here, move on to the next transport), so one message, detail in the log.
    if (!list) {
      PD_LOG(kInfo, "kvt.verbs") << "ibv_get_device_list failed: " << std::strerror(errno);
    } else {
      ibv_free_device_list(list);
    }
    return unavailable("verbs: no RDMA device found (ibv_get_device_list returned 0 devices)");
  }
  ibv_device* dev = nullptr;
  std::string names;
  for (int i = 0; i < n; ++i) {
    const char* name = ibv_get_device_name(list[i]);
    names += (names.empty() ? "" : ", ") + std::string(name);
    if (!dev && (options.deviceName.empty() || options.deviceName == name)) dev = list[i];
  }
  if (!dev) {
    ibv_free_device_list(list);
    return notFound("verbs: RDMA device '" + options.deviceName + "' not found (have: " + names + ")");
  }
  auto t = std::make_unique<VerbsTransport>(options);
  Status s = t->init(dev);
  ibv_free_device_list(list);
  if (!s.isOk()) return s;
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pd::kvt
