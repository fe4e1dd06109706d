// Overload shedding (docs/serving.md, "Overload"). A request is refused with 429
// and Retry-After when the router predicts it would miss its SLO and, by being admitted,
// push the requests behind it past theirs too: so the admitted requests keep their SLO and
// the refused ones learn when to come back.
//
// Both sides predict from what the workers measured (their load reports) and from this
// router's own outstanding work on them (WorkerView::routedPrefillTokens / routedStreams),
// which a report cannot show yet: it is taken between engine steps, and a prompt reaches a
// prefill worker through the decode worker. Of the two, the larger counts: the report also
// holds other routers' work, the router's count also what the report missed.
//
// Pure policy (no clock, no I/O); the router loop calls it on its strand.
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include "router/routing_policy.h"

namespace pd::router {

struct AdmissionVerdict {
  bool admit = true;
  double predictedS = 0;  // prefill: the predicted TTFT; decode: the predicted step time
  int retryAfterS = 0;    // refused: seconds until the prediction is within target
};

// The prefill side. `prefilling` is the view of the worker that will prefill the prompt (the
// prefill worker when disaggregated, else the decode worker), `promptTokens` the prompt's
// uncached tokens. The predicted TTFT is (tokens ahead + promptTokens) / its measured
// prefill rate: the worker computes its queue first come, first served, batch by batch.
// Refused when that passes the TTFT target while something is ahead; a prompt with nothing
// ahead is admitted whatever it costs (refusing it helps no one: a prompt longer than the
// target allows is admitted when the worker is idle). A worker whose rate is not measured
// yet (no prefill since it started) is never shed against: there is nothing to predict from.
// `scale` multiplies the prediction before it is compared (PercentileScale).
AdmissionVerdict admitPrefill(const WorkerView& prefilling, int64_t promptTokens, double ttftTargetS, double scale = 1);

// The prefill pool's overflow: a prompt that admitPrefill refuses on its prefill worker may be
// prefilled by its decode worker instead, beside the streams, when the caller knows that
// worker's prompt chunks keep its steps within the ITL target (SLO-sized chunks and
// RoutingPolicy::fitsBesideStreams). Admitted there only when its first token is predicted
// within half the TTFT target, or, with no measured rate yet, when nothing is ahead of it. The
// other half is kept for the worker's own short prompts: they queue behind it, first come,
// first served (measured: an overflowed 1,400-token prompt admitted against the whole target
// got a 15-token prompt behind it shed). Unlike admitPrefill, a prompt that does not fit
// stays refused with nothing ahead: the prefill pool already said it cannot be served in
// time, and this worker's streams would pay for trying.
AdmissionVerdict admitOverflow(const WorkerView& decoding, int64_t promptTokens, double ttftTargetS, double scale = 1);

// A prediction multiplier that makes an SLO percentile hold where the prediction alone would
// not: predictions miss what their inputs do not see (the gaps between engine steps, the
// hand-offs between processes, a machine busier than when the rates were measured, steps
// that vary around their mean), and an SLO is a percentile, not a mean. By stochastic
// approximation each observation past its bound raises the scale by step x p, each within it
// lowers it by step x (1 - p) (multiplicatively, within [0.5, 4]), which settles where a
// fraction (1 - p) of observations pass: e.g. admitted requests whose TTFT passed their
// scaled prediction (the scale is then the p-quantile of observed / predicted), or gaps
// past the ITL target (the scale then tightens decode admission until p of the gaps meet
// it). Pure state; the router loop's strand owns it.
class PercentileScale {
 public:
  PercentileScale(double percentile, double step) : p_(percentile / 100), step_(step) {}
  void observe(bool exceeded);
  double value() const { return value_; }

 private:
  double p_, step_;
  double value_ = 1;
};

// What an admitted request's first token tells the TTFT PercentileScale: whether it passed its
// scaled prediction, or nothing (nullopt) when both came under half the target. A short prompt
// whose first token took twice its 50 ms prediction is far within any target and says nothing
// about the predictions admission weighs near it; counted, such prompts (most of a conversation
// mix) drove the scale to ~2 and shed requests that would have met the target. A real miss
// (past the target) always counts, so at most (1 - p) of the requests near the target, and so
// of all requests, miss it.
std::optional<bool> ttftPastBound(double observedS, double scaledPredictionS, double ttftTargetS);

// The TTFT scales, one per route: a prefill worker's queue of whole prompts and a decode
// worker's prompts in chunks beside its streams are predicted from different rates and miss
// differently. One scale for both let the prefill worker's misses raise every colocated
// prediction: on 3 Dec (conversation mix, 1 + 1 on two shared cores) it stood at 1.58 and
// shed 20 short prompts predicted at 2.1-3.4 s on the decode worker, while the prompts
// admitted there beside them took 0.7-1.0 s. Pure state; the router loop's strand owns it.
class TtftCalibration {
 public:
  explicit TtftCalibration(double percentile)
      : scales_{PercentileScale(percentile, kStep), PercentileScale(percentile, kStep)} {}
  double scale(Route route) const { return scales_[size_t(route)].value(); }
  // An admitted request's first token came `observedS` after it was routed on `route`,
  // against the unscaled prediction `predictedS` (ttftPastBound decides what it says).
  void observe(Route route, double observedS, double predictedS, double ttftTargetS);

 private:
  static constexpr double kStep = 0.05;    // per request
  std::array<PercentileScale, 2> scales_;  // [Route]
};

// The decode side: the step time one more stream would give every stream of `decoding`,
// from its fitted step cost (base + per stream x streams, step_cost_model.h), must stay
// within the ITL target (prompts that its prefill chunks would push past the target are
// routed to a prefill worker instead: "protect_itl", routing_policy.h); a worker with no
// stream yet admits (one stream alone is not made
// faster by refusing it). Before the worker's steps taught it the line, the measured step
// time decides: a worker already stepping slower than the target with two or more streams
// refuses. Refusals say Retry-After 1 s: streams end all the time.
// `scale` multiplies the predicted step time before it is compared (PercentileScale).
AdmissionVerdict admitDecode(const WorkerView& decoding, double itlTargetS, double scale = 1);

// The router's admission control as one piece (docs/serving.md "Overload"): the sequence
// admitPrefill -> admitOverflow -> admitDecode with the scales it has learned, and the
// observations that teach them. The router loop and `pdserve plan`'s simulation
// (tools/plan/cluster_sim.h) both run it, so a plan sheds what the router would.
// Pure state; the caller serialises (the router loop's strand).
struct AdmissionTargets {
  double ttftS = 1, ttftPercentile = 99;   // pools.prefill.slo
  double itlS = 0.05, itlPercentile = 99;  // pools.decode.slo
  // engine.slo_sized_prefill_chunks: a prompt the prefill pool refuses may be prefilled by its
  // decode worker beside the streams (admitOverflow), where its chunks keep them within the ITL.
  bool overflowToDecode = true;
};

struct AdmissionDecision {
  enum class Side { kNone, kPrefill, kDecode };
  Side refusedBy = Side::kNone;  // kNone: admitted
  AdmissionVerdict verdict;      // the refusing side's; admitted: the prefill side's (scaled)
  double predictedTtftS = 0;     // admitted: the unscaled TTFT prediction, for observeFirstToken
  bool admitted() const { return refusedBy == Side::kNone; }
};

class AdmissionControl {
 public:
  explicit AdmissionControl(AdmissionTargets targets)
      : targets_(targets), ttft_(targets.ttftPercentile), itl_(targets.itlPercentile, kItlStep) {}

  // `plan` is the policy's choice for a prompt of `promptTokens` tokens; `prefilling` and
  // `decoding` the views of the workers it names (prefilling == decoding when colocated).
  // May turn a disaggregated plan into a colocated one on `decoding` ("prefill_overflow"),
  // when `policy` says that worker's chunks fit beside its streams.
  AdmissionDecision decide(RoutePlan& plan, const WorkerView& prefilling, const WorkerView& decoding,
                           int64_t promptTokens, const RoutingPolicy& policy) const;
  // An admitted request's first token came `observedS` after it was routed on `route`,
  // against decide()'s predictedTtftS.
  void observeFirstToken(Route route, double observedS, double predictedS) {
    ttft_.observe(route, observedS, predictedS, targets_.ttftS);
  }
  // One inter-token gap of a stream (a gap of 0: tokens that came together).
  void observeGap(double seconds) { itl_.observe(seconds > targets_.itlS); }

  double ttftScale(Route route) const { return ttft_.scale(route); }
  // What decode admission and RoutingPolicy's "protect_itl" multiply a predicted step by.
  double itlScale() const { return itl_.value(); }
  const AdmissionTargets& targets() const { return targets_; }

 private:
  static constexpr double kItlStep = 0.002;  // per gap: it sees ~100x more than the TTFT scale
  AdmissionTargets targets_;
  TtftCalibration ttft_;
  PercentileScale itl_;
};

}  // namespace pd::router
