// plan::searchLayouts: the sizing question. For a device budget, every layout pdserve can
// run -- colocated, and each prefill/decode split with each short-prompt threshold -- is
// simulated over the same requests (cluster_sim.h), first as the trace has them, then as
// Poisson arrivals with the trace's lengths at a searched rate, to find the highest request
// rate at which the layout still meets both SLOs for `attainment` of the requests
// (DistServe's per-layout goodput). Layouts are ranked by that rate, then by attainment at
// the trace's own arrivals. (Compressing the trace's timestamps instead would turn a short
// trace into one burst and measure its drain, not a sustained rate.)
//
// The rate search: from the trace's mean rate, double (or halve) until the attainment
// changes side, then bisect `bisections` times; rates between 1/64x and 1024x of it.
//
// Tensor parallelism: the smallest degree in {1, 2, 4, 8} at which one worker holds the
// weights and the KV of the longest request; every worker uses it.
//
// Pure apart from the optional progress callback; deterministic.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tools/plan/cluster_sim.h"

namespace pd::plan {

struct PlanOptions {
  int devices = 8;
  SimOptions sim;  // its layout is what the search varies
  std::vector<int64_t> thresholds = {256, 512, 1024, 2048};
  double attainment = 0.9;  // of the requests meeting both SLOs, at the highest rate
  int bisections = 6;
};

// One probe of the rate search: a Poisson rate and what the layout attained at it.
struct RatePoint {
  double rate = 0;  // requests/s
  SimSummary summary;
};

struct Candidate {
  Layout layout;
  SimSummary summary;       // at the trace's own rate
  double maxRateScale = 0;  // that rate over the trace's mean rate (0: none found)
  double maxRate = 0;       // the highest Poisson rate (requests/s) that keeps the attainment
  SimSummary atMaxRate;
  std::vector<RatePoint> curve;  // every rate the search simulated, by rate: the SLO-attainment curve
  std::string verdict;           // "best", or why it loses to the best
};

using Progress = std::function<void(int done, int total, const Layout& layout)>;

// The requests to simulate: rate 0 for the trace's own arrivals, else Poisson arrivals at
// `rate` requests/s over a fixed duration, with the trace's lengths. The same rate must
// give the same requests.
using RequestSource = std::function<Result<std::vector<SimRequest>>(double rate)>;

// Best first. Errors: the model fits no worker of up to 8 devices, or fewer devices than one
// worker needs; the source's errors.
Result<std::vector<Candidate>> searchLayouts(const ModelShape& model, const Device& device, const PlanOptions& options,
                                             const RequestSource& source, const Progress& progress = {});

// The smallest tensor-parallel degree that fits (0: none up to 8).
int fittingTensorParallel(const ModelShape& model, const Device& device, const SimOptions& sim, int64_t longestTokens);

}  // namespace pd::plan
