#include "router/adaptive_threshold.h"

#include <algorithm>
#include <cmath>

namespace pd::router {

AdaptiveThreshold::AdaptiveThreshold(int64_t base)
    : base_(std::max<int64_t>(base, 1)),
      min_(std::max<int64_t>(1, int64_t(std::floor(double(base_) / kRange)))),
      max_(int64_t(std::ceil(double(base_) * kRange))),
      value_(base_) {}

int64_t AdaptiveThreshold::update(const PoolPressure& prefill, const PoolPressure& decode, std::string* reason) {
  if (!prefill.enoughSamples || !decode.enoughSamples) {
    *reason = "hold: too few samples in a pool's window";
    return value_;
  }
  if (prefill.ratio > 1 && decode.ratio < kSpareBelow) {
    const int64_t next = std::min(max_, std::max(value_ + 1, int64_t(std::ceil(double(value_) * kStep))));
    *reason = next == value_ ? "hold: prefill over its SLO, threshold at its maximum"
                             : "raise: prefill over its SLO, decode has room";
    value_ = next;
  } else if (decode.ratio > 1 && prefill.ratio < kSpareBelow) {
    const int64_t next = std::max(min_, std::min(value_ - 1, int64_t(std::floor(double(value_) / kStep))));
    *reason = next == value_ ? "hold: decode over its SLO, threshold at its minimum"
                             : "lower: decode over its SLO, prefill has room";
    value_ = next;
  } else {
    *reason = "hold: no pool over its SLO with the other one spare";
  }
  return value_;
}

}  // namespace pd::router
