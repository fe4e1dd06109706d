#include "tools/plan/cluster_sim.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <queue>

#include "common/base/clock.h"
#include "common/engine/engine.h"
#include "router/routing_policy.h"

namespace pd::plan {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// A Backend that computes nothing: each step advances the worker's clock by the cost
// model's time for that batch and samples a fixed ordinary token (requests ignore EOS).
class SimBackend final : public engine::Backend {
 public:
  SimBackend(const CostModel& cost, ManualClock& clock, engine::KvLayout layout, int32_t token,
             const StepSpread* spread, bool prefillWorker, uint64_t seed)
      : cost_(cost), clock_(clock), layout_(layout), token_(token), spread_(spread), prefillWorker_(prefillWorker),
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
  double freeAtS = 0;  // the end of its last step
  bool stalled = false;  // its last step found nothing to run: wait for new work
};

struct KvArrival {
  double atS;
  size_t request;
  bool operator>(const KvArrival& o) const { return atS != o.atS ? atS > o.atS : request > o.request; }
};

// Per request: where it went and what its stream has seen.
struct Tracking {
  size_t prefillWorker = 0, decodeWorker = 0;
  engine::SampledToken first;  // the prefill worker's token (disaggregated)
  double lastTokenS = -1;
};

class Simulation {
 public:
  Simulation(const CostModel& cost, const SimOptions& o, const std::vector<SimRequest>& requests)
      : cost_(cost), o_(o), requests_(requests), outcomes_(requests.size()), tracking_(requests.size()),
        policy_(routingConfig(o)) {}

  Status run(SimSummary* summary) {
    PD_RETURN_IF_ERROR(makeWorkers());
    const double horizon = o_.horizonS > 0 ? o_.horizonS
                                           : (requests_.empty() ? 0 : requests_.back().arrivalS) + 600;
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
      const double t = std::min({tArrival, tKv, tStep});
      if (t == kNever || t > horizon) break;
      // Ties: KV landings, then arrivals, then steps (a step at t sees what arrived at t).
      if (tKv == t) {
        const KvArrival a = kv_.top();
        kv_.pop();
        PD_RETURN_IF_ERROR(landKv(a));
      } else if (tArrival == t) {
        PD_RETURN_IF_ERROR(arrive(nextArrival++));
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
    r.itlTargetMs = o.slo.itlS * 1000;  // router.overload_shedding's default: on
    return r;
  }

  Status makeWorkers() {
    const Layout& l = o_.layout;
    if (l.decodeWorkers < 1) return invalidArgument("plan: a layout needs at least one decode worker");
    blocks_ = cost_.kvBlocks(o_.blockSize, o_.memoryUtilization, o_.kvCacheBytes);
    if (blocks_ <= 0) {
      return failedPrecondition("plan: " + cost_.model().name + " does not fit " + std::to_string(l.tensorParallel) +
                                " x " + cost_.device().name + ": " +
                                std::to_string(int64_t(cost_.weightBytesPerDevice() / double(1 << 20))) +
                                " MiB of weights per device, " + std::to_string(o_.memoryUtilization) +
                                " of the memory usable");
    }
    const auto& eos = cost_.model().config.eosTokenIds;
    int32_t token = 1;
    while (std::find(eos.begin(), eos.end(), token) != eos.end()) ++token;
    for (int i = 0; i < l.prefillWorkers + l.decodeWorkers; ++i) {
      Worker w;
      w.role = i < l.prefillWorkers ? router::WorkerRole::kPrefill : router::WorkerRole::kDecode;
      w.id = (i < l.prefillWorkers ? "prefill-" + std::to_string(i) : "decode-" + std::to_string(i - l.prefillWorkers));
      w.clock = std::make_unique<ManualClock>();
      const engine::KvLayout layout =
          engine::kvLayoutFor(cost_.model().config, int(std::min<int64_t>(blocks_, 1 << 30)), o_.blockSize,
                              cost_.model().kvBytes == 4 ? engine::KvDtype::kF32 : engine::KvDtype::kBF16);
      auto kv = engine::KvCacheManager::create(layout, engine::KvCacheManager::Backing::kAccountingOnly);
      if (!kv.ok()) return kv.status();
      engine::EngineOptions eo;
      eo.scheduler = o_.scheduler;
      eo.releaseKvOnFinish = w.role == router::WorkerRole::kDecode;  // a prefill worker frees after the push
      if (o_.sloSizedPrefillChunks) {
        eo.prefillChunks.itlTargetMs = o_.slo.itlS * 1000;
        eo.prefillChunks.percentile = o_.slo.percentile;
      }
      eo.prefillChunks.minTokens = o_.minPrefillChunkTokens;
      auto backend = std::make_unique<SimBackend>(cost_, *w.clock, layout, token, o_.stepSpread.get(),
                                                  w.role == router::WorkerRole::kPrefill,
                                                  o_.seed * 1000003 + uint64_t(i));
      w.engine = std::make_unique<engine::Engine>(std::move(backend), std::move(*kv), eo, *w.clock);
      origin_ = w.clock->now();  // every clock starts at the same point
      workers_.push_back(std::move(w));
    }
    return Status::ok();
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

  std::vector<router::WorkerView> views() const {
    std::vector<router::WorkerView> out;
    for (const auto& w : workers_) {
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

  Status arrive(size_t index) {
    const SimRequest& r = requests_[index];
    const auto views = this->views();
    auto plan = policy_.select(int64_t(r.prompt.size()), views);
    if (!plan) return internalError("plan: no decode worker to route to");
    Tracking& tr = tracking_[index];
    tr.decodeWorker = workerIndex(plan->decodeWorker);
    Worker& decode = workers_[tr.decodeWorker];
    advanceTo(decode, r.arrivalS);
    if (plan->route == router::Route::kDisaggregated) {
      auto remote = makeRequest(index, decode, r.outputTokens);
      if (!remote.ok()) return remote.status();
      if (decode.engine->submitRemote(std::move(*remote)).ok()) {
        outcomes_[index].disaggregated = true;
        tr.prefillWorker = workerIndex(plan->prefillWorker);
        Worker& prefill = workers_[tr.prefillWorker];
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
      } else {
        out.itlsS.push_back(now - tr.lastTokenS);
      }
      tr.lastTokenS = now;
    } else {
      out.finished = e.kind == engine::EngineEvent::Kind::kFinished;
      out.endS = now;
    }
    return Status::ok();
  }

  // The prompt's KV is in the decode worker: its loop hands the first token over between
  // steps, and the prefill worker frees the blocks it pushed from.
  Status landKv(const KvArrival& a) {
    Tracking& tr = tracking_[a.request];
    Worker& decode = workers_[tr.decodeWorker];
    const double at = std::max(a.atS, decode.freeAtS);
    advanceTo(decode, at);
    std::vector<engine::EngineEvent> events;
    PD_RETURN_IF_ERROR(decode.engine->completeRemote(a.request + 1, tr.first, &events));
    for (const auto& e : events) PD_RETURN_IF_ERROR(onEvent(tr.decodeWorker, e));
    wake(decode, at);
    Worker& prefill = workers_[tr.prefillWorker];
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
  }

  const CostModel& cost_;
  const SimOptions& o_;
  const std::vector<SimRequest>& requests_;
  std::vector<RequestOutcome> outcomes_;
  std::vector<Tracking> tracking_;
  router::RoutingPolicy policy_;
  std::vector<Worker> workers_;
  std::priority_queue<KvArrival, std::vector<KvArrival>, std::greater<>> kv_;
  SteadyTime origin_{};
  int64_t blocks_ = 0;
  int64_t steps_ = 0;
  int64_t reserveFallbacks_ = 0;
};

}  // namespace

std::string Layout::describe() const {
  std::string s = prefillWorkers == 0
                      ? "colocated x" + std::to_string(decodeWorkers)
                      : std::to_string(prefillWorkers) + "P + " + std::to_string(decodeWorkers) + "D (threshold " +
                            std::to_string(shortPromptTokens) + ")";
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
    if (requests[i].arrivalS < requests[i - 1].arrivalS) return invalidArgument("plan: requests must be in arrival order");
  }
  Simulation sim(cost, options, requests);
  SimResult r;
  PD_RETURN_IF_ERROR(sim.run(&r.summary));
  r.outcomes = sim.takeOutcomes();
  return r;
}

}  // namespace pd::plan
