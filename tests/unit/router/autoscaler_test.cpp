// router::Autoscaler: window percentiles, and the replica recommendation per pool: the
// percentile rule alone (no load reports), then the capacity model, cooldowns, hysteresis and
// idleness on recorded windows (burst, ramp, steady, flapping bait, idle), on a fake clock.
#include "router/autoscaler.h"

#include <cmath>
#include <memory>

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::router;
using namespace std::chrono_literals;

namespace {
SteadyTime at(double seconds) {
  return SteadyTime(std::chrono::duration_cast<SteadyTime::duration>(std::chrono::duration<double>(seconds)));
}

const PoolLoad kNoReports{};  // no measured rate, no fitted line: the capacity model abstains

// A decode pool whose workers step in 10 ms + 5 ms per stream: within a 50 ms ITL target at
// 80% (40 ms) a worker takes floor(30 / 5) = 6 streams, at 60% (30 ms) 4.
PoolLoad decodeLoad(int streams) {
  PoolLoad l;
  l.streams = streams;
  l.stepBaseMs = 10;
  l.stepPerStreamMs = 5;
  return l;
}

PoolLoad prefillLoad(int64_t queued, double rate = 10000) {
  PoolLoad l;
  l.queuedPrefillTokens = queued;
  l.prefillTokensPerS = rate;
  return l;
}

// The percentile rule's cases below were written before the cooldowns: they take none.
AutoscalerOptions immediate() {
  AutoscalerOptions o;
  o.scaleDownCooldown = 0s;
  o.scaleUpCooldown = 0s;
  return o;
}
}  // namespace

TEST_CASE("the latency window reads percentiles to within one 5% bucket, upper edge") {
  LatencyWindow w(60s, 12);
  CHECK(w.count() == 0);
  CHECK(w.quantile(0.99) == 0);
  CHECK(w.fractionWithin(1.0) == 1.0);
  // 1..100 ms, one each: p50 = 50 ms, p99 = 99 ms, p100 = 100 ms.
  for (int i = 1; i <= 100; ++i) w.add(at(1000), i / 1000.0);
  CHECK(w.count() == 100);
  for (auto [q, v] : {std::pair{0.5, 0.050}, {0.99, 0.099}, {1.0, 0.100}}) {
    INFO("q " << q);
    CHECK(w.quantile(q) >= v);
    CHECK(w.quantile(q) <= v * 1.05 + 1e-12);
  }
  // Within 50 ms: every observation whose bucket ends by 50 ms (47 to 50 of them).
  CHECK(w.fractionWithin(0.050) >= 0.47);
  CHECK(w.fractionWithin(0.050) <= 0.50);
  // Zero gaps (tokens that arrived in one chunk) and absurd values land in the end buckets.
  w.add(at(1000), 0.0);
  w.add(at(1000), 1e9);
  CHECK(w.count() == 102);
  CHECK(w.quantile(1.0) > 1000);
}

TEST_CASE("observations leave the window once it has passed them") {
  LatencyWindow w(60s, 12);  // 5 s slices
  w.add(at(1000), 0.5);
  w.add(at(1030), 0.5);
  w.advance(at(1059));
  CHECK(w.count() == 2);
  w.advance(at(1065));  // the slice of t=1000 ended 60 s ago
  CHECK(w.count() == 1);
  w.advance(at(1095));
  CHECK(w.count() == 0);
  // A slot reused for a later slice starts empty.
  w.add(at(1000 + 60 * 7), 0.2);
  CHECK(w.count() == 1);
  CHECK(w.quantile(1.0) == Approx(0.2).epsilon(0.05));
}

TEST_CASE("the prefill pool grows in proportion to TTFT over target, at most double") {
  PoolSlo prefill{/*target*/ 0.5, /*pct*/ 99, /*min*/ 1, /*max*/ 8};
  PoolSlo decode{0.05, 99, 1, 4};
  Autoscaler a(prefill, decode, immediate());
  // Too few samples and no load reports: hold whatever is running, inside the bounds.
  for (int i = 0; i < 10; ++i) a.observeTtft(at(100), 2.0);
  auto d = a.decidePrefill(2, kNoReports, at(101));
  CHECK(d.desired == 2);
  CHECK(d.samples == 10);
  CHECK(d.latencyReplicas == -1);
  CHECK(d.capacityReplicas == -1);
  CHECK_THAT(d.reason, Catch::StartsWith("hold: 10 samples < 20"));

  // p99 = 0.8 s against 0.5 s: ratio 1.6 -> ceil(2 * 1.6) = 4.
  Autoscaler fresh(prefill, decode, immediate());
  for (int i = 0; i < 100; ++i) fresh.observeTtft(at(102), 0.8);
  d = fresh.decidePrefill(2, kNoReports, at(103));
  CHECK(d.desired == 4);
  CHECK(d.latencyReplicas == 4);
  CHECK(d.observedSeconds == Approx(0.8).epsilon(0.05));
  CHECK(d.attainment == 0.0);
  CHECK_THAT(d.reason, Catch::StartsWith("scale up: latency: p99"));

  // Ten times over target: capped at double (and the step bound), then at max_replicas.
  AutoscalerOptions big = immediate();
  big.maxStepUp = 8;
  Autoscaler slow(prefill, decode, big);
  for (int i = 0; i < 50; ++i) slow.observeTtft(at(200), 5.0);
  CHECK(slow.decidePrefill(2, kNoReports, at(201)).desired == 4);
  Autoscaler slow6(prefill, decode, big);
  for (int i = 0; i < 50; ++i) slow6.observeTtft(at(200), 5.0);
  CHECK(slow6.decidePrefill(6, kNoReports, at(201)).desired == 8);
  // An empty pool with traffic over target gets at least one more.
  Autoscaler empty(PoolSlo{0.5, 99, 0, 8}, decode, big);
  for (int i = 0; i < 50; ++i) empty.observeTtft(at(200), 5.0);
  CHECK(empty.decidePrefill(0, kNoReports, at(201)).desired == 2);
}

TEST_CASE("the decode pool scales on the TTFT of the prompts it prefills, and shed requests count as misses") {
  // A colocated-only cluster: the prefill pool has no workers, the decode pool prefills every
  // prompt. Its streams fit (no capacity call) and its gaps meet the ITL target.
  PoolSlo prefill{/*target*/ 1.0, /*pct*/ 99, /*min*/ 0, /*max*/ 0};
  PoolSlo decode{0.05, 99, 1, 8};
  auto fed = [&](double colocatedTtft, int shed) {
    auto a = std::make_unique<Autoscaler>(prefill, decode, immediate());
    for (int i = 0; i < 500; ++i) a->observeItl(at(10), 0.03);
    for (int i = 0; i < 200; ++i) a->observeTtft(at(10), colocatedTtft, Route::kColocated);
    // What admission refused at the TTFT target, predicted at 1.4 s.
    for (int i = 0; i < shed; ++i) a->observeShed(at(10), Route::kColocated, /*prefillSide*/ true, 1.4);
    return a;
  };
  // Colocated TTFT p99 at 1.6 s against 1 s: ceil(2 x 1.6) = 4, where the ITL rule holds.
  auto slow = fed(1.6, 0);
  auto d = slow->decideDecode(2, decodeLoad(4), at(11));
  CHECK(d.desired == 4);
  CHECK(d.observedSeconds < 0.05);  // the pool's own SLO window is still its ITL
  CHECK_THAT(d.reason, Catch::Contains("colocated TTFT p99"));
  // Prompts in time: the ITL rule's call (hold at this load) stands.
  CHECK(fed(0.7, 0)->decideDecode(2, decodeLoad(4), at(11)).desired == 2);
  // Admission keeps the admitted prompts in time by shedding 3% of them: those misses (p99 at
  // 1.4 s) scale it, ceil(2 x 1.4) = 3.
  auto shedding = fed(0.7, 6);
  d = shedding->decideDecode(2, decodeLoad(4), at(11));
  CHECK(d.desired == 3);
  CHECK_THAT(d.reason, Catch::Contains("colocated TTFT"));
  // Disaggregated TTFTs and sheds are the prefill pool's: the decode pool does not see them.
  Autoscaler split(PoolSlo{1.0, 99, 1, 4}, decode, immediate());
  for (int i = 0; i < 500; ++i) split.observeItl(at(10), 0.03);
  for (int i = 0; i < 200; ++i) split.observeTtft(at(10), 1.6, Route::kDisaggregated);
  for (int i = 0; i < 6; ++i) split.observeShed(at(10), Route::kDisaggregated, true, 3.0);
  CHECK(split.decideDecode(2, decodeLoad(4), at(11)).desired == 2);
  CHECK(split.decidePrefill(1, kNoReports, at(11)).desired == 2);
  // A stream refused at the ITL target is a gap past it.
  Autoscaler streams(prefill, decode, immediate());
  for (int i = 0; i < 90; ++i) streams.observeItl(at(10), 0.03);
  for (int i = 0; i < 10; ++i) streams.observeShed(at(10), Route::kColocated, /*prefillSide*/ false, 0.08);
  CHECK(streams.decideDecode(2, decodeLoad(4), at(11)).desired == 4);
}

TEST_CASE("the decode pool shrinks one at a time when ITL is far under target, never below min") {
  PoolSlo prefill{0.5, 99, 0, 4};
  PoolSlo decode{0.050, 90, 2, 6};
  auto fedWith = [&](double itl) {
    auto a = std::make_unique<Autoscaler>(prefill, decode, immediate());
    for (int i = 0; i < 200; ++i) a->observeItl(at(10), itl);
    return a;
  };
  auto a = fedWith(0.010);  // p90 10 ms vs 50 ms
  auto d = a->decideDecode(5, kNoReports, at(11));
  CHECK(d.desired == 4);
  CHECK(d.attainment == 1.0);
  CHECK_THAT(d.reason, Catch::StartsWith("scale down: latency: p90"));
  CHECK(fedWith(0.010)->decideDecode(2, kNoReports, at(11)).desired == 2);  // min_replicas
  // Near target (within tolerance, or between half and the target): hold.
  CHECK(fedWith(0.052)->decideDecode(3, kNoReports, at(11)).desired == 3);
  CHECK(fedWith(0.030)->decideDecode(3, kNoReports, at(11)).desired == 3);
  // Above max (someone scaled by hand): brought back within bounds.
  CHECK(fedWith(0.030)->decideDecode(9, kNoReports, at(11)).desired == 6);
  // Once the window has passed, the samples are gone; with no work since, the pool is idle
  // and goes to its minimum.
  d = a->decideDecode(4, kNoReports, at(200));
  CHECK(d.samples == 0);
  CHECK(d.desired == 2);
  CHECK_THAT(d.reason, Catch::StartsWith("idle"));
}

TEST_CASE("the percentile, not the mean, drives the decision") {
  PoolSlo prefill{0.5, 99, 1, 8};
  Autoscaler a(prefill, PoolSlo{}, immediate());
  // 97 fast requests and 3 at 2 s: the mean is ~0.16 s but p99 is 2 s.
  for (int i = 0; i < 97; ++i) a.observeTtft(at(50), 0.1);
  for (int i = 0; i < 3; ++i) a.observeTtft(at(50), 2.0);
  auto d = a.decidePrefill(1, kNoReports, at(51));
  CHECK(d.observedSeconds == Approx(2.0).epsilon(0.05));
  CHECK(d.desired == 2);
  CHECK(d.attainment == Approx(0.97));
}

// ---- the capacity model on recorded windows --------------------------------------------------

TEST_CASE("burst: a decode queue scales out at once, in bounded steps, before any ITL breach") {
  PoolSlo decode{0.050, 99, 1, 4};
  Autoscaler a(PoolSlo{}, decode);  // default options: 10 s between scale-ups, +2 at most
  // Quiet: 3 streams fit one worker.
  auto d = a.decideDecode(1, decodeLoad(3), at(100));
  CHECK(d.desired == 1);
  CHECK(d.workerCapacity == 6);
  CHECK(d.capacityReplicas == 1);
  CHECK(d.predictedSeconds == Approx(0.025));
  // 20 requests arrive at once (running + waiting): 20 / 6 -> 4 workers, +2 per step.
  a.observeDecodeArrival(at(104));
  d = a.decideDecode(1, decodeLoad(20), at(105));
  CHECK(d.samples == 0);  // no latency observed yet: the percentile rule cannot see it
  CHECK(d.capacityReplicas == 4);
  CHECK(d.predictedSeconds == Approx(0.110));  // 10 + 5 x 20 ms on the one worker
  CHECK(d.desired == 3);
  CHECK_THAT(d.reason, Catch::StartsWith("scale up: capacity: 20 streams, 6 per worker"));
  // Within the scale-up cooldown: held at 3, though 4 are wanted.
  d = a.decideDecode(1, decodeLoad(20), at(110));
  CHECK(d.desired == 3);
  CHECK_THAT(d.reason, Catch::StartsWith("hold: scale-up cooldown"));
  d = a.decideDecode(3, decodeLoad(20), at(115));
  CHECK(d.desired == 4);
  // More than max_replicas could take: max.
  CHECK(a.decideDecode(4, decodeLoad(200), at(130)).desired == 4);
}

TEST_CASE("queued streams past max_running_requests scale out while every ITL is within target") {
  PoolSlo decode{0.050, 99, 1, 4};
  Autoscaler a(PoolSlo{}, decode);
  // The running streams step fast (10 ms gaps against 50 ms: the percentile says shrink),
  // but each worker runs 4 at most and 10 are there: 6 wait, with no gap to observe.
  for (int i = 0; i < 100; ++i) a.observeItl(at(5), 0.010);
  auto load = decodeLoad(10);
  load.maxStreamsPerWorker = 4;
  auto d = a.decideDecode(1, load, at(6));
  CHECK(d.latencyReplicas == 0);
  CHECK(d.workerCapacity == 4);  // the bound, tighter than the line's 6
  CHECK(d.capacityReplicas == 3);
  CHECK(d.desired == 3);
  // Before the line is fitted the bound alone decides.
  Autoscaler early(PoolSlo{}, decode);
  PoolLoad unfitted;
  unfitted.streams = 10;
  unfitted.maxStreamsPerWorker = 4;
  d = early.decideDecode(1, unfitted, at(6));
  CHECK(d.capacityReplicas == 3);
  CHECK(d.predictedSeconds == 0);
  CHECK_THAT(d.reason, Catch::Contains("max_running_requests; no step line yet"));
  // Shrinking plans the bound at the lower utilization: 4 x 0.6 / 0.8 = 3 per worker, so 7
  // streams keep 3 workers (7 / 4 -> 2 would be needed to grow, 7 / 3 -> 3 to shrink).
  AutoscalerOptions o;
  o.scaleDownCooldown = 0s;
  Autoscaler band(PoolSlo{}, decode, o);
  unfitted.streams = 7;
  CHECK(band.decideDecode(3, unfitted, at(6)).desired == 3);
}

TEST_CASE("ramp: prefill arrivals growing over a minute are met step by step, never overshooting") {
  PoolSlo prefill{1.0, 99, 1, 8};
  AutoscalerOptions o;
  o.scaleUpCooldown = 5s;
  Autoscaler a(prefill, PoolSlo{}, o);
  int current = 1, last = 1, maxSeen = 0;
  for (int t = 0; t <= 90; ++t) {
    // Arrivals ramp from 2k to 32k prompt tokens/s over 60 s, then stay there.
    const double rate = 2000 + 500.0 * std::min(t, 60);
    a.observePrefillArrival(at(1000 + t), int64_t(rate));
    auto d = a.decidePrefill(current, prefillLoad(0), at(1000 + t + 0.5));
    INFO("t " << t << " rate " << rate << ": " << d.reason);
    CHECK(d.desired >= last);  // a ramp only ever grows the pool
    // Never more than the rate (averaged over the last 10 s) needs at 80% utilization.
    CHECK(d.desired <= std::max(1, int(std::ceil(rate / 8000))));
    maxSeen = std::max(maxSeen, d.desired);
    last = d.desired;
    current = d.desired;  // the actuator keeps up
  }
  CHECK(maxSeen == 4);  // 32k / (10k x 0.8)
}

TEST_CASE("a prefill queue predicts its TTFT and scales out before the percentile sees it") {
  PoolSlo prefill{1.0, 99, 1, 8};
  Autoscaler a(prefill, PoolSlo{});
  // 30k tokens queued at 10k tokens/s on one worker: the last of them waits 3 s.
  auto d = a.decidePrefill(1, prefillLoad(30000), at(10));
  CHECK(d.predictedSeconds == Approx(3.0));
  CHECK(d.demand == Approx(30000));
  CHECK(d.capacityReplicas == 4);  // 30k / (10k x 0.8)
  CHECK(d.desired == 3);           // +2 per step
  CHECK(d.samples == 0);
  // Without a measured rate the model abstains (a worker that has not prefilled yet).
  Autoscaler blind(prefill, PoolSlo{});
  d = blind.decidePrefill(1, prefillLoad(30000, 0), at(10));
  CHECK(d.capacityReplicas == -1);
  CHECK(d.demand == Approx(30000));  // the work is known; what a worker does is not
  CHECK(d.desired == 1);
}

TEST_CASE("steady load: the size holds, tick after tick, for ten minutes") {
  PoolSlo decode{0.050, 99, 1, 4};
  Autoscaler a(PoolSlo{}, decode);
  int current = 2, changes = 0;
  for (int t = 0; t < 600; t += 5) {
    for (int i = 0; i < 100; ++i) a.observeItl(at(t), 0.030);  // within target
    a.observeDecodeArrival(at(t));
    auto d = a.decideDecode(current, decodeLoad(11), at(t + 1));  // 11 / 6 -> 2
    INFO("t " << t << ": " << d.reason);
    changes += d.desired != current;
    current = d.desired;
  }
  CHECK(current == 2);
  CHECK(changes == 0);
}

TEST_CASE("flapping bait: a load on the 1 <-> 2 boundary scales once and stays") {
  PoolSlo decode{0.050, 99, 1, 4};
  // Replays streams(t) every 5 s for ten minutes from one worker, the actuator keeping up;
  // returns the final size and how many times it changed.
  const auto replay = [&](auto streams) {
    Autoscaler a(PoolSlo{}, decode);
    int current = 1, changes = 0;
    for (int t = 0; t < 600; t += 5) {
      auto d = a.decideDecode(current, decodeLoad(streams(t)), at(t));
      changes += d.desired != current;
      current = d.desired;
    }
    return std::pair{current, changes};
  };
  SECTION("alternating every tick across the scale-up boundary") {
    // 7 needs 2 workers at 80%; 6 fits one. Up once at the first 7; 6 streams on one worker
    // would run above 60%, so it stays.
    CHECK(replay([](int t) { return (t / 5) % 2 ? 7 : 6; }) == std::pair{2, 1});
  }
  SECTION("dipping below the scale-down boundary for less than the cooldown") {
    // 20 s at 9 (2 workers), 20 s at 3 (1 would do, but not for the 60 s cooldown).
    CHECK(replay([](int t) { return (t / 20) % 2 ? 3 : 9; }) == std::pair{2, 1});
  }
  SECTION("a lower load that lasts past the cooldown does scale down, one step") {
    Autoscaler a(PoolSlo{}, decode);
    CHECK(a.decideDecode(1, decodeLoad(13), at(0)).desired == 3);
    for (int t = 5; t < 65; t += 5) CHECK(a.decideDecode(3, decodeLoad(3), at(t)).desired == 3);
    auto d = a.decideDecode(3, decodeLoad(3), at(65));
    CHECK(d.desired == 2);
    CHECK_THAT(d.reason, Catch::StartsWith("scale down: capacity"));
    // The next step waits a whole cooldown again.
    CHECK(a.decideDecode(2, decodeLoad(3), at(100)).desired == 2);
    CHECK(a.decideDecode(2, decodeLoad(3), at(159)).desired == 2);
    CHECK(a.decideDecode(2, decodeLoad(3), at(161)).desired == 1);
  }
}

TEST_CASE("a percentile at the target vetoes the capacity model's scale-down") {
  PoolSlo decode{0.050, 99, 1, 4};
  AutoscalerOptions o;
  o.scaleDownCooldown = 0s;
  Autoscaler a(PoolSlo{}, decode, o);
  for (int i = 0; i < 100; ++i) a.observeItl(at(10), 0.045);  // p99 45 ms: busy
  auto d = a.decideDecode(3, decodeLoad(2), at(11));          // the line says 1 would do
  CHECK(d.latencyReplicas == 3);
  CHECK(d.desired == 3);
  CHECK_THAT(d.reason, Catch::StartsWith("hold: p99"));
}

TEST_CASE("idle: no requests and no queue for idle_after -> the minimum, at once") {
  PoolSlo decode{0.050, 99, 1, 4};
  PoolSlo prefill{1.0, 99, 0, 4};
  AutoscalerOptions o;
  o.idleAfter = 30s;
  Autoscaler a(prefill, decode, o);
  // Busy until t=10, then nothing: no streams, no arrivals.
  a.observeDecodeArrival(at(10));
  CHECK(a.decideDecode(3, decodeLoad(5), at(10)).desired == 3);
  auto d = a.decideDecode(3, decodeLoad(0), at(25));
  CHECK(d.desired == 3);
  CHECK(d.idleSeconds == Approx(15));
  // A request at t=30 restarts the idle clock (it ended before the next tick saw it).
  a.observeDecodeArrival(at(30));
  CHECK(a.decideDecode(3, decodeLoad(0), at(45)).desired == 3);
  d = a.decideDecode(3, decodeLoad(0), at(61));
  CHECK(d.desired == 1);
  CHECK_THAT(d.reason, Catch::StartsWith("idle: no work for 31 s"));
  // Without any load report (no fitted line, too few samples), idleness alone decides.
  CHECK(a.decidePrefill(2, kNoReports, at(0)).desired == 2);
  CHECK(a.decidePrefill(2, kNoReports, at(29)).desired == 2);
  CHECK(a.decidePrefill(2, kNoReports, at(30)).desired == 0);
  // A queue is work: a prefill pool with queued tokens is not idle (no rate measured yet, so
  // the capacity model abstains).
  Autoscaler q(prefill, decode, o);
  CHECK(q.decidePrefill(2, prefillLoad(100, 0), at(0)).desired == 2);
  CHECK(q.decidePrefill(2, prefillLoad(100, 0), at(100)).desired == 2);
}

TEST_CASE("shared budget: a pool at its maximum borrows the slots the other pool gives up, never more") {
  // Budget 1 + 1 = 2 workers; prefill may go to 0.
  PoolSlo prefill{1.0, 99, /*min*/ 0, /*max*/ 1};
  PoolSlo decode{0.050, 99, /*min*/ 1, /*max*/ 1};
  AutoscalerOptions o = immediate();
  o.idleAfter = 30s;
  o.scaleUpCooldown = 10s;
  o.sharedBudget = true;
  Autoscaler a(prefill, decode, o);
  // Twelve streams want two decode workers (6 each within the target), but the prefill
  // worker is still wanted: decode stays at its own maximum.
  a.observePrefillArrival(at(0), 1000);
  auto [p, d] = a.decide(1, prefillLoad(500), 1, decodeLoad(12), at(1));
  CHECK(p.desired == 1);
  CHECK(d.desired == 1);
  CHECK_THAT(d.reason, Catch::Contains("trimmed from 2: the shared budget of 2 has 1 left"));
  std::tie(p, d) = a.decide(1, prefillLoad(500), 1, decodeLoad(12), at(20));
  CHECK(d.desired == 1);
  // The prefill queue is gone: its slot goes to decode in the same tick (the growth refused
  // a second ago started no scale-up cooldown).
  std::tie(p, d) = a.decide(1, prefillLoad(0), 1, decodeLoad(12), at(21));
  CHECK(p.desired == 0);
  CHECK_THAT(p.reason, Catch::StartsWith("scale down"));
  CHECK(d.desired == 2);
  // The decode load falls: decode shrinks back within its own maximum (at once: no cooldown
  // in these options). A prefill pool at 0 has no measured rate, so its queue alone does not
  // bring it back (docs/serving.md "Not done yet").
  a.observePrefillArrival(at(41), 1000);
  std::tie(p, d) = a.decide(0, prefillLoad(4000, 0), 2, decodeLoad(2), at(42));
  CHECK(d.desired == 1);
  CHECK(p.desired == 0);

  // Without the shared budget the same load keeps each pool within its own bounds.
  o.sharedBudget = false;
  Autoscaler fixed(prefill, decode, o);
  auto [fp, fd] = fixed.decide(1, prefillLoad(0), 1, decodeLoad(12), at(40));
  CHECK(fd.desired == 1);
  CHECK_THAT(fd.reason, !Catch::Contains("trimmed"));
}

TEST_CASE(
    "shared budget: a pool takes what the other gives up; when both want more than their own, each gets its own") {
  PoolSlo prefill{0.5, 99, 1, 2};
  PoolSlo decode{0.050, 99, 1, 2};
  AutoscalerOptions o = immediate();
  o.sharedBudget = true;
  Autoscaler a(prefill, decode, o);
  // Either may be recommended up to 4 - 1 = 3: prefill's queue needs one worker, so decode
  // (30 streams at 6 a worker: 5) takes the slot prefill gives up ...
  a.observePrefillArrival(at(0), 1);
  auto [p, d] = a.decide(2, prefillLoad(100), 2, decodeLoad(30), at(1));
  CHECK(p.desired == 1);
  CHECK(d.desired == 3);
  // ... and when both want more than their own, neither takes the other's.
  Autoscaler both(prefill, decode, o);
  both.observePrefillArrival(at(0), 1);
  std::tie(p, d) = both.decide(2, prefillLoad(40000), 2, decodeLoad(30), at(1));
  CHECK(p.desired == 2);
  CHECK(d.desired == 2);
  CHECK_THAT(p.reason, Catch::Contains("trimmed from"));
}

TEST_CASE("a pool is met at its first registered worker, not at the router's first tick") {
  // The router ticks before the workers it was started with register: a pool that may go to
  // 0 must not be recommended 0 from that empty view (its worker would be drained at once).
  PoolSlo prefill{1.0, 99, /*min*/ 0, /*max*/ 2};
  PoolSlo decode{0.050, 99, 1, 2};
  AutoscalerOptions o;
  o.idleAfter = 30s;
  Autoscaler a(prefill, decode, o);
  auto d = a.decidePrefill(0, kNoReports, at(0));
  CHECK(d.desired == 0);
  CHECK(d.reason == "hold: no worker of the pool registered yet");
  // It registers at t=5: held, and idle only idle_after later.
  CHECK(a.decidePrefill(1, kNoReports, at(5)).desired == 1);
  CHECK(a.decidePrefill(1, kNoReports, at(34)).desired == 1);
  CHECK(a.decidePrefill(1, kNoReports, at(35)).desired == 0);
}
