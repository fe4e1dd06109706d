// UCX transport implementation; the contract is in ucx_transport.h and transport.h.
#include "kvtransfer/transports/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/segment_matcher.h"
#include "kvtransfer/transports/blob_codec.h"

namespace pd::kvt {

// ---- Blob formats --------------------------------------------------------------------------
// kvt.proto's UcxConnInfo / UcxRemoteKey. Both carry a magic and a version so a blob from
// another transport (or another version of this one) is refused with a message instead of
// being misread.
namespace ucxwire {
namespace {
constexpr uint32_t kKeyMagic = 0x4b584355;   // "UCXK"
constexpr uint32_t kAddrMagic = 0x41584355;  // "UCXA"
// 1 was the hand-written binary layout; 2 is the protobuf messages.
constexpr uint32_t kVersion = 2;
}  // namespace

std::string encodeKey(const PackedKey& key) {
  proto::UcxRemoteKey m;
  m.set_magic(kKeyMagic);
  m.set_version(kVersion);
  m.set_base(key.base);
  m.set_len(key.len);
  m.set_kind(key.kind);
  m.set_device(key.device);
  m.set_rkey(key.rkey);
  return m.SerializeAsString();
}

Result<PackedKey> decodeKey(const std::string& blob) {
  PD_ASSIGN_OR_RETURN(
      auto m, parseMagicBlob<proto::UcxRemoteKey>(blob, kKeyMagic, kVersion, "ucx: remote key blob", "a UCX key"));
  if (!m.has_base() || !m.has_len() || !m.has_kind() || !m.has_device() || !m.has_rkey())
    return dataLoss("ucx: remote key blob lacks some of its fields (truncated? " + std::to_string(blob.size()) +
                    " bytes)");
  if (m.kind() > static_cast<uint8_t>(MemKind::kCuda))
    return invalidArgument("ucx: remote key names unknown memory kind " + std::to_string(m.kind()));
  PackedKey k;
  k.base = m.base();
  k.len = m.len();
  k.kind = static_cast<uint8_t>(m.kind());
  k.device = m.device();
  k.rkey = m.rkey();
  if (k.len == 0 || k.base + k.len < k.base) return invalidArgument("ucx: remote key has an empty or wrapping range");
  if (k.rkey.empty()) return invalidArgument("ucx: remote key carries no packed rkey");
  return k;
}

std::string encodeConnInfo(const std::string& workerAddress) {
  proto::UcxConnInfo m;
  m.set_magic(kAddrMagic);
  m.set_version(kVersion);
  m.set_worker_address(workerAddress);
  return m.SerializeAsString();
}

Result<std::string> decodeConnInfo(const std::string& blob) {
  PD_ASSIGN_OR_RETURN(auto m, parseMagicBlob<proto::UcxConnInfo>(blob, kAddrMagic, kVersion, "ucx: connection info",
                                                                 "a UCX worker address"));
  if (!m.has_worker_address() || m.worker_address().empty())
    return dataLoss("ucx: connection info carries no worker address (truncated? " + std::to_string(blob.size()) +
                    " bytes)");
  return m.worker_address();
}
}  // namespace ucxwire

namespace {

std::string ucsText(ucs_status_t s) { return ucs_status_string(s); }

enum class Phase { kPutting, kFlushing, kDone, kFailed, kCancelled };

bool terminal(Phase p) { return p == Phase::kDone || p == Phase::kFailed || p == Phase::kCancelled; }

struct Transfer;

// Lives in the space UCX reserves at every request pointer (ucp_params_t::request_size), so a
// completion finds its transfer without a lookup table.
struct ReqCtx {
  Transfer* transfer;
  size_t bytes;
  enum Kind : int { kPut, kFlush } kind;
};

struct Segment {
  char* local;
  uint64_t remote;
  size_t len;
  ucp_mem_h memh;
  size_t keyIndex;
};

struct Transfer {
  TransferId id = 0;
  PeerId peer = 0;
  Phase phase = Phase::kPutting;
  std::vector<Segment> segs;
  size_t nextSeg = 0;
  size_t segOffset = 0;
  size_t inflightBytes = 0;
  int pendingRequests = 0;  // UCX requests that still point at this object
  Status error;
  SteadyTime deadline;
  SteadyTime started;
};

struct Registration {
  MemDesc desc;
  ucp_mem_h memh = nullptr;
};

struct RemoteKey {
  ucxwire::PackedKey packed;
  ucp_rkey_h rkey = nullptr;
};

class UcxTransport;

struct Peer {
  UcxTransport* owner = nullptr;
  PeerId id = 0;
  std::string name;
  std::string address;  // the peer's worker address
  ucp_ep_h ep = nullptr;
  std::vector<RemoteKey> keys;
  std::vector<KeyRange> keyRanges;  // keys' addresses, in the same order, for matcher_
  Status failure;                   // set once the peer is known dead; posts to it fail fast
  bool errorPending = false;        // the error callback fired; close the endpoint in progress()
  std::string lanes;                // transports UCX picked for this endpoint
};

// An endpoint being closed: its rkeys are destroyed once UCX is done with the endpoint.
struct Closing {
  void* request = nullptr;
  std::vector<ucp_rkey_h> rkeys;
  std::unique_ptr<Peer> keepAlive;  // the error callback's argument must outlive the close
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const UcxOptions& o) : opt_(o) {}
  ~UcxTransport() override;

  Status init();

  TransportCaps caps() const override;
  Result<MemHandle> registerMemory(const MemDesc& desc) override;
  Result<UcxAllocation> allocateRegistered(size_t len);
  Status deregisterMemory(MemHandle handle) override;
  Result<std::string> packRemoteKey(MemHandle handle) override;
  Result<std::string> localConnInfo() override { return ucxwire::encodeConnInfo(address_); }
  Result<PeerId> loadPeer(const PeerInfo& peer) override;
  Status unloadPeer(PeerId peer) override;
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& grant) override;
  Status poll(TransferId id) override;
  Status cancel(TransferId id) override;
  bool progress() override;

 private:
  static void onRequestDone(void* request, ucs_status_t status, void* userData);
  static void onEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

  Status connect(Peer* peer);
  // kForce discards what UCX has not sent yet: only for endpoints UCX reported failed. Every
  // other endpoint gets kFlush (see the header: force-closing a live tcp connection crashed).
  enum class Close { kFlush, kForce };
  static Close closeModeFor(const Peer& p) { return p.failure.isOk() ? Close::kFlush : Close::kForce; }
  void closeEndpoint(Peer* peer, const Status& why, Close how, std::unique_ptr<Peer> keepAlive = nullptr);
  void fail(Transfer* t, Status s);
  bool issue(Transfer* t, size_t* budget);
  void retire(std::unique_ptr<Transfer> t);
  Peer* findPeer(PeerId id) {
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second.get();
  }

  UcxOptions opt_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  bool cudaSupported_ = false;
  std::string memTypes_;

  std::map<MemHandle, Registration> regs_;
  SegmentMatcher matcher_{"ucx"};  // mirrors regs_
  std::map<PeerId, std::unique_ptr<Peer>> peers_;
  std::map<TransferId, std::unique_ptr<Transfer>> transfers_;  // ordered: oldest issues first
  std::vector<std::unique_ptr<Transfer>> zombies_;             // reported, but UCX still holds requests
  std::vector<Closing> closing_;
  uint64_t nextHandle_ = 1, nextPeer_ = 1, nextTransfer_ = 1;
};

// ---- setup ---------------------------------------------------------------------------------

Status UcxTransport::init() {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return unavailable("ucx: ucp_config_read failed: " + ucsText(s));
  const std::string keepalive = std::to_string(opt_.keepaliveInterval.count()) + "ms";
  if (ucp_config_modify(config, "KEEPALIVE_INTERVAL", keepalive.c_str()) != UCS_OK) {
    PD_LOG(kWarn, "kvt.ucx") << "cannot set UCX_KEEPALIVE_INTERVAL=" << keepalive
                             << "; dead peers are noticed by UCX's default keepalive";
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE;
  params.features = UCP_FEATURE_RMA;
  params.request_size = sizeof(ReqCtx);
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return unavailable("ucx: ucp_init failed: " + ucsText(s));

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &attr) == UCS_OK) {
    cudaSupported_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t)
      if (attr.memory_types & UCS_BIT(t)) {
        if (!memTypes_.empty()) memTypes_ += ",";
        memTypes_ += ucs_memory_type_names[t];
      }
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return unavailable("ucx: ucp_worker_create failed: " + ucsText(s));

  ucp_address_t* addr = nullptr;
  size_t addrLen = 0;
  s = ucp_worker_get_address(worker_, &addr, &addrLen);
  if (s != UCS_OK) return unavailable("ucx: ucp_worker_get_address failed: " + ucsText(s));
  address_.assign(reinterpret_cast<const char*>(addr), addrLen);
  ucp_worker_release_address(worker_, addr);

  const char* tls = std::getenv("UCX_TLS");
  PD_LOG(kInfo, "kvt.ucx") << "UCX " << ucp_get_version_string() << " ready: UCX_TLS=" << (tls ? tls : "all")
                           << ", memory types " << memTypes_;
  return Status::ok();
}

UcxTransport::~UcxTransport() {
  if (!worker_) {
    if (context_) ucp_cleanup(context_);
    return;
  }
  for (auto& [id, peer] : peers_)
    closeEndpoint(peer.get(), unavailable("ucx: transport destroyed"), closeModeFor(*peer));
  // Bounded: force-closed endpoints complete their requests promptly; never hang on exit.
  Deadline d = Deadline::in(std::chrono::seconds(2));
  while (!d.expired()) {
    ucp_worker_progress(worker_);
    bool busy = false;
    for (auto& c : closing_)
      if (c.request && ucp_request_check_status(c.request) == UCS_INPROGRESS) busy = true;
    for (auto& [id, t] : transfers_) busy |= t->pendingRequests > 0;
    for (auto& z : zombies_) busy |= z->pendingRequests > 0;
    if (!busy) break;
  }
  for (auto& c : closing_) {
    if (c.request) ucp_request_free(c.request);
    for (ucp_rkey_h k : c.rkeys) ucp_rkey_destroy(k);
  }
  closing_.clear();
  for (auto& [h, r] : regs_) ucp_mem_unmap(context_, r.memh);
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

TransportCaps UcxTransport::caps() const {
  TransportCaps c;
  c.name = "ucx";
  c.hostMemory = true;
  c.cudaMemory = cudaSupported_;
  if (cudaSupported_) c.cudaPath = "direct GPU memory";
  c.oneSided = true;
  std::ostringstream d;
  const char* tls = std::getenv("UCX_TLS");
  d << "UCX " << ucp_get_version_string() << ", UCX_TLS=" << (tls ? tls : "all") << ", memory types " << memTypes_
    << ", error handling " << (opt_.peerErrorHandling ? "peer" : "none");
  for (auto& [id, p] : peers_)
    if (!p->lanes.empty()) d << "; peer " << p->name << ": " << p->lanes;
  c.details = d.str();
  return c;
}

// ---- memory --------------------------------------------------------------------------------

Result<MemHandle> UcxTransport::registerMemory(const MemDesc& desc) {
  if (desc.len == 0 || desc.addr == 0)
    return invalidArgument("ucx: cannot register " + toString(desc) + ": empty range");
  if (desc.kind == MemKind::kCuda && !cudaSupported_)
    return unimplemented("ucx: cannot register " + toString(desc) +
                         ": this UCX has no CUDA memory support (memory types: " + memTypes_ + ")");
  ucp_mem_map_params_t mp{};
  mp.field_mask =
      UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = desc.ptr();
  mp.length = desc.len;
  mp.memory_type = desc.kind == MemKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK) return internalError("ucx: ucp_mem_map of " + toString(desc) + " failed: " + ucsText(s));
  MemHandle h = nextHandle_++;
  regs_[h] = Registration{desc, memh};
  matcher_.addRegion(h, desc);
  return h;
}

Result<UcxAllocation> UcxTransport::allocateRegistered(size_t len) {
  if (len == 0) return invalidArgument("ucx: cannot allocate 0 bytes");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = nullptr;
  mp.length = len;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK)
    return resourceExhausted("ucx: ucp_mem_map cannot allocate " + std::to_string(len) + " bytes: " + ucsText(s));
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return internalError("ucx: ucp_mem_query failed: " + ucsText(s));
  }
  UcxAllocation a;
  a.desc = MemDesc{reinterpret_cast<uintptr_t>(attr.address), len};
  a.handle = nextHandle_++;
  regs_[a.handle] = Registration{a.desc, memh};
  matcher_.addRegion(a.handle, a.desc);
  return a;
}

Status UcxTransport::deregisterMemory(MemHandle handle) {
  auto it = regs_.find(handle);
  if (it == regs_.end()) return notFound("ucx: unknown memory handle " + std::to_string(handle));
  for (auto& [id, t] : transfers_)
    if (!terminal(t->phase))
      for (const Segment& s : t->segs)
        if (s.memh == it->second.memh)
          return failedPrecondition("ucx: memory handle " + std::to_string(handle) + " is in use by transfer " +
                                    std::to_string(id));
  ucp_mem_unmap(context_, it->second.memh);
  regs_.erase(it);
  matcher_.removeRegion(handle);
  return Status::ok();
}

Result<std::string> UcxTransport::packRemoteKey(MemHandle handle) {
  auto it = regs_.find(handle);
  if (it == regs_.end()) return notFound("ucx: unknown memory handle " + std::to_string(handle));
  void* buf = nullptr;
  size_t size = 0;
  ucs_status_t s = ucp_rkey_pack(context_, it->second.memh, &buf, &size);
  if (s != UCS_OK) return internalError("ucx: ucp_rkey_pack failed: " + ucsText(s));
  ucxwire::PackedKey k;
  k.base = it->second.desc.addr;
  k.len = it->second.desc.len;
  k.kind = static_cast<uint8_t>(it->second.desc.kind);
  k.device = it->second.desc.device;
  k.rkey.assign(static_cast<const char*>(buf), size);
  ucp_rkey_buffer_release(buf);
  return ucxwire::encodeKey(k);
}

// ---- peers ---------------------------------------------------------------------------------

Result<PeerId> UcxTransport::loadPeer(const PeerInfo& info) {
  auto peer = std::make_unique<Peer>();
  peer->owner = this;
  peer->name = info.name.empty() ? "unnamed" : info.name;
  auto addr = ucxwire::decodeConnInfo(info.connInfo);
  if (!addr.ok()) return addr.status().withContext("loading peer '" + peer->name + "'");
  peer->address = std::move(addr).value();
  for (size_t i = 0; i < info.remoteKeys.size(); ++i) {
    auto k = ucxwire::decodeKey(info.remoteKeys[i]);
    if (!k.ok()) return k.status().withContext("loading peer '" + peer->name + "', key " + std::to_string(i));
    peer->keyRanges.push_back(KeyRange{k->base, k->len});
    peer->keys.push_back(RemoteKey{std::move(k).value(), nullptr});
  }
  peer->id = nextPeer_++;
  PD_RETURN_IF_ERROR(connect(peer.get()));
  PeerId id = peer->id;
  peers_[id] = std::move(peer);
  return id;
}

Status UcxTransport::connect(Peer* peer) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer->address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  if (opt_.peerErrorHandling) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxTransport::onEndpointError;
    ep.err_handler.arg = peer;
  }
  ucs_status_t s = ucp_ep_create(worker_, &ep, &peer->ep);
  if (s != UCS_OK) {
    peer->ep = nullptr;
    return unavailable("ucx: cannot create an endpoint to peer '" + peer->name + "': " + ucsText(s));
  }
  for (size_t i = 0; i < peer->keys.size(); ++i) {
    RemoteKey& k = peer->keys[i];
    s = ucp_ep_rkey_unpack(peer->ep, k.packed.rkey.data(), &k.rkey);
    if (s != UCS_OK) {
      k.rkey = nullptr;
      closeEndpoint(peer, unavailable("key unpack failed"), Close::kFlush);
      return invalidArgument("ucx: remote key " + std::to_string(i) + " of peer '" + peer->name +
                             "' does not unpack: " + ucsText(s));
    }
  }
  // Which transports UCX chose (tcp, cma, posix, rc_mlx5, ...): said once per endpoint.
  char* text = nullptr;
  size_t textLen = 0;
  if (FILE* f = open_memstream(&text, &textLen)) {
    ucp_ep_print_info(peer->ep, f);
    std::fclose(f);
    std::set<std::string> tls;
    std::istringstream in(std::string(text, textLen));
    std::string line;
    while (std::getline(in, line)) {
      // lane lines look like "#   lane[0]:  8:cma/memory.0 md[6]  ... rma_bw#0"
      auto lanePos = line.find("lane[");
      if (lanePos == std::string::npos) continue;
      auto colon = line.find(':', line.find(']', lanePos));
      if (colon == std::string::npos) continue;
      std::istringstream words(line.substr(colon + 1));
      std::string rsc;
      words >> rsc;
      auto c = rsc.find(':');
      if (c != std::string::npos) rsc = rsc.substr(c + 1);
      auto dot = rsc.find('.');
      if (dot != std::string::npos) rsc = rsc.substr(0, dot);
      if (!rsc.empty()) tls.insert(rsc);
    }
    std::free(text);
    peer->lanes.clear();
    for (const auto& t : tls) peer->lanes += (peer->lanes.empty() ? "" : ", ") + t;
    PD_LOG(kInfo, "kvt.ucx") << "endpoint to peer '" << peer->name << "' uses " << peer->lanes;
  }
  return Status::ok();
}

void UcxTransport::closeEndpoint(Peer* peer, const Status& why, Close how, std::unique_ptr<Peer> keepAlive) {
  for (auto& [id, t] : transfers_)
    if (t->peer == peer->id && !terminal(t->phase)) fail(t.get(), why);
  Closing c;
  for (RemoteKey& k : peer->keys)
    if (k.rkey) {
      c.rkeys.push_back(k.rkey);
      k.rkey = nullptr;
    }
  if (peer->ep) {
    ucp_request_param_t p{};
    if (how == Close::kForce) {
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer->ep, &p);
    if (UCS_PTR_IS_PTR(r)) c.request = r;
    peer->ep = nullptr;
  }
  c.keepAlive = std::move(keepAlive);
  if (c.request || c.keepAlive) {
    closing_.push_back(std::move(c));
  } else {
    for (ucp_rkey_h k : c.rkeys) ucp_rkey_destroy(k);
  }
}

Status UcxTransport::unloadPeer(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return notFound("ucx: unknown peer " + std::to_string(id));
  std::unique_ptr<Peer> peer = std::move(it->second);
  peers_.erase(it);
  Peer* p = peer.get();
  closeEndpoint(p, unavailable("ucx: peer '" + p->name + "' was unloaded"), closeModeFor(*p), std::move(peer));
  return Status::ok();
}

void UcxTransport::onEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // Runs inside ucp_worker_progress: only record; progress() closes the endpoint.
  auto* peer = static_cast<Peer*>(arg);
  if (peer->ep != ep) return;  // an endpoint already being closed
  peer->failure = unavailable("ucx: peer '" + peer->name + "' is unreachable: " + ucsText(status));
  peer->errorPending = true;
}

// ---- transfers -----------------------------------------------------------------------------

Result<TransferId> UcxTransport::post(const DescList& local, const DescList& remote, PeerId peerId,
                                      const std::string& /*grant*/) {
  Peer* peer = findPeer(peerId);
  if (!peer) return notFound("ucx: post to unknown peer " + std::to_string(peerId));
  if (!peer->failure.isOk()) return peer->failure;
  auto t = std::make_unique<Transfer>();
  PD_ASSIGN_OR_RETURN(auto matches, matcher_.match(local, remote, peer->keyRanges, peer->name));
  t->segs.reserve(matches.size());
  const Registration* reg = nullptr;
  MemHandle regHandle = 0;
  for (const SegmentMatch& m : matches) {
    if (!reg || regHandle != m.region) {
      reg = &regs_.at(m.region);
      regHandle = m.region;
    }
    const MemDesc& l = local[m.index];
    t->segs.push_back(Segment{reinterpret_cast<char*>(l.addr), remote[m.index].addr, l.len, reg->memh, m.key});
  }
  t->id = nextTransfer_++;
  t->peer = peerId;
  t->started = steadyNow();
  t->deadline = t->started + opt_.transferTimeout;
  TransferId id = t->id;
  transfers_[id] = std::move(t);
  return id;
}

void UcxTransport::fail(Transfer* t, Status s) {
  if (terminal(t->phase)) return;
  t->phase = Phase::kFailed;
  t->error = std::move(s);
}

void UcxTransport::onRequestDone(void* request, ucs_status_t status, void* /*userData*/) {
  auto* ctx = static_cast<ReqCtx*>(request);
  Transfer* t = ctx->transfer;
  const size_t bytes = ctx->bytes;
  const ReqCtx::Kind kind = ctx->kind;
  ucp_request_free(request);
  t->pendingRequests--;
  if (kind == ReqCtx::kPut) t->inflightBytes -= bytes;
  if (terminal(t->phase)) return;  // cancelled or failed already: completions are ignored
  if (status != UCS_OK) {
    const char* what = kind == ReqCtx::kPut ? "put" : "flush";
    t->phase = Phase::kFailed;
    t->error = unavailable(std::string("ucx: transfer ") + std::to_string(t->id) + ": " + what +
                           " failed: " + ucsText(status));
    return;
  }
  if (kind == ReqCtx::kFlush && t->phase == Phase::kFlushing) t->phase = Phase::kDone;
}

// Issues puts of one transfer within the per-progress budget; returns true if any was issued.
bool UcxTransport::issue(Transfer* t, size_t* budget) {
  Peer* peer = findPeer(t->peer);
  if (!peer) {
    fail(t, unavailable("ucx: peer " + std::to_string(t->peer) + " was unloaded"));
    return false;
  }
  if (!peer->failure.isOk()) {
    fail(t, peer->failure);
    return false;
  }
  if (!peer->ep) {
    // The endpoint was closed after a missed deadline: reconnect (the peer may be alive).
    Status s = connect(peer);
    if (!s.isOk()) {
      fail(t, s);
      return false;
    }
  }
  bool any = false;
  // Built once: small segments are issued at tens of millions per second, so per-put work counts.
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_MEMH;
  p.cb.send = &UcxTransport::onRequestDone;
  while (t->nextSeg < t->segs.size() && *budget > 0 && t->inflightBytes < opt_.maxInflightBytes) {
    const Segment& s = t->segs[t->nextSeg];
    const size_t piece = std::min(opt_.maxPutBytes, s.len - t->segOffset);
    p.memh = s.memh;
    ucs_status_ptr_t r =
        ucp_put_nbx(peer->ep, s.local + t->segOffset, piece, s.remote + t->segOffset, peer->keys[s.keyIndex].rkey, &p);
    if (UCS_PTR_IS_ERR(r)) {
      fail(t, unavailable("ucx: transfer " + std::to_string(t->id) + ": put to peer '" + peer->name +
                          "' failed: " + ucsText(UCS_PTR_STATUS(r))));
      return true;
    }
    if (r != nullptr) {
      auto* ctx = static_cast<ReqCtx*>(r);
      *ctx = ReqCtx{t, piece, ReqCtx::kPut};
      t->pendingRequests++;
      t->inflightBytes += piece;
    }
    any = true;
    *budget = *budget > piece ? *budget - piece : 0;
    t->segOffset += piece;
    if (t->segOffset == s.len) {
      t->nextSeg++;
      t->segOffset = 0;
    }
  }
  if (t->nextSeg == t->segs.size() && t->phase == Phase::kPutting) {
    // Every put is issued: the flush completes only when they are all done at the target.
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    p.cb.send = &UcxTransport::onRequestDone;
    t->phase = Phase::kFlushing;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(peer->ep, &p);
    any = true;
    if (UCS_PTR_IS_ERR(r)) {
      fail(t, unavailable("ucx: transfer " + std::to_string(t->id) + ": flush to peer '" + peer->name +
                          "' failed: " + ucsText(UCS_PTR_STATUS(r))));
    } else if (r != nullptr) {
      *static_cast<ReqCtx*>(r) = ReqCtx{t, 0, ReqCtx::kFlush};
      t->pendingRequests++;
    } else {
      t->phase = Phase::kDone;
    }
  }
  return any;
}

bool UcxTransport::progress() {
  bool any = false;
  for (int i = 0; i < 256 && ucp_worker_progress(worker_) != 0; ++i) any = true;

  for (auto& [id, peer] : peers_)
    if (peer->errorPending) {
      peer->errorPending = false;
      PD_LOG(kWarn, "kvt.ucx") << peer->failure.message();
      closeEndpoint(peer.get(), peer->failure, Close::kForce);
      any = true;
    }

  size_t budget = opt_.sliceBytes;
  // An idle target spins here; skip the clock read when there is nothing to time.
  const SteadyTime now = transfers_.empty() ? SteadyTime{} : steadyNow();
  for (auto& [id, tp] : transfers_) {
    Transfer* t = tp.get();
    if (t->phase == Phase::kPutting && budget > 0) any |= issue(t, &budget);
    if (!terminal(t->phase) && now >= t->deadline) {
      Status why = deadlineExceeded("ucx: transfer " + std::to_string(id) + " to peer " + std::to_string(t->peer) +
                                    " not confirmed within " + std::to_string(opt_.transferTimeout.count()) + " ms");
      PD_LOG(kWarn, "kvt.ucx") << why.message() << "; closing the endpoint";
      fail(t, why);
      if (Peer* p = findPeer(t->peer)) closeEndpoint(p, why, Close::kFlush);
      any = true;
    }
  }

  // Reap closed endpoints and reported transfers UCX no longer references.
  for (size_t i = 0; i < closing_.size();) {
    Closing& c = closing_[i];
    if (c.request && ucp_request_check_status(c.request) == UCS_INPROGRESS) {
      ++i;
      continue;
    }
    if (c.request) ucp_request_free(c.request);
    for (ucp_rkey_h k : c.rkeys) ucp_rkey_destroy(k);
    closing_.erase(closing_.begin() + i);
  }
  std::erase_if(zombies_, [](const std::unique_ptr<Transfer>& z) { return z->pendingRequests == 0; });
  return any;
}

void UcxTransport::retire(std::unique_ptr<Transfer> t) {
  if (t->pendingRequests > 0) zombies_.push_back(std::move(t));
}

Status UcxTransport::poll(TransferId id) {
  auto it = transfers_.find(id);
  if (it == transfers_.end())
    return notFound("ucx: unknown transfer " + std::to_string(id) +
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
      out = cancelled("ucx: transfer " + std::to_string(id) + " was cancelled");
      break;
    default:
      return Status(StatusCode::kInProgress, "ucx: transfer " + std::to_string(id) + " in progress");
  }
  std::unique_ptr<Transfer> owned = std::move(it->second);
  transfers_.erase(it);
  retire(std::move(owned));
  return out;
}

Status UcxTransport::cancel(TransferId id) {
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return notFound("ucx: cancel of unknown transfer " + std::to_string(id));
  Transfer* t = it->second.get();
  if (t->phase == Phase::kDone)
    return failedPrecondition("ucx: transfer " + std::to_string(id) +
                              " already completed at the target; too late to cancel");
  if (!terminal(t->phase)) t->phase = Phase::kCancelled;
  return Status::ok();
}

}  // namespace

Result<UcxAllocation> ucxAllocateRegistered(Transport& transport, size_t len) {
  auto* ucx = dynamic_cast<UcxTransport*>(&transport);
  if (!ucx)
    return invalidArgument("ucx: ucxAllocateRegistered needs a UCX transport, got '" + transport.caps().name + "'");
  return ucx->allocateRegistered(len);
}

Result<std::unique_ptr<Transport>> makeUcxTransport(const UcxOptions& options) {
  if (options.maxPutBytes == 0 || options.sliceBytes == 0 || options.maxInflightBytes == 0)
    return invalidArgument("ucx: maxPutBytes, sliceBytes and maxInflightBytes must be > 0");
  if (options.transferTimeout.count() <= 0) return invalidArgument("ucx: transferTimeout must be > 0");
  auto t = std::make_unique<UcxTransport>(options);
  PD_RETURN_IF_ERROR(t->init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pd::kvt
