#include "tools/plan/cluster_sim.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <queue>
#include <utility>

#include "common/base/clock.h"
#include "engine/engine.h"
#include "router/admission.h"
#include "router/autoscaler.h"
#include "router/routing_policy.h"
#include "tools/local_actuator.h"

namespace pd::plan {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// A Backend that computes nothing: each step advances the worker's clock by the cost
// model's time for that batch and samples a fixed ordinary token (requests ignore EOS).
class SimBackend final : public engine::Backend {
 public:
  SimBackend(const CostModel& cost, ManualClock& clock, engine::KvLayout layout, int32_t token,
             const StepSpread* spread, bool prefillWorker, uint64_t seed)
      : cost_(cost),
        clock_(clock),
        layout_(layout),
        token_(token),
        spread_(spread),
        prefillWorker_(prefillWorker),
        rng_(seed) {}

  const engine::ModelConfig& config() const override { return cost_.model().config; }
  const engine::KvLayout& kvLayout() const override { return layout_; }
  bool samplesOnDevice() const override { return true; }

  Status forward(std::span<const engine::SeqChunk> batch, float* logits, const engine::LayerKvReadyFn&) override {
    // Only reached for rows with host logits processors, which the simulator never sends.
    (void)logits;
    advance(batch);
    return Status::ok();
  }
  Status forwardAndSample(std::span<const engine::SeqChunk> batch, std::span<const pd::kernels::SampleRowParams> params,
                          int, engine::SampledToken* out, const engine::LayerKvReadyFn&) override {
    advance(batch);
    for (size_t i = 0; i < params.size(); ++i) out[i] = engine::SampledToken{token_, 0.0f, {}};
    return Status::ok();
  }

 private:
  void advance(std::span<const engine::SeqChunk> batch) {
    double seconds = cost_.stepSeconds(batch);
    if (spread_ != nullptr) seconds *= spread_->sample(StepClass::of(prefillWorker_, batch), rng_);
    clock_.advance(std::chrono::duration_cast<Duration>(std::chrono::duration<double>(seconds)));
  }
  const CostModel& cost_;
  ManualClock& clock_;
  engine::KvLayout layout_;
  int32_t token_;
  const StepSpread* spread_;  // may be null
  bool prefillWorker_;
  std::mt19937_64 rng_;
};

struct Worker {
  std::string id;
  router::WorkerRole role;
  std::unique_ptr<ManualClock> clock;  // the engine and its requests hold a reference
  std::unique_ptr<engine::Engine> engine;
  double freeAtS = 0;     // the end of its last step
  bool stalled = false;   // its last step found nothing to run: wait for new work
  double startS = 0;      // started: it holds its devices from here
  double readyS = 0;      // it takes work from here
  bool draining = false;  // takes no new work; exits when its requests are done
  double exitS = kNever;
  // The router's own count of its outstanding work here (router/worker_registry.h noteRouted):
  // prompt tokens routed to prefill with no first token yet, streams routed and not ended.
  int64_t routedPrefillTokens = 0;
  int routedStreams = 0;
  bool exited() const { return exitS != kNever; }
  bool takesWork(double t) const { return readyS <= t && !draining && !exited(); }
};

struct KvArrival {
  double atS;
  size_t request;
  bool operator>(const KvArrival& o) const { return atS != o.atS ? atS > o.atS : request > o.request; }
};

// Per request: where it went and what its stream has seen.
struct Tracking {
  size_t decodeWorker = 0;
  // The worker that prefills it as routed (the decode worker when colocated): the one its
  // prompt tokens count on in the router's view until its first token, and the one a
  // disaggregated prompt's KV comes from.
  size_t prefilling = 0;
  int64_t prefillTokens = 0;                        // those tokens (0: settled)
  router::Route route = router::Route::kColocated;  // as admitted
  double predictedTtftS = 0;                        // admission's unscaled prediction (0: none made)
  engine::SampledToken first;                       // the prefill worker's token (disaggregated)
  double lastTokenS = -1;
};

class Simulation {
 public:
  Simulation(const CostModel& cost, const SimOptions& o, const std::vector<SimRequest>& requests)
      : cost_(cost),
        o_(o),
        requests_(requests),
        outcomes_(requests.size()),
        tracking_(requests.size()),
        policy_(routingConfig(o)),
        admission_(router::AdmissionTargets{o.slo.ttftS, o.slo.percentile, o.slo.itlS, o.slo.percentile,
                                            o.sloSizedPrefillChunks}) {
    if (const auto& a = o.autoscaling) {
      autoscaler_.emplace(router::PoolSlo{o.slo.ttftS, o.slo.percentile, a->minPrefill, a->maxPrefill},
                          router::PoolSlo{o.slo.itlS, o.slo.percentile, a->minDecode, a->maxDecode},
                          router::autoscalerOptions(a->keys));
    }
  }

  Status run(SimSummary* summary) {
    PD_RETURN_IF_ERROR(makeWorkers());
    const double horizon = o_.horizonS > 0 ? o_.horizonS : (requests_.empty() ? 0 : requests_.back().arrivalS) + 600;
    const double tickS = autoscaler_ ? double(o_.autoscaling->keys.tickMs) / 1e3 : kNever;
    double nextTick = requests_.empty() ? 0 : requests_.front().arrivalS;
    size_t nextArrival = 0;
    std::vector<engine::EngineEvent> events;
    while (true) {
      const double tArrival = nextArrival < requests_.size() ? requests_[nextArrival].arrivalS : kNever;
      const double tKv = kv_.empty() ? kNever : kv_.top().atS;
      size_t stepper = workers_.size();
      double tStep = kNever;
      for (size_t w = 0; w < workers_.size(); ++w) {
        const Worker& c = workers_[w];
        if (c.engine->hasWork() && !c.stalled && c.freeAtS < tStep) tStep = c.freeAtS, stepper = w;
      }
      const double tWork = std::min({tArrival, tKv, tStep});
      if (tWork == kNever) break;  // nothing left to serve: the autoscaler's ticks alone end here
      const double tTick = autoscaler_ ? nextTick : kNever;
      const double t = std::min(tWork, tTick);
      if (t > horizon) break;
      // Ties: KV landings, then arrivals, then the autoscaler, then steps (a step at t sees
      // what arrived at t).
      if (tKv == t) {
        const KvArrival a = kv_.top();
        kv_.pop();
        PD_RETURN_IF_ERROR(landKv(a));
      } else if (tArrival == t) {
        PD_RETURN_IF_ERROR(arrive(nextArrival++));
      } else if (tTick == t) {
        PD_RETURN_IF_ERROR(autoscale(t));
        nextTick += tickS;
      } else {
        Worker& w = workers_[stepper];
        advanceTo(w, t);
        events.clear();
        PD_RETURN_IF_ERROR(w.engine->step(&events));
        ++steps_;
        // Nothing could be scheduled (requests waiting for remote KV or for blocks): the
        // worker sleeps until something reaches it, as the worker loop does.
        w.stalled = nowOf(w) == t && events.empty();
        w.freeAtS = nowOf(w);
        for (const auto& e : events) PD_RETURN_IF_ERROR(onEvent(stepper, e));
        exitIfDrained(w, w.freeAtS);
      }
    }
    summarize(summary);
    return Status::ok();
  }

  std::vector<RequestOutcome> takeOutcomes() { return std::move(outcomes_); }

 private:
  static router::RoutingConfig routingConfig(const SimOptions& o) {
    router::RoutingConfig r;
    r.shortPromptTokens = o.layout.shortPromptTokens;
    r.itlTargetMs = o.overloadShedding ? o.slo.itlS * 1000 : 0;  // "protect_itl" goes with overload control
    return r;
  }

  Status makeWorkers() {
    const Layout& l = o_.layout;
    if (l.decodeWorkers < 1) return invalidArgument("plan: a layout needs at least one decode worker");
    blocks_ = cost_.kvBlocks(o_.blockSize, o_.memoryUtilization, o_.kvCacheBytes);
    if (blocks_ <= 0) {
      return failedPrecondition(
          "plan: " + cost_.model().name + " does not fit " + std::to_string(l.tensorParallel) + " x " +
          cost_.device().name + ": " + std::to_string(int64_t(cost_.weightBytesPerDevice() / double(1 << 20))) +
          " MiB of weights per device, " + std::to_string(o_.memoryUtilization) + " of the memory usable");
    }
    const auto& eos = cost_.model().config.eosTokenIds;
    while (std::find(eos.begin(), eos.end(), token_) != eos.end()) ++token_;
    for (int i = 0; i < l.prefillWorkers + l.decodeWorkers; ++i)
      PD_RETURN_IF_ERROR(
          startWorker(i < l.prefillWorkers ? router::WorkerRole::kPrefill : router::WorkerRole::kDecode, 0, 0));
    return Status::ok();
  }

  // A worker of `role` started at `startS` that takes work from `readyS`.
  Status startWorker(router::WorkerRole role, double startS, double readyS) {
    const bool prefill = role == router::WorkerRole::kPrefill;
    Worker w;
    w.role = role;
    w.id = (prefill ? "prefill-" : "decode-") + std::to_string(prefill ? prefillStarted_++ : decodeStarted_++);
    w.startS = startS;
    w.readyS = w.freeAtS = readyS;
    w.clock = std::make_unique<ManualClock>();
    if (workers_.empty()) origin_ = w.clock->now();  // every clock starts at the same point
    advanceTo(w, startS);
    const engine::KvLayout layout =
        engine::kvLayoutFor(cost_.model().config, int(std::min<int64_t>(blocks_, 1 << 30)), o_.blockSize,
                            cost_.model().kvBytes == 4 ? engine::KvDtype::kF32 : engine::KvDtype::kBF16);
    auto kv = engine::KvCacheManager::create(layout, engine::KvCacheManager::Backing::kAccountingOnly);
    if (!kv.ok()) return kv.status();
    engine::EngineOptions eo;
    eo.scheduler = o_.scheduler;
    eo.releaseKvOnFinish = !prefill;  // a prefill worker frees after the push
    if (o_.sloSizedPrefillChunks) {
      eo.prefillChunks.itlTargetMs = o_.slo.itlS * 1000;
      eo.prefillChunks.percentile = o_.slo.percentile;
    }
    eo.prefillChunks.minTokens = o_.minPrefillChunkTokens;
    auto backend = std::make_unique<SimBackend>(cost_, *w.clock, layout, token_, o_.stepSpread.get(), prefill,
                                                o_.seed * 1000003 + uint64_t(workers_.size()));
    w.engine = std::make_unique<engine::Engine>(std::move(backend), std::move(*kv), eo, *w.clock);
    workers_.push_back(std::move(w));
    ++holding_;
    peakHolding_ = std::max(peakHolding_, holding_);
    return Status::ok();
  }

  // A draining worker leaves once nothing it holds is in flight (no request to step, none
  // waiting for its KV): its devices are free from `t`.
  void exitIfDrained(Worker& w, double t) {
    if (!w.draining || w.exited() || w.engine->hasWork() || w.engine->load().remote > 0) return;
    w.exitS = t;
    --holding_;
  }

  // The router's tick (router_loop.cpp autoscale) and pdserve up's actuation of it: each
  // pool's recommendation from the views that take work, then planPool's one action per pool.
  Status autoscale(double t) {
    const auto views = this->views(t);
    int prefill = 0, decode = 0;
    for (const auto& v : views) ++(v.role == router::WorkerRole::kPrefill ? prefill : decode);
    auto [prefillLoad, decodeLoad] = router::poolLoads(views);
    decodeLoad.maxStreamsPerWorker = o_.scheduler.maxNumSeqs;
    const auto [p, d] = autoscaler_->decide(prefill, prefillLoad, decode, decodeLoad, at(t));
    const Autoscaling& a = *o_.autoscaling;
    PD_RETURN_IF_ERROR(actuate(router::WorkerRole::kPrefill, a.minPrefill, a.maxPrefill, p.desired, t));
    return actuate(router::WorkerRole::kDecode, a.minDecode, a.maxDecode, d.desired, t);
  }

  Status actuate(router::WorkerRole role, int minReplicas, int maxReplicas, int desired, double t) {
    tools::PoolActuation pool{minReplicas, maxReplicas, desired};
    Worker* newest = nullptr;
    for (auto& w : workers_) {
      if (w.role != role || w.exited()) continue;
      if (w.draining) {
        ++pool.draining;
        continue;
      }
      ++pool.live;
      pool.registered += w.readyS <= t;
      newest = &w;
    }
    const tools::ActuationStep step = tools::planPool(pool);
    if (step.drainOne && newest != nullptr) {
      newest->draining = true;
      ++drained_;
      exitIfDrained(*newest, std::max(t, newest->freeAtS));
    }
    for (int i = 0; i < step.start; ++i, ++started_)
      PD_RETURN_IF_ERROR(startWorker(role, t, t + o_.autoscaling->startupS));
    return Status::ok();
  }

  SteadyTime at(double t) const {
    return origin_ + std::chrono::duration_cast<Duration>(std::chrono::duration<double>(t));
  }

  double nowOf(const Worker& w) const { return secondsBetween(origin_, w.clock->now()); }
  void advanceTo(Worker& w, double t) {
    const double now = nowOf(w);
    if (t > now) w.clock->advance(std::chrono::duration_cast<Duration>(std::chrono::duration<double>(t - now)));
  }
  // A worker that had nothing to do starts its next step when work reaches it.
  void wake(Worker& w, double t) {
    if (w.freeAtS < t) w.freeAtS = t;
    w.stalled = false;
  }

  // The workers that take work at `t`, as the router sees them in their load reports.
  std::vector<router::WorkerView> views(double t) const {
    std::vector<router::WorkerView> out;
    for (const auto& w : workers_) {
      if (!w.takesWork(t)) continue;
      const engine::EngineLoad l = w.engine->load();
      router::WorkerView v;
      v.id = w.id;
      v.role = w.role;
      v.healthy = true;
      v.queuedPrefillTokens = l.queuedPrefillTokens;
      v.running = l.running;
      v.waiting = l.waiting + l.remote;
      v.freeBlocks = l.freeBlocks;
      v.totalBlocks = l.totalBlocks;
      v.prefillTokensPerS = l.prefillTokensPerS;
      v.decodeStepMs = l.decodeStepMs;
      v.routedPrefillTokens = w.routedPrefillTokens;
      v.routedStreams = w.routedStreams;
      if (l.decodeStepCost) {
        v.decodeStepBaseMs = l.decodeStepCost->baseMs;
        v.decodeStepPerStreamMs = l.decodeStepCost->perStreamMs;
        v.decodeSmallChunkMs = l.decodeStepCost->smallChunkMs;
      }
      out.push_back(std::move(v));
    }
    return out;
  }

  size_t workerIndex(const std::string& id) const {
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].id == id) return i;
    return 0;
  }

  Result<engine::Request> makeRequest(size_t index, Worker& w, int maxTokens) {
    engine::SamplingParams p;
    p.temperature = 0;
    p.maxTokens = maxTokens;
    p.ignoreEos = true;
    p.seed = 0;
    return engine::Request::create(index + 1, requests_[index].prompt, p, *w.clock, cost_.model().config.vocabSize);
  }

  static const router::WorkerView& viewOf(const std::vector<router::WorkerView>& views, const std::string& id) {
    return *std::find_if(views.begin(), views.end(), [&](const router::WorkerView& v) { return v.id == id; });
  }

  // The router's route(): the policy's plan, admission, then the dispatch to the workers.
  Status arrive(size_t index) {
    const SimRequest& r = requests_[index];
    const double t = r.arrivalS;
    auto views = this->views(t);
    const int64_t promptTokens = int64_t(r.prompt.size());
    if (o_.scheduler.enablePrefixCaching) {
      // Prefix-aware routing on the exact index, as the router keeps it from the workers' KV
      // events (router.routing.exact_prefix_routing, on by default): what each worker's prefix cache
      // holds now, never the prompt's last token (it is computed for its logits).
      for (auto& v : views) {
        auto& kv = workers_[workerIndex(v.id)].engine->kv();
        v.cachedTokens = v.exactCachedTokens = kv.findCachedPrefix(r.prompt, int(promptTokens) - 1).numTokens;
      }
    }
    auto plan = policy_.select(promptTokens, views);
    if (!plan) return internalError("plan: no decode worker to route to");
    Tracking& tr = tracking_[index];
    if (o_.overloadShedding) {
      const router::WorkerView& decoding = viewOf(views, plan->decodeWorker);
      const router::WorkerView& prefilling =
          plan->route == router::Route::kDisaggregated ? viewOf(views, plan->prefillWorker) : decoding;
      const router::AdmissionDecision d = admission_.decide(*plan, prefilling, decoding, promptTokens, policy_);
      if (d.refusedBy != router::AdmissionDecision::Side::kDecode)
        outcomes_[index].admissionTtftS = d.verdict.predictedS;
      if (!d.admitted()) {
        if (autoscaler_)
          autoscaler_->observeShed(at(t), plan->route, d.refusedBy == router::AdmissionDecision::Side::kPrefill,
                                   d.verdict.predictedS);
        outcomes_[index].shed = true;
        return Status::ok();
      }
      tr.predictedTtftS = d.predictedTtftS;
    }
    tr.route = plan->route;
    if (autoscaler_) {
      autoscaler_->observeDecodeArrival(at(t));
      // An overflowed prompt is still the prefill pool's demand (router_loop.cpp dispatch).
      if (plan->route == router::Route::kDisaggregated || plan->reason == "prefill_overflow")
        autoscaler_->observePrefillArrival(at(t), promptTokens - plan->cachedTokens);
    }
    tr.decodeWorker = workerIndex(plan->decodeWorker);
    tr.prefilling = plan->route == router::Route::kDisaggregated ? workerIndex(plan->prefillWorker) : tr.decodeWorker;
    tr.prefillTokens = std::max<int64_t>(0, promptTokens - plan->cachedTokens);
    workers_[tr.prefilling].routedPrefillTokens += tr.prefillTokens;
    ++workers_[tr.decodeWorker].routedStreams;
    Worker& decode = workers_[tr.decodeWorker];
    advanceTo(decode, r.arrivalS);
    if (plan->route == router::Route::kDisaggregated) {
      auto remote = makeRequest(index, decode, r.outputTokens);
      if (!remote.ok()) return remote.status();
      if (decode.engine->submitRemote(std::move(*remote)).ok()) {
        outcomes_[index].disaggregated = true;
        Worker& prefill = workers_[tr.prefilling];
        advanceTo(prefill, r.arrivalS);
        auto job = makeRequest(index, prefill, 1);
        if (!job.ok()) return job.status();
        PD_RETURN_IF_ERROR(prefill.engine->submit(std::move(*job)));
        wake(prefill, r.arrivalS);
        return Status::ok();
      }
      ++reserveFallbacks_;  // no blocks free for the whole prompt: prefilled here instead
    }
    auto local = makeRequest(index, decode, r.outputTokens);
    if (!local.ok()) return local.status();
    PD_RETURN_IF_ERROR(decode.engine->submit(std::move(*local)));
    wake(decode, r.arrivalS);
    return Status::ok();
  }

  Status onEvent(size_t worker, const engine::EngineEvent& e) {
    const size_t index = size_t(e.requestId - 1);
    Worker& w = workers_[worker];
    const double now = nowOf(w);
    if (w.role == router::WorkerRole::kPrefill) {
      if (e.kind == engine::EngineEvent::Kind::kToken) tracking_[index].first = e.token;
      if (e.kind == engine::EngineEvent::Kind::kFinished) {
        const double prefillS = e.timings.prefillSeconds.value_or(0);
        const double link = o_.kvLinkBytesPerS > 0 ? o_.kvLinkBytesPerS : cost_.device().nicBytesPerS;
        kv_.push({now + cost_.kvTransferSeconds(int64_t(requests_[index].prompt.size()), link, prefillS), index});
      }
      return Status::ok();
    }
    RequestOutcome& out = outcomes_[index];
    Tracking& tr = tracking_[index];
    if (e.kind == engine::EngineEvent::Kind::kToken) {
      if (out.ttftS < 0) {
        out.ttftS = now - requests_[index].arrivalS;
        workers_[tr.prefilling].routedPrefillTokens -= std::exchange(tr.prefillTokens, 0);
        if (tr.predictedTtftS > 0) admission_.observeFirstToken(tr.route, out.ttftS, tr.predictedTtftS);
        if (autoscaler_) autoscaler_->observeTtft(at(now), out.ttftS, tr.route);
      } else {
        const double gap = now - tr.lastTokenS;
        out.itlsS.push_back(gap);
        if (o_.overloadShedding) {
          admission_.observeGap(gap);
          policy_.setItlPredictionScale(admission_.itlScale());
        }
        if (autoscaler_) autoscaler_->observeItl(at(now), gap);
      }
      tr.lastTokenS = now;
    } else {
      out.finished = e.kind == engine::EngineEvent::Kind::kFinished;
      out.endS = now;
      workers_[tr.prefilling].routedPrefillTokens -= std::exchange(tr.prefillTokens, 0);
      --w.routedStreams;
    }
    return Status::ok();
  }

  // The prompt's KV is in the decode worker: its loop hands the first token over between
  // steps, and the prefill worker frees the blocks it pushed from.
  Status landKv(const KvArrival& a) {
    Tracking& tr = tracking_[a.request];
    Worker& decode = workers_[tr.decodeWorker];
    const double handoverS = std::max(a.atS, decode.freeAtS);
    advanceTo(decode, handoverS);
    std::vector<engine::EngineEvent> events;
    PD_RETURN_IF_ERROR(decode.engine->completeRemote(a.request + 1, tr.first, &events));
    for (const auto& e : events) PD_RETURN_IF_ERROR(onEvent(tr.decodeWorker, e));
    wake(decode, handoverS);
    Worker& prefill = workers_[tr.prefilling];
    prefill.engine->release(a.request + 1);
    wake(prefill, a.atS);  // freed blocks may admit what waits there
    return Status::ok();
  }

  void summarize(SimSummary* s) const {
    s->requests = int64_t(requests_.size());
    s->steps = steps_;
    s->kvBlocksPerWorker = blocks_;
    s->reserveFallbacks = reserveFallbacks_;
    std::vector<double> ttfts, itls;
    double end = 0;
    for (const auto& o : outcomes_) {
      s->disaggregated += o.disaggregated ? 1 : 0;
      s->shed += o.shed ? 1 : 0;
      if (!o.finished) continue;
      ++s->finished;
      end = std::max(end, o.endS);
      ttfts.push_back(o.ttftS);
      itls.insert(itls.end(), o.itlsS.begin(), o.itlsS.end());
      const bool ttftOk = o.ttftS <= o_.slo.ttftS;
      const bool itlOk = o.itlsS.empty() || percentileOf(o.itlsS, o_.slo.percentile) <= o_.slo.itlS;
      s->good += ttftOk && itlOk ? 1 : 0;
    }
    const double start = requests_.empty() ? 0 : requests_.front().arrivalS;
    s->durationS = std::max(0.0, end - start);
    s->goodput = s->durationS > 0 ? double(s->good) / s->durationS : 0;
    s->attainment = s->requests > 0 ? double(s->good) / double(s->requests) : 0;
    s->ttftP50 = percentileOf(ttfts, 50), s->ttftP90 = percentileOf(ttfts, 90), s->ttftP99 = percentileOf(ttfts, 99);
    s->itlP50 = percentileOf(itls, 50), s->itlP90 = percentileOf(itls, 90), s->itlP99 = percentileOf(itls, 99);
    const int tp = o_.layout.tensorParallel;
    for (const auto& w : workers_)
      s->deviceSeconds += tp * std::max(0.0, std::min(w.exitS, start + s->durationS) - std::max(w.startS, start));
    s->meanDevices = s->durationS > 0 ? s->deviceSeconds / s->durationS : 0;
    s->peakDevices = peakHolding_ * tp;
    s->workersStarted = started_;
    s->workersDrained = drained_;
  }

  const CostModel& cost_;
  const SimOptions& o_;
  const std::vector<SimRequest>& requests_;
  std::vector<RequestOutcome> outcomes_;
  std::vector<Tracking> tracking_;
  router::RoutingPolicy policy_;
  router::AdmissionControl admission_;
  std::optional<router::Autoscaler> autoscaler_;  // with SimOptions::autoscaling
  std::vector<Worker> workers_;                   // every worker started, exited ones too (requests index them)
  std::priority_queue<KvArrival, std::vector<KvArrival>, std::greater<>> kv_;
  SteadyTime origin_{};
  int64_t blocks_ = 0;
  int64_t steps_ = 0;
  int64_t reserveFallbacks_ = 0;
  int32_t token_ = 1;                           // what every step samples: an ordinary token, not EOS
  int prefillStarted_ = 0, decodeStarted_ = 0;  // for the workers' ids
  int holding_ = 0, peakHolding_ = 0;           // workers started and not exited: now, at most
  int started_ = 0, drained_ = 0;               // by the autoscaler
};

}  // namespace

std::string Layout::describe() const {
  std::string s = prefillWorkers == 0 ? "colocated x" + std::to_string(decodeWorkers)
                                      : std::to_string(prefillWorkers) + "P + " + std::to_string(decodeWorkers) +
                                            "D (threshold " + std::to_string(shortPromptTokens) + ")";
  if (tensorParallel > 1) s += ", TP" + std::to_string(tensorParallel);
  return s;
}

double percentileOf(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  const double rank = p / 100 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(rank));
  std::nth_element(v.begin(), v.begin() + lo, v.end());  // O(n): called once per request
  const double low = v[lo];
  const double high = lo + 1 < v.size() ? *std::min_element(v.begin() + lo + 1, v.end()) : low;
  return low + (high - low) * (rank - double(lo));
}

Result<SimResult> simulate(const CostModel& cost, const SimOptions& options, const std::vector<SimRequest>& requests) {
  for (size_t i = 1; i < requests.size(); ++i) {
    if (requests[i].arrivalS < requests[i - 1].arrivalS)
      return invalidArgument("plan: requests must be in arrival order");
  }
  Simulation sim(cost, options, requests);
  SimResult r;
  PD_RETURN_IF_ERROR(sim.run(&r.summary));
  r.outcomes = sim.takeOutcomes();
  return r;
}

}  // namespace pd::plan
