#include "prefill_worker/prefill_jobs.h"

#include "common/base/log.h"
#include "kvtransfer/block_segments.h"

namespace pd::prefill {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "prefill";
}  // namespace

PrefillJobs::PrefillJobs(worker::WorkerLoop& loop)
    : loop_(loop),
      pulls_(loop, [this](uint64_t id, int tokens, double ms, const std::string& transport,
                          Status queued) { pulled(id, tokens, ms, transport, queued); }),
      // The answer carries this worker's pool: the decode worker pushes the prefixes this
      // worker pulls from it into it.
      targets_(loop, "prefill worker", "KvConnect", "prefill", /*replyWithPool=*/true) {}

void PrefillJobs::reject(const net::ConnectionPtr& decode, uint64_t id, const Status& why) {
  proto::Envelope env;
  env.set_request_id(id);
  *env.mutable_error() = net::toProtoError(why);
  (void)decode->send(std::move(env));
}

void PrefillJobs::connect(const net::ConnectionPtr& decode, const proto::KvConnect& offer) {
  const worker::KvConnectTarget* target = targets_.accept(decode, offer);
  if (!target) return;
  PD_LOG(kInfo, kTag) << "decode worker " << decode->peerHello().worker_id() << ": KV over "
                      << loop_.agent().peerTransport(target->peer).value();
}

void PrefillJobs::accept(const net::ConnectionPtr& decode, const proto::PrefillRequest& pr) {
  // Up to here (before the engine request exists): the wait for the loop.
  const double inboxS = secondsBetween(loop_.postedAt(), steadyNow());
  engine::Engine& engine = loop_.engine();
  const uint64_t id = pr.request_id();
  if (jobs_.count(id))
    return reject(decode, id, failedPrecondition("request " + std::to_string(id) + " is already being prefilled here"));
  // No refusal while draining: the router routes nothing here once it read the draining load
  // report, so every PrefillRequest that still arrives was routed before, and is served; one
  // that comes after stop() meets a closed connection and the decode worker recomputes it
  // (docs/architecture.md, "Drain").
  const worker::KvConnectTarget* target = targets_.find(decode.get());
  if (!target) {
    return reject(decode, id, failedPrecondition("PrefillRequest before KvConnect on this connection"));
  }
  auto blocks = worker::fromProto(pr.kv_target(), target->layout.numBlocks);
  if (!blocks.ok()) return reject(decode, id, blocks.status());
  std::vector<int32_t> prompt(pr.prompt_token_ids().begin(), pr.prompt_token_ids().end());
  if (int(blocks->blockIds.size()) < engine.kv().blocksFor(int(prompt.size()))) {
    return reject(decode, id,
                  invalidArgument("kv_target: " + std::to_string(blocks->blockIds.size()) + " blocks cannot hold a " +
                                  std::to_string(prompt.size()) + "-token prompt"));
  }
  engine::SamplingParams params = worker::fromProto(pr.sampling());
  params.maxTokens = 1;  // the first token; the decode worker samples the rest
  auto request =
      engine::Request::create(id, std::move(prompt), params, SystemClock::instance(), engine.modelConfig().vocabSize);
  if (!request.ok()) return reject(decode, id, request.status());
  const int bs = engine.kv().blockSize();
  const auto promptTokens = uint32_t(pr.prompt_token_ids_size());
  if (pr.pull_tokens() > 0 && (pr.pull_tokens() % uint32_t(bs) != 0 || pr.pull_tokens() >= promptTokens)) {
    return reject(decode, id,
                  invalidArgument("PrefillRequest.pull_tokens: " + std::to_string(pr.pull_tokens()) +
                                  " is not a multiple of the block size " + std::to_string(bs) +
                                  " below the prompt's " + std::to_string(promptTokens) + " tokens"));
  }
  loop_.metrics().promptTokens.inc(double(request->numPromptTokens()));
  Job job;
  job.decode = decode;
  job.peer = target->peer;
  job.target = target->layout;
  job.blocks = std::move(blocks).value();
  job.received = steadyNow();
  job.inboxS = inboxS;
  const int64_t deadlineMs = pr.deadline_ms() ? int64_t(pr.deadline_ms()) : loop_.config().kvTransfer.timeoutMs;
  job.leaseMs = milliseconds(deadlineMs);
  job.progressAt = job.progressSentAt = job.received;
  jobs_.emplace(id, std::move(job));
  bool pulling = false;
  if (pr.pull_tokens() > 0) {
    // The job exists first: a pull that cannot even be sent ends (pulled()) inside start().
    jobs_.at(id).pulling = true;
    auto started = pulls_.start(decode, target->peer, pr, request.value());
    if (!started.ok()) {
      jobs_.erase(id);
      return reject(decode, id, started.status());
    }
    pulling = *started;
    if (!pulling) jobs_.at(id).pulling = false;
  }
  if (!pulling) {
    if (Status s = engine.submit(std::move(request).value()); !s.isOk()) {
      jobs_.erase(id);
      return reject(decode, id, s);
    }
  }
  auto expiry = [this, id] {
    auto it = jobs_.find(id);
    return it == jobs_.end() ? SteadyTime{} : it->second.progressAt + it->second.leaseMs;
  };
  jobs_.at(id).deadlineTimer = loop_.lease(expiry, [this, id, deadlineMs] {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return;
    it->second.deadlineTimer = 0;
    end(id,
        deadlineExceeded("prefill and KV push made no progress for the request's " + std::to_string(deadlineMs) +
                         " ms"),
        /*reply=*/true);
  });
}

void PrefillJobs::pulled(uint64_t id, int tokens, double ms, const std::string& transport, const Status& queued) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  Job& job = it->second;
  job.pulling = false;
  job.pulledTokens = tokens;
  job.pullMs = ms;
  job.pullTransport = transport;
  job.progressAt = steadyNow();  // the lease runs anew for the compute
  if (!queued.isOk() && job.failed.isOk()) job.failed = queued.withContext("queueing after its pull");
}

void PrefillJobs::onPullReply(const net::ConnectionPtr& decode, const proto::Envelope& env) {
  switch (env.body_case()) {
    case proto::Envelope::kPullDone:
      return pulls_.onPullDone(decode, env.pull_done());
    case proto::Envelope::kError:
      return pulls_.onError(decode, env.request_id(), net::fromProtoError(env.error()));
    case proto::Envelope::kCancel:
      return pulls_.onCancelAck(decode, env.cancel().request_id());
    default:
      return;
  }
}

void PrefillJobs::onLayerDone(int layer, const engine::StepView& step) {
  const engine::KvLayout& layout = step.kv->layout();
  const auto& regions = loop_.bundle().kvRegions;
  for (const auto& e : step.entries) {
    auto it = jobs_.find(e.seq);
    if (it == jobs_.end() || !it->second.failed.isOk()) continue;
    Job& job = it->second;
    // The blocks this chunk wrote, from the first block not yet pushed: on the first chunk
    // that is block 0, so a prefix this worker had cached (and did not recompute) travels too.
    auto table = step.kv->blockTable(e.seq);
    const int firstBlock = job.pushedTokens / layout.blockSize;
    const int endBlock = (e.start + e.count + layout.blockSize - 1) / layout.blockSize;
    const std::span<const int> blocks(table.data() + firstBlock, size_t(endBlock - firstBlock));
    const std::span<const int> targetBlocks(job.blocks.blockIds.data() + firstBlock, size_t(endBlock - firstBlock));
    engine::KvLayout targetLayout = layout;
    targetLayout.numBlocks = job.target.numBlocks;
    // Tensor parallelism: rank r's region goes to the target's rank r region (same block
    // ids, the same share of the kv heads), one transfer per rank.
    for (size_t r = 0; r < regions.size() && job.failed.isOk(); ++r) {
      auto segments =
          kvt::blockSegments(worker::kvBlockPool(layout, regions[r]), blocks,
                             worker::kvBlockPool(targetLayout, job.target.regions[r]), targetBlocks, layer, layer + 1);
      if (!segments.ok()) {
        job.failed = segments.status();
        break;
      }
      auto t = loop_.agent().post(segments->local, segments->remote, job.peer, job.blocks.writeGrant);
      if (!t.ok()) {
        job.failed = t.status();
        break;
      }
      job.inflight.push_back(t.value());
      job.bytes += totalBytes(segments->local);
    }
    if (job.failed.isOk() && layer == layout.numLayers - 1) job.pushedTokens = e.start + e.count;
    if (job.failed.isOk()) renewLease(e.seq, job, e.start);
  }
  loop_.agent().progress();
  // Completions seen per layer, not only after the step: the agent's lane figures time each
  // transfer to the poll that sees it done (kvtransfer/lane_rates.h).
  for (auto& [id, job] : jobs_) pollInflight(job);
}

void PrefillJobs::pollInflight(Job& job) {
  for (size_t i = 0; i < job.inflight.size();) {
    Status s = loop_.agent().poll(job.inflight[i]);
    if (s.inProgress()) {
      ++i;
      continue;
    }
    if (!s.isOk() && job.failed.isOk()) job.failed = s;
    job.inflight.erase(job.inflight.begin() + long(i));
  }
}

// A layer of the job was computed: its lease runs anew, and the decode worker hears so (at
// most every quarter lease: the lease there is as long, so it is renewed well before it ends).
void PrefillJobs::renewLease(uint64_t id, Job& job, int computedTokens) {
  const SteadyTime now = steadyNow();
  job.progressAt = now;
  if (now - job.progressSentAt < job.leaseMs / 4) return;
  job.progressSentAt = now;
  proto::Envelope env;
  env.set_request_id(id);
  env.mutable_prefill_progress()->set_request_id(id);
  env.mutable_prefill_progress()->set_computed_tokens(uint32_t(std::max(0, computedTokens)));
  (void)job.decode->send(std::move(env));
}

void PrefillJobs::onStepEvents(const std::vector<engine::EngineEvent>& events) {
  for (const auto& e : events) {
    auto it = jobs_.find(e.requestId);
    if (it == jobs_.end()) continue;
    Job& job = it->second;
    switch (e.kind) {
      case engine::EngineEvent::Kind::kToken:
        job.first = e.token;
        break;
      case engine::EngineEvent::Kind::kFinished:
        job.state = State::kPushing;
        job.computedAt = steadyNow();
        job.queueS = e.timings.queueSeconds;
        job.computeS = e.timings.prefillSeconds.value_or(0);
        job.cachedTokens = e.timings.cachedPromptTokens;
        break;
      case engine::EngineEvent::Kind::kFailed:
        if (job.failed.isOk()) job.failed = e.error;
        break;
    }
  }
}

void PrefillJobs::exportStates() {
  int64_t computing = 0, pushing = 0;
  for (const auto& [id, job] : jobs_) {
    computing += job.state == State::kComputing;
    pushing += job.state == State::kPushing;
  }
  auto& m = loop_.metrics();
  m.remotePrefillsIn("computing", computing);
  m.remotePrefillsIn("pushing", pushing);
  m.remotePrefillsIn("ending", int64_t(ending_.size()));
}

void PrefillJobs::settle() {
  pulls_.poll();
  std::vector<uint64_t> done, failed;
  for (auto& [id, job] : jobs_) {
    pollInflight(job);
    if (!job.failed.isOk())
      failed.push_back(id);
    else if (job.state == State::kPushing && job.inflight.empty())
      done.push_back(id);
  }
  for (uint64_t id : done) finish(id);
  for (uint64_t id : failed) end(id, jobs_.at(id).failed, /*reply=*/true);
  for (auto it = ending_.begin(); it != ending_.end();) {
    auto& inflight = it->second.inflight;
    for (size_t i = 0; i < inflight.size();) {
      if (loop_.agent().poll(inflight[i]).inProgress()) {
        ++i;
      } else {
        inflight.erase(inflight.begin() + long(i));
      }
    }
    if (!inflight.empty()) {
      ++it;
      continue;
    }
    if (it->second.ackTo) sendCancelAck(it->second.ackTo, it->first);
    it = ending_.erase(it);
  }
}

void PrefillJobs::sendCancelAck(const net::ConnectionPtr& decode, uint64_t id) {
  proto::Envelope env;
  env.set_request_id(id);
  env.mutable_cancel()->set_request_id(id);
  env.mutable_cancel()->set_ack(true);
  (void)decode->send(std::move(env));
}

bool PrefillJobs::hasTransfers() const {
  for (const auto& [id, job] : jobs_)
    if (!job.inflight.empty()) return true;
  return !ending_.empty();
}

uint32_t PrefillJobs::transfersInFlight() const {
  uint32_t n = 0;
  for (const auto& [id, job] : jobs_) n += uint32_t(job.inflight.size());
  return n;
}

void PrefillJobs::finish(uint64_t id) {
  Job& job = jobs_.at(id);
  proto::Envelope env;
  env.set_request_id(id);
  auto* d = env.mutable_prefill_done();
  d->set_request_id(id);
  d->set_first_token_id(static_cast<uint32_t>(job.first->id));
  *d->mutable_first_logprob() = worker::toProto(*job.first);
  d->set_bytes_transferred(job.bytes);
  // The actual prefix hit, which the router compares with its prediction (docs/kv_events.md).
  d->set_cached_prompt_tokens(uint32_t(job.cachedTokens));
  auto* t = d->mutable_timings();
  t->set_prefill_worker_id(loop_.flags().workerId);
  t->set_route(proto::ROUTE_DISAGGREGATED);
  // Three consecutive intervals of this host's clock: the request's wait for the loop and
  // the engine queue, compute to the first
  // token, and the KV push left after it (layers were posted while later ones computed, so
  // only the tail is exposed).
  t->set_ttft_split(true);
  // The engine counts the queue from the pull's reservation: the pull is its own phase.
  t->set_prefill_queue_ms(std::max(0.0, 1e3 * (job.inboxS + job.queueS) - job.pullMs));
  t->set_prefill_ms(1e3 * job.computeS);
  t->set_transfer_ms(1e3 * secondsBetween(*job.computedAt, steadyNow()));
  if (job.pullMs > 0) {
    // Its pull (inside prefill_queue_ms: the engine counts the queue from the reservation).
    t->set_pull_ms(job.pullMs);
    t->set_pull_tokens(uint32_t(job.pulledTokens));
    t->set_pull_transport(job.pullTransport);
  }
  if (auto name = loop_.agent().peerTransport(job.peer); name.ok()) t->set_transport(name.value());
  (void)job.decode->send(std::move(env));
  loop_.cancelTimer(job.deadlineTimer);
  loop_.engine().release(id);
  jobs_.erase(id);
}

void PrefillJobs::end(uint64_t id, const Status& why, bool reply, net::ConnectionPtr ackTo) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    // Nothing of it here (never accepted, or already ended): once an earlier ending of the
    // same id is settled, nothing of it can land.
    if (ackTo) {
      if (auto e = ending_.find(id); e != ending_.end()) {
        e->second.ackTo = std::move(ackTo);
      } else {
        sendCancelAck(ackTo, id);
      }
    }
    return;
  }
  Job& job = it->second;
  // cancel() returns once the transport no longer reads our blocks (transport.h); the ids are
  // polled on (settle) until each reports its terminal state, and only then is a Cancel
  // acknowledged: then no byte of the request can still land at the target.
  for (auto t : job.inflight) (void)loop_.agent().cancel(t);
  Ending& ending = ending_[id];
  ending.inflight.insert(ending.inflight.end(), job.inflight.begin(), job.inflight.end());
  if (ackTo) ending.ackTo = std::move(ackTo);
  if (reply) {
    PD_LOG(kWarn, kTag) << "request " << id << ": " << why.toString();
    reject(job.decode, id, why);
  }
  loop_.cancelTimer(job.deadlineTimer);
  if (job.pulling) pulls_.end(id, why.isOk() ? "cancelled" : why.message());  // fenced or held first
  loop_.engine().cancel(id);
  loop_.engine().release(id);
  jobs_.erase(it);
}

void PrefillJobs::cancel(const net::ConnectionPtr& decode, uint64_t id) {
  end(id, Status::ok(), /*reply=*/false, decode);
  settle();  // acknowledges at once when nothing was in flight
}

void PrefillJobs::dropConnection(const net::ConnectionPtr& decode, const Status& why) {
  targets_.drop(decode.get());
  std::vector<uint64_t> ids;
  for (auto& [id, job] : jobs_)
    if (job.decode == decode) ids.push_back(id);
  if (!ids.empty()) {
    PD_LOG(kWarn, kTag) << "decode worker " << decode->peerHello().worker_id() << " went away (" << why.message()
                        << "); dropping " << ids.size() << " request(s)";
  }
  for (uint64_t id : ids) end(id, why, /*reply=*/false);
  pulls_.dropConnection(decode);
}

void PrefillJobs::shutdown(const Status& why) {
  std::vector<uint64_t> ids;
  for (auto& [id, job] : jobs_) ids.push_back(id);
  for (uint64_t id : ids) end(id, why, /*reply=*/true);
  pulls_.shutdown();
  targets_.clear();
}

}  // namespace pd::prefill
