// TcpTransport implementation. With tcp/, the only compile units of kvtransfer that include Asio.
//
// Two roles per transport instance:
//  - sender: per loaded peer, options.tcpStreams outgoing sockets ("streams"); each stream
//    has a FIFO of jobs (one job = this stream's share of one transfer) and at most one
//    gathered write in flight; it reads acks back on the same socket.
//  - receiver: accepted sockets; each reads header -> validates -> reads payload in place,
//    and writes acks.
// Everything on the I/O side runs on the single I/O thread, so it needs no locks; the owner
// thread and the I/O thread meet in two mutex-guarded places: the exposure table and the
// completion queue.
//
// This file: the owner-thread half of TcpTransport::Impl and the public forwarders; the I/O
// side is in tcp/ (tcp/tcp_impl.h lists which file does what).
#include "kvtransfer/transports/tcp_transport.h"

#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/transports/tcp/tcp_impl.h"

namespace pd::kvt {

namespace {

// Any-address binds ("0.0.0.0", "::"): kvtransfer links only pd_base, so it cannot use
// config::isWildcardHost.
bool isWildcardAddress(const std::string& host) {
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  return host.empty() || (!ec && addr.is_unspecified());
}

}  // namespace

// ---- owner thread ------------------------------------------------------------------------------
Status TcpTransport::Impl::start() {
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(options_.listenHost, ec);
  if (ec) return invalidArgument("tcp transport: listen host '" + options_.listenHost + "': " + ec.message());
  tcp::endpoint ep(addr, options_.listenPort);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return unavailable("tcp transport: cannot listen on " + options_.listenHost + ":" +
                       std::to_string(options_.listenPort) + ": " + ec.message());
  }
  port_ = acceptor_.local_endpoint().port();
  if (options_.tcpStreams < 1 || options_.tcpStreams > 16) {
    return invalidArgument("tcp transport: tcpStreams must be in [1, 16], got " + std::to_string(options_.tcpStreams));
  }
  if (options_.stageChunkBytes < kMinStageChunk || options_.stageBuffers < 2 || options_.stageBuffers > 64) {
    return invalidArgument("tcp transport: stageChunkBytes must be >= " + std::to_string(kMinStageChunk) +
                           " and stageBuffers in [2, 64], got " + std::to_string(options_.stageChunkBytes) + " and " +
                           std::to_string(options_.stageBuffers));
  }
  if (options_.deviceCopier) {
    copier_ = options_.deviceCopier;
  } else {
    auto c = makeCudaCopier();
    if (c.ok()) {
      copier_ = std::move(c).value();
    } else {
      noCopierWhy_ = c.status().message();
    }
  }
  doAccept();
  armWatchdog();
  thread_ = std::thread([this] { io_.run(); });
  return Status::ok();
}

void TcpTransport::Impl::shutdown() {
  if (!thread_.joinable()) return;
  // Every loaded peer, connected or still connecting (ioPeers_ has only the connected ones).
  std::vector<std::shared_ptr<OutPeer>> loaded;
  for (auto& [id, p] : peers_) loaded.push_back(p);
  asio::post(io_, [this, loaded] {
    // Completions already queued (a watchdog tick, an accept) must not re-arm anything.
    stopping_ = true;
    boost::system::error_code ec;
    acceptor_.close(ec);
    watchdog_.cancel();
    for (auto& p : ioPeers_) closePeerSockets(*p);
    for (auto& p : loaded) closePeerSockets(*p);
    for (auto& c : inConns_) closeIn(*c);
    work_.reset();
  });
  // The posted lambda drops the work guard; pending handlers drain with operation_aborted.
  thread_.join();
  ioPeers_.clear();
  inConns_.clear();
}

TransportCaps TcpTransport::Impl::caps() const {
  TransportCaps c;
  c.name = "tcp";
  c.hostMemory = true;
  c.cudaMemory = copier_ != nullptr;
  c.cudaStaged = c.cudaMemory;
  c.oneSided = false;
  c.receiverFenced = true;  // validateWrite checks every frame against the live grants
  c.details = "asio, " + std::to_string(options_.tcpStreams) + " stream(s) per peer, listening on " +
              options_.listenHost + ":" + std::to_string(port_) +
              (options_.advertiseHost.empty() ? "" : ", advertised as " + options_.advertiseHost);
  if (copier_) {
    c.cudaPath = "staged through pinned host memory";
    c.details += "; GPU memory staged through pinned host memory (" + copier_->describe() + ", " +
                 std::to_string(options_.stageBuffers) + " x " + std::to_string(options_.stageChunkBytes >> 10) +
                 " KiB bounce buffers)";
  }
  return c;
}

Result<MemHandle> TcpTransport::Impl::registerMemory(const MemDesc& desc) {
  if (desc.addr == 0 || desc.len == 0) {
    return invalidArgument("tcp transport: cannot register an empty region " + toString(desc));
  }
  if (desc.kind == MemKind::kCuda) {
    if (!copier_) {
      return failedPrecondition("tcp transport: cannot register CUDA memory " + toString(desc) +
                                ": staging it needs a CUDA device at run time (" + noCopierWhy_ + ")");
    }
    Status st = copier_->checkDeviceMemory(desc);
    if (!st.isOk()) return st.withContext("tcp transport: registering " + toString(desc));
  }
  MemHandle h = nextHandle_++;
  regions_[h] = Region{desc, {}};
  matcher_.addRegion(h, desc);
  return h;
}

Status TcpTransport::Impl::deregisterMemory(MemHandle handle) {
  auto it = regions_.find(handle);
  if (it == regions_.end()) return notFound("tcp transport: no registration " + std::to_string(handle));
  {
    std::unique_lock lock(exposuresMu_);
    for (uint64_t tok : it->second.tokens) exposures_.erase(tok);
  }
  regions_.erase(it);
  matcher_.removeRegion(handle);
  return Status::ok();
}

Result<std::string> TcpTransport::Impl::packRemoteKey(MemHandle handle) {
  auto it = regions_.find(handle);
  if (it == regions_.end()) return notFound("tcp transport: no registration " + std::to_string(handle));
  proto::TcpRemoteKey key;
  key.set_token(randomNonZeroU64());
  key.set_addr(it->second.desc.addr);
  key.set_len(it->second.desc.len);
  key.set_instance(instance_);
  {
    std::unique_lock lock(exposuresMu_);
    exposures_[key.token()] = it->second.desc;
  }
  it->second.tokens.push_back(key.token());
  return key.SerializeAsString();
}

Result<std::string> TcpTransport::Impl::localConnInfo() {
  const std::string& host = options_.advertiseHost.empty() ? options_.listenHost : options_.advertiseHost;
  if (isWildcardAddress(host)) {
    return failedPrecondition("tcp transport: listening on " + options_.listenHost +
                              " with no advertised address: peers cannot dial a wildcard address (set the "
                              "advertised host, --advertise-host on a worker)");
  }
  proto::TcpConnInfo info;
  info.set_version(kWireVersion);
  info.set_host(host);
  info.set_port(port_);
  info.set_instance(instance_);
  return info.SerializeAsString();
}

Result<PeerId> TcpTransport::Impl::loadPeer(const PeerInfo& peer) {
  proto::TcpConnInfo info;
  if (!info.ParseFromString(peer.connInfo) || info.port() == 0 || info.port() > 65535) {
    return invalidArgument("tcp transport: peer '" + peer.name + "': connInfo is not a tcp connection blob");
  }
  if (info.version() != kWireVersion) {
    return failedPrecondition("tcp transport: peer '" + peer.name + "' speaks wire version " +
                              std::to_string(info.version()) + ", this build speaks " + std::to_string(kWireVersion));
  }
  auto p = std::make_shared<OutPeer>();
  for (size_t i = 0; i < peer.remoteKeys.size(); ++i) {
    proto::TcpRemoteKey key;
    if (!key.ParseFromString(peer.remoteKeys[i]) || key.token() == 0) {
      return invalidArgument("tcp transport: peer '" + peer.name + "': remote key " + std::to_string(i) +
                             " is not a tcp key");
    }
    p->keys.push_back({key.token(), key.addr(), key.len()});
    p->keyRanges.push_back({key.addr(), key.len()});
  }
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(info.host(), ec);
  if (ec) return invalidArgument("tcp transport: peer '" + peer.name + "': bad host '" + info.host() + "'");
  tcp::endpoint ep(addr, uint16_t(info.port()));
  p->id = nextPeer_++;
  p->name = peer.name;
  p->endpoint = info.host() + ":" + std::to_string(info.port());

  // The connection is made on the I/O thread; the owner never waits for it (a peer that is
  // slow, stopped or unreachable must not stall the worker's loop). Transfers posted before it
  // is up wait for it; if it fails, or is not up within connectTimeout, they fail with it and
  // peerAlive() turns false.
  // The streams exist before the owner returns: post() stripes over them from its thread.
  for (int i = 0; i < options_.tcpStreams; ++i) {
    p->streams.push_back(std::make_shared<OutStream>(io_));
    p->streams.back()->index = i;
  }
  const uint64_t remoteInstance = info.instance();
  asio::post(io_, [this, p, ep, remoteInstance] { connectStreams(p, ep, remoteInstance); });
  peers_[p->id] = p;
  return p->id;
}

bool TcpTransport::Impl::peerAlive(PeerId id) const {
  auto it = peers_.find(id);
  return it != peers_.end() && !it->second->dead.load();
}

Status TcpTransport::Impl::unloadPeer(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return notFound("tcp transport: no peer " + std::to_string(id));
  auto p = it->second;
  peers_.erase(it);
  asio::post(io_, [this, p] {
    failPeer(p, "peer unloaded", StatusCode::kCancelled);
    ioPeers_.erase(std::remove(ioPeers_.begin(), ioPeers_.end(), p), ioPeers_.end());
  });
  return Status::ok();
}

void TcpTransport::Impl::dropConnections(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  auto p = it->second;
  asio::post(io_, [this, p] { failPeer(p, "connection dropped (test hook)"); });
}

Result<std::string> TcpTransport::Impl::grantWrite(const DescList& ranges) {
  if (ranges.empty()) return invalidArgument("tcp transport: a write grant over no memory");
  Grant g;
  for (const MemDesc& r : ranges) {
    const Region* in = nullptr;
    for (const auto& [h, region] : regions_) {
      if (KeyRange{region.desc.addr, region.desc.len}.covers(r.addr, r.len)) in = &region;
    }
    if (!in || r.len == 0) {
      return invalidArgument("tcp transport: write grant range " + toString(r) +
                             " is empty or outside every registered region");
    }
    MemDesc d = in->desc;
    d.addr = r.addr;
    d.len = r.len;
    g.ranges.push_back(d);
  }
  std::sort(g.ranges.begin(), g.ranges.end(), [](const MemDesc& a, const MemDesc& b) { return a.addr < b.addr; });
  proto::TcpGrant out;
  out.set_instance(instance_);
  std::unique_lock lock(exposuresMu_);
  uint64_t token = randomNonZeroU64();
  while (grants_.count(token) || exposures_.count(token)) token = randomNonZeroU64();
  grants_.emplace(token, std::move(g));
  out.set_token(token);
  return out.SerializeAsString();
}

Status TcpTransport::Impl::revokeWrite(const std::string& grant) {
  proto::TcpGrant g;
  if (!g.ParseFromString(grant) || g.token() == 0 || g.instance() != instance_) {
    return invalidArgument("tcp transport: revokeWrite: not a write grant of this transport");
  }
  {
    std::unique_lock lock(exposuresMu_);
    if (grants_.erase(g.token()) == 0) return notFound("tcp transport: revokeWrite: grant unknown or already revoked");
  }
  // From here on validateWrite refuses the token. A frame validated before that may still be
  // landing: its connection is closed (on the I/O thread, between two reads), so not one
  // more byte of it lands; the sender's transfers on it fail (that writer is stale anyway).
  auto prom = std::make_shared<std::promise<void>>();
  auto fut = prom->get_future();
  asio::post(io_, [this, token = g.token(), prom] {
    const auto conns = inConns_;
    for (const auto& c : conns) {
      if (c->landingGrant == token) dropIn(c, "a write under a revoked grant was landing", true);
    }
    prom->set_value();
  });
  if (fut.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    return internalError("tcp transport: revokeWrite: the I/O thread did not fence the grant within 5 s");
  }
  return Status::ok();
}

Result<TransferId> TcpTransport::Impl::post(const DescList& local, const DescList& remote, PeerId peerId,
                                            const std::string& grant) {
  uint64_t grantToken = 0;
  if (!grant.empty()) {
    proto::TcpGrant g;
    if (!g.ParseFromString(grant) || g.token() == 0) {
      return invalidArgument("tcp transport: the write grant is not a tcp grant");
    }
    grantToken = g.token();
  }
  auto pit = peers_.find(peerId);
  if (pit == peers_.end()) return notFound("tcp transport: no peer " + std::to_string(peerId));
  auto& peer = pit->second;
  if (peer->dead.load()) {
    std::lock_guard lock(peer->reasonMu);
    return unavailable("tcp transport: peer '" + peer->name + "' at " + peer->endpoint +
                       " is dead: " + peer->deathReason);
  }
  PD_ASSIGN_OR_RETURN(auto matches, matcher_.match(local, remote, peer->keyRanges, peer->name));
  std::vector<Seg> segs;
  segs.reserve(matches.size());
  size_t total = 0;
  bool staged = false;
  const Region* region = nullptr;
  MemHandle regionHandle = 0;
  for (const SegmentMatch& m : matches) {
    const MemDesc& l = local[m.index];
    if (!region || regionHandle != m.region) {
      region = &regions_.at(m.region);
      regionHandle = m.region;
    }
    const int device = region->desc.kind == MemKind::kCuda ? region->desc.device : -1;
    staged |= device >= 0;
    segs.push_back({l.addr, grantToken ? grantToken : peer->keys[m.key].token, remote[m.index].addr, l.len, device});
    total += l.len;
  }

  auto t = std::make_shared<IoTransfer>();
  t->id = nextTransfer_++;

  // Striping: large transfers are spread over the peer's streams in chunks.
  const size_t nStreams = peer->streams.size();
  std::vector<std::vector<Seg>> perStream(nStreams);
  if (nStreams == 1 || total < kStripeMinBytes) {
    perStream[t->id % nStreams] = std::move(segs);
  } else {
    size_t s = 0;
    for (const Seg& seg : segs) {
      for (size_t off = 0; off < seg.len; off += kStripeChunk) {
        size_t n = std::min(kStripeChunk, seg.len - off);
        perStream[s].push_back({seg.local + off, seg.token, seg.remote + off, n, seg.device});
        s = (s + 1) % nStreams;
      }
    }
  }
  entries_[t->id] = OwnerEntry{t, peerId, false, std::nullopt};
  asio::post(io_, [this, p = peer, t, perStream = std::move(perStream), staged]() mutable {
    startTransfer(p, t, std::move(perStream), staged);
  });
  return t->id;
}

void TcpTransport::Impl::harvest() {
  std::vector<Completion> done;
  {
    std::lock_guard lock(completedMu_);
    done.swap(completed_);
  }
  for (auto& c : done) {
    auto it = entries_.find(c.id);
    if (it == entries_.end()) continue;
    if (!it->second.cancelled) it->second.outcome = std::move(c.status);
  }
  harvested_ = !done.empty();
}

Status TcpTransport::Impl::poll(TransferId id) {
  harvest();
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return notFound("tcp transport: transfer " + std::to_string(id) +
                    " is unknown or its outcome was already reported");
  }
  if (it->second.cancelled) {
    entries_.erase(it);
    return cancelled("tcp transport: transfer " + std::to_string(id) + " was cancelled");
  }
  if (!it->second.outcome) return Status(StatusCode::kInProgress, "");
  Status st = std::move(*it->second.outcome);
  entries_.erase(it);
  return st;
}

Status TcpTransport::Impl::cancel(TransferId id) {
  harvest();
  auto it = entries_.find(id);
  if (it == entries_.end()) return notFound("tcp transport: transfer " + std::to_string(id) + " is unknown");
  if (it->second.cancelled) return Status::ok();
  if (it->second.outcome) {
    return failedPrecondition("tcp transport: transfer " + std::to_string(id) + " already finished");
  }
  auto t = it->second.t;
  auto prom = std::make_shared<std::promise<bool>>();
  auto fut = prom->get_future();
  asio::post(io_, [this, t, prom] { cancelOnIo(t, prom); });
  // Bounded: at most one batch (kMaxBatchBytes) is in flight per stream.
  if (fut.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    return internalError("tcp transport: cancel of transfer " + std::to_string(id) + " did not quiesce within 5 s");
  }
  if (!fut.get()) {
    return failedPrecondition("tcp transport: transfer " + std::to_string(id) +
                              " is past the point of no return (all its data is sent)");
  }
  it->second.cancelled = true;
  return Status::ok();
}

bool TcpTransport::Impl::progress() {
  harvest();
  return harvested_;
}

Result<std::unique_ptr<Transport>> TcpTransport::create(const TransportOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  PD_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<Transport>(new TcpTransport(std::move(impl)));
}

TcpTransport::TcpTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpTransport::~TcpTransport() = default;

TransportCaps TcpTransport::caps() const { return impl_->caps(); }
Result<MemHandle> TcpTransport::registerMemory(const MemDesc& d) { return impl_->registerMemory(d); }
Status TcpTransport::deregisterMemory(MemHandle h) { return impl_->deregisterMemory(h); }
Result<std::string> TcpTransport::packRemoteKey(MemHandle h) { return impl_->packRemoteKey(h); }
Result<std::string> TcpTransport::localConnInfo() { return impl_->localConnInfo(); }
Result<PeerId> TcpTransport::loadPeer(const PeerInfo& p) { return impl_->loadPeer(p); }
bool TcpTransport::peerAlive(PeerId p) const { return impl_->peerAlive(p); }
Status TcpTransport::unloadPeer(PeerId p) { return impl_->unloadPeer(p); }
Result<TransferId> TcpTransport::post(const DescList& l, const DescList& r, PeerId p, const std::string& g) {
  return impl_->post(l, r, p, g);
}
Result<std::string> TcpTransport::grantWrite(const DescList& ranges) { return impl_->grantWrite(ranges); }
Status TcpTransport::revokeWrite(const std::string& grant) { return impl_->revokeWrite(grant); }
Status TcpTransport::poll(TransferId id) { return impl_->poll(id); }
Status TcpTransport::cancel(TransferId id) { return impl_->cancel(id); }
bool TcpTransport::progress() { return impl_->progress(); }
void TcpTransport::dropConnections(PeerId p) { impl_->dropConnections(p); }

}  // namespace pd::kvt
