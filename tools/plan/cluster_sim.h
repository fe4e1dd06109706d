// plan::simulate: a discrete-event simulation of one pdserve layout serving a trace, built
// from the production policy code, not copies of it:
//   - every worker is a real engine::Engine (its Scheduler, KvCacheManager with the prefix
//     cache, SLO-sized prefill chunks, step-cost model) over a SimBackend that computes
//     nothing and advances the worker's ManualClock by CostModel::stepSeconds;
//   - each arrival is routed by router::RoutingPolicy over WorkerViews filled from the
//     engines' load, as the router fills them from load reports, with each worker's cached
//     prefix of the prompt from its prefix cache, as the router's exact index has it;
//   - a disaggregated request is prefilled on a prefill worker's engine (one token), its KV
//     moves to the decode worker in CostModel::kvTransferSeconds, and the decode engine takes
//     it with submitRemote / completeRemote, as the decode worker does;
//   - with router.admission.overload_shedding, router::AdmissionControl admits or sheds each request
//     and learns its scales from the simulated first tokens and gaps, as the router does;
//   - with SimOptions::autoscaling, router::Autoscaler recommends each pool's size every
//     tick from the same views and latencies, and pdserve up's local actuator policy
//     (tools/local_actuator.h planPool) starts workers (serving after startupS) or drains
//     the newest one (it takes no new work and leaves when its requests are done).
// Not simulated (docs/plan.md): request migration, failures, load-report lag, the router's
// own latency, the adaptive threshold and role moves.
//
// Deterministic: the same inputs give the same result (no wall clock, no unseeded random:
// a step spread draws from seeded generators).
// Not thread-safe; each call is independent.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/config/cluster_config.h"
#include "engine/scheduler.h"
#include "tools/plan/cost_model.h"
#include "tools/plan/step_spread.h"

namespace pd::plan {

struct Layout {
  int prefillWorkers = 0;  // 0: colocated only
  int decodeWorkers = 1;
  int tensorParallel = 1;           // devices per worker
  int64_t shortPromptTokens = 256;  // router.routing.short_prompt_tokens

  int devices() const { return (prefillWorkers + decodeWorkers) * tensorParallel; }
  std::string describe() const;  // "colocated x4", "2P + 2D (threshold 512)", with "TP2"
};

struct Slo {
  double ttftS = 2.0;
  double itlS = 0.1;
  double percentile = 99;
};

// Pools that follow the router's recommendation, as pdserve up's local actuator makes them:
// the layout gives each pool's starting size, these its bounds.
struct Autoscaling {
  config::RouterConfig::Autoscaler keys;  // router.autoscaler: tick, window, cooldowns (its defaults)
  int minPrefill = 0, maxPrefill = 0;     // the prefill pool stays empty when the layout has none
  int minDecode = 1, maxDecode = 1;
  double startupS = 60;  // a started worker serves this long after the decision (start, weights, warm-up)
};

struct SimOptions {
  Layout layout;
  Slo slo;
  engine::SchedulerConfig scheduler;  // max_batch_tokens, max_running_requests, prefix caching
  bool sloSizedPrefillChunks = true;  // engine.slo_sized_prefill_chunks
  int minPrefillChunkTokens = 32;
  int blockSize = 16;
  double memoryUtilization = 0.9;
  double kvCacheBytes = 0;     // > 0: engine.kv_cache_bytes per worker instead
  double kvLinkBytesPerS = 0;  // 0: the device's NIC
  // router.admission.overload_shedding: router::AdmissionControl refuses a request it predicts would
  // miss (429); a refused request counts as a miss.
  bool overloadShedding = true;
  std::optional<Autoscaling> autoscaling;  // nullopt: the layout's pools keep their size
  double horizonS = 0;                     // stop here (0: the last arrival + 600 s); unfinished requests miss
  // Measured steps' spread (--step-trace): each step's modelled time times a ratio drawn
  // for its kind, from a generator per worker seeded by `seed` and the worker's index.
  // Null: every step takes the modelled time.
  std::shared_ptr<const StepSpread> stepSpread;
  uint64_t seed = 0;
};

struct SimRequest {
  double arrivalS = 0;
  std::vector<int32_t> prompt;
  int outputTokens = 1;
};

struct RequestOutcome {
  bool finished = false;
  bool shed = false;           // refused by admission control
  double admissionTtftS = -1;  // the TTFT admission predicted (scaled) and compared (-1: none)
  bool disaggregated = false;
  double ttftS = -1;
  std::vector<double> itlsS;
  double endS = 0;
};

struct SimSummary {
  int64_t requests = 0, finished = 0, good = 0, disaggregated = 0, reserveFallbacks = 0, shed = 0;
  double durationS = 0;                          // first arrival -> last token
  double goodput = 0;                            // requests meeting both SLOs per second
  double attainment = 0;                         // good / requests
  double ttftP50 = 0, ttftP90 = 0, ttftP99 = 0;  // over finished requests, seconds
  double itlP50 = 0, itlP90 = 0, itlP99 = 0;     // every gap of every finished request
  int64_t steps = 0;
  int64_t kvBlocksPerWorker = 0;
  // Devices held from the first arrival to the last token (a worker from its start to its exit),
  // their mean over that time and the most at once; workers started and drained (autoscaling).
  double deviceSeconds = 0, meanDevices = 0;
  int peakDevices = 0, workersStarted = 0, workersDrained = 0;
};

struct SimResult {
  std::vector<RequestOutcome> outcomes;  // in input order
  SimSummary summary;
};

// Errors: the model does not fit a worker's devices (names the bytes), or an empty layout.
Result<SimResult> simulate(const CostModel& cost, const SimOptions& options, const std::vector<SimRequest>& requests);

// numpy's linear-interpolation percentile of `values` (0 when empty).
double percentileOf(std::vector<double> values, double p);

}  // namespace pd::plan
