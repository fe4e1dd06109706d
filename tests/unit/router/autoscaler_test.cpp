// router::Autoscaler: window percentiles, and the replica recommendation per pool.
#include "router/autoscaler.h"

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::router;
using namespace std::chrono_literals;

namespace {
SteadyTime at(double seconds) {
  return SteadyTime(std::chrono::duration_cast<SteadyTime::duration>(std::chrono::duration<double>(seconds)));
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
  Autoscaler a(prefill, decode);
  // Too few samples: hold whatever is running, inside the bounds.
  for (int i = 0; i < 10; ++i) a.observeTtft(at(100), 2.0);
  auto d = a.decidePrefill(2, at(101));
  CHECK(d.desired == 2);
  CHECK(d.samples == 10);
  CHECK_THAT(d.reason, Catch::StartsWith("hold: 10 samples < 20"));

  // p99 = 0.8 s against 0.5 s: ratio 1.6 -> ceil(2 * 1.6) = 4.
  Autoscaler fresh(prefill, decode);
  for (int i = 0; i < 100; ++i) fresh.observeTtft(at(102), 0.8);
  d = fresh.decidePrefill(2, at(103));
  CHECK(d.desired == 4);
  CHECK(d.observedSeconds == Approx(0.8).epsilon(0.05));
  CHECK(d.attainment == 0.0);
  CHECK_THAT(d.reason, Catch::StartsWith("scale up: p99"));

  // Ten times over target: capped at double, then at max_replicas.
  Autoscaler slow(prefill, decode);
  for (int i = 0; i < 50; ++i) slow.observeTtft(at(200), 5.0);
  CHECK(slow.decidePrefill(2, at(201)).desired == 4);
  CHECK(slow.decidePrefill(6, at(201)).desired == 8);
  // An empty pool with traffic over target gets at least one more.
  CHECK(slow.decidePrefill(0, at(201)).desired == 2);
}

TEST_CASE("the decode pool shrinks one at a time when ITL is far under target, never below min") {
  PoolSlo prefill{0.5, 99, 0, 4};
  PoolSlo decode{0.050, 90, 2, 6};
  Autoscaler a(prefill, decode);
  for (int i = 0; i < 200; ++i) a.observeItl(at(10), 0.010);  // p90 10 ms vs 50 ms
  auto d = a.decideDecode(5, at(11));
  CHECK(d.desired == 4);
  CHECK(d.attainment == 1.0);
  CHECK_THAT(d.reason, Catch::StartsWith("scale down: p90"));
  CHECK(a.decideDecode(2, at(11)).desired == 2);  // min_replicas
  // Near target (within tolerance, or between half and the target): hold.
  Autoscaler near(prefill, decode);
  for (int i = 0; i < 200; ++i) near.observeItl(at(10), 0.052);
  CHECK(near.decideDecode(3, at(11)).desired == 3);
  Autoscaler mid(prefill, decode);
  for (int i = 0; i < 200; ++i) mid.observeItl(at(10), 0.030);
  CHECK(mid.decideDecode(3, at(11)).desired == 3);
  // Above max (someone scaled by hand): brought back within bounds.
  CHECK(mid.decideDecode(9, at(11)).desired == 6);
  // Once the window has passed, the samples are gone and the decision holds.
  d = a.decideDecode(5, at(200));
  CHECK(d.samples == 0);
  CHECK(d.desired == 5);
}

TEST_CASE("the percentile, not the mean, drives the decision") {
  PoolSlo prefill{0.5, 99, 1, 8};
  Autoscaler a(prefill, PoolSlo{});
  // 97 fast requests and 3 at 2 s: the mean is ~0.16 s but p99 is 2 s.
  for (int i = 0; i < 97; ++i) a.observeTtft(at(50), 0.1);
  for (int i = 0; i < 3; ++i) a.observeTtft(at(50), 2.0);
  auto d = a.decidePrefill(1, at(51));
  CHECK(d.observedSeconds == Approx(2.0).epsilon(0.05));
  CHECK(d.desired == 2);
  CHECK(d.attainment == Approx(0.97));
}
