// `pdserve bench mixed`: the plans it sends and the figures and verdict it derives from the
// records (the network side is runLoad's, tested in client_test.cpp).
#include "tools/bench/mixed.h"

#include <catch2/catch.hpp>

namespace pd::bench {
namespace {

RequestRecord record(int64_t index, std::vector<double> gaps, bool ok = true, double ttft = 100) {
  RequestRecord r;
  r.index = index;
  r.ok = ok;
  r.error = ok ? "" : "HTTP 503: no healthy decode worker";
  r.ttftMs = ttft;
  r.itlsMs = std::move(gaps);
  return r;
}

TEST_CASE("bench mixed: the plans put the short streams first and space the long prompts", "[bench][mixed]") {
  MixedOptions o;
  const Workload solo = soloWorkload(o), mixed = mixedWorkload(o);
  REQUIRE(solo.requests.size() == 2);
  REQUIRE(mixed.requests.size() == 6);
  CHECK(mixed.requests[0].promptTokens == 100);
  CHECK(mixed.requests[0].outputTokens == 400);
  CHECK(mixed.requests[2].promptTokens == 2000);
  CHECK(mixed.requests[2].scheduledS == Approx(1.0));
  CHECK(mixed.requests[5].scheduledS == Approx(4.0));
  o.shortOutputTokens = 1;
  CHECK_THAT(validate(o).message(), Catch::Contains("--short-output"));
}

TEST_CASE("bench mixed: gaps are pooled per phase, errors are listed, the check applies the bounds", "[bench][mixed]") {
  MixedOptions o;
  std::vector<double> even(100, 10.0);
  std::vector<RequestRecord> solo{record(0, even), record(1, even)};
  std::vector<double> spiky = even;
  spiky[50] = 25.0;  // 2.5x the solo p99 of 10 ms
  std::vector<RequestRecord> mixed{record(0, spiky), record(1, even), record(2, {}, true, 3000),
                                   record(3, {}, true, 5000)};
  MixedResult r = summarizeMixed(solo, mixed, o);
  CHECK(r.solo.count == 200);
  CHECK(r.mixed.count == 200);
  CHECK(r.mixed.maxMs == 25.0);
  CHECK(r.maxOverSoloP99() == Approx(2.5));
  CHECK(r.longTtftMs.count == 2);
  CHECK(r.errors.empty());
  CHECK(checkMixed(r, 3, 1.5).empty());
  CHECK_THAT(checkMixed(r, 2, 1.5), Catch::Contains("max gap 2.50x"));

  mixed.push_back(record(4, {}, false));
  r = summarizeMixed(solo, mixed, o);
  REQUIRE(r.errors.size() == 1);
  CHECK_THAT(r.errors[0], Catch::Contains("mixed long #4: HTTP 503"));
  CHECK_THAT(checkMixed(r, 3, 1.5), Catch::Contains("1 error(s)"));
  CHECK_THAT(formatMixed("x", r), Catch::Contains("errors: 1"));
}

}  // namespace
}  // namespace pd::bench
