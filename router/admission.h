// Overload shedding (issue 12; docs/serving.md, "Overload"). A request is refused with 429
// and Retry-After when the wait predicted before its prefill can start -- the prompt tokens
// already queued on the worker that will prefill it, over that worker's measured prefill
// rate -- would alone exceed the TTFT target: it would miss its SLO anyway, and admitting it
// would push every request behind it past the target too. So the requests that are admitted
// keep their TTFT, and the refused ones learn when to come back.
//
// Pure policy (no clock, no I/O); the router loop calls it on its strand.
#pragma once

#include "router/routing_policy.h"

namespace pd::router {

struct AdmissionVerdict {
  bool admit = true;
  double predictedWaitS = 0;  // queued tokens ahead of this prompt / prefill rate
  int retryAfterS = 0;        // refused: seconds until that wait is predicted to be within target
};

// `prefilling`: the view of the worker that will prefill the prompt (the prefill worker when
// disaggregated, else the decode worker). A worker whose rate is not measured yet (no prefill
// since it started) is never shed against: there is nothing to predict from.
AdmissionVerdict admitPrefill(const WorkerView& prefilling, double maxQueueWaitS);

// The decode side: a decode worker whose recent steps already take longer than the ITL target
// while it runs two or more streams is past its capacity, and every stream added lengthens
// its steps further: refused (Retry-After 1 s: streams end all the time); predictedWaitS is
// then that step time. (No extrapolation to one more stream: at small batches a step costs
// about the same whatever the batch, and a per-stream model would refuse far too early.)
// A worker with fewer than two streams, or no measured step, admits.
AdmissionVerdict admitDecode(const WorkerView& decoding, double itlTargetS);

}  // namespace pd::router
