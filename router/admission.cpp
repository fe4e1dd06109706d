#include "router/admission.h"

#include <algorithm>
#include <cmath>

namespace pd::router {

AdmissionVerdict admitPrefill(const WorkerView& w, int64_t promptTokens, double ttftTargetS, double scale) {
  AdmissionVerdict v;
  if (w.prefillTokensPerS <= 0) return v;
  const int64_t ahead = w.prefillTokensAhead();
  v.predictedS = scale * double(ahead + std::max<int64_t>(0, promptTokens)) / w.prefillTokensPerS;
  if (ahead == 0 || v.predictedS <= ttftTargetS) return v;
  v.admit = false;
  v.retryAfterS = std::max(1, int(std::ceil(v.predictedS - ttftTargetS)));
  return v;
}

AdmissionVerdict admitOverflow(const WorkerView& w, int64_t promptTokens, double ttftTargetS, double scale) {
  const double limitS = ttftTargetS / 2;
  AdmissionVerdict v;
  if (w.prefillTokensPerS <= 0) {
    v.admit = w.prefillTokensAhead() == 0;
  } else {
    v = admitPrefill(w, promptTokens, limitS, scale);
    v.admit = v.predictedS <= limitS;  // also with nothing ahead
  }
  if (!v.admit) v.retryAfterS = std::max(1, int(std::ceil(v.predictedS - limitS)));
  return v;
}

std::optional<bool> ttftPastBound(double observedS, double scaledPredictionS, double ttftTargetS) {
  if (std::max(observedS, scaledPredictionS) < ttftTargetS / 2) return std::nullopt;
  return observedS > scaledPredictionS;
}

void TtftCalibration::observe(Route route, double observedS, double predictedS, double ttftTargetS) {
  PercentileScale& s = scales_[size_t(route)];
  if (const auto past = ttftPastBound(observedS, predictedS * s.value(), ttftTargetS)) s.observe(*past);
}

void PercentileScale::observe(bool exceeded) {
  value_ = std::clamp(value_ * std::exp(exceeded ? step_ * p_ : -step_ * (1 - p_)), 0.5, 4.0);
}

AdmissionVerdict admitDecode(const WorkerView& w, double itlTargetS, double scale) {
  AdmissionVerdict v;
  const int streams = w.streams();
  if (const auto stepMs = w.predictedDecodeStepMs(streams + 1)) {
    v.predictedS = scale * *stepMs / 1e3;
    if (streams == 0 || v.predictedS <= itlTargetS) return v;
  } else {
    v.predictedS = scale * w.decodeStepMs / 1e3;
    if (streams < 2 || v.predictedS <= itlTargetS) return v;
  }
  v.admit = false;
  v.retryAfterS = 1;
  return v;
}

AdmissionDecision AdmissionControl::decide(RoutePlan& plan, const WorkerView& prefilling, const WorkerView& decoding,
                                           int64_t promptTokens, const RoutingPolicy& policy) const {
  AdmissionDecision d;
  d.verdict = admitPrefill(prefilling, promptTokens - plan.cachedTokens, targets_.ttftS, ttftScale(plan.route));
  // The prefill pool cannot serve it in time: its decode worker may, if its SLO-sized chunks
  // keep the streams there within their ITL (docs/serving.md "Overload").
  if (!d.verdict.admit && plan.route == Route::kDisaggregated && targets_.overflowToDecode &&
      policy.fitsBesideStreams(decoding)) {
    const AdmissionVerdict there =
        admitOverflow(decoding, promptTokens - decoding.cachedTokens, targets_.ttftS, ttftScale(Route::kColocated));
    if (there.admit) {
      plan = RoutingPolicy::colocatedOn(decoding, "prefill_overflow");
      d.verdict = there;
    }
  }
  if (!d.verdict.admit) {
    d.refusedBy = AdmissionDecision::Side::kPrefill;
    return d;
  }
  d.predictedTtftS = d.verdict.predictedS / ttftScale(plan.route);
  const AdmissionVerdict streams = admitDecode(decoding, targets_.itlS, itlScale());
  if (!streams.admit) {
    d.refusedBy = AdmissionDecision::Side::kDecode;
    d.verdict = streams;
    d.predictedTtftS = 0;
  }
  return d;
}

}  // namespace pd::router
