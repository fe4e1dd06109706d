#include "router/admission.h"

#include <cmath>

namespace pd::router {

AdmissionVerdict admitPrefill(const WorkerView& w, double maxQueueWaitS) {
  AdmissionVerdict v;
  if (w.prefillTokensPerS <= 0) return v;
  v.predictedWaitS = double(w.queuedPrefillTokens + w.unreportedPrefillTokens) / w.prefillTokensPerS;
  if (v.predictedWaitS <= maxQueueWaitS) return v;
  v.admit = false;
  v.retryAfterS = std::max(1, int(std::ceil(v.predictedWaitS - maxQueueWaitS)));
  return v;
}

AdmissionVerdict admitDecode(const WorkerView& w, double itlTargetS) {
  AdmissionVerdict v;
  const int streams = w.running + w.unreportedStreams;
  const double itlS = w.decodeStepMs / 1e3;
  if (streams < 2 || itlS <= itlTargetS) return v;
  v.admit = false;
  v.predictedWaitS = itlS;
  v.retryAfterS = 1;
  return v;
}

}  // namespace pd::router
