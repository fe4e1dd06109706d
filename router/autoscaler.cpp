#include "router/autoscaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace pd::router {
namespace {

constexpr double kFirstEdge = 1e-4;  // seconds
constexpr double kGrowth = 1.05;

template <typename... Args>
std::string fmt(const char* f, Args... args) {
  char buf[200];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

}  // namespace

// ---- LatencyWindow ---------------------------------------------------------------------------

LatencyWindow::LatencyWindow(std::chrono::milliseconds window, int slices)
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

namespace {

double secondsOf(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ceil(x) for a replica count, without a float's 2.0000001 becoming 3.
int replicasFor(double x) { return x <= 0 ? 0 : int(std::min(1e6, std::ceil(x - 1e-9))); }

}  // namespace

Autoscaler::Autoscaler(PoolSlo prefill, PoolSlo decode, AutoscalerOptions options)
    : prefill_(prefill),
      decode_(decode),
      opt_(options),
      ttft_(options.window, options.slices),
      itl_(options.window, options.slices),
      colocatedTtft_(options.window, options.slices) {}

void Autoscaler::observeShed(SteadyTime at, Route route, bool prefillSide, double predictedSeconds) {
  if (!prefillSide) return observeItl(at, predictedSeconds);
  observeTtft(at, predictedSeconds, route);
}

void Autoscaler::observePrefillArrival(SteadyTime at, int64_t tokens) {
  if (tokens > 0) prefillArrivals_.emplace_back(at, tokens);
}

void Autoscaler::observeDecodeArrival(SteadyTime at) {
  lastDecodeArrival_ = std::max(lastDecodeArrival_, at);
  anyDecodeArrival_ = true;
}

double Autoscaler::prefillArrivalRate(SteadyTime now) {
  while (!prefillArrivals_.empty() && prefillArrivals_.front().first <= now - opt_.rateWindow) {
    prefillArrivals_.pop_front();
  }
  double tokens = 0;
  for (const auto& [at, n] : prefillArrivals_) tokens += double(n);
  return tokens / std::max(1e-3, secondsOf(opt_.rateWindow));
}

void Autoscaler::percentileRule(LatencyWindow& w, const PoolSlo& slo, SteadyTime now, ScalingDecision& d) const {
  w.advance(now);
  d.samples = w.count();
  d.observedSeconds = w.quantile(slo.percentile / 100.0);
  d.attainment = w.fractionWithin(slo.targetSeconds);
  d.ratio = d.observedSeconds / slo.targetSeconds;
  d.enoughSamples = d.samples >= opt_.minSamples;
  d.latencyWhy = fmt("p%g %.4g s, target %.4g s", slo.percentile, d.observedSeconds, slo.targetSeconds);
  if (!d.enoughSamples) return;
  if (d.ratio > 1 + opt_.tolerance) {
    const int base = std::max(d.current, 1);
    d.latencyReplicas = std::clamp(int(std::ceil(base * d.ratio)), d.current + 1, 2 * base);
  } else if (d.ratio < opt_.scaleDownBelow) {
    d.latencyReplicas = std::max(0, d.current - 1);
  } else {
    d.latencyReplicas = d.current;
  }
}

ScalingDecision Autoscaler::decidePrefill(int currentReplicas, const PoolLoad& load, SteadyTime now) {
  ScalingDecision d;
  d.current = std::max(currentReplicas, 0);
  percentileRule(ttft_, prefill_, now, d);
  const double target = prefill_.targetSeconds;
  const double arrivals = prefillArrivalRate(now);
  const auto queued = double(std::max<int64_t>(0, load.queuedPrefillTokens));
  const bool busy = queued > 0 || arrivals > 0;
  int downTarget = -1;
  d.demand = queued / target + arrivals;
  if (load.prefillTokensPerS > 0) {
    const double rate = load.prefillTokensPerS;
    d.workerCapacity = rate;
    d.capacityReplicas = replicasFor(d.demand / (rate * opt_.scaleUpUtilization));
    downTarget = replicasFor(d.demand / (rate * opt_.scaleDownUtilization));
    d.predictedSeconds = d.current > 0 ? queued / (d.current * rate) : 0;
    d.reason = fmt("capacity: %.0f tokens/s of work (queue / TTFT target + arrivals), %.0f tokens/s per worker",
                   d.demand, rate);
  }
  combine(prefillState_, prefill_, upperBound(prefill_, decode_), busy, downTarget, now, d);
  return d;
}

ScalingDecision Autoscaler::decideDecode(int currentReplicas, const PoolLoad& load, SteadyTime now) {
  ScalingDecision d;
  d.current = std::max(currentReplicas, 0);
  percentileRule(itl_, decode_, now, d);
  ScalingDecision colocated;
  colocated.current = d.current;
  percentileRule(colocatedTtft_, prefill_, now, colocated);
  if (colocated.latencyReplicas > d.latencyReplicas) {
    d.latencyReplicas = colocated.latencyReplicas;
    d.latencyWhy = "colocated TTFT " + colocated.latencyWhy;
  }
  const int streams = std::max(0, load.streams);
  PoolState& st = decodeState_;
  if (anyDecodeArrival_ && lastDecodeArrival_ > st.lastBusy) st.lastBusy = lastDecodeArrival_;
  const bool busy = streams > 0;
  int downTarget = -1;
  d.demand = streams;
  const bool line = load.stepPerStreamMs >= 0;
  if (line || load.maxStreamsPerWorker > 0) {
    const double targetMs = decode_.targetSeconds * 1e3;
    // Streams per worker whose step stays within the target at utilization u, and that it
    // runs at once (at least one: a worker too slow for the target still serves a stream).
    auto perWorker = [&](double u) {
      double k = 1e6;
      if (line && load.stepPerStreamMs > 0) k = std::floor((targetMs * u - load.stepBaseMs) / load.stepPerStreamMs);
      if (load.maxStreamsPerWorker > 0) {
        k = std::min(k, std::floor(load.maxStreamsPerWorker * u / opt_.scaleUpUtilization));
      }
      return std::max(1.0, k);
    };
    d.workerCapacity = perWorker(opt_.scaleUpUtilization);
    d.capacityReplicas = replicasFor(streams / d.workerCapacity);
    downTarget = replicasFor(streams / perWorker(opt_.scaleDownUtilization));
    if (d.current > 0 && line) {
      const double each = std::ceil(double(streams) / d.current);
      d.predictedSeconds = each > 0 ? (load.stepBaseMs + load.stepPerStreamMs * each) / 1e3 : 0;
    }
    d.reason = fmt("capacity: %.0f streams, %.0f per worker within the ITL target%s", d.demand, d.workerCapacity,
                   line ? "" : " (max_running_requests; no step line yet)");
  }
  combine(st, decode_, upperBound(decode_, prefill_), busy, downTarget, now, d);
  return d;
}

std::pair<ScalingDecision, ScalingDecision> Autoscaler::decide(int prefillReplicas, const PoolLoad& prefillLoad,
                                                               int decodeReplicas, const PoolLoad& decodeLoad,
                                                               SteadyTime now) {
  const PoolState prefillBefore = prefillState_, decodeBefore = decodeState_;
  auto prefill = decidePrefill(prefillReplicas, prefillLoad, now);
  auto decode = decideDecode(decodeReplicas, decodeLoad, now);
  if (opt_.sharedBudget) shareBudget(prefill, prefillBefore, decode, decodeBefore, now);
  return {std::move(prefill), std::move(decode)};
}

int Autoscaler::upperBound(const PoolSlo& own, const PoolSlo& other) const {
  const int hi = std::max(own.minReplicas, own.maxReplicas);
  if (!opt_.sharedBudget) return hi;
  return hi + std::max(other.minReplicas, other.maxReplicas) - other.minReplicas;
}

void Autoscaler::shareBudget(ScalingDecision& prefill, const PoolState& prefillBefore, ScalingDecision& decode,
                             const PoolState& decodeBefore, SteadyTime now) {
  auto maxOf = [](const PoolSlo& s) { return std::max(s.minReplicas, s.maxReplicas); };
  const int budget = maxOf(prefill_) + maxOf(decode_);
  if (prefill.desired + decode.desired <= budget) return;
  // Only a pool past its own maximum is borrowing; it gets what the other one leaves (at
  // least its own maximum). Both past theirs: each gets its own. The trimmed decision
  // replaces the one combine() recorded, so the pacing (cooldowns) counts the change actually
  // recommended: a growth the budget refuses does not restart the scale-up cooldown each tick.
  auto trim = [&](ScalingDecision& d, const PoolSlo& slo, PoolState& st, const PoolState& before, int other) {
    if (d.desired <= maxOf(slo)) return;
    const int allowed = std::max(maxOf(slo), budget - other);
    if (allowed >= d.desired) return;
    d.reason += fmt(" (trimmed from %d: the shared budget of %d has %d left)", d.desired, budget, allowed);
    d.desired = st.desired = allowed;
    st.lastChange = before.lastChange;
    st.changed = before.changed;
    st.lastUp = before.lastUp;
    st.grown = before.grown;
    if (allowed != before.desired) {
      st.lastChange = now;
      st.changed = true;
      if (allowed > before.desired) {
        st.lastUp = now;
        st.grown = true;
      }
    }
  };
  trim(prefill, prefill_, prefillState_, prefillBefore, decode.desired);
  trim(decode, decode_, decodeState_, decodeBefore, prefill.desired);
}

void Autoscaler::combine(PoolState& st, const PoolSlo& slo, int hi, bool busy, int downTarget, SteadyTime now,
                         ScalingDecision& d) const {
  const int lo = slo.minReplicas;
  if (!st.started && d.current == 0 && !busy && d.latencyReplicas < 1 && d.capacityReplicas < 1) {
    // Not met yet: the router ticks before the workers started with it register. Starting
    // from this empty view would recommend min_replicas (0 for a pool that may shrink to
    // nothing) and have the workers just started drained at once.
    d.desired = std::clamp(d.current, lo, hi);
    d.reason = "hold: no worker of the pool registered yet";
    return;
  }
  if (!st.started) {
    st.started = true;
    st.desired = std::clamp(d.current, lo, hi);
    st.lastBusy = std::max(st.lastBusy, now);  // a pool just met is not idle yet
  }
  if (busy) st.lastBusy = now;
  d.idleSeconds = std::max(0.0, secondsOf(now - st.lastBusy));
  const int was = st.desired;
  const std::string capacityWhy = d.reason;
  // The percentile rule looks at a window that mixes sizes after a change: its call for more
  // waits one window after a change (the capacity model reacts meanwhile).
  const bool latencyFresh = !st.changed || now - st.lastChange >= opt_.window;
  const int latencyUp = latencyFresh ? d.latencyReplicas : -1;
  const int up = std::min(hi, std::max(d.capacityReplicas, latencyUp));
  auto pct = [&](const char* verb) { return std::string(verb) + ": " + d.latencyWhy; };
  int next = was;
  if (!busy && now - st.lastBusy >= opt_.idleAfter) {
    next = lo;
    d.reason = fmt("idle: no work for %.0f s", d.idleSeconds);
    st.lowering = false;
  } else if (up > was) {
    if (!st.grown || now - st.lastUp >= opt_.scaleUpCooldown) {
      next = std::min(up, was + std::max(1, opt_.maxStepUp));
      d.reason = "scale up: " + (d.capacityReplicas >= latencyUp ? capacityWhy : pct("latency"));
      st.lastUp = now;
      st.grown = true;
    } else {
      d.reason = "hold: scale-up cooldown (" + (d.capacityReplicas >= latencyUp ? capacityWhy : pct("latency")) + ")";
    }
    st.lowering = false;
  } else {
    // A lower target: the capacity model's at the scale-down utilization, or the percentile
    // rule's one fewer where the capacity model knows nothing. A percentile at or near the
    // target (the rule's "hold", or more) vetoes it: the pool is busy at the size it has.
    int lower = downTarget >= 0                                           ? downTarget
                : d.latencyReplicas >= 0 && d.latencyReplicas < d.current ? d.latencyReplicas
                                                                          : -1;
    const bool veto = d.latencyReplicas >= 0 && d.latencyReplicas >= d.current;
    lower = lower < 0 ? -1 : std::clamp(lower, lo, hi);
    if (lower >= 0 && lower < was && !veto) {
      if (!st.lowering) {
        st.lowering = true;
        st.lowerSince = now;
      }
      const double heldS = secondsOf(now - st.lowerSince);
      if (now - st.lowerSince >= opt_.scaleDownCooldown &&
          (!st.changed || now - st.lastChange >= opt_.scaleDownCooldown)) {
        next = std::max(lower, was - std::max(1, opt_.maxStepDown));
        d.reason = "scale down: " + (downTarget >= 0 ? capacityWhy : pct("latency"));
      } else {
        d.reason = fmt("hold: %d would do, for %.0f of %.0f s of scale-down cooldown", lower, heldS,
                       secondsOf(opt_.scaleDownCooldown));
      }
    } else {
      st.lowering = false;
      if (veto)
        d.reason = pct("hold");
      else if (d.reason.empty())
        d.reason = fmt("hold: %lld samples < %d, no capacity measurement yet", (long long)d.samples, opt_.minSamples);
      else
        d.reason = "hold: " + capacityWhy;
    }
  }
  next = std::clamp(next, lo, hi);
  if (next != was) {
    st.lastChange = now;
    st.changed = true;
    st.lowering = false;
  }
  st.desired = next;
  d.desired = next;
}

AutoscalerOptions autoscalerOptions(const config::RouterConfig::Autoscaler& a) {
  AutoscalerOptions o;
  o.window = std::chrono::milliseconds(a.windowMs);
  o.minSamples = a.minSamples;
  o.scaleUpUtilization = a.scaleUpUtilization;
  o.scaleDownUtilization = a.scaleDownUtilization;
  o.scaleUpCooldown = std::chrono::milliseconds(a.scaleUpCooldownMs);
  o.scaleDownCooldown = std::chrono::milliseconds(a.scaleDownCooldownMs);
  o.idleAfter = std::chrono::milliseconds(a.idleAfterMs);
  o.maxStepUp = a.maxStepUp;
  o.maxStepDown = a.maxStepDown;
  o.sharedBudget = a.roleMoves;
  return o;
}

std::pair<PoolLoad, PoolLoad> poolLoads(const std::vector<WorkerView>& views) {
  PoolLoad prefill, decode;
  int rates = 0, lines = 0;
  double rateSum = 0, baseSum = 0, perStreamSum = 0;
  for (const auto& v : views) {
    if (!v.healthy) continue;
    if (v.role == WorkerRole::kPrefill) {
      prefill.queuedPrefillTokens += v.prefillTokensAhead();
      if (v.prefillTokensPerS > 0) rateSum += v.prefillTokensPerS, ++rates;
    } else {
      decode.streams += v.streams();
      if (v.decodeStepPerStreamMs >= 0) baseSum += v.decodeStepBaseMs, perStreamSum += v.decodeStepPerStreamMs, ++lines;
    }
  }
  if (rates > 0) prefill.prefillTokensPerS = rateSum / rates;
  if (lines > 0) {
    decode.stepBaseMs = baseSum / lines;
    decode.stepPerStreamMs = perStreamSum / lines;
  }
  return {prefill, decode};
}

}  // namespace pd::router
