#include "router/router_loop.h"

#include <algorithm>
#include <map>
#include <unordered_set>

#include <boost/asio/post.hpp>

#include "common/base/log.h"
#include "common/base/random.h"
#include "router/admission.h"

namespace pd::router {
namespace {

constexpr const char* kTag = "router";

}  // namespace

RouterLoop::RouterLoop(boost::asio::io_context& io, const config::ClusterConfig& cfg, std::string modelName,
                       metrics::Registry& registry, metrics::RouterMetrics& metrics)
    : strand_(boost::asio::make_strand(io)),
      cfg_(cfg),
      modelName_(std::move(modelName)),
      metrics_(metrics),
      prefixAware_(cfg.router.prefixAwareRouting && cfg.engine.enablePrefixCaching),
      exactRouting_(prefixAware_ && cfg.router.exactPrefixRouting),
      hasher_(cfg.engine.blockSize),
      workers_(strand_, modelName_, std::chrono::milliseconds(cfg.router.workerReportTimeoutMs), registry, metrics),
      policy_({cfg.router.shortPromptTokens, RoutingConfig{}.cacheLoadSlack,
               cfg.router.overloadShedding ? cfg.pools.decode.slo.itlMs : 0}),
      prefixIndex_(cfg.engine.blockSize),
      exactIndex_(cfg.engine.blockSize, std::chrono::milliseconds(cfg.router.kvEventMaxLagMs)),
      autoscaler_(PoolSlo{cfg.pools.prefill.slo.ttftMs / 1e3, cfg.pools.prefill.slo.percentile,
                          cfg.pools.prefill.minReplicas, cfg.pools.prefill.maxReplicas},
                  PoolSlo{cfg.pools.decode.slo.itlMs / 1e3, cfg.pools.decode.slo.percentile,
                          cfg.pools.decode.minReplicas, cfg.pools.decode.maxReplicas},
                  autoscalerOptions(cfg.router.autoscaler)),
      threshold_(cfg.router.adaptiveThreshold
                     ? std::optional<AdaptiveThreshold>(AdaptiveThreshold(cfg.router.shortPromptTokens))
                     : std::nullopt),
      autoscaleTimer_(strand_),
      admission_(AdmissionTargets{cfg.pools.prefill.slo.ttftMs / 1e3, cfg.pools.prefill.slo.percentile,
                                  cfg.pools.decode.slo.itlMs / 1e3, cfg.pools.decode.slo.percentile,
                                  cfg.engine.sloSizedPrefillChunks}) {
  // A decode worker whose reports stopped is cut off (its reports come from its I/O threads,
  // never blocked by a long step): its streams would stall until the request deadline.
  workers_.onSilent([this](const std::string& id) {
    migrateFrom(id, unavailable("decode worker '" + id + "' sent no load report for " +
                                std::to_string(cfg_.router.workerReportTimeoutMs) + " ms"));
  });
}

template <typename F>
void RouterLoop::onStrand(F&& f) {
  boost::asio::post(strand_, std::forward<F>(f));
}

void RouterLoop::start() {
  onStrand([this] { scheduleAutoscale(std::chrono::steady_clock::duration::zero()); });
}

std::vector<uint64_t> RouterLoop::blockHashes(std::span<const int32_t> prompt) const {
  return prefixAware_ ? hasher_.blockHashes(prompt) : std::vector<uint64_t>{};
}

// ---- control plane ----------------------------------------------------------------------------

void RouterLoop::workerOpened(net::ConnectionPtr conn) {
  onStrand([this, conn = std::move(conn)] {
    if (Status s = workers_.add(conn); !s.isOk()) return refuseWorker(conn, s);
    // A worker that publishes KV events is indexed exactly once its snapshot arrives.
    if (exactRouting_ && conn->peerHello().kv_events()) {
      exactIndex_.addWorker(conn->peerHello().worker_id());
      metrics_.setKvIndexCurrent(conn->peerHello().worker_id(), false);
    }
  });
}

// The worker reads why in an Error frame and closes its side (worker/router_link.h); the close
// here, a second later, bounds a peer that does not (the frame is written by then).
void RouterLoop::refuseWorker(const net::ConnectionPtr& conn, const Status& why) {
  proto::Envelope env;
  *env.mutable_error() = net::toProtoError(why);
  if (!conn->send(env).isOk()) return conn->close(why);
  auto timer = std::make_shared<boost::asio::steady_timer>(strand_, std::chrono::seconds(1));
  timer->async_wait([timer, conn, why](const boost::system::error_code&) { conn->close(why); });
}

void RouterLoop::workerMessage(net::ConnectionPtr conn, proto::Envelope env) {
  onStrand([this, conn = std::move(conn), env = std::move(env)]() mutable {
    switch (env.body_case()) {
      case proto::Envelope::kLoadReport:
        return onLoadReport(conn, env.load_report());
      case proto::Envelope::kKvEvents:
        return onKvEvents(conn, env.kv_events());
      case proto::Envelope::kTokenChunk:
        return onChunk(conn, std::move(*env.mutable_token_chunk()));
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from " << conn->remoteAddress();
    }
  });
}

void RouterLoop::workerClosed(net::ConnectionPtr conn, Status why) {
  onStrand([this, conn = std::move(conn), why = std::move(why)] { onWorkerClosed(conn, why); });
}

void RouterLoop::onWorkerClosed(const net::ConnectionPtr& conn, const Status& why) {
  const std::string id = workers_.remove(conn);
  if (id.empty()) return;
  PD_LOG(kWarn, kTag) << "worker '" << id << "' left: " << why.message();
  prefixIndex_.forget(id);
  exactIndex_.forget(id);
  metrics_.setPrefixIndexBlocks(id, "predicted", 0);
  metrics_.setPrefixIndexBlocks(id, "exact", 0);
  metrics_.setKvIndexCurrent(id, false);
  migrateFrom(id, unavailable("decode worker '" + id + "' disconnected"));
}

void RouterLoop::migrateFrom(const std::string& id, const Status& why) {
  std::unordered_set<RequestStream*> affected;  // once per request, however many choices
  for (const auto& [rid, e] : requests_)
    if (e.decodeWorker == id && affected.insert(e.stream.get()).second) e.stream->workerLost(why);
}

std::string RouterLoop::registeredId(const net::ConnectionPtr& conn) const {
  const std::string& id = conn->peerHello().worker_id();
  const auto* w = workers_.find(id);
  return w && w->conn == conn ? id : std::string();
}

void RouterLoop::onLoadReport(const net::ConnectionPtr& from, const proto::LoadReport& report) {
  workers_.onLoadReport(from, report);
  const std::string id = registeredId(from);
  if (id.empty() || !exactIndex_.tracks(id)) return;
  const SteadyTime now = steadyNow();
  exactIndex_.noteReportedSeq(id, report.kv_event_seq(), now);
  const bool current = exactIndex_.current(id, now);
  metrics_.setKvIndexCurrent(id, current);
  // Behind for longer than router.routing.kv_event_max_lag_ms (a batch lost, or a snapshot request
  // lost): start again from a snapshot.
  if (!current) askResync(from, id, "lag");
}

void RouterLoop::onKvEvents(const net::ConnectionPtr& from, const proto::KvEventBatch& batch) {
  const std::string id = registeredId(from);
  if (id.empty()) return;
  const KvEventIndex::Applied applied = exactIndex_.apply(id, batch);
  if (applied == KvEventIndex::Applied::kApplied && batch.created_unix_us() > 0) {
    const auto nowUs =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    metrics_.observeKvEventLag(std::max<double>(0, double(nowUs - int64_t(batch.created_unix_us())) / 1e6));
  }
  if (applied == KvEventIndex::Applied::kGap) {
    PD_LOG(kWarn, kTag) << "worker '" << id << "': KV event batch " << batch.seq() << " after "
                        << exactIndex_.appliedSeq(id) << "; asking for a snapshot, predicted index meanwhile";
    askResync(from, id, "gap");
  }
  metrics_.setPrefixIndexBlocks(id, "exact", int64_t(exactIndex_.blocks(id)));
  metrics_.setKvIndexCurrent(id, exactIndex_.current(id, steadyNow()));
}

void RouterLoop::askResync(const net::ConnectionPtr& conn, const std::string& id, std::string_view reason) {
  if (!exactIndex_.takeResyncDue(id, steadyNow())) return;
  proto::Envelope env;
  env.mutable_kv_resync()->set_last_applied_seq(exactIndex_.appliedSeq(id));
  if (conn->send(env).isOk()) metrics_.kvEventResync(reason);
}

// The chunk goes to its request's strand; the table entry stays until the stream says the
// choice ended (a chunk that arrives after that is dropped here). Only the connection the
// request was dispatched to may speak for it (docs/security.md): another worker's tokens, stop or
// error for it are dropped, logged and counted.
void RouterLoop::onChunk(const net::ConnectionPtr& from, proto::TokenChunk&& chunk) {
  auto it = requests_.find(chunk.request_id());
  if (it == requests_.end()) return;  // finished or cancelled meanwhile
  if (it->second.decodeConnId == 0 || it->second.decodeConnId != from->id()) {
    PD_LOG(kWarn, kTag) << "dropping a token chunk for request " << chunk.request_id() << " from '"
                        << from->peerHello().worker_id() << "' (" << from->remoteAddress()
                        << "): it was dispatched to '" << it->second.decodeWorker << "'";
    metrics_.controlMessageDropped("wrong_worker");
    return;
  }
  Entry& e = it->second;
  if (e.prefillTokens > 0) {  // the first chunk: the prompt is prefilled (or failed)
    workers_.prefillSettled(e.prefillWorker, e.prefillTokens);
    e.prefillTokens = 0;
  }
  if (e.predictedTtftS > 0 && chunk.token_ids_size() > 0) {
    admission_.observeFirstToken(e.predictedRoute, secondsBetween(e.routedAt, steadyNow()), e.predictedTtftS);
    metrics_.admissionScaleTtft[size_t(e.predictedRoute)].set(admission_.ttftScale(e.predictedRoute));
    e.predictedTtftS = 0;
  }
  e.stream->deliver(std::move(chunk));
}

void RouterLoop::forget(uint64_t workerRequestId) {
  auto it = requests_.find(workerRequestId);
  if (it == requests_.end()) return;
  const Entry& e = it->second;
  if (e.prefillTokens > 0) workers_.prefillSettled(e.prefillWorker, e.prefillTokens);
  workers_.streamEnded(e.decodeWorker);
  requests_.erase(it);
}

// ---- requests ---------------------------------------------------------------------------------

void RouterLoop::submit(std::shared_ptr<RequestStream> stream) {
  onStrand([this, stream = std::move(stream)] { route(stream); });
}

void RouterLoop::inFlight(std::function<void(size_t)> done) {
  onStrand([this, done = std::move(done)] {
    std::unordered_set<RequestStream*> streams;
    for (const auto& [rid, e] : requests_) streams.insert(e.stream.get());
    done(streams.size());
  });
}

void RouterLoop::failAll(Status why) {
  onStrand([this, why = std::move(why)] {
    std::unordered_set<RequestStream*> failed;
    for (const auto& [rid, e] : requests_)
      if (failed.insert(e.stream.get()).second) e.stream->fail(why);
  });
}

void RouterLoop::route(const std::shared_ptr<RequestStream>& stream) {
  const RequestSpec& spec = stream->spec();
  if (draining_) {
    return stream->refuse(
        ApiError::unavailable("this router is shutting down; retry (another router takes the request)"), "draining",
        "router");
  }
  const int64_t promptTokens = int64_t(spec.parsed.prompt.size());
  if (const auto limit = longestServablePrompt(workers_.snapshot()); limit && promptTokens > *limit) {
    ApiError e;  // no retry can help it: a 400, like a prompt past the model's context
    e.code = "context_length_exceeded";
    e.message = "the prompt has " + std::to_string(promptTokens) + " tokens, more than the " + std::to_string(*limit) +
                " that any decode worker's KV cache can ever hold with a generated token (engine.num_blocks x "
                "engine.block_size, less the blocks admission keeps free)";
    return stream->refuse(std::move(e), "kv_cache_too_small", metrics::kPoolDecode);
  }
  WorkerView prefilling, decoding;
  auto p = plan(promptTokens, spec.prefixBlocks, "", &prefilling, &decoding);
  if (!p) {
    return stream->refuse(ApiError::unavailable("no healthy decode worker; retry later"), "no_worker",
                          metrics::kPoolDecode);
  }
  double predictedTtftS = 0;  // unscaled, for the calibration
  if (cfg_.router.overloadShedding) {
    const AdmissionDecision d = admission_.decide(*p, prefilling, decoding, promptTokens, policy_);
    if (!d.admitted()) {
      const AdmissionVerdict& v = d.verdict;
      autoscaler_.observeShed(steadyNow(), p->route, d.refusedBy == AdmissionDecision::Side::kPrefill, v.predictedS);
      const std::string why =
          d.refusedBy == AdmissionDecision::Side::kPrefill
              ? "with the prompts queued on worker " + prefilling.id + ", this one's first token is predicted at " +
                    std::to_string(int(v.predictedS * 1e3)) + " ms, past the " +
                    std::to_string(int(cfg_.pools.prefill.slo.ttftMs)) + " ms TTFT target"
              : "one more stream on decode worker " + decoding.id + " would make its steps take about " +
                    std::to_string(int(v.predictedS * 1e3)) + " ms, past the " +
                    std::to_string(int(cfg_.pools.decode.slo.itlMs)) + " ms ITL target";
      return stream->refuse(
          ApiError::rateLimited("overloaded: " + why + "; retry after " + std::to_string(v.retryAfterS) + " s",
                                "overloaded", std::nullopt, v.retryAfterS),
          "overloaded",
          d.refusedBy == AdmissionDecision::Side::kPrefill ? metrics::kPoolPrefill : metrics::kPoolDecode);
    }
    predictedTtftS = d.predictedTtftS;
  }
  commit(*p, spec.prefixBlocks);
  const Route route = p->route;
  Dispatch d = dispatch(stream, std::move(*p), spec.parsed.req.n, promptTokens);
  d.responseId = std::to_string(d.workerRequestIds.front());
  if (predictedTtftS > 0) {
    Entry& first = requests_.at(d.workerRequestIds.front());
    first.predictedTtftS = predictedTtftS;
    first.predictedRoute = route;
    first.routedAt = steadyNow();
  }
  stream->start(std::move(d));
}

std::optional<RoutePlan> RouterLoop::plan(int64_t promptTokens, const std::vector<uint64_t>& blocks,
                                          const std::string& exclude, WorkerView* prefilling, WorkerView* decoding) {
  std::vector<WorkerView> views = workers_.snapshot();
  if (!exclude.empty()) std::erase_if(views, [&](const WorkerView& v) { return v.id == exclude; });
  if (!blocks.empty()) {
    // A worker's cache never serves a prompt's last token (one is computed for its logits),
    // so a prompt of whole blocks can hit at most all but its last one.
    const size_t usable =
        std::min(blocks.size(), size_t(std::max<int64_t>(0, promptTokens - 1)) / size_t(prefixIndex_.blockSize()));
    const std::span<const uint64_t> lookup(blocks.data(), usable);
    const SteadyTime now = steadyNow();
    for (auto& v : views) {
      v.predictedCachedTokens = prefixIndex_.cachedTokens(v.id, lookup);
      v.exactCachedTokens = exactIndex_.current(v.id, now) ? exactIndex_.cachedTokens(v.id, lookup) : -1;
      v.cachedTokens = v.exactCachedTokens >= 0 ? v.exactCachedTokens : v.predictedCachedTokens;
      if (v.exactCachedTokens >= 0) v.diskCachedTokens = exactIndex_.diskOnlyTokens(v.id, lookup);
    }
  }
  // Peer pulls: a prefix some peer holds (in any tier) counts as cached on every pull-serving
  // decode worker that would pull it faster than compute it (router/pull_cost.h), so the
  // policy weighs it like its own cache.
  std::unordered_map<std::string, PullChoice> pulls;
  if (!blocks.empty()) pulls = pullChoices(views);
  auto p = policy_.select(promptTokens, views);
  if (!p) return std::nullopt;
  if (p->route == Route::kColocated) {
    if (auto it = pulls.find(p->decodeWorker); it != pulls.end()) {
      const PullChoice& c = it->second;
      // The source itself, when it is no busier, serves the prompt from its own cache.
      const WorkerView* source = nullptr;
      const WorkerView* target = nullptr;
      for (const auto& v : views) {
        if (v.id == c.source) source = &v;
        if (v.id == p->decodeWorker) target = &v;
      }
      if (source && target && source->healthy &&
          source->running + source->waiting <= target->running + target->waiting) {
        p = RoutingPolicy::colocatedOn(*source, p->reason);
      } else {
        p->pullSource = c.source;
        p->pullTokens = c.prefixTokens;
        p->pullWhy = c.decision.why;
        p->reason = "pull";
      }
    }
  }
  if (p->route == Route::kDisaggregated && !blocks.empty()) {
    // The prefill worker pulls the prefix a decode worker holds when that beats computing it
    // (routing_policy.h planPrefillPull): the multi-turn history lives on a decode worker.
    double fleetRate = 0;
    std::string why;
    if (planPrefillPull(*p, views, pullCandidates(views, &fleetRate), fleetRate, &why)) {
      PD_LOG(kDebug, kTag) << "prefill worker " << p->prefillWorker << " pulls from " << p->pullSource << ": " << why;
    } else {
      PD_LOG(kDebug, kTag) << "no pull for prefill worker " << p->prefillWorker << ": " << why;
    }
  }
  const std::string& who = p->route == Route::kDisaggregated ? p->prefillWorker : p->decodeWorker;
  for (const auto& v : views) {
    if (v.id == who) {
      *prefilling = v;
      p->predictedCachedTokens = v.predictedCachedTokens;
      p->exactCachedTokens = v.exactCachedTokens;
    }
    if (v.id == p->decodeWorker) *decoding = v;
  }
  return p;
}

std::vector<PullCandidate> RouterLoop::pullCandidates(const std::vector<WorkerView>& views, double* fleetRate) const {
  // The fleet's figures stand in for a worker's own until it has measured them: every worker
  // runs the same model on the same engine and transports (a decode worker that never pushed
  // KV has no lane figure; one that never prefilled, no rate).
  std::map<std::string, LaneCost> fleetLanes;
  double rateSum = 0;
  int rates = 0;
  for (const auto& v : views) {
    for (const LaneCost& l : v.lanes)
      if (l.bytesPerS > 0 && !fleetLanes.count(l.transport)) fleetLanes[l.transport] = l;
    if (v.prefillTokensPerS > 0) rateSum += v.prefillTokensPerS, ++rates;
  }
  std::vector<PullCandidate> candidates;
  for (const auto& v : views) {
    if (v.role != WorkerRole::kDecode) continue;
    // Any tier's run: the source promotes its host and disk tiers' blocks for a pull.
    PullCandidate c{v.id, v.healthy, v.servesPulls, v.host, v.exactCachedTokens, v.lanes, v.diskCachedTokens};
    for (const auto& [transport, lane] : fleetLanes) {
      if (std::none_of(c.lanes.begin(), c.lanes.end(), [&](const LaneCost& l) { return l.transport == transport; }))
        c.lanes.push_back(lane);
    }
    candidates.push_back(std::move(c));
  }
  *fleetRate = rates ? rateSum / rates : 0;
  return candidates;
}

std::unordered_map<std::string, PullChoice> RouterLoop::pullChoices(std::vector<WorkerView>& views) const {
  std::unordered_map<std::string, PullChoice> out;
  double fleetRate = 0;
  const std::vector<PullCandidate> candidates = pullCandidates(views, &fleetRate);
  for (auto& v : views) {
    if (v.role != WorkerRole::kDecode || !v.healthy || !v.servesPulls) continue;
    const double rate = v.prefillTokensPerS > 0 ? v.prefillTokensPerS : fleetRate;
    std::string rejected;
    auto c =
        choosePull(v.id, v.host, std::max<int64_t>(0, v.cachedTokens), rate, v.kvBytesPerToken, candidates, &rejected);
    if (!c) {
      PD_LOG(kDebug, kTag) << "no pull for " << v.id << ": " << rejected;
      continue;
    }
    v.cachedTokens = std::max<int64_t>(0, v.cachedTokens) + c->pullTokens;
    out.emplace(v.id, std::move(*c));
  }
  return out;
}

void RouterLoop::commit(const RoutePlan& p, const std::vector<uint64_t>& blocks) {
  metrics_.routeDecision(routeName(p.route), p.reason);
  if (!p.pullSource.empty()) {
    PD_LOG(kDebug, kTag) << (p.route == Route::kDisaggregated ? "prefill worker " + p.prefillWorker
                                                              : "decode worker " + p.decodeWorker)
                         << " pulls from " << p.pullSource << ": " << p.pullWhy;
  }
  metrics_.predictedCachedTokens(p.cachedTokens);
  // Both workers hold the prompt's blocks afterwards (the decode worker caches what it
  // received), as far as their pools keep them.
  for (const std::string& w : {p.decodeWorker, p.prefillWorker})
    if (!w.empty() && !blocks.empty()) {
      prefixIndex_.record(w, blocks, workers_.totalBlocks(w));
      metrics_.setPrefixIndexBlocks(w, "predicted", int64_t(prefixIndex_.blocksKnown(w)));
    }
}

Dispatch RouterLoop::dispatch(const std::shared_ptr<RequestStream>& stream, RoutePlan plan, int n,
                              int64_t promptTokens) {
  Dispatch d;
  if (const auto* w = workers_.find(plan.decodeWorker)) d.decodeConn = w->conn;
  if (plan.route == Route::kDisaggregated) {
    if (const auto* w = workers_.find(plan.prefillWorker)) d.prefillAddress = w->address;
  }
  if (!plan.pullSource.empty()) {
    if (const auto* w = workers_.find(plan.pullSource)) d.pullAddress = w->address;
  }
  const std::string& prefilling = plan.route == Route::kDisaggregated ? plan.prefillWorker : plan.decodeWorker;
  const int64_t uncached = std::max<int64_t>(0, promptTokens - plan.cachedTokens);
  workers_.noteRouted(prefilling, uncached, plan.decodeWorker, n);
  const SteadyTime now = steadyNow();
  autoscaler_.observeDecodeArrival(now);
  // An overflowed prompt is still the prefill pool's demand: it would scale out for it.
  if (plan.route == Route::kDisaggregated || plan.reason == "prefill_overflow")
    autoscaler_.observePrefillArrival(now, uncached);
  for (int i = 0; i < n; ++i) {
    const uint64_t id = newRequestId();
    d.workerRequestIds.push_back(id);
    // The choices share the prompt's prefill on the worker; the first one carries its count.
    requests_[id] =
        Entry{stream, plan.decodeWorker, d.decodeConn ? d.decodeConn->id() : 0, prefilling, i == 0 ? uncached : 0};
  }
  d.plan = std::move(plan);
  return d;
}

// The prompt grew by the streamed tokens, so it is routed again by length (no prefix
// hashes: the index has none for the generated part), never back to the worker it left.
void RouterLoop::migrate(std::shared_ptr<RequestStream> stream, std::vector<uint64_t> oldIds, int64_t promptTokens,
                         std::string leftWorker) {
  onStrand([this, stream = std::move(stream), oldIds = std::move(oldIds), promptTokens, left = std::move(leftWorker)] {
    for (uint64_t id : oldIds) forget(id);
    WorkerView prefilling, decoding;
    auto p = plan(promptTokens, {}, left, &prefilling, &decoding);
    if (!p) return stream->resume(std::nullopt, unavailable("no other decode worker can continue it"));
    commit(*p, {});  // an admitted request is never shed: it moves
    stream->resume(dispatch(stream, std::move(*p), int(oldIds.size()), promptTokens), Status());
  });
}

uint64_t RouterLoop::newRequestId() {
  uint64_t id = 0;
  while (id == 0 || requests_.count(id)) id = randomNonZeroU64();  // 0 is "connection-level" on the wire
  return id;
}

void RouterLoop::choicesEnded(std::vector<uint64_t> workerRequestIds) {
  onStrand([this, ids = std::move(workerRequestIds)] {
    for (uint64_t id : ids) forget(id);
  });
}

void RouterLoop::observeTokens(const TokenTiming& t) {
  onStrand([this, t] {
    if (t.ttft) autoscaler_.observeTtft(t.at, *t.ttft, t.route);
    if (t.itl) autoscaler_.observeItl(t.at, *t.itl);
    for (int k = 0; k < t.zeroItls; ++k) autoscaler_.observeItl(t.at, 0.0);
    if (t.itl && cfg_.router.overloadShedding) {
      admission_.observeGap(*t.itl);
      for (int k = 0; k < t.zeroItls; ++k) admission_.observeGap(0);
      metrics_.admissionScaleItl.set(admission_.itlScale());
      policy_.setItlPredictionScale(admission_.itlScale());
    }
  });
}

void RouterLoop::healthyDecodeWorkers(std::function<void(int)> done) {
  onStrand([this, done = std::move(done)] {
    int n = 0;
    for (const auto& v : workers_.snapshot()) n += v.healthy && v.role == WorkerRole::kDecode;
    done(n);
  });
}

// ---- autoscaler -------------------------------------------------------------------------------

void RouterLoop::scheduleAutoscale(std::chrono::steady_clock::duration after) {
  autoscaleTimer_.expires_after(after);
  autoscaleTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    autoscale(steadyNow());
    scheduleAutoscale(std::chrono::milliseconds(cfg_.router.autoscaler.tickMs));
  });
}

// Every tick: pdserve_desired_replicas and the SLO window gauges of both pools (a change of
// recommendation is logged with its reason), and the adaptive threshold when it is on.
void RouterLoop::autoscale(SteadyTime now) {
  int prefill = 0, decode = 0;
  const auto views = workers_.snapshot();
  for (const auto& v : views) (v.role == WorkerRole::kPrefill ? prefill : decode) += v.healthy;
  auto [prefillLoad, decodeLoad] = poolLoads(views);
  decodeLoad.maxStreamsPerWorker = cfg_.engine.maxRunningRequests;
  auto [prefillDecision, decodeDecision] = autoscaler_.decide(prefill, prefillLoad, decode, decodeLoad, now);
  const std::pair<std::string_view, ScalingDecision> pools[] = {{metrics::kPoolPrefill, std::move(prefillDecision)},
                                                                {metrics::kPoolDecode, std::move(decodeDecision)}};
  if (threshold_) {
    std::string why;
    const int64_t before = threshold_->value();
    const int64_t after = threshold_->update({pools[0].second.ratio, pools[0].second.enoughSamples},
                                             {pools[1].second.ratio, pools[1].second.enoughSamples}, &why);
    if (after != before) {
      policy_.setShortPromptTokens(after);
      metrics_.setShortPromptTokens(after);
      PD_LOG(kInfo, kTag) << "short_prompt_tokens " << before << " -> " << after << " (" << why << ")";
    }
  }
  for (const auto& [pool, d] : pools) {
    metrics_.setSloWindow(pool, d.observedSeconds, d.attainment);
    metrics_.setDesiredReplicas(pool, d.desired);
    metrics_.setAutoscalerSignals(
        pool, {d.capacityReplicas, d.latencyReplicas, d.demand, d.workerCapacity, d.predictedSeconds, d.idleSeconds});
    int& last = pool == metrics::kPoolPrefill ? lastDesiredPrefill_ : lastDesiredDecode_;
    if (d.desired != last) {
      PD_LOG(kInfo, kTag) << pool << " pool: " << d.current << " healthy, recommending " << d.desired << " ("
                          << d.reason << "; " << d.samples << " latency samples)";
      last = d.desired;
    }
  }
}

}  // namespace pd::router
