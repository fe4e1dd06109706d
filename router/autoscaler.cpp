#include "router/autoscaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace pd::router {
namespace {

constexpr double kFirstEdge = 1e-4;  // seconds
constexpr double kGrowth = 1.05;

std::string fmt(const char* f, double a, double b, double c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}

}  // namespace

// ---- LatencyWindow ---------------------------------------------------------------------------

LatencyWindow::LatencyWindow(std::chrono::seconds window, int slices)
    : sliceLength_(std::chrono::duration_cast<std::chrono::nanoseconds>(window) / std::max(slices, 1)),
      slices_(size_t(std::max(slices, 1))),
      sliceIndex_(size_t(std::max(slices, 1)), -1) {}

int LatencyWindow::bucketOf(double seconds) {
  if (!(seconds > kFirstEdge)) return 0;  // also NaN and negatives
  const int k = int(std::ceil(std::log(seconds / kFirstEdge) / std::log(kGrowth)));
  return std::clamp(k, 0, kBuckets - 1);
}

double LatencyWindow::upperEdge(int bucket) { return kFirstEdge * std::pow(kGrowth, bucket); }

void LatencyWindow::add(SteadyTime at, double seconds) {
  const int64_t abs = at.time_since_epoch() / sliceLength_;
  const size_t i = size_t(abs % int64_t(slices_.size()));
  if (sliceIndex_[i] != abs) {
    slices_[i].fill(0);
    sliceIndex_[i] = abs;
  }
  slices_[i][size_t(bucketOf(seconds))]++;
}

void LatencyWindow::advance(SteadyTime now) {
  const int64_t nowAbs = now.time_since_epoch() / sliceLength_;
  for (size_t i = 0; i < slices_.size(); ++i) {
    if (sliceIndex_[i] >= 0 && sliceIndex_[i] <= nowAbs - int64_t(slices_.size())) {
      slices_[i].fill(0);
      sliceIndex_[i] = -1;
    }
  }
}

std::vector<int64_t> LatencyWindow::summed() const {
  std::vector<int64_t> out(kBuckets, 0);
  for (size_t i = 0; i < slices_.size(); ++i) {
    if (sliceIndex_[i] < 0) continue;
    for (int b = 0; b < kBuckets; ++b) out[size_t(b)] += slices_[i][size_t(b)];
  }
  return out;
}

int64_t LatencyWindow::count() const {
  int64_t n = 0;
  for (int64_t c : summed()) n += c;
  return n;
}

double LatencyWindow::quantile(double q) const {
  const auto s = summed();
  int64_t total = 0;
  for (int64_t c : s) total += c;
  if (total == 0) return 0;
  const int64_t rank = std::max<int64_t>(1, int64_t(std::ceil(std::clamp(q, 0.0, 1.0) * double(total))));
  int64_t seen = 0;
  for (int b = 0; b < kBuckets; ++b) {
    seen += s[size_t(b)];
    if (seen >= rank) return upperEdge(b);
  }
  return upperEdge(kBuckets - 1);
}

double LatencyWindow::fractionWithin(double seconds) const {
  const auto s = summed();
  int64_t total = 0, within = 0;
  for (int b = 0; b < kBuckets; ++b) {
    total += s[size_t(b)];
    if (upperEdge(b) <= seconds * (1 + 1e-9)) within += s[size_t(b)];
  }
  return total == 0 ? 1.0 : double(within) / double(total);
}

// ---- Autoscaler ------------------------------------------------------------------------------

Autoscaler::Autoscaler(PoolSlo prefill, PoolSlo decode, AutoscalerOptions options)
    : prefill_(prefill),
      decode_(decode),
      opt_(options),
      ttft_(options.window, options.slices),
      itl_(options.window, options.slices) {}

ScalingDecision Autoscaler::decidePrefill(int currentReplicas, SteadyTime now) {
  return decide(ttft_, prefill_, currentReplicas, now);
}

ScalingDecision Autoscaler::decideDecode(int currentReplicas, SteadyTime now) {
  return decide(itl_, decode_, currentReplicas, now);
}

ScalingDecision Autoscaler::decide(LatencyWindow& w, const PoolSlo& slo, int current, SteadyTime now) const {
  w.advance(now);
  ScalingDecision d;
  d.current = std::max(current, 0);
  d.samples = w.count();
  d.observedSeconds = w.quantile(slo.percentile / 100.0);
  d.attainment = w.fractionWithin(slo.targetSeconds);
  int desired = d.current;
  const double pct = slo.percentile;
  d.ratio = d.observedSeconds / slo.targetSeconds;
  d.enoughSamples = d.samples >= opt_.minSamples;
  if (!d.enoughSamples) {
    d.reason = "hold: " + std::to_string(d.samples) + " samples < " + std::to_string(opt_.minSamples);
  } else {
    const double ratio = d.ratio;
    if (ratio > 1 + opt_.tolerance) {
      const int base = std::max(d.current, 1);
      desired = std::clamp(int(std::ceil(base * ratio)), d.current + 1, 2 * base);
      d.reason = fmt("scale up: p%g %.4g s > target %.4g s", pct, d.observedSeconds, slo.targetSeconds);
    } else if (ratio < opt_.scaleDownBelow) {
      desired = d.current - 1;
      d.reason = fmt("scale down: p%g %.4g s < %.4g s", pct, d.observedSeconds,
                     slo.targetSeconds * opt_.scaleDownBelow);
    } else {
      d.reason = fmt("hold: p%g %.4g s near target %.4g s", pct, d.observedSeconds, slo.targetSeconds);
    }
  }
  d.desired = std::clamp(desired, slo.minReplicas, std::max(slo.minReplicas, slo.maxReplicas));
  return d;
}

}  // namespace pd::router
