#include "kvtransfer/transports/loopback_transport.h"

#include <unistd.h>

#include <cstring>

#include "common/base/random.h"
#include "kvtransfer/kvt.pb.h"

namespace pd::kvt {

namespace {

// Live loopback transports of this process by instance id. Holding the lock while copying
// keeps a target alive until the copy is done.
std::mutex& registryMu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<uint64_t, LoopbackTransport*>& registry() {
  static std::unordered_map<uint64_t, LoopbackTransport*> r;
  return r;
}

}  // namespace

Result<std::unique_ptr<Transport>> LoopbackTransport::create(const TransportOptions& options) {
  return std::unique_ptr<Transport>(new LoopbackTransport(options));
}

LoopbackTransport::LoopbackTransport(const TransportOptions& options)
    : options_(options), instance_(randomNonZeroU64()) {
  std::lock_guard lock(registryMu());
  registry()[instance_] = this;
}

LoopbackTransport::~LoopbackTransport() {
  std::lock_guard lock(registryMu());
  registry().erase(instance_);
}

TransportCaps LoopbackTransport::caps() const {
  TransportCaps c;
  c.name = "loopback";
  c.oneSided = true;
  c.details = "same-process memcpy";
  c.receiverFenced = true;
  return c;
}

Result<MemHandle> LoopbackTransport::registerMemory(const MemDesc& desc) {
  if (desc.kind == MemKind::kCuda) {
    return unimplemented("loopback transport: cannot register CUDA memory " + toString(desc));
  }
  if (desc.addr == 0 || desc.len == 0) {
    return invalidArgument("loopback transport: cannot register an empty region " + toString(desc));
  }
  MemHandle h = nextHandle_++;
  regions_[h] = desc;
  matcher_.addRegion(h, desc);
  return h;
}

Status LoopbackTransport::deregisterMemory(MemHandle handle) {
  auto it = regions_.find(handle);
  if (it == regions_.end()) return notFound("loopback transport: no registration " + std::to_string(handle));
  std::lock_guard lock(mu_);
  for (auto e = exposures_.begin(); e != exposures_.end();) {
    if (e->second.addr == it->second.addr && e->second.len == it->second.len) {
      e = exposures_.erase(e);
    } else {
      ++e;
    }
  }
  regions_.erase(it);
  matcher_.removeRegion(handle);
  return Status::ok();
}

Result<std::string> LoopbackTransport::packRemoteKey(MemHandle handle) {
  auto it = regions_.find(handle);
  if (it == regions_.end()) return notFound("loopback transport: no registration " + std::to_string(handle));
  proto::LoopbackRemoteKey key;
  key.set_token(randomNonZeroU64());
  key.set_addr(it->second.addr);
  key.set_len(it->second.len);
  std::lock_guard lock(mu_);
  exposures_[key.token()] = it->second;
  return key.SerializeAsString();
}

Result<std::string> LoopbackTransport::localConnInfo() {
  proto::LoopbackConnInfo info;
  info.set_pid(uint32_t(::getpid()));
  info.set_instance(instance_);
  return info.SerializeAsString();
}

Result<PeerId> LoopbackTransport::loadPeer(const PeerInfo& peer) {
  proto::LoopbackConnInfo info;
  if (!info.ParseFromString(peer.connInfo) || info.instance() == 0) {
    return invalidArgument("loopback transport: peer '" + peer.name + "': connInfo is not a loopback blob");
  }
  if (info.pid() != uint32_t(::getpid())) {
    return unavailable("loopback transport: peer '" + peer.name + "' lives in process " + std::to_string(info.pid()) +
                       "; loopback only reaches this process");
  }
  {
    std::lock_guard lock(registryMu());
    if (!registry().count(info.instance())) {
      return unavailable("loopback transport: peer '" + peer.name + "' no longer exists");
    }
  }
  Peer p{peer.name, info.instance(), {}};
  for (size_t i = 0; i < peer.remoteKeys.size(); ++i) {
    proto::LoopbackRemoteKey key;
    if (!key.ParseFromString(peer.remoteKeys[i]) || key.token() == 0) {
      return invalidArgument("loopback transport: peer '" + peer.name + "': remote key " + std::to_string(i) +
                             " is not a loopback key");
    }
    p.keys.push_back(KeyRange{key.addr(), key.len()});
  }
  PeerId id = nextPeer_++;
  peers_[id] = std::move(p);
  return id;
}

Status LoopbackTransport::unloadPeer(PeerId peer) {
  if (!peers_.erase(peer)) return notFound("loopback transport: no peer " + std::to_string(peer));
  return Status::ok();
}

Result<TransferId> LoopbackTransport::post(const DescList& local, const DescList& remote, PeerId peer,
                                           const std::string& grant) {
  auto pit = peers_.find(peer);
  if (pit == peers_.end()) return notFound("loopback transport: no peer " + std::to_string(peer));
  uint64_t token = 0;
  if (!grant.empty()) {
    proto::LoopbackRemoteKey g;
    if (!g.ParseFromString(grant) || g.token() == 0) return invalidArgument("loopback transport: not a write grant");
    token = g.token();
  }
  PD_RETURN_IF_ERROR(matcher_.match(local, remote, pit->second.keys, pit->second.name).status());
  TransferId id = nextTransfer_++;
  queue_.push_back({id, peer, local, remote, token});
  outcomes_[id] = std::nullopt;
  return id;
}

Result<std::string> LoopbackTransport::grantWrite(const DescList& ranges) {
  if (ranges.empty()) return invalidArgument("loopback transport: a write grant over no memory");
  for (const MemDesc& r : ranges) {
    bool in = false;
    for (const auto& [h, d] : regions_) in = in || KeyRange{d.addr, d.len}.covers(r.addr, r.len);
    if (!in || r.len == 0) {
      return invalidArgument("loopback transport: write grant range " + toString(r) +
                             " is empty or outside every registered region");
    }
  }
  proto::LoopbackRemoteKey g;  // token only: a grant names no region of its own
  std::lock_guard lock(mu_);
  uint64_t token = randomNonZeroU64();
  while (grants_.count(token) || exposures_.count(token)) token = randomNonZeroU64();
  grants_[token] = ranges;
  g.set_token(token);
  return g.SerializeAsString();
}

Status LoopbackTransport::revokeWrite(const std::string& grant) {
  proto::LoopbackRemoteKey g;
  if (!g.ParseFromString(grant) || g.token() == 0) return invalidArgument("loopback transport: not a write grant");
  // Senders copy while holding the registry lock: once we hold it, no copy under the grant runs.
  std::lock_guard reg(registryMu());
  std::lock_guard lock(mu_);
  if (!grants_.erase(g.token())) return notFound("loopback transport: revokeWrite: grant unknown or already revoked");
  return Status::ok();
}

Status LoopbackTransport::acceptWrite(const MemDesc& r, uint64_t grant) {
  std::lock_guard lock(mu_);
  auto refuse = [&](const char* reason, const std::string& why) {
    if (options_.onWriteRejected) options_.onWriteRejected(reason);
    return invalidArgument("loopback transport: peer '" + options_.localName + "' refused a write of " +
                           std::to_string(r.len) + " bytes at " + toString(r) + ": " + why);
  };
  if (grant != 0) {
    auto g = grants_.find(grant);
    if (g == grants_.end()) return refuse("unknown_grant", "it names a revoked write grant (a stale or forged write)");
    for (const MemDesc& d : g->second) {
      if (KeyRange{d.addr, d.len}.covers(r.addr, r.len)) return Status::ok();
    }
    return refuse("outside_grant", "outside the memory its write grant covers");
  }
  if (options_.requireWriteGrant) return refuse("grant_required", "no write grant, and this receiver requires one");
  for (const auto& [tok, d] : exposures_) {
    if (KeyRange{d.addr, d.len}.covers(r.addr, r.len)) return Status::ok();
  }
  return invalidArgument("loopback transport: peer '" + options_.localName + "' refused a write of " +
                         std::to_string(r.len) + " bytes at " + toString(r) + ": outside every exposed region");
}

bool LoopbackTransport::progress() {
  bool any = false;
  while (!queue_.empty()) {
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    any = true;
    auto pit = peers_.find(p.peer);
    Status st;
    if (pit == peers_.end()) {
      st = cancelled("loopback transport: peer unloaded");
    } else {
      std::lock_guard lock(registryMu());
      auto it = registry().find(pit->second.instance);
      if (it == registry().end()) {
        st = unavailable("loopback transport: peer '" + pit->second.name + "' is gone");
      } else {
        LoopbackTransport* target = it->second;
        for (size_t i = 0; i < p.local.size() && st.isOk(); ++i) {
          if (p.local[i].len) st = target->acceptWrite(p.remote[i], p.grant);
        }
        if (st.isOk()) {
          for (size_t i = 0; i < p.local.size(); ++i) {
            if (p.local[i].len) std::memcpy(p.remote[i].ptr(), p.local[i].ptr(), p.local[i].len);
          }
        }
      }
    }
    auto o = outcomes_.find(p.id);
    if (o != outcomes_.end()) o->second = std::move(st);
  }
  return any;
}

Status LoopbackTransport::poll(TransferId id) {
  auto it = outcomes_.find(id);
  if (it == outcomes_.end()) {
    return notFound("loopback transport: transfer " + std::to_string(id) + " is unknown or already reported");
  }
  if (!it->second) return Status(StatusCode::kInProgress, "");
  Status st = std::move(*it->second);
  outcomes_.erase(it);
  return st;
}

Status LoopbackTransport::cancel(TransferId id) {
  auto it = outcomes_.find(id);
  if (it == outcomes_.end()) return notFound("loopback transport: transfer " + std::to_string(id) + " is unknown");
  if (it->second) return failedPrecondition("loopback transport: transfer " + std::to_string(id) + " already finished");
  for (auto q = queue_.begin(); q != queue_.end(); ++q) {
    if (q->id == id) {
      queue_.erase(q);
      break;
    }
  }
  it->second = cancelled("loopback transport: transfer " + std::to_string(id) + " was cancelled");
  return Status::ok();
}

}  // namespace pd::kvt
