// router::Autoscaler (DESIGN.md §3, §6): per pool, its SLO and a sliding window of observed
// latencies -> the replicas the pool should have. The router exports the result as
// pdserve_desired_replicas{pool}; KEDA or an HPA (deploy/k8s) reads it and does the scaling,
// with its own stabilisation windows, so this is a recommendation, recomputed every tick.
//
// Signals (docs/serving.md "Autoscaling"):
//   prefill pool: time to first token of the requests routed to it (disaggregated);
//   decode pool:  inter-token latency of every request (all are decoded there).
// Rule, per pool, with p = the SLO percentile of the window and ratio = p / target:
//   - fewer than minSamples observations in the window: hold the current size;
//   - ratio > 1 + tolerance: grow in proportion, ceil(current * ratio), at least +1 and at
//     most double (a latency far over target says "more", not exactly how many);
//   - ratio < scaleDownBelow: shrink by one (one step per tick; the orchestrator's
//     stabilisation window keeps it from flapping);
//   - otherwise: hold.
//   The result is clamped to the pool's [min_replicas, max_replicas].
//
// The window is a ring of fixed-bucket histograms (slices), so observing costs O(1) and a
// percentile is read to within one bucket (5% wide, the upper edge is reported).
//
// Pure: no I/O, no locks; time is passed in. Threads: the caller serialises access (the
// router calls it on its loop strand, router/router_loop.h).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/base/clock.h"

namespace pd::router {

struct AutoscalerOptions {
  std::chrono::seconds window{60};   // observations older than this are forgotten
  int slices = 12;                   // window granularity: window / slices
  int minSamples = 20;               // fewer: hold
  double tolerance = 0.1;            // ratio within (1, 1 + tolerance]: hold
  double scaleDownBelow = 0.5;       // ratio below this: one replica fewer
};

struct PoolSlo {
  double targetSeconds = 1.0;  // TTFT (prefill) or ITL (decode)
  double percentile = 99;      // (0, 100]
  int minReplicas = 1;
  int maxReplicas = 1;
};

struct ScalingDecision {
  int desired = 0;
  int current = 0;
  int64_t samples = 0;           // observations in the window
  double observedSeconds = 0;    // the SLO percentile over the window (0 without samples)
  double attainment = 1;         // fraction of observations within target (1 without samples)
  double ratio = 0;              // observedSeconds / target
  bool enoughSamples = false;    // samples >= minSamples: the percentile means something
  std::string reason;            // "hold: 3 samples < 20", "scale up: p99 0.84 s > 0.5 s", ...
};

// Latencies over a sliding window, as a ring of log-bucketed histograms.
class LatencyWindow {
 public:
  LatencyWindow(std::chrono::seconds window, int slices);

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

  void observeTtft(SteadyTime at, double seconds) { ttft_.add(at, seconds); }
  void observeItl(SteadyTime at, double seconds) { itl_.add(at, seconds); }

  // currentReplicas: the pool's healthy workers now.
  ScalingDecision decidePrefill(int currentReplicas, SteadyTime now);
  ScalingDecision decideDecode(int currentReplicas, SteadyTime now);

 private:
  ScalingDecision decide(LatencyWindow& w, const PoolSlo& slo, int current, SteadyTime now) const;

  PoolSlo prefill_, decode_;
  AutoscalerOptions opt_;
  LatencyWindow ttft_, itl_;
};

}  // namespace pd::router
