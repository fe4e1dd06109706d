// router::Autoscaler (docs/design.md §3, §6; docs/serving.md "Autoscaling"): per pool, its SLO,
// what its workers report now and a sliding window of observed latencies -> the replicas the
// pool should have. The router exports the result as pdserve_desired_replicas{pool}; KEDA or
// an HPA (deploy/k8s) or `pdserve up`'s local actuator (tools/local_actuator.h) acts on it.
//
// Three inputs per pool, each exported as a metric:
//   1. the capacity model (online, from the load reports): what one worker can do within the
//      SLO against the work there is now, so a building queue scales out before the
//      percentiles breach:
//        prefill: a worker computes its measured prefill tokens/s (r); the work the pool
//          must finish within the TTFT target T is the queued prefill tokens (Q) plus what
//          arrives meanwhile (the arrival rate A over rateWindow x T):
//            need = ceil((Q + A*T) / (r * T * u));
//        decode: a worker's fitted step line (base + perStream x streams) allows
//          k = floor((ITL target * u - base) / perStream) streams within the ITL target
//          (at least 1), and it runs at most max_running_requests x u / u_up of them (the
//          rest wait, invisible to the ITL percentile); the pool holds S streams (running +
//          waiting):  need = ceil(S / k). Without a fitted line yet, the bound alone.
//        u is scaleUpUtilization for growing and scaleDownUtilization (< u_up) for
//        shrinking: the gap between them is the hysteresis band that keeps a steady load
//        near a boundary from flapping. Unknown (no measured rate / no fitted line yet): no
//        opinion.
//   2. the observed-percentile rule (the window of TTFTs or ITLs), p = the SLO percentile,
//      ratio = p / target: fewer than minSamples -> no opinion; ratio > 1 + tolerance ->
//      ceil(current * ratio) (at least +1, at most double); ratio < scaleDownBelow -> one
//      fewer; otherwise "hold", which also vetoes the capacity model's scale-down (the
//      latencies say the pool is busy at the size it has).
//      The decode pool also prefills the colocated prompts: the same rule over their TTFTs
//      (against the prefill SLO) may ask it for more replicas, or veto its scale-down, where
//      the ITL rule would not (a colocated-only cluster has no other TTFT signal). Requests
//      admission shed count in these windows at their predicted latency (observeShed).
//   3. idleness: no queued or running work and no arrival for idleAfter -> the minimum.
// Combination, from the previous recommendation D (the current size on the first call):
//   - idle for idleAfter -> min_replicas at once (stale latencies in the window do not count);
//   - up = max(capacity need at u_up, percentile rule's); up > D -> min(up, D + maxStepUp),
//     at once, unless the last scale-up is younger than scaleUpCooldown. The percentile
//     rule's call for more waits one window after a change of size (its window then mixes
//     both sizes; the capacity model reacts meanwhile);
//   - else a lower target (capacity need at u_down, or the percentile rule's one fewer
//     when the capacity model has no opinion), not vetoed, that has held continuously for
//     scaleDownCooldown and no change within scaleDownCooldown -> max(target, D - maxStepDown);
//   - otherwise D. The result is clamped to the pool's [min_replicas, max_replicas].
// With sharedBudget (role moves) the upper bound is the budget's instead, and decide()
// trims a pool that borrows past its own maximum to what the other pool leaves.
//
// The window is a ring of fixed-bucket histograms (slices), so observing costs O(1) and a
// percentile is read to within one bucket (5% wide, the upper edge is reported).
//
// Pure: no I/O, no locks; time is passed in, so tests replay recorded windows. Threads: the
// caller serialises access (the router calls it on its loop strand, router/router_loop.h).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "common/base/clock.h"
#include "common/config/cluster_config.h"
#include "router/routing_policy.h"

namespace pd::router {

struct AutoscalerOptions {
  // The observed-percentile rule.
  std::chrono::milliseconds window{60000};  // observations older than this are forgotten
  int slices = 12;                          // window granularity: window / slices
  int minSamples = 20;                      // fewer: no opinion
  double tolerance = 0.1;                   // ratio within (1, 1 + tolerance]: hold
  double scaleDownBelow = 0.5;              // ratio below this: one replica fewer
  // The capacity model.
  double scaleUpUtilization = 0.8;              // grow when the work needs more than this of the pool
  double scaleDownUtilization = 0.6;            // shrink only to a size the work fills below this
  std::chrono::milliseconds rateWindow{10000};  // prefill arrivals are averaged over this
  // Pacing.
  std::chrono::milliseconds scaleUpCooldown{10000};    // between two scale-ups
  std::chrono::milliseconds scaleDownCooldown{60000};  // a lower target must hold this long
  std::chrono::milliseconds idleAfter{60000};          // no work this long: the minimum
  int maxStepUp = 2;                                   // replicas added per decision at most
  int maxStepDown = 1;  // replicas removed per decision at most (idle goes to min at once)
  // Role moves (router.autoscaler.role_moves): the two pools' max_replicas are one budget of
  // prefill.max + decode.max workers. A pool may grow past its own maximum into the slots the
  // other pool does not want (up to the budget less the other pool's minimum); a supervisor
  // that can switch a worker's role (pdserve up's local actuator) then moves one worker from
  // the shrinking pool instead of draining one and starting another. Off: each pool within
  // its own bounds, as an HPA per pool expects.
  bool sharedBudget = false;
};

struct PoolSlo {
  double targetSeconds = 1.0;  // TTFT (prefill) or ITL (decode)
  double percentile = 99;      // (0, 100]
  int minReplicas = 1;
  int maxReplicas = 1;
};

// What a pool's healthy workers report now, summed (router/worker_registry.h WorkerView; the
// router loop fills it from its snapshot). Only the fields of the pool's kind are read.
struct PoolLoad {
  // Prefill: prompt tokens waiting to be prefilled on the pool (each worker: the larger of
  // its report and this router's routed count, as admission reads them), and the mean of the
  // workers' measured prefill rates (0: none measured yet).
  int64_t queuedPrefillTokens = 0;
  double prefillTokensPerS = 0;
  // Decode: streams running or waiting on the pool (each worker: WorkerView::streams()), and
  // the mean fitted step line of the workers that have one (perStreamMs < 0: none yet).
  int streams = 0;
  double stepBaseMs = 0;
  double stepPerStreamMs = -1;
  // Decode: the most streams a worker runs at once (engine.max_running_requests; 0: no
  // bound). The rest wait without a token, so no ITL shows them: the capacity model counts
  // them against this bound.
  int maxStreamsPerWorker = 0;
};

struct ScalingDecision {
  int desired = 0;
  int current = 0;
  // The percentile rule.
  int64_t samples = 0;         // observations in the window
  double observedSeconds = 0;  // the SLO percentile over the window (0 without samples)
  double attainment = 1;       // fraction of observations within target (1 without samples)
  double ratio = 0;            // observedSeconds / target
  bool enoughSamples = false;  // samples >= minSamples: the percentile means something
  int latencyReplicas = -1;    // its recommendation (-1: no opinion); decode: the larger of
                               // the ITL rule's and the colocated TTFT rule's
  std::string latencyWhy;      // which percentile, against which target (for the reason)
  // The capacity model (-1 / 0 where it has no opinion yet; demand is always filled in).
  int capacityReplicas = -1;    // the need at scaleUpUtilization
  double demand = 0;            // prefill: tokens/s to serve (Q / T + A); decode: streams
  double workerCapacity = 0;    // prefill: measured tokens/s per worker; decode: streams per
                                // worker within the ITL target at scaleUpUtilization
  double predictedSeconds = 0;  // prefill: Q / (current x r), the queue's TTFT share;
                                // decode: the step time at streams / current per worker
  double idleSeconds = 0;       // how long the pool has had no work
  std::string reason;           // "capacity: 9 streams / 4 per worker", "idle 61 s", ...
};

// Latencies over a sliding window, as a ring of log-bucketed histograms.
class LatencyWindow {
 public:
  LatencyWindow(std::chrono::milliseconds window, int slices);

  void add(SteadyTime at, double seconds);
  // Drops slices that ended more than `window` before `now`.
  void advance(SteadyTime now);
  int64_t count() const;
  // The upper edge of the bucket holding the q-quantile (q in (0, 1]); 0 when empty.
  double quantile(double q) const;
  // Fraction of observations <= seconds (by bucket: those in buckets whose upper edge is
  // <= seconds); 1 when empty.
  double fractionWithin(double seconds) const;

  static constexpr int kBuckets = 340;  // 100 us * 1.05^k up to ~1.5e3 s

 private:
  static int bucketOf(double seconds);
  static double upperEdge(int bucket);
  std::vector<int64_t> summed() const;

  std::chrono::nanoseconds sliceLength_;
  std::vector<std::array<int64_t, kBuckets>> slices_;
  std::vector<int64_t> sliceIndex_;  // which absolute slice each ring entry holds
};

class Autoscaler {
 public:
  Autoscaler(PoolSlo prefill, PoolSlo decode, AutoscalerOptions options = {});

  // A first token's TTFT. A disaggregated one is the prefill pool's signal; a colocated one
  // the decode pool's, which prefilled it (its TTFT rule, below).
  void observeTtft(SteadyTime at, double seconds, Route route = Route::kDisaggregated) {
    (route == Route::kDisaggregated ? ttft_ : colocatedTtft_).add(at, seconds);
  }
  void observeItl(SteadyTime at, double seconds) { itl_.add(at, seconds); }
  // A request admission control refused (router/admission.h): a miss of the pool that would
  // have served it, observed at its predicted latency (past the target) in that pool's window
  // -- the prefill side's on `route` as a TTFT, the decode side's as a gap. Without it,
  // shedding would hide an overloaded pool: the requests it admits meet their targets.
  void observeShed(SteadyTime at, Route route, bool prefillSide, double predictedSeconds);
  // Prompt tokens routed to the prefill pool (disaggregated requests): its arrival rate.
  void observePrefillArrival(SteadyTime at, int64_t tokens);
  // A request routed to the decode pool (every request): it ends the pool's idleness.
  void observeDecodeArrival(SteadyTime at);

  // currentReplicas: the pool's healthy workers now; load: what they report. Stateful: each
  // call moves the pool's recommendation (call it once per tick, times non-decreasing).
  ScalingDecision decidePrefill(int currentReplicas, const PoolLoad& load, SteadyTime now);
  ScalingDecision decideDecode(int currentReplicas, const PoolLoad& load, SteadyTime now);
  // Both pools at once, the tick's call: with sharedBudget, a pool that wants to grow past its
  // own maximum gets the budget's slots the other pool's recommendation leaves (never one the
  // other pool wants to keep); without, exactly decidePrefill then decideDecode.
  std::pair<ScalingDecision, ScalingDecision> decide(int prefillReplicas, const PoolLoad& prefillLoad,
                                                     int decodeReplicas, const PoolLoad& decodeLoad, SteadyTime now);

 private:
  struct PoolState {
    int desired = -1;         // the last recommendation (-1: none yet)
    SteadyTime lastBusy{};    // the last time the pool had work
    SteadyTime lastChange{};  // the last change of recommendation
    SteadyTime lastUp{};      // the last scale-up
    SteadyTime lowerSince{};  // since when a lower target has held (valid when lowering)
    bool lowering = false;
    bool started = false;
    bool changed = false;  // lastChange is set
    bool grown = false;    // lastUp is set
  };
  // The percentile rule alone, into d (its fields and latencyReplicas).
  void percentileRule(LatencyWindow& w, const PoolSlo& slo, SteadyTime now, ScalingDecision& d) const;
  // Combines the inputs already in d (capacityReplicas, downTarget) with the pool's state.
  void combine(PoolState& st, const PoolSlo& slo, int hi, bool busy, int downTarget, SteadyTime now,
               ScalingDecision& d) const;
  // The most replicas `own` may be recommended: its maximum, or with sharedBudget the budget
  // less the other pool's minimum.
  int upperBound(const PoolSlo& own, const PoolSlo& other) const;
  // sharedBudget: trims the pool that borrows past its own maximum to what the other leaves.
  // The states before this tick's decisions restore the pacing of a trimmed one.
  void shareBudget(ScalingDecision& prefill, const PoolState& prefillBefore, ScalingDecision& decode,
                   const PoolState& decodeBefore, SteadyTime now);
  double prefillArrivalRate(SteadyTime now);

  PoolSlo prefill_, decode_;
  AutoscalerOptions opt_;
  LatencyWindow ttft_, itl_;
  LatencyWindow colocatedTtft_;                                 // the decode pool's prompts' TTFTs
  std::deque<std::pair<SteadyTime, int64_t>> prefillArrivals_;  // within rateWindow
  SteadyTime lastDecodeArrival_{};
  bool anyDecodeArrival_ = false;
  PoolState prefillState_, decodeState_;
};

// router.autoscaler's keys as AutoscalerOptions (the router and `pdserve plan` read the same).
AutoscalerOptions autoscalerOptions(const config::RouterConfig::Autoscaler& keys);

// Each pool's PoolLoad from the healthy workers' views, as admission reads them
// (maxStreamsPerWorker is left 0: the caller knows engine.max_running_requests).
std::pair<PoolLoad, PoolLoad> poolLoads(const std::vector<WorkerView>& views);  // {prefill, decode}

}  // namespace pd::router
