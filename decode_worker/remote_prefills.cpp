#include "decode_worker/remote_prefills.h"

#include <algorithm>

#include "common/base/log.h"
#include "kvtransfer/block_segments.h"

namespace pd::decode {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "decode";
}  // namespace

RemotePrefills::RemotePrefills(worker::WorkerLoop& loop, Callbacks callbacks)
    : loop_(loop), callbacks_(std::move(callbacks)) {}

worker::WorkerLoop::TimerId RemotePrefills::deadline(uint64_t id, std::function<Status()> why) {
  return loop_.at(steadyNow() + milliseconds(loop_.config().kvTransfer.timeoutMs), [this, id, why] {
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    it->second.deadlineTimer = 0;
    failed(id, why());
  });
}

void RemotePrefills::start(proto::Generate gen, engine::Request request) {
  const uint64_t id = gen.request_id();
  Remote r;
  r.address = gen.prefill_worker_address();
  r.gen = std::move(gen);
  const int tokens = request.numPromptTokens();
  requests_.emplace(id, std::move(r));
  requests_.at(id).deadlineTimer = deadline(id, [this, tokens] {
    return resourceExhausted("no free KV blocks for a " + std::to_string(tokens) + "-token prompt within " +
                             std::to_string(loop_.config().kvTransfer.timeoutMs) + " ms");
  });
  waiting_.push_back({id, std::move(request)});
  admitWaiting();
}

// Disaggregated requests get all their prompt's blocks at once, in arrival order.
void RemotePrefills::admitWaiting() {
  engine::Engine& engine = loop_.engine();
  while (!waiting_.empty()) {
    Waiting& w = waiting_.front();
    if (engine.kv().blocksFor(w.request.numPromptTokens()) > engine.kv().numFreeBlocks()) return;
    const uint64_t id = w.id;
    auto blocks = engine.submitRemote(std::move(w.request));
    waiting_.pop_front();
    if (!blocks.ok()) {
      failed(id, blocks.status());
      continue;
    }
    reserved(id, std::move(blocks).value());
  }
}

void RemotePrefills::reserved(uint64_t id, std::vector<engine::BlockId> blocks) {
  Remote& r = requests_.at(id);
  r.state = State::kConnecting;
  r.reservedAt = steadyNow();
  r.blocks = std::move(blocks);
  loop_.cancelTimer(r.deadlineTimer);
  const std::string address = r.address;
  r.deadlineTimer = deadline(id, [this, address] {
    auto peer = peers_.find(address);
    const bool handshaking = peer != peers_.end() && peer->second.conn && !peer->second.kvReady;
    return deadlineExceeded((handshaking ? "prefill worker " + address + " did not answer KvConnect"
                                         : std::string("no PrefillDone")) +
                            " within " + std::to_string(loop_.config().kvTransfer.timeoutMs) + " ms");
  });
  Peer& peer = peers_[address];
  peer.requests.insert(id);
  if (peer.conn && peer.kvReady) return sendPrefillRequest(peer, id);
  if (!peer.conn && !peer.connecting) connect(address);
}

// The offer made for this connection is the request's KV target endpoint: the prefill worker
// loaded it at KvConnect, so loading it again finds the same (connected) peer.
void RemotePrefills::sendPrefillRequest(Peer& peer, uint64_t id) {
  Remote& r = requests_.at(id);
  const worker::EngineBundle& bundle = loop_.bundle();
  const engine::KvCacheManager& kv = loop_.engine().kv();
  worker::KvTargetSpec target;
  target.connInfo = peer.offer;
  target.fingerprint = bundle.fingerprint;
  target.blockSize = kv.layout().blockSize;
  target.numBlocks = kv.numTotalBlocks();
  target.blockIds.assign(r.blocks.begin(), r.blocks.end());
  target.regions = bundle.kvRegions;
  // The request's epoch: a grant for exactly its blocks, in every layer of every rank's
  // region, to this prefill worker alone. Revoked when the request leaves REQUESTED.
  DescList ranges;
  for (const MemDesc& region : bundle.kvRegions) {
    const kvt::BlockPool pool = worker::kvBlockPool(kv.layout(), region);
    auto segs = kvt::blockSegments(pool, r.blocks, pool, r.blocks, 0, kv.layout().numLayers);
    if (!segs.ok()) return failed(id, segs.status().withContext("KV write grant"));
    ranges.insert(ranges.end(), segs->remote.begin(), segs->remote.end());
  }
  auto grant = loop_.agent().grantWrite(peer.kvPeer, ranges);
  if (!grant.ok()) return failed(id, grant.status());
  r.grant = std::move(grant).value();
  r.kvPeer = peer.kvPeer;
  target.writeGrant = r.grant;
  proto::Envelope env;
  env.set_request_id(id);
  auto* pr = env.mutable_prefill_request();
  pr->set_request_id(id);
  *pr->mutable_prompt_token_ids() = r.gen.prompt_token_ids();
  *pr->mutable_sampling() = r.gen.sampling();
  pr->set_deadline_ms(static_cast<uint64_t>(loop_.config().kvTransfer.timeoutMs));
  *pr->mutable_kv_target() = worker::toProto(target);
  r.state = State::kRequested;
  r.requestedAt = steadyNow();
  if (Status s = peer.conn->send(std::move(env)); !s.isOk()) failed(id, s);
}

void RemotePrefills::connect(const std::string& address) {
  const auto colon = address.rfind(':');
  Peer& peer = peers_[address];
  peer.connecting = true;
  net::ConnectionOptions opts = loop_.leasedControlOptions("prefill_link");
  opts.hello.set_role(proto::ROLE_DECODE);
  opts.hello.set_worker_id(loop_.flags().workerId);
  opts.hello.set_model_fingerprint(loop_.bundle().fingerprint);
  net::ConnectionCallbacks cb;
  cb.onMessage = [this, address](const net::ConnectionPtr&, proto::Envelope&& env) {
    auto shared = std::make_shared<proto::Envelope>(std::move(env));
    loop_.post([this, address, shared] { onPeerMessage(address, std::move(*shared)); });
  };
  cb.onClose = [this, address](const net::ConnectionPtr& c, const Status& why) {
    loop_.post([this, address, c, why] { onPeerClosed(address, c, why); });
  };
  const milliseconds timeout(std::min<int64_t>(3000, loop_.config().kvTransfer.timeoutMs));
  net::FramedClient::connectAsync(loop_.io(), address.substr(0, colon), std::atoi(address.c_str() + colon + 1), opts,
                                  cb, timeout, [this, address](Result<net::ConnectionPtr> r) {
                                    loop_.post([this, address, r = std::move(r)]() mutable {
                                      onConnected(address, std::move(r));
                                    });
                                  });
}

void RemotePrefills::onConnected(const std::string& address, Result<net::ConnectionPtr> r) {
  Peer& peer = peers_[address];
  peer.connecting = false;
  if (!r.ok()) {
    PD_LOG(kWarn, kTag) << "prefill worker " << address << ": " << r.status().toString();
    return failPeerRequests(address, r.status());
  }
  const std::string& fingerprint = loop_.bundle().fingerprint;
  if (r.value()->peerHello().model_fingerprint() != fingerprint) {
    Status why = failedPrecondition("prefill worker " + address + " serves '" +
                                    r.value()->peerHello().model_fingerprint() + "', not '" + fingerprint + "'");
    r.value()->close(why);
    return failPeerRequests(address, why);
  }
  peer.conn = r.value();
  peer.kvReady = false;
  // Step 1 of the kvtransfer exchange: a fresh offer for this prefill worker alone (verbs
  // makes one QP per offer; RC cannot share it between peers).
  auto offer = loop_.agent().localMetadata();
  if (!offer.ok()) return dropPeer(address, offer.status().withContext("KV offer to prefill worker " + address));
  peer.offer = std::move(offer).value();
  peer.kvTimer = loop_.at(steadyNow() + milliseconds(loop_.config().kvTransfer.timeoutMs), [this, address] {
    auto it = peers_.find(address);
    if (it == peers_.end()) return;
    it->second.kvTimer = 0;
    if (it->second.conn && !it->second.kvReady) {
      dropPeer(address, deadlineExceeded("prefill worker " + address + " did not answer KvConnect within " +
                                         std::to_string(loop_.config().kvTransfer.timeoutMs) + " ms"));
    }
  });
  proto::Envelope env;
  env.set_request_id(0);
  env.mutable_kv_connect()->set_metadata(peer.offer);
  if (Status s = peer.conn->send(std::move(env)); !s.isOk()) dropPeer(address, s);
}

void RemotePrefills::onPeerMessage(const std::string& address, proto::Envelope&& env) {
  if (auto p = peers_.find(address); p != peers_.end()) p->second.lastHeard = steadyNow();
  if (env.request_id() == 0) return onKvConnectReply(address, std::move(env));
  const uint64_t id = env.request_id();
  if (env.body_case() == proto::Envelope::kCancel && env.cancel().ack()) return onCancelAck(address, id);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second.state != State::kRequested || it->second.address != address) return;
  if (env.body_case() == proto::Envelope::kError) return failed(id, net::fromProtoError(env.error()));
  if (env.body_case() == proto::Envelope::kPrefillDone) return onPrefillDone(id, env.prefill_done());
}

// Step 3: the prefill worker's reply (or its refusal). Loading it connects our side; then the
// requests waiting on this peer go.
void RemotePrefills::onKvConnectReply(const std::string& address, proto::Envelope&& env) {
  auto it = peers_.find(address);
  if (it == peers_.end() || !it->second.conn) return;
  Peer& peer = it->second;
  if (env.body_case() == proto::Envelope::kError) return dropPeer(address, net::fromProtoError(env.error()));
  if (env.body_case() != proto::Envelope::kKvConnect || peer.kvReady) {
    PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from prefill worker " << address;
    return;
  }
  auto loaded = loop_.agent().loadPeer(env.kv_connect().metadata());
  if (!loaded.ok()) {
    return dropPeer(address, loaded.status().withContext("loading prefill worker " + address + "'s KV reply"));
  }
  peer.kvReady = true;
  peer.kvPeer = *loaded;
  peer.redialDelay = milliseconds(0);
  loop_.cancelTimer(peer.kvTimer);
  // Holds from an earlier connection to this worker: ask again (an acknowledgement may have
  // been lost with that connection; a worker that holds nothing of the request answers at once).
  for (const auto& [holder, q] : quarantine_) {
    if (q.address != address) continue;
    proto::Envelope cancel;
    cancel.set_request_id(q.requestId);
    cancel.mutable_cancel()->set_request_id(q.requestId);
    cancel.mutable_cancel()->set_reason("KV fencing: acknowledge that nothing of this request is in flight");
    (void)peer.conn->send(std::move(cancel));
  }
  PD_LOG(kInfo, kTag) << "prefill worker " << address << ": KV over " << loop_.agent().peerTransport(*loaded).value();
  const std::vector<uint64_t> ids(peer.requests.begin(), peer.requests.end());
  for (uint64_t id : ids) {
    auto r = requests_.find(id);
    if (r != requests_.end() && r->second.state == State::kConnecting && peer.conn) sendPrefillRequest(peer, id);
  }
}

// Closes the connection (the next request reconnects) and fails its requests with `why`.
void RemotePrefills::dropPeer(const std::string& address, const Status& why) {
  auto it = peers_.find(address);
  if (it == peers_.end()) return;
  PD_LOG(kWarn, kTag) << "prefill worker " << address << ": " << why.toString();
  it->second.kvReady = false;
  loop_.cancelTimer(it->second.kvTimer);
  if (auto c = std::move(it->second.conn)) {
    it->second.conn.reset();
    c->close(why);  // onPeerClosed ignores it: conn is no longer this connection
  }
  failPeerRequests(address, why);
}

void RemotePrefills::onPeerClosed(const std::string& address, const net::ConnectionPtr& c, const Status& why) {
  auto it = peers_.find(address);
  if (it == peers_.end() || it->second.conn != c) return;
  it->second.conn.reset();
  it->second.kvReady = false;
  loop_.cancelTimer(it->second.kvTimer);
  failPeerRequests(address, unavailable("prefill worker " + address + " disconnected: " + why.message()));
}

void RemotePrefills::failPeerRequests(const std::string& address, const Status& why) {
  auto it = peers_.find(address);
  if (it == peers_.end()) return;
  const std::vector<uint64_t> ids(it->second.requests.begin(), it->second.requests.end());
  for (uint64_t id : ids) failed(id, why);
}

void RemotePrefills::onPrefillDone(uint64_t id, const proto::PrefillDone& done) {
  const SteadyTime arrived = loop_.postedAt();  // on the wire here, before the loop was free
  std::vector<engine::EngineEvent> events;
  Status s = loop_.engine().completeRemote(id, worker::fromProto(done.first_token_id(), done.first_logprob()), &events);
  // A PrefillDone the engine refuses (a first token outside the vocabulary) is the prefill
  // worker's failure: this request recomputes or fails, the batch it would join is untouched.
  Remote& r = requests_.at(id);
  r.writerDone = true;  // PrefillDone comes only after every write was confirmed at the target
  (void)fenceWrites(id, r);  // replays of the grant are refused from now on
  if (!s.isOk()) return failed(id, s.withContext("PrefillDone from prefill worker " + r.address));
  proto::Timings split;
  split.set_kv_connect_ms(1e3 * secondsBetween(r.reservedAt, r.requestedAt));
  split.set_prefill_queue_ms(done.timings().prefill_queue_ms());
  split.set_prefill_ms(done.timings().prefill_ms());
  split.set_transfer_ms(done.timings().transfer_ms());
  split.set_transport(done.timings().transport());
  split.set_prefill_cached_tokens(done.cached_prompt_tokens());
  forget(id);
  loop_.metrics().remotePrefill("ok");
  callbacks_.onKvReady(id, split, arrived, events);
}

void RemotePrefills::sendCancel(const Remote& r, const std::string& reason) {
  if (r.state != State::kRequested) return;
  auto peer = peers_.find(r.address);
  if (peer == peers_.end() || !peer->second.conn) return;
  proto::Envelope cancel;
  cancel.set_request_id(r.gen.request_id());
  cancel.mutable_cancel()->set_request_id(r.gen.request_id());
  cancel.mutable_cancel()->set_reason(reason);
  (void)peer->second.conn->send(std::move(cancel));
}

bool RemotePrefills::fenceWrites(uint64_t id, Remote& r) {
  if (r.state != State::kRequested || r.grant.empty()) return true;  // no writer was told
  Status revoked = loop_.agent().revokeWrite(r.grant);
  r.grant.clear();
  if (!revoked.isOk()) {
    PD_LOG(kWarn, kTag) << "request " << id << ": revoking its KV write grant: " << revoked.toString();
    return r.writerDone;
  }
  return r.writerDone || loop_.agent().receiverFenced(r.kvPeer);
}

void RemotePrefills::quarantine(uint64_t id, const Remote& r, const std::string& why) {
  const engine::SeqId holder = nextHolder_++;
  if (Status s = loop_.engine().quarantineRemote(id, holder); !s.isOk()) {
    // Not expected (the request holds its reservation until here); the blocks stay with the
    // request and are freed with it: say so loudly, it is the unfenced case.
    PD_LOG(kError, kTag) << "request " << id << ": cannot quarantine its KV blocks (" << s.toString()
                         << "); freeing them although prefill worker " << r.address << " may still write them";
    return;
  }
  Quarantined q;
  q.requestId = id;
  q.address = r.address;
  q.kvPeer = r.kvPeer;
  q.blocks = int(r.blocks.size());
  q.since = steadyNow();
  quarantinedBlocks_ += q.blocks;
  loop_.metrics().kvBlocksQuarantined.set(quarantinedBlocks_);
  PD_LOG(kInfo, kTag) << "request " << id << " (" << why << "): " << q.blocks
                      << " KV block(s) quarantined until prefill worker " << r.address
                      << " acknowledges the cancel or is gone (its KV lane is one-sided)";
  quarantine_.emplace(holder, std::move(q));
}

void RemotePrefills::release(engine::SeqId holder, const std::string& why) {
  auto it = quarantine_.find(holder);
  if (it == quarantine_.end()) return;
  const double held = secondsBetween(it->second.since, steadyNow());
  PD_LOG(kInfo, kTag) << "request " << it->second.requestId << ": " << it->second.blocks
                      << " quarantined KV block(s) released after " << int64_t(held * 1e3) << " ms: " << why;
  (void)loop_.engine().kv().free(holder);
  quarantinedBlocks_ -= it->second.blocks;
  loop_.metrics().kvBlocksQuarantined.set(quarantinedBlocks_);
  loop_.metrics().kvQuarantineSeconds.observe(held);
  quarantine_.erase(it);
}

void RemotePrefills::onCancelAck(const std::string& address, uint64_t id) {
  std::vector<engine::SeqId> holders;
  for (const auto& [holder, q] : quarantine_) {
    if (q.requestId == id && q.address == address) holders.push_back(holder);
  }
  for (engine::SeqId h : holders) release(h, "prefill worker " + address + " acknowledged the cancel");
}

void RemotePrefills::exportStates() {
  int64_t waiting = 0, connecting = 0, requested = 0;
  for (const auto& [id, r] : requests_) {
    waiting += r.state == State::kWaitingBlocks;
    connecting += r.state == State::kConnecting;
    requested += r.state == State::kRequested;
  }
  auto& m = loop_.metrics();
  m.remotePrefillsIn("waiting_blocks", waiting);
  m.remotePrefillsIn("connecting", connecting);
  m.remotePrefillsIn("requested", requested);
}

void RemotePrefills::pollQuarantine() {
  if (quarantine_.empty()) return;
  const auto now = steadyNow();
  const auto lease = milliseconds(loop_.config().kvTransfer.timeoutMs);
  std::vector<std::pair<engine::SeqId, std::string>> gone;
  std::vector<std::string> redial;
  for (auto& [holder, q] : quarantine_) {
    auto peer = peers_.find(q.address);
    const bool connected = peer != peers_.end() && peer->second.conn;
    if (!connected && loop_.agent().unfencedLanesDead(q.kvPeer)) {
      gone.emplace_back(holder, "prefill worker " + q.address + " is gone (control connection closed, KV lane dead)");
      continue;
    }
    // Its connection closed (a lease that ran out, a reset) but the writer may live: only a
    // new connection can carry the Cancel and its acknowledgement, so dial it again rather
    // than hold the blocks until a request goes there.
    if (!connected && (peer == peers_.end() || !peer->second.connecting)) redial.push_back(q.address);
    if (!q.leaseLogged && now - q.since > lease) {
      q.leaseLogged = true;
      PD_LOG(kWarn, kTag) << "request " << q.requestId << ": " << q.blocks << " KV block(s) still quarantined "
                          << lease.count() << " ms after its remote prefill ended: prefill worker " << q.address
                          << " has neither acknowledged the cancel nor gone away; holding them (a one-sided "
                             "writer may still write them)";
    }
  }
  for (auto& [holder, why] : gone) release(holder, why);
  for (const std::string& address : redial) {
    Peer& peer = peers_[address];
    if (peer.conn || peer.connecting || now < peer.redialAt) continue;
    // Backoff (500 ms doubling to 8 s, reset by a connection that loads): a writer that stays
    // unreachable costs a dial now and then, not one per poll.
    peer.redialDelay = peer.redialDelay == milliseconds(0) ? kFirstRedial : std::min(2 * peer.redialDelay, kMaxRedial);
    peer.redialAt = now + peer.redialDelay;
    PD_LOG(kDebug, kTag) << "prefill worker " << address << ": reconnecting to ask it to acknowledge cancels of "
                         << "quarantined KV blocks";
    connect(address);
  }
}

void RemotePrefills::failed(uint64_t id, const Status& why) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  const bool hasBlocks = it->second.state != State::kWaitingBlocks;
  const Status stall = recomputeStall(it->second);
  sendCancel(it->second, why.message());
  if (!fenceWrites(id, it->second)) quarantine(id, it->second, "failed: " + why.message());
  forget(id);
  if (hasBlocks && !stall.isOk()) {
    PD_LOG(kWarn, kTag) << "request " << id << ": remote prefill failed (" << why.message() << "); not recomputing: "
                        << stall.message();
    loop_.metrics().remotePrefill("refused_recompute");
    loop_.engine().cancel(id);
    return callbacks_.onFailed(id, resourceExhausted("remote prefill failed (" + why.message() + ") and " +
                                                     stall.message() + "; retry later"));
  }
  if (hasBlocks && loop_.config().kvTransfer.onRemotePrefillFailure == config::RemotePrefillFailure::kRecompute &&
      loop_.engine().recomputeRemote(id).isOk()) {
    PD_LOG(kWarn, kTag) << "request " << id << ": remote prefill failed (" << why.message() << "); recomputing here";
    loop_.metrics().remotePrefill("recomputed");
    return;
  }
  if (hasBlocks) loop_.metrics().remotePrefill("failed");
  loop_.engine().cancel(id);
  callbacks_.onFailed(id, hasBlocks ? unavailable("remote prefill failed: " + why.message()) : why);
}

Status RemotePrefills::recomputeStall(const Remote& r) const {
  // Overloaded, not broken: the prefill worker answered since it got this request (other
  // requests' replies), so it is alive and merely behind. A silent one may be dead or cut
  // off, and recomputing here is the only way left to serve the request.
  const auto peer = peers_.find(r.address);
  if (r.state != State::kRequested || peer == peers_.end() || !(peer->second.lastHeard > r.requestedAt))
    return Status::ok();
  const int promptTokens = r.gen.prompt_token_ids_size();
  const engine::EngineLoad load = loop_.engine().load();
  if (load.decoding == 0 || load.prefillTokensPerS <= 0) return Status::ok();
  // The chunk a step beside the streams would take: SLO-sized when engine.slo_sized_prefill_chunks
  // (then it fits by construction), max_batch_tokens otherwise.
  const int64_t chunk = std::min<int64_t>(promptTokens, load.prefillChunkTokens);
  const double stepMs = 1e3 * double(chunk) / load.prefillTokensPerS;
  const double itlMs = loop_.config().pools.decode.slo.itlMs;
  if (stepMs <= itlMs) return Status::ok();
  return resourceExhausted("recomputing its " + std::to_string(promptTokens) + " prompt tokens here would stretch the " +
                           std::to_string(load.decoding) + " running streams' steps to ~" +
                           std::to_string(int(stepMs)) + " ms, past the " + std::to_string(int(itlMs)) +
                           " ms ITL target");
}

void RemotePrefills::cancel(uint64_t id, const std::string& reason) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  sendCancel(it->second, reason);
  if (!fenceWrites(id, it->second)) quarantine(id, it->second, "cancelled: " + reason);
  forget(id);
  loop_.engine().cancel(id);
}

void RemotePrefills::forget(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  loop_.cancelTimer(it->second.deadlineTimer);
  auto peer = peers_.find(it->second.address);
  if (peer != peers_.end()) peer->second.requests.erase(id);
  for (auto w = waiting_.begin(); w != waiting_.end(); ++w) {
    if (w->id == id) {
      waiting_.erase(w);
      break;
    }
  }
  requests_.erase(it);
}

void RemotePrefills::shutdown(const Status& why) {
  std::vector<uint64_t> ids;
  for (auto& [id, r] : requests_) ids.push_back(id);
  for (uint64_t id : ids) {
    sendCancel(requests_.at(id), why.message());
    (void)fenceWrites(id, requests_.at(id));  // the process ends: its memory goes with it
    forget(id);
    loop_.engine().cancel(id);
    callbacks_.onFailed(id, why);
  }
  for (auto& [address, peer] : peers_) {
    loop_.cancelTimer(peer.kvTimer);
    if (peer.conn) peer.conn->close(why);
  }
  peers_.clear();
  std::vector<engine::SeqId> holders;
  for (const auto& [holder, q] : quarantine_) holders.push_back(holder);
  for (engine::SeqId h : holders) release(h, "shutting down");
}

}  // namespace pd::decode
