#include "kvtransfer/agent.h"

#include <algorithm>

#include "common/base/log.h"
#include "kvtransfer/kvt.pb.h"

namespace pd::kvt {

namespace {
constexpr uint32_t kMetadataVersion = 1;

std::optional<PeerInfo> peerInfoFrom(const proto::AgentMetadata& md, const std::string& name) {
  for (const auto& tp : md.transports()) {
    if (tp.transport() != name) continue;
    PeerInfo pi;
    pi.name = md.name();
    pi.connInfo = tp.conn_info();
    // An empty key: the peer did not register that region with this transport (GPU memory).
    for (const auto& k : tp.remote_keys()) {
      if (!k.empty()) pi.remoteKeys.push_back(k);
    }
    return pi;
  }
  return std::nullopt;
}
}  // namespace

Result<std::unique_ptr<TransferAgent>> TransferAgent::create(const AgentOptions& options,
                                                             prometheus::Registry& registry) {
  TransportOptions topts = options.transport;
  topts.localName = options.name;
  topts.onWriteRejected = [count = writeRejectCounter(registry),
                           also = options.transport.onWriteRejected](const std::string& reason) {
    count(reason);
    if (also) also(reason);
  };
  std::vector<NamedTransport> transports;
  std::string skipped;
  auto add = [&](const std::string& name) {
    for (const auto& t : transports) {
      if (t.name == name) return;
    }
    auto t = makeTransport(name, topts);
    if (!t.ok()) {
      PD_LOG(kInfo, "kvt") << "agent '" << options.name << "': transport " << name
                           << " skipped: " << t.status().message();
      skipped += "\n  " + name + ": " + t.status().message();
      return;
    }
    PD_LOG(kInfo, "kvt") << "agent '" << options.name << "': transport " << name << " ready (" << (*t)->caps().details
                         << ")";
    transports.push_back({name, std::move(t).value()});
  };
  for (const auto& name : options.preference) add(name);
  if (transports.empty()) {
    return unavailable("kvtransfer agent '" + options.name +
                       "': no usable transport among the preference list:" + skipped);
  }
  // The fallback lane: tcp is always created when built in, even if not preferred.
  if (options.fallbackToTcp) add("tcp");
  return createWith(options, std::move(transports), registry);
}

Result<std::unique_ptr<TransferAgent>> TransferAgent::createWith(const AgentOptions& options,
                                                                 std::vector<NamedTransport> transports,
                                                                 prometheus::Registry& registry) {
  if (transports.empty()) return invalidArgument("kvtransfer agent: no transports given");
  for (const auto& t : transports) {
    if (!t.transport) return invalidArgument("kvtransfer agent: transport '" + t.name + "' is null");
  }
  return std::unique_ptr<TransferAgent>(new TransferAgent(options, std::move(transports), registry));
}

TransferAgent::TransferAgent(const AgentOptions& options, std::vector<NamedTransport> transports,
                             prometheus::Registry& registry)
    : options_(options), transports_(std::move(transports)), metrics_(registry) {}

TransferAgent::~TransferAgent() = default;

std::vector<std::string> TransferAgent::transportNames() const {
  std::vector<std::string> out;
  for (const auto& t : transports_) out.push_back(t.name);
  return out;
}

std::optional<size_t> TransferAgent::indexOf(const std::string& name) const {
  for (size_t i = 0; i < transports_.size(); ++i) {
    if (transports_[i].name == name) return i;
  }
  return std::nullopt;
}

Result<RegionId> TransferAgent::registerMemory(const MemDesc& desc) {
  RegionState rs;
  rs.desc = desc;
  const bool gpu = desc.kind == MemKind::kCuda;
  std::string noGpu;
  auto rollback = [&] {
    for (size_t j = 0; j < rs.handles.size(); ++j) {
      if (rs.registered[j]) (void)transports_[j].transport->deregisterMemory(rs.handles[j]);
    }
  };
  for (size_t i = 0; i < transports_.size(); ++i) {
    auto& t = *transports_[i].transport;
    if (gpu) {
      const TransportCaps caps = t.caps();
      if (!caps.cudaMemory || gpuRefused_.count(i)) {
        noGpu += "\n  " + transports_[i].name + ": cannot move GPU memory here" +
                 (caps.details.empty() ? std::string() : " (" + caps.details + ")");
        rs.handles.push_back(0);
        rs.keys.emplace_back();
        rs.registered.push_back(false);
        continue;
      }
    }
    auto h = t.registerMemory(desc);
    Result<std::string> key = h.ok() ? t.packRemoteKey(*h) : Result<std::string>(h.status());
    if (!key.ok() && gpu) {
      // A transport that claims GPU memory but refuses it (verbs on a NIC without dma-buf) is
      // skipped for GPU memory from now on; the next GPU-capable transport carries it.
      if (h.ok()) (void)t.deregisterMemory(*h);
      PD_LOG(kWarn, "kvt") << "agent '" << options_.name << "': " << transports_[i].name << " refused GPU memory ("
                           << key.status().message() << "); GPU memory goes over the next transport that can move it";
      noGpu += "\n  " + transports_[i].name + ": " + key.status().message();
      gpuRefused_.insert(i);
      rs.handles.push_back(0);
      rs.keys.emplace_back();
      rs.registered.push_back(false);
      continue;
    }
    if (!key.ok()) {
      if (h.ok()) (void)t.deregisterMemory(*h);
      rollback();
      return key.status().withContext("kvtransfer agent: registering " + toString(desc) + " with " +
                                      transports_[i].name);
    }
    rs.handles.push_back(*h);
    rs.keys.push_back(std::move(key).value());
    rs.registered.push_back(true);
  }
  if (gpu && std::find(rs.registered.begin(), rs.registered.end(), true) == rs.registered.end()) {
    return failedPrecondition("kvtransfer agent: no transport can move GPU memory " + toString(desc) + ":" + noGpu);
  }
  RegionId id = nextRegion_++;
  regions_[id] = std::move(rs);
  regionOrder_.push_back(id);
  return id;
}

Status TransferAgent::deregisterMemory(RegionId region) {
  auto it = regions_.find(region);
  if (it == regions_.end()) return notFound("kvtransfer agent: no region " + std::to_string(region));
  Status first;
  for (size_t i = 0; i < transports_.size(); ++i) {
    if (!it->second.registered[i]) continue;
    Status st = transports_[i].transport->deregisterMemory(it->second.handles[i]);
    if (!st.isOk() && first.isOk()) first = st;
  }
  regions_.erase(it);
  regionOrder_.erase(std::remove(regionOrder_.begin(), regionOrder_.end(), region), regionOrder_.end());
  return first;
}

// Our name and regions; the caller adds the transports.
proto::AgentMetadata TransferAgent::metadataHead() const {
  proto::AgentMetadata md;
  md.set_version(kMetadataVersion);
  md.set_name(options_.name);
  for (RegionId r : regionOrder_) {
    const auto& rs = regions_.at(r);
    auto* reg = md.add_regions();
    reg->set_addr(rs.desc.addr);
    reg->set_len(rs.desc.len);
    reg->set_kind(uint32_t(rs.desc.kind));
    reg->set_device(rs.desc.device);
  }
  return md;
}

void TransferAgent::addTransport(proto::AgentMetadata* md, size_t i, std::string connInfo) const {
  auto* tp = md->add_transports();
  tp->set_transport(transports_[i].name);
  tp->set_conn_info(std::move(connInfo));
  for (RegionId r : regionOrder_) tp->add_remote_keys(regions_.at(r).keys[i]);
}

Result<std::string> TransferAgent::localMetadata() {
  proto::AgentMetadata md = metadataHead();
  for (size_t i = 0; i < transports_.size(); ++i) {
    PD_ASSIGN_OR_RETURN(std::string conn, transports_[i].transport->localConnInfo());
    addTransport(&md, i, std::move(conn));
  }
  return md.SerializeAsString();
}

Result<std::string> TransferAgent::peerMetadata(AgentPeer peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return notFound("kvtransfer agent: peerMetadata of unknown peer " + std::to_string(peer));
  const PeerState& ps = it->second;
  proto::AgentMetadata md = metadataHead();
  // Only the transports that have a lane to this peer: answering on another one would make
  // an endpoint (a verbs QP) that nobody connects.
  for (size_t i = 0; i < transports_.size(); ++i) {
    std::optional<Lane> lane;
    for (const std::optional<Lane>& l : {std::optional<Lane>(ps.primary), ps.tcpLane, ps.gpuLane}) {
      if (l && l->transport == i) lane = l;
    }
    if (!lane) continue;
    auto conn = transports_[i].transport->peerConnInfo(lane->peer);
    if (!conn.ok()) {
      return conn.status().withContext("kvtransfer agent: reply to peer '" + ps.name + "' over " + transports_[i].name);
    }
    addTransport(&md, i, std::move(conn).value());
  }
  return md.SerializeAsString();
}

Result<std::string> TransferAgent::metadataName(const std::string& metadata) {
  proto::AgentMetadata md;
  if (!md.ParseFromString(metadata)) {
    return invalidArgument("kvtransfer agent: peer metadata is not a serialized AgentMetadata");
  }
  return md.name();
}

Result<AgentPeer> TransferAgent::loadPeer(const std::string& metadata) {
  proto::AgentMetadata md;
  if (!md.ParseFromString(metadata)) {
    return invalidArgument("kvtransfer agent: peer metadata is not a serialized AgentMetadata");
  }
  if (md.version() != kMetadataVersion) {
    return failedPrecondition("kvtransfer agent: peer '" + md.name() + "' metadata version " +
                              std::to_string(md.version()) + ", expected " + std::to_string(kMetadataVersion));
  }
  for (auto& [id, ps] : peers_) {
    if (ps.name != md.name()) continue;
    const bool alive = transports_[ps.primary.transport].transport->peerAlive(ps.primary.peer);
    if (ps.metadata == metadata && alive) return id;
    PD_LOG(kInfo, "kvt") << "peer '" << md.name() << "' "
                         << (alive ? "sent new metadata" : "lost its " + laneName(ps.primary) + " connection")
                         << "; reconnecting";
    PD_RETURN_IF_ERROR(unloadPeer(id));
    break;
  }
  auto peerInfoFor = [&](const std::string& name) { return peerInfoFrom(md, name); };

  PeerState ps;
  ps.name = md.name();
  ps.metadata = metadata;
  std::string why;
  bool found = false;
  for (size_t i = 0; i < transports_.size() && !found; ++i) {
    const std::string& name = transports_[i].name;
    auto pi = peerInfoFor(name);
    if (!pi) {
      why += "\n  " + name + ": the peer does not offer it";
      continue;
    }
    auto id = transports_[i].transport->loadPeer(*pi);
    if (!id.ok()) {
      PD_LOG(kWarn, "kvt") << "peer '" << md.name() << "': " << name << " failed: " << id.status().message();
      why += "\n  " + name + ": " + id.status().message();
      continue;
    }
    ps.primary = Lane{i, *id};
    found = true;
  }
  if (!found) {
    return unavailable("kvtransfer agent: no common transport reaches peer '" + md.name() + "':" + why);
  }
  std::string lanes = laneName(ps.primary);
  if (options_.fallbackToTcp && laneName(ps.primary) != "tcp") {
    auto tcpIdx = indexOf("tcp");
    auto pi = peerInfoFor("tcp");
    if (tcpIdx && pi) {
      auto id = transports_[*tcpIdx].transport->loadPeer(*pi);
      if (id.ok()) {
        ps.tcpLane = Lane{*tcpIdx, *id};
        lanes += " (tcp as fallback)";
      } else {
        PD_LOG(kWarn, "kvt") << "peer '" << md.name() << "': no tcp fallback lane: " << id.status().message();
      }
    }
  }
  resolveGpuLane(ps);
  if (ps.gpuLaneOwned) lanes += "; " + laneName(*ps.gpuLane) + " for GPU memory";
  PD_LOG(kInfo, "kvt") << "peer '" << md.name() << "': using " << lanes;
  metrics_.onPeerLane(laneName(ps.primary), +1);
  AgentPeer id = nextPeer_++;
  peers_[id] = std::move(ps);
  return id;
}

Status TransferAgent::unloadPeer(AgentPeer peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return notFound("kvtransfer agent: no peer " + std::to_string(peer));
  // Transfers to it end as cancelled; their ids stay pollable.
  for (auto& [id, e] : entries_) {
    if (e.peer == peer) (void)transports_[e.lane.transport].transport->cancel(e.inner);
  }
  Status st = transports_[it->second.primary.transport].transport->unloadPeer(it->second.primary.peer);
  if (it->second.tcpLane)
    (void)transports_[it->second.tcpLane->transport].transport->unloadPeer(it->second.tcpLane->peer);
  if (it->second.gpuLaneOwned) {
    (void)transports_[it->second.gpuLane->transport].transport->unloadPeer(it->second.gpuLane->peer);
  }
  metrics_.onPeerLane(laneName(it->second.primary), -1);
  peers_.erase(it);
  return st;
}

Result<std::string> TransferAgent::peerTransport(AgentPeer peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return notFound("kvtransfer agent: no peer " + std::to_string(peer));
  return laneName(it->second.primary);
}

Result<std::string> TransferAgent::peerName(AgentPeer peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return notFound("kvtransfer agent: no peer " + std::to_string(peer));
  return it->second.name;
}

Result<std::string> TransferAgent::grantWrite(AgentPeer peer, const DescList& ranges) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return notFound("kvtransfer agent: grantWrite for unknown peer " + std::to_string(peer));
  const PeerState& ps = it->second;
  proto::AgentGrant out;
  std::vector<std::pair<size_t, std::string>> made;  // for the rollback
  for (const std::optional<Lane>& l : {std::optional<Lane>(ps.primary), ps.tcpLane, ps.gpuLane}) {
    if (!l) continue;
    bool seen = false;
    for (const auto& e : out.entries()) seen = seen || e.transport() == laneName(*l);
    if (seen) continue;
    auto g = transports_[l->transport].transport->grantWrite(ranges);
    if (!g.ok()) {
      for (auto& [t, key] : made) (void)transports_[t].transport->revokeWrite(key);
      return g.status().withContext("kvtransfer agent: write grant for peer '" + ps.name + "' over " + laneName(*l));
    }
    made.emplace_back(l->transport, *g);
    auto* e = out.add_entries();
    e->set_transport(laneName(*l));
    e->set_grant(std::move(g).value());
  }
  return out.SerializeAsString();
}

Status TransferAgent::revokeWrite(const std::string& grant) {
  proto::AgentGrant g;
  if (!g.ParseFromString(grant)) return invalidArgument("kvtransfer agent: revokeWrite: not an agent write grant");
  Status first;
  for (const auto& e : g.entries()) {
    auto i = indexOf(e.transport());
    if (!i) continue;
    Status st = transports_[*i].transport->revokeWrite(e.grant());
    if (!st.isOk() && first.isOk()) first = st.withContext("kvtransfer agent: revoking over " + e.transport());
  }
  return first;
}

bool TransferAgent::receiverFenced(AgentPeer peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return false;
  const PeerState& ps = it->second;
  for (const std::optional<Lane>& l : {std::optional<Lane>(ps.primary), ps.tcpLane, ps.gpuLane}) {
    if (l && !transports_[l->transport].transport->caps().receiverFenced) return false;
  }
  return true;
}

bool TransferAgent::unfencedLanesDead(AgentPeer peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return false;
  const PeerState& ps = it->second;
  for (const std::optional<Lane>& l : {std::optional<Lane>(ps.primary), ps.tcpLane, ps.gpuLane}) {
    if (!l) continue;
    const Transport& t = *transports_[l->transport].transport;
    if (!t.caps().receiverFenced && t.peerAlive(l->peer)) return false;
  }
  return true;
}

std::string TransferAgent::grantFor(const std::string& grant, const Lane& lane) const {
  if (grant.empty()) return {};
  proto::AgentGrant g;
  if (!g.ParseFromString(grant)) return {};
  for (const auto& e : g.entries()) {
    if (e.transport() == laneName(lane)) return e.grant();
  }
  return {};
}

Result<AgentTransfer> TransferAgent::post(const DescList& local, const DescList& remote, AgentPeer peer,
                                          const std::string& grant) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return notFound("kvtransfer agent: no peer " + std::to_string(peer));
  PeerState& ps = it->second;
  Entry e;
  e.peer = peer;
  e.lane = ps.primary;
  e.start = steadyNow();
  e.bytes = totalBytes(local);
  auto isCuda = [](const MemDesc& d) { return d.kind == MemKind::kCuda; };
  e.gpu = std::any_of(local.begin(), local.end(), isCuda) || std::any_of(remote.begin(), remote.end(), isCuda);
  if (e.gpu) {
    if (ps.gpuLane && gpuRefused_.count(ps.gpuLane->transport)) resolveGpuLane(ps);
    if (!ps.gpuLane) {
      return failedPrecondition("kvtransfer agent: no transport to peer '" + ps.name +
                                "' can move GPU memory:" + ps.noGpuWhy);
    }
    e.lane = *ps.gpuLane;
  }
  auto tcpCanCarry = [&] {
    if (!ps.tcpLane || ps.tcpLane->transport == e.lane.transport) return false;
    return !e.gpu || transports_[ps.tcpLane->transport].transport->caps().cudaMemory;
  };
  e.canFallBack = tcpCanCarry();
  auto id = transports_[e.lane.transport].transport->post(local, remote, e.lane.peer, grantFor(grant, e.lane));
  if (!id.ok()) {
    // Argument errors are the caller's; anything else on a fabric lane may still go over tcp.
    if (id.status().code() == StatusCode::kInvalidArgument || !e.canFallBack) {
      return id.status().withContext("kvtransfer agent: posting to peer '" + ps.name + "' over " + laneName(e.lane));
    }
    metrics_.onFailure(laneName(e.lane), id.status().code());
    metrics_.onFallback(laneName(e.lane), "tcp");
    PD_LOG(kWarn, "kvt") << "peer '" << ps.name << "': post over " << laneName(e.lane) << " failed ("
                         << id.status().message() << "); sending over tcp instead";
    e.lane = *ps.tcpLane;
    e.fellBack = true;
    id = transports_[e.lane.transport].transport->post(local, remote, e.lane.peer, grantFor(grant, e.lane));
    if (!id.ok()) return id.status().withContext("kvtransfer agent: tcp fallback to peer '" + ps.name + "'");
  }
  e.inner = *id;
  if (e.gpu) notePath(ps, e.lane);  // the lane it actually went over
  if (e.canFallBack && !e.fellBack) {
    e.grant = grant;
    e.local = local;
    e.remote = remote;
  }
  AgentTransfer aid = nextTransfer_++;
  entries_[aid] = std::move(e);
  return aid;
}

Status TransferAgent::poll(AgentTransfer id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return notFound("kvtransfer agent: transfer " + std::to_string(id) + " is unknown or already reported");
  }
  Entry& e = it->second;
  const std::string transport = laneName(e.lane);
  Status st = transports_[e.lane.transport].transport->poll(e.inner);
  if (st.inProgress()) return st;
  if (st.isOk()) {
    const double seconds = secondsBetween(e.start, steadyNow());
    metrics_.onSuccess(transport, e.bytes, seconds);
    laneRates_.record(transport, e.bytes, seconds);
    entries_.erase(it);
    return st;
  }
  if (st.code() == StatusCode::kCancelled) {
    metrics_.onCancel(transport);
    entries_.erase(it);
    return st;
  }
  metrics_.onFailure(transport, st.code());
  auto pit = peers_.find(e.peer);
  if (!e.fellBack && e.canFallBack && pit != peers_.end() && pit->second.tcpLane) {
    PeerState& ps = pit->second;
    auto retry = transports_[ps.tcpLane->transport].transport->post(e.local, e.remote, ps.tcpLane->peer,
                                                                    grantFor(e.grant, *ps.tcpLane));
    if (retry.ok()) {
      PD_LOG(kWarn, "kvt") << "peer '" << ps.name << "': transfer " << id << " failed over " << transport << " ("
                           << st.message() << "); retrying once over tcp";
      metrics_.onFallback(transport, "tcp");
      e.lane = *ps.tcpLane;
      if (e.gpu) notePath(ps, e.lane);
      e.inner = *retry;
      e.fellBack = true;
      e.local.clear();
      e.remote.clear();
      return Status(StatusCode::kInProgress, "");
    }
    st = st.withContext("tcp fallback impossible too (" + retry.status().message() + ")");
  }
  entries_.erase(it);
  return st;
}

// The GPU lane: the first preferred transport that can move GPU memory, has not refused a
// kCuda region here, and the peer offers. Re-resolved at post when its transport refused one
// after the peer was loaded.
void TransferAgent::resolveGpuLane(PeerState& ps) {
  proto::AgentMetadata md;
  (void)md.ParseFromString(ps.metadata);  // parsed once already in loadPeer
  auto peerInfoFor = [&](const std::string& name) { return peerInfoFrom(md, name); };
  if (ps.gpuLaneOwned) (void)transports_[ps.gpuLane->transport].transport->unloadPeer(ps.gpuLane->peer);
  ps.gpuLane.reset();
  ps.gpuLaneOwned = false;
  ps.noGpuWhy.clear();
  for (size_t i = 0; i < transports_.size() && !ps.gpuLane; ++i) {
    if (!transports_[i].transport->caps().cudaMemory) {
      ps.noGpuWhy += "\n  " + transports_[i].name + ": cannot move GPU memory here";
      continue;
    }
    if (gpuRefused_.count(i)) {
      ps.noGpuWhy += "\n  " + transports_[i].name + ": refused to register GPU memory here";
      continue;
    }
    if (i == ps.primary.transport) {
      ps.gpuLane = ps.primary;
    } else if (ps.tcpLane && i == ps.tcpLane->transport) {
      ps.gpuLane = ps.tcpLane;
    } else if (auto pi = peerInfoFor(transports_[i].name)) {
      auto id = transports_[i].transport->loadPeer(*pi);
      if (id.ok()) {
        ps.gpuLane = Lane{i, *id};
        ps.gpuLaneOwned = true;
      } else {
        ps.noGpuWhy += "\n  " + transports_[i].name + ": " + id.status().message();
      }
    } else {
      ps.noGpuWhy += "\n  " + transports_[i].name + ": the peer does not offer it";
    }
  }
}

void TransferAgent::notePath(PeerState& ps, const Lane& lane) {
  const TransportCaps caps = transports_[lane.transport].transport->caps();
  metrics_.onGpuPath(caps.cudaStaged ? "staged" : "direct");
  if (ps.gpuPathLogged && lane.transport == ps.gpuLane->transport) return;
  ps.gpuPathLogged = true;
  PD_LOG(kInfo, "kvt") << "peer '" << ps.name << "': GPU memory goes over " << laneName(lane) << " "
                       << (caps.cudaPath.empty() ? std::string("(GPU memory)") : caps.cudaPath);
}

Status TransferAgent::cancel(AgentTransfer id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return notFound("kvtransfer agent: transfer " + std::to_string(id) + " is unknown");
  return transports_[it->second.lane.transport].transport->cancel(it->second.inner);
}

bool TransferAgent::progress() {
  bool any = false;
  for (auto& t : transports_) any = t.transport->progress() || any;
  return any;
}

}  // namespace pd::kvt
