#include "engine/step_cost_model.h"

#include <algorithm>

namespace pd::engine {

void StepCostModel::observe(int streams, double ms) {
  if (streams <= 0 || ms <= 0) return;
  const double n = streams;
  w_ = kDecay * w_ + 1;
  n_ = kDecay * n_ + n;
  nn_ = kDecay * nn_ + n * n;
  y_ = kDecay * y_ + ms;
  ny_ = kDecay * ny_ + n * ms;
}

void StepCostModel::observeSmallChunk(int streams, double ms) {
  const auto l = line();
  if (!l || streams <= 0 || ms <= 0) return;
  const double excess = std::max(0.0, ms - l->stepMs(streams));
  // These steps are rarer (routing sends prompts elsewhere while they cost too much), so the
  // average follows the last few.
  constexpr double kWeight = 0.2;
  smallChunkMs_ = smallChunkMs_ == 0 ? excess : (1 - kWeight) * smallChunkMs_ + kWeight * excess;
}

std::optional<StepCostModel::Line> StepCostModel::line() const {
  if (w_ <= 0) return std::nullopt;
  const double meanN = n_ / w_;
  const double varN = nn_ / w_ - meanN * meanN;
  // Below a variance of 1/4 the batch sizes hardly differ (e.g. 99% of the weight on one
  // size): the slope would be noise.
  if (varN < 0.25) return std::nullopt;
  const double meanY = y_ / w_;
  const double cov = ny_ / w_ - meanN * meanY;
  Line l;
  l.perStreamMs = std::max(0.0, cov / varN);
  l.baseMs = std::max(0.0, meanY - l.perStreamMs * meanN);
  l.smallChunkMs = smallChunkMs_;
  return l;
}

}  // namespace pd::engine
