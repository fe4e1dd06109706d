#include "decode_worker/remote_prefills.h"

#include <algorithm>

#include "common/base/log.h"
#include "kvtransfer/block_segments.h"
#include "worker/pull_metrics.h"

namespace pd::decode {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "decode";
}  // namespace

RemotePrefills::RemotePrefills(worker::WorkerLoop& loop, Callbacks callbacks)
    : loop_(loop),
      callbacks_(std::move(callbacks)),
      links_(loop, PrefillLinks::Callbacks{
                       [this](const std::string& a) { onLinkReady(a); },
                       [this](const std::string& a, proto::Envelope&& env) { onLinkMessage(a, std::move(env)); },
                       [this](const std::string& a, const Status& why) { onLinkDown(a, why); },
                   }),
      quarantine_(loop, links_) {}

worker::WorkerLoop::TimerId RemotePrefills::deadline(uint64_t id, std::function<Status()> why) {
  requests_.at(id).leaseFrom = steadyNow();
  auto expiry = [this, id] {
    auto it = requests_.find(id);
    return it == requests_.end() ? SteadyTime{} : it->second.leaseFrom + milliseconds(timeoutMs(it->second));
  };
  return loop_.lease(expiry, [this, id, why] {
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    it->second.deadlineTimer = 0;
    failed(id, why());
  });
}

// A pull waits for blocks as long as a remote prefill (timeout_ms); once they are reserved,
// the pull deadline runs.
int64_t RemotePrefills::timeoutMs(const Remote& r) const {
  const auto& c = loop_.config().kvTransfer;
  return r.pullTokens > 0 && r.state != State::kWaitingBlocks ? c.pullTimeoutMs : c.timeoutMs;
}

void RemotePrefills::start(proto::Generate gen, engine::Request request) {
  const uint64_t id = gen.request_id();
  // A pull is worth it only now: with no blocks free for the prompt, it is computed here like
  // any colocated prompt (the engine queues it for blocks) instead of waiting to pull.
  if (gen.pull_tokens() > 0 && gen.prefill_worker_address().empty() &&
      loop_.engine().kv().blocksFor(request.numPromptTokens()) > loop_.engine().kv().numFreeBlocks()) {
    Remote skipped;
    skipped.pullTokens = int(gen.pull_tokens());
    countPull(skipped, "fell_back", 0, "");
    if (callbacks_.onPulled) callbacks_.onPulled(id, 0, 0, "");
    if (Status s = loop_.engine().submit(std::move(request)); !s.isOk()) callbacks_.onFailed(id, s);
    return;
  }
  Remote r;
  r.pullTokens = gen.prefill_worker_address().empty() ? int(gen.pull_tokens()) : 0;  // a prefill pull is forwarded
  r.address = r.pullTokens > 0 ? gen.pull_source_address() : gen.prefill_worker_address();
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
  if (r.pullTokens > 0) {
    r.deadlineTimer = deadline(id, [this, address] {
      return deadlineExceeded("peer pull from " + address + " not done within " +
                              std::to_string(loop_.config().kvTransfer.pullTimeoutMs) + " ms");
    });
    if (links_.ready(address)) return sendPrefillRequest(id);
    return links_.dial(address);
  }
  r.deadlineTimer = deadline(id, [this, address] {
    return deadlineExceeded((links_.handshaking(address) ? "prefill worker " + address + " did not answer KvConnect"
                                                         : std::string("no PrefillDone and no progress")) +
                            " within " + std::to_string(loop_.config().kvTransfer.timeoutMs) + " ms");
  });
  if (links_.ready(address)) return sendPrefillRequest(id);
  links_.dial(address);
}

// The link is ready: its KvConnect told the prefill worker where our blocks live, so the
// request carries only its own blocks and the grant to write them.
void RemotePrefills::sendPrefillRequest(uint64_t id) {
  Remote& r = requests_.at(id);
  const engine::KvCacheManager& kv = loop_.engine().kv();
  // The request's epoch: a grant for exactly its blocks, in every layer of every rank's
  // region, to this prefill worker alone. Revoked when the request leaves REQUESTED.
  // A pull's writer fills only the pulled blocks: the grant covers those alone.
  const size_t granted =
      r.pullTokens > 0 ? std::min(r.blocks.size(), size_t(r.pullTokens / kv.blockSize())) : r.blocks.size();
  const std::span<const engine::BlockId> grantedBlocks(r.blocks.data(), granted);
  DescList ranges;
  for (const MemDesc& region : loop_.bundle().kvRegions) {
    const kvt::BlockPool pool = worker::kvBlockPool(kv.layout(), region);
    auto segs = kvt::blockSegments(pool, grantedBlocks, pool, grantedBlocks, 0, kv.layout().numLayers);
    if (!segs.ok()) return failed(id, segs.status().withContext("KV write grant"));
    ranges.insert(ranges.end(), segs->remote.begin(), segs->remote.end());
  }
  r.kvPeer = links_.kvPeer(r.address);
  auto grant = loop_.agent().grantWrite(r.kvPeer, ranges);
  if (!grant.ok()) return failed(id, grant.status());
  r.grant = std::move(grant).value();
  worker::KvTargetBlocks target;
  target.blockIds.assign(grantedBlocks.begin(), grantedBlocks.end());
  target.writeGrant = r.grant;
  proto::Envelope env;
  env.set_request_id(id);
  if (r.pullTokens > 0) {
    auto* pr = env.mutable_pull_request();
    pr->set_request_id(id);
    pr->mutable_prompt_token_ids()->Add(r.gen.prompt_token_ids().begin(),
                                        r.gen.prompt_token_ids().begin() + r.pullTokens);
    *pr->mutable_kv_target() = worker::toProto(target);
    pr->set_deadline_ms(uint64_t(loop_.config().kvTransfer.pullTimeoutMs));
    r.state = State::kRequested;
    r.requestedAt = steadyNow();
    if (Status s = links_.send(r.address, std::move(env)); !s.isOk()) failed(id, s);
    return;
  }
  auto* pr = env.mutable_prefill_request();
  pr->set_request_id(id);
  *pr->mutable_prompt_token_ids() = r.gen.prompt_token_ids();
  *pr->mutable_sampling() = r.gen.sampling();
  pr->set_deadline_ms(static_cast<uint64_t>(loop_.config().kvTransfer.timeoutMs));
  *pr->mutable_kv_target() = worker::toProto(target);
  if (r.gen.pull_tokens() > 0 && links_.replyLayout(r.address)) {
    // The prefill worker pulls the prefix from this worker, over this link.
    pr->set_pull_source_id(r.gen.pull_source_id());
    pr->set_pull_source_address(r.gen.pull_source_address());
    pr->set_pull_tokens(r.gen.pull_tokens());
  }
  r.state = State::kRequested;
  r.requestedAt = steadyNow();
  if (Status s = links_.send(r.address, std::move(env)); !s.isOk()) failed(id, s);
}

void RemotePrefills::onLinkReady(const std::string& address) {
  quarantine_.onLinkReady(address);
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : requests_) {
    if (r.address == address && r.state == State::kConnecting) ids.push_back(id);
  }
  for (uint64_t id : ids) {
    if (requests_.count(id) && links_.ready(address)) sendPrefillRequest(id);
  }
}

void RemotePrefills::onLinkMessage(const std::string& address, proto::Envelope&& env) {
  const uint64_t id = env.request_id();
  if (env.body_case() == proto::Envelope::kCancel && env.cancel().ack()) {
    return quarantine_.onCancelAck(address, id);
  }
  if (env.body_case() == proto::Envelope::kPullRequest || env.body_case() == proto::Envelope::kCancel) {
    // The prefill worker pulls (or stops pulling) a prefix from this worker.
    const worker::KvTargetLayout* layout = links_.replyLayout(address);
    net::ConnectionPtr conn = links_.connection(address);
    if (!layout || !conn || !callbacks_.onLinkPull) return;
    if (auto old = pullLinks_.find(address); old != pullLinks_.end() && old->second != conn) {
      if (callbacks_.onLinkPullDown) callbacks_.onLinkPullDown(old->second, unavailable("link replaced"));
    }
    pullLinks_[address] = conn;
    return callbacks_.onLinkPull(conn, links_.kvPeer(address), *layout, std::move(env));
  }
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second.state != State::kRequested || it->second.address != address) {
    return;
  }
  if (env.body_case() == proto::Envelope::kError) {
    return failed(id, net::fromProtoError(env.error()), it->second.pullTokens > 0 ? "refused" : "fell_back");
  }
  if (it->second.pullTokens > 0) {
    if (env.body_case() == proto::Envelope::kPullDone) return onPullDone(id, env.pull_done());
    return;
  }
  if (env.body_case() == proto::Envelope::kPrefillDone) return onPrefillDone(id, env.prefill_done());
  if (env.body_case() == proto::Envelope::kPrefillProgress) it->second.leaseFrom = steadyNow();  // still computing
}

// Every request that waits on or was sent over that link fails (and recomputes or not).
void RemotePrefills::onLinkDown(const std::string& address, const Status& why) {
  if (auto it = pullLinks_.find(address); it != pullLinks_.end()) {
    net::ConnectionPtr conn = std::move(it->second);
    pullLinks_.erase(it);
    if (callbacks_.onLinkPullDown) callbacks_.onLinkPullDown(conn, why);
  }
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : requests_) {
    if (r.address == address && r.state != State::kWaitingBlocks) ids.push_back(id);
  }
  for (uint64_t id : ids) failed(id, why);
}

void RemotePrefills::onPrefillDone(uint64_t id, const proto::PrefillDone& done) {
  const SteadyTime arrived = loop_.postedAt();  // on the wire here, before the loop was free
  std::vector<engine::EngineEvent> events;
  Status s = loop_.engine().completeRemote(id, worker::fromProto(done.first_token_id(), done.first_logprob()), &events);
  // A PrefillDone the engine refuses (a first token outside the vocabulary) is the prefill
  // worker's failure: this request recomputes or fails, the batch it would join is untouched.
  Remote& r = requests_.at(id);
  r.writerDone = true;       // PrefillDone comes only after every write was confirmed at the target
  (void)fenceWrites(id, r);  // replays of the grant are refused from now on
  if (!s.isOk()) return failed(id, s.withContext("PrefillDone from prefill worker " + r.address));
  proto::Timings split;
  split.set_kv_connect_ms(1e3 * secondsBetween(r.reservedAt, r.requestedAt));
  split.set_prefill_queue_ms(done.timings().prefill_queue_ms());
  split.set_prefill_ms(done.timings().prefill_ms());
  split.set_transfer_ms(done.timings().transfer_ms());
  split.set_transport(done.timings().transport());
  split.set_prefill_cached_tokens(done.cached_prompt_tokens());
  split.set_pull_ms(done.timings().pull_ms());  // the prefill worker's own pull, if it pulled
  split.set_pull_tokens(done.timings().pull_tokens());
  split.set_pull_transport(done.timings().pull_transport());
  forget(id);
  loop_.metrics().remotePrefill("ok");
  callbacks_.onKvReady(id, split, arrived, events);
}

// The pulled blocks hold the prompt's first tokens: named, they are a cached prefix; the
// request then queues here (its reserved blocks freed, the named ones staying cached) and
// the scheduler attaches them, computing only the rest.
void RemotePrefills::onPullDone(uint64_t id, const proto::PullDone& done) {
  Remote& r = requests_.at(id);
  r.writerDone = true;       // PullDone comes only after every write was confirmed here
  (void)fenceWrites(id, r);  // replays of the grant are refused from now on
  engine::Engine& engine = loop_.engine();
  const int bs = engine.kv().blockSize();
  const int tokens = std::min<int>(int(done.tokens()), r.pullTokens) / bs * bs;
  const std::vector<int32_t> prompt(r.gen.prompt_token_ids().begin(), r.gen.prompt_token_ids().end());
  Status named = tokens > 0 ? engine.kv().cacheComputedBlocks(id, prompt, tokens) : Status::ok();
  if (!named.isOk()) return failed(id, named.withContext("naming pulled blocks"));
  const double ms = 1e3 * secondsBetween(r.reservedAt, steadyNow());
  countPull(r, "done", done.bytes_transferred(), done.transport());
  const std::string address = r.address;
  forget(id);
  if (callbacks_.onPulled) callbacks_.onPulled(id, tokens, ms, done.transport());
  if (Status q = engine.recomputeRemote(id); !q.isOk()) {
    engine.cancel(id);
    return callbacks_.onFailed(id, q);
  }
  PD_LOG(kDebug, kTag) << "request " << id << ": pulled " << tokens << " tokens from " << address << " in " << ms
                       << " ms";
}

void RemotePrefills::countPull(const Remote& r, const std::string& outcome, uint64_t bytes,
                               const std::string& transport) {
  worker::countPeerPull(loop_.registry(), outcome, bytes, transport, secondsBetween(r.reservedAt, steadyNow()));
}

void RemotePrefills::sendCancel(const Remote& r, const std::string& reason) {
  if (r.state != State::kRequested) return;
  proto::Envelope cancel;
  cancel.set_request_id(r.gen.request_id());
  cancel.mutable_cancel()->set_request_id(r.gen.request_id());
  cancel.mutable_cancel()->set_reason(reason);
  (void)links_.send(r.address, std::move(cancel));
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

void RemotePrefills::end(uint64_t id, const std::string& how, const std::string& reason) {
  Remote& r = requests_.at(id);
  sendCancel(r, reason);
  if (!fenceWrites(id, r)) {
    quarantine_.hold(id, r.address, r.kvPeer, int(r.blocks.size()), how + ": " + reason);
  }
  forget(id);
}

void RemotePrefills::failed(uint64_t id, const Status& why, const std::string& pullOutcome) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  const bool hasBlocks = it->second.state != State::kWaitingBlocks;
  if (it->second.pullTokens > 0 && hasBlocks) {
    // A pull is an optimisation: whatever went wrong, the prompt is computed here.
    countPull(it->second, pullOutcome, 0, "");
    const std::string address = it->second.address;
    const double ms = 1e3 * secondsBetween(it->second.reservedAt, steadyNow());
    end(id, "pull failed", why.message());
    if (callbacks_.onPulled) callbacks_.onPulled(id, 0, ms, "");
    if (Status s = loop_.engine().recomputeRemote(id); !s.isOk()) {
      loop_.engine().cancel(id);
      return callbacks_.onFailed(id, s);
    }
    PD_LOG(kWarn, kTag) << "request " << id << ": peer pull from " << address << " " << pullOutcome << " ("
                        << why.message() << "); computing the prompt here";
    return;
  }
  // unavailable: the prefill worker is gone or going (draining, shutting down, its connection
  // closed) and will never serve this request, so recomputing here is its retry elsewhere; the
  // ITL stall rule is for a prefill worker that is merely behind (docs/architecture.md, "Drain").
  const Status stall = why.code() == StatusCode::kUnavailable ? Status::ok() : recomputeStall(it->second);
  end(id, "failed", why.message());
  if (hasBlocks && !stall.isOk()) {
    PD_LOG(kWarn, kTag) << "request " << id << ": remote prefill failed (" << why.message()
                        << "); not recomputing: " << stall.message();
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
  if (r.state != State::kRequested || !(links_.lastHeard(r.address) > r.requestedAt)) {
    return Status::ok();
  }
  const int promptTokens = r.gen.prompt_token_ids_size();
  const engine::EngineLoad load = loop_.engine().load();
  if (load.decoding == 0 || load.prefillTokensPerS <= 0) return Status::ok();
  // The chunk a step beside the streams would take: SLO-sized when engine.slo_sized_prefill_chunks
  // (then it fits by construction), max_batch_tokens otherwise.
  const int64_t chunk = std::min<int64_t>(promptTokens, load.prefillChunkTokens);
  const double stepMs = 1e3 * double(chunk) / load.prefillTokensPerS;
  const double itlMs = loop_.config().pools.decode.slo.itlMs;
  if (stepMs <= itlMs) return Status::ok();
  return resourceExhausted("recomputing its " + std::to_string(promptTokens) +
                           " prompt tokens here would stretch the " + std::to_string(load.decoding) +
                           " running streams' steps to ~" + std::to_string(int(stepMs)) + " ms, past the " +
                           std::to_string(int(itlMs)) + " ms ITL target");
}

void RemotePrefills::cancel(uint64_t id, const std::string& reason) {
  if (!requests_.count(id)) return;
  end(id, "cancelled", reason);
  loop_.engine().cancel(id);
}

void RemotePrefills::forget(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  loop_.cancelTimer(it->second.deadlineTimer);
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
  links_.shutdown(why);
  pullLinks_.clear();
  quarantine_.releaseAll("shutting down");
}

}  // namespace pd::decode
