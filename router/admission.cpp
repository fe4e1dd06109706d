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

}  // namespace pd::router
