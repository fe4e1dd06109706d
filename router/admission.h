// Overload shedding (issue 12; docs/serving.md, "Overload"). A request is refused with 429
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

#include <cstdint>

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
// `scale` multiplies the prediction before it is compared (TtftCalibration::scale()).
AdmissionVerdict admitPrefill(const WorkerView& prefilling, int64_t promptTokens, double ttftTargetS,
                              double scale = 1);

// What the admitted requests' first tokens really took against what admitPrefill predicted:
// the prediction misses what the rate does not see (the gaps between engine steps, the
// hand-offs between processes, a machine busier than when the rate was measured), and the
// SLO is a percentile. scale() tracks the SLO percentile of observed / predicted by
// stochastic approximation: each request whose ratio passes the scale raises it by ~5% x p,
// each below lowers it by ~5% x (1 - p), within [0.5, 4]; so ~(1 - p) of admitted requests
// exceed their scaled prediction, and a prediction scaled within the target is met at the
// percentile. Pure state; the router loop's strand owns it.
class TtftCalibration {
 public:
  explicit TtftCalibration(double percentile) : p_(percentile / 100) {}
  void observe(double predictedS, double observedS);
  double scale() const { return scale_; }

 private:
  double p_;
  double scale_ = 1;
};

// The decode side: the step time one more stream would give every stream of `decoding`,
// from its fitted step cost (base + per stream x streams, step_cost_model.h), must stay
// within the ITL target (prompts that its prefill chunks would push past the target are
// routed to a prefill worker instead: "protect_itl", routing_policy.h); a worker with no
// stream yet admits (one stream alone is not made
// faster by refusing it). Before the worker's steps taught it the line, the measured step
// time decides: a worker already stepping slower than the target with two or more streams
// refuses. Refusals say Retry-After 1 s: streams end all the time.
AdmissionVerdict admitDecode(const WorkerView& decoding, double itlTargetS);

}  // namespace pd::router
