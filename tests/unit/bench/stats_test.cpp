// Percentiles (numpy's default interpolation), summaries, SLO parsing and goodput.
#include "tools/bench/stats.h"

#include <cmath>

#include <catch2/catch.hpp>

using namespace pd::bench;

TEST_CASE("percentiles interpolate as numpy.percentile does by default", "[bench][stats]") {
  // numpy.percentile([15, 20, 35, 40, 50], q): rank = q/100 * (n-1), linear in between.
  const std::vector<double> v{50, 15, 40, 20, 35};
  CHECK(percentile(v, 40) == Approx(29.0));
  CHECK(percentile(v, 50) == Approx(35.0));
  CHECK(percentile(v, 90) == Approx(46.0));
  CHECK(percentile(v, 99) == Approx(49.6));
  CHECK(percentile(v, 0) == Approx(15.0));
  CHECK(percentile(v, 100) == Approx(50.0));
  // numpy.percentile(range(1, 11), [50, 90, 95, 99]) = [5.5, 9.1, 9.55, 9.91]
  std::vector<double> ten;
  for (int i = 1; i <= 10; ++i) ten.push_back(i);
  CHECK(percentile(ten, 50) == Approx(5.5));
  CHECK(percentile(ten, 90) == Approx(9.1));
  CHECK(percentile(ten, 95) == Approx(9.55));
  CHECK(percentile(ten, 99) == Approx(9.91));
  CHECK(std::isnan(percentile({}, 50)));
  CHECK(percentile({7}, 99) == 7);
  // Nearest rank differs: ceil(0.9 * 10) = 9th value.
  CHECK(nearestRankSorted(ten, 90) == 9);
  CHECK(nearestRankSorted(ten, 91) == 10);
}

TEST_CASE("summaries use the population stddev and skip NaN", "[bench][stats]") {
  const Summary s = summarize({15, 20, 35, 40, 50, kNaN});
  CHECK(s.count == 5);
  CHECK(s.mean == Approx(32.0));
  CHECK(s.stddev == Approx(std::sqrt(166.0)));  // numpy.std (ddof=0)
  CHECK(s.median == Approx(35.0));
  CHECK(s.p90 == Approx(46.0));
  CHECK(s.p95 == Approx(48.0));
  CHECK(s.p99 == Approx(49.6));
  CHECK(s.min == 15);
  CHECK(s.max == 50);
  CHECK(std::isnan(summarize({}).mean));
}

TEST_CASE("SLO specs parse and reject bad keys", "[bench][stats]") {
  auto s = parseSlo("ttft_ms=500,itl_ms=50");
  REQUIRE(s.ok());
  CHECK(*s->ttftMs == 500);
  CHECK(*s->itlMs == 50);
  CHECK_FALSE(s->tpotMs);
  CHECK(s->itlPercentile == 99);
  auto t = parseSlo("tpot_ms=40,e2el_ms=9000,itl_ms=30,itl_pct=90");
  REQUIRE(t.ok());
  CHECK(t->itlPercentile == 90);
  CHECK(*t->e2elMs == 9000);
  auto bad = parseSlo("ttft_ms=500,latency=3");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("unknown key 'latency'"));
  auto neg = parseSlo("ttft_ms=-1");
  REQUIRE_FALSE(neg.ok());
  CHECK_THAT(neg.status().message(), Catch::Contains("ttft_ms"));
  CHECK_FALSE(parseSlo("").ok());
  CHECK_FALSE(parseSlo("ttft_ms").ok());
}

namespace {
RequestRecord rec(double startS, double ttft, std::vector<double> itls, bool ok = true) {
  RequestRecord r;
  r.startS = r.eligibleS = r.scheduledS = startS;
  r.ok = ok;
  r.httpStatus = ok ? 200 : 503;
  if (!ok) r.error = "HTTP 503: busy";
  r.promptTokens = 100;
  r.ttftMs = ttft;
  double e2e = ttft;
  for (double g : itls) e2e += g;
  r.e2eMs = e2e;
  r.outputTokens = static_cast<int64_t>(itls.size()) + 1;
  r.itlsMs = std::move(itls);
  return r;
}
}  // namespace

TEST_CASE("shed requests: HTTP 429s counted, with the send time of the first", "[bench][stats]") {
  std::vector<RequestRecord> rs;
  rs.push_back(rec(0.0, 100, {20}));
  for (double at : {2.5, 1.5}) {
    RequestRecord r = rec(at, kNaN, {}, /*ok=*/false);
    r.httpStatus = 429;
    r.error = "HTTP 429: overloaded";
    rs.push_back(r);
  }
  rs.push_back(rec(3.0, kNaN, {}, /*ok=*/false));  // a 503 is a failure, not a shed request
  const Aggregate a = aggregate(rs, 4.0, Slo{});
  CHECK(a.shed == 2);
  CHECK(a.firstShedS == Approx(1.5));
  CHECK(a.failed == 3);
  CHECK(std::isnan(aggregate({rs[0]}, 4.0, Slo{}).firstShedS));
}

TEST_CASE("goodput counts requests meeting every target and which target each missed", "[bench][stats]") {
  std::vector<RequestRecord> rs;
  rs.push_back(rec(0.0, 100, {20, 20, 20}));       // good
  rs.push_back(rec(0.5, 700, {20, 20, 20}));       // misses TTFT
  rs.push_back(rec(1.0, 100, {20, 90, 20}));       // misses ITL (its p99 gap ~ 89)
  rs.push_back(rec(1.5, 900, {20, 20, 95}));       // misses both
  rs.push_back(rec(2.0, 200, {10, 10, 10}));       // good
  rs.push_back(rec(2.5, kNaN, {}, /*ok=*/false));  // failed: not good, not counted as a miss
  auto slo = parseSlo("ttft_ms=500,itl_ms=50");
  REQUIRE(slo.ok());
  const Aggregate a = aggregate(rs, 4.0, *slo);
  CHECK(a.completed == 5);
  CHECK(a.failed == 1);
  CHECK(a.goodRequests == 2);
  CHECK(a.requestGoodput == Approx(0.5));
  CHECK(a.missedTtft == 2);
  CHECK(a.missedItl == 2);
  CHECK(a.requestThroughput == Approx(5 / 4.0));
  CHECK(a.totalInputTokens == 500);
  CHECK(a.totalOutputTokens == 20);
  CHECK(a.outputThroughput == Approx(20 / 4.0));
  CHECK(a.errorsByKind.at("HTTP 503") == 1);
  // ITL pooled over all gaps of successful requests: 15 gaps.
  CHECK(a.itl.count == 15);
  CHECK(a.ttft.median == Approx(200));
  // TPOT = (e2e - ttft) / (out - 1): for request 3, (130) / 3.
  CHECK(rs[2].tpotMs() == Approx(130.0 / 3));
  CHECK(a.tpot.max == Approx(135.0 / 3));
}

TEST_CASE("aggregate measures concurrency, peak token rate and generator lag", "[bench][stats]") {
  std::vector<RequestRecord> rs;
  rs.push_back(rec(0.0, 100, {100, 100, 100, 100}));  // 0.0 - 0.5 s
  rs.push_back(rec(0.2, 100, {100, 100}));            // 0.2 - 0.5 s
  rs.push_back(rec(0.6, 100, {100}));                 // 0.6 - 0.8 s
  rs[1].eligibleS = 0.15;                             // sent 50 ms late
  rs[2].eligibleS = 0.599;                            // 1 ms late
  const Aggregate a = aggregate(rs, 1.0, Slo{});
  CHECK_FALSE(a.haveSlo);
  CHECK(a.maxConcurrentRequests == 2);
  CHECK(a.maxOutputTokensPerS == Approx(10));
  CHECK(a.lagMaxMs == Approx(50).margin(1e-6));
  CHECK(a.lagMeanMs == Approx(17.0).margin(1e-6));
  CHECK(a.lateStarts == 1);
  const TimeSeries ts = timeSeries(rs, 1.0);
  REQUIRE(ts.outputTokensPerS.size() == 1);
  CHECK(ts.completedPerS[0] == 3);
}
