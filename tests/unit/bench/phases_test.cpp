// Phased workloads (`pdserve bench --phase`): the spec's parsing and refusals, and the plan's
// schedule (monotonic times, requests inside their phase, lengths from their phase).
#include <cmath>

#include <catch2/catch.hpp>

#include "tools/bench/workload.h"

using namespace pd::bench;

namespace {
PhaseSpec defaults() {
  PhaseSpec d;
  d.promptLen = {LengthSpec::Kind::kFixed, 256, 0};
  d.outputLen = {LengthSpec::Kind::kFixed, 64, 0};
  return d;
}
PhaseSpec phase(const char* text, int n = 1) {
  auto p = parsePhaseSpec(text, n, defaults());
  REQUIRE(p.ok());
  return *p;
}
}  // namespace

TEST_CASE("phase specs parse every field, and left-out ones take the run's defaults", "[bench][phases]") {
  const PhaseSpec p = phase("prompt-len=uniform:16:128,output-len=uniform:16:64,rate=3,duration=30");
  CHECK(p.promptLen.kind == LengthSpec::Kind::kUniform);
  CHECK(p.promptLen.a == 16);
  CHECK(p.promptLen.b == 128);
  CHECK(p.outputLen.b == 64);
  CHECK(p.rate == 3);
  CHECK(p.durationS == 30);
  CHECK(p.describe() == "prompt uniform[16,128], output uniform[16,64], 3/s for 30 s");

  PhaseSpec d = defaults();
  d.rate = 2.5;
  auto q = parsePhaseSpec("duration=10", 2, d);
  REQUIRE(q.ok());
  CHECK(q->rate == 2.5);
  CHECK(q->promptLen.a == 256);
  CHECK(q->outputLen.a == 64);
  CHECK(phase("rate=0.5,duration=1.5,prompt-len=lognormal:500:0.5").promptLen.kind == LengthSpec::Kind::kLognormal);
}

TEST_CASE("bad phase specs are refused naming the phase and the field", "[bench][phases]") {
  struct Case {
    const char* text;
    const char* want;
  } cases[] = {
      {"", "--phase 3: empty"},
      {"rate=3", "--phase 3: duration is missing"},
      {"duration=10", "--phase 3: rate is missing"},
      {"rat=3,duration=10", "unknown field 'rat'"},
      {"rate=3,duration=10,", "'' is not FIELD=VALUE"},
      {"rate,duration=10", "'rate' is not FIELD=VALUE"},
      {"rate=-1,duration=10", "rate '-1' is not a number > 0"},
      {"rate=3,duration=0", "duration '0' is not a number > 0"},
      {"rate=3,duration=x", "duration 'x'"},
      {"rate=3,rate=4,duration=1", "field 'rate' given twice"},
      {"prompt-len=uniform:9:3,rate=3,duration=1", "--phase 3 prompt-len: 'uniform:9:3'"},
      {"output-len=gamma:1:2,rate=3,duration=1", "--phase 3 output-len"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    auto r = parsePhaseSpec(c.text, 3, defaults());
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains(c.want));
  }
}

TEST_CASE("a phased plan: monotonic times, each request inside its phase with its phase's lengths", "[bench][phases]") {
  WorkloadOptions o;
  o.seed = 7;
  o.warmup = 2;
  o.phases = {phase("prompt-len=uniform:16:128,output-len=uniform:4:8,rate=20,duration=10"),
              phase("prompt-len=uniform:1000:2000,output-len=16,rate=5,duration=10"),
              phase("prompt-len=uniform:16:128,output-len=uniform:4:8,rate=20,duration=5")};
  auto w = buildWorkload(o);
  REQUIRE(w.ok());
  CHECK(w->arrival == ArrivalMode::kPoisson);
  REQUIRE(w->phases.size() == 3);
  CHECK(w->phases[0].startS == 0);
  CHECK(w->phases[0].endS == 10);
  CHECK(w->phases[1].startS == 10);
  CHECK(w->phases[1].endS == 20);
  CHECK(w->phases[2].startS == 20);
  CHECK(w->phases[2].endS == 25);
  int counts[3] = {0, 0, 0};
  double last = -1;
  for (size_t i = 0; i < w->requests.size(); ++i) {
    const PlannedRequest& r = w->requests[i];
    CHECK(r.index == static_cast<int64_t>(i));
    CHECK(r.scheduledS > last);  // strictly increasing
    last = r.scheduledS;
    REQUIRE(r.phase >= 0);
    REQUIRE(r.phase < 3);
    const PhaseWindow& win = w->phases[static_cast<size_t>(r.phase)];
    CHECK(r.scheduledS >= win.startS);
    CHECK(r.scheduledS < win.endS);
    CHECK(r.promptTokens >= win.spec.promptLen.a);
    CHECK(r.promptTokens <= (r.phase == 1 ? 2000 : 128));
    if (r.phase == 1)
      CHECK(r.outputTokens == 16);
    else
      CHECK((r.outputTokens >= 4 && r.outputTokens <= 8));
    ++counts[r.phase];
  }
  // Poisson counts near rate x duration (200, 50, 100; 5 sigma bounds).
  CHECK(std::abs(counts[0] - 200) < 5 * std::sqrt(200.0));
  CHECK(std::abs(counts[1] - 50) < 5 * std::sqrt(50.0));
  CHECK(std::abs(counts[2] - 100) < 5 * std::sqrt(100.0));
  // Phases follow each other: every request of phase k comes before any of phase k+1.
  for (size_t i = 1; i < w->requests.size(); ++i) CHECK(w->requests[i].phase >= w->requests[i - 1].phase);
  REQUIRE(w->warmups.size() == 2);
  for (const auto& r : w->warmups) {
    CHECK(r.warmup);
    CHECK(r.promptTokens <= 128);  // warm-ups look like the first phase
  }
  CHECK_THAT(w->describe, Catch::Contains("3 phases"));

  // The same seed gives the same plan; another seed another one.
  auto again = buildWorkload(o);
  REQUIRE(again.ok());
  REQUIRE(again->requests.size() == w->requests.size());
  for (size_t i = 0; i < w->requests.size(); ++i) {
    CHECK(again->requests[i].scheduledS == w->requests[i].scheduledS);
    CHECK(again->requests[i].promptTokens == w->requests[i].promptTokens);
  }
  o.seed = 8;
  auto other = buildWorkload(o);
  REQUIRE(other.ok());
  CHECK(other->requests.front().scheduledS != w->requests.front().scheduledS);
}

TEST_CASE("phases refuse the options that would contradict them", "[bench][phases]") {
  WorkloadOptions o;
  o.phases = {phase("rate=2,duration=5")};
  auto withTrace = o;
  withTrace.tracePath = "x.csv";
  auto withDuration = o;
  withDuration.durationS = 3;
  auto withCount = o;
  withCount.numRequests = 3;
  auto closed = o;
  closed.closedLoop = true;
  struct Case {
    WorkloadOptions opts;
    const char* want;
  } cases[] = {
      {withTrace, "--trace"}, {withDuration, "--duration"}, {withCount, "--num-requests"}, {closed, "open-loop"}};
  for (const auto& c : cases) {
    auto w = buildWorkload(c.opts);
    REQUIRE_FALSE(w.ok());
    CHECK_THAT(w.status().message(), Catch::Contains(c.want));
  }
  // Caps apply to phased lengths too.
  o.phases = {phase("prompt-len=uniform:500:900,output-len=100,rate=50,duration=2")};
  o.maxPromptTokens = 600;
  o.maxOutputTokens = 10;
  auto w = buildWorkload(o);
  REQUIRE(w.ok());
  for (const auto& r : w->requests) {
    CHECK(r.promptTokens <= 600);
    CHECK(r.outputTokens == 10);
  }
  // A phase too short to hold an arrival (rate x duration tiny) with no other phase: empty plan.
  o.phases = {phase("rate=0.001,duration=0.001")};
  auto empty = buildWorkload(o);
  REQUIRE_FALSE(empty.ok());
  CHECK_THAT(empty.status().message(), Catch::Contains("no request"));
}
