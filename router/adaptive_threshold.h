// router::AdaptiveThreshold (docs/design.md §6, "an adaptive threshold driven by both pools' SLO
// headroom"): moves short_prompt_tokens between the pools' SLO windows. Prompts at or under
// the threshold are prefilled on the decode pool (colocated), longer ones on the prefill
// pool, so the threshold decides how prefill work is split between the two.
//
// Each tick, with p = prefill TTFT percentile / target and d = decode ITL percentile / target
// (the autoscaler's windows, router/autoscaler.h), and both windows holding enough samples:
//   - p > 1 and d < kSpareBelow: the prefill pool misses its SLO while decode has room ->
//     raise the threshold by kStep (more prompts stay colocated);
//   - d > 1 and p < kSpareBelow: decode misses while prefill has room -> lower it by kStep
//     (fewer prefills interleave with decoding);
//   - otherwise hold. The threshold stays within [base / kRange, base * kRange] (and >= 1).
// Multiplicative steps of 25% every 5 s: a factor of 4 takes ~30 s, slower than a burst,
// faster than the autoscaler's replicas arrive.
//
// Pure, no I/O; the caller serialises access (the router calls it under its mutex).
#pragma once

#include <cstdint>
#include <string>

namespace pd::router {

struct PoolPressure {
  double ratio = 0;  // observed SLO percentile / target
  bool enoughSamples = false;
};

class AdaptiveThreshold {
 public:
  static constexpr double kStep = 1.25;
  static constexpr double kRange = 4.0;
  static constexpr double kSpareBelow = 0.8;

  explicit AdaptiveThreshold(int64_t base);

  int64_t value() const { return value_; }
  // One tick; returns the (possibly new) threshold and says why in *reason.
  int64_t update(const PoolPressure& prefill, const PoolPressure& decode, std::string* reason);

 private:
  int64_t base_, min_, max_, value_;
};

}  // namespace pd::router
