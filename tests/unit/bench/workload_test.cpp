// Workload plans: length distributions, arrivals, trace scaling and exact prompt construction.
#include "tools/bench/workload.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <set>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tools/bench/stats.h"

using namespace pd::bench;

namespace {
std::string tracesDir() {
  if (const char* env = std::getenv("PD_TRACES_DIR")) return env;
  return std::string(PD_SOURCE_DIR) + "/data/traces";
}
}  // namespace

TEST_CASE("length specs parse, and bad ones name the option", "[bench][workload]") {
  auto f = parseLengthSpec("512", "--prompt-len");
  REQUIRE(f.ok());
  CHECK(f->kind == LengthSpec::Kind::kFixed);
  CHECK(f->a == 512);
  auto u = parseLengthSpec("uniform:10:20", "--prompt-len");
  REQUIRE(u.ok());
  CHECK(u->kind == LengthSpec::Kind::kUniform);
  auto l = parseLengthSpec("lognormal:300:0.5", "--output-len");
  REQUIRE(l.ok());
  CHECK(l->kind == LengthSpec::Kind::kLognormal);
  for (const char* bad : {"0", "uniform:20:10", "gamma:1:2", "lognormal:100", "x"}) {
    auto r = parseLengthSpec(bad, "--prompt-len");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("--prompt-len"));
  }
}

TEST_CASE("synthetic workloads follow their distributions and are seeded", "[bench][workload]") {
  WorkloadOptions o;
  o.promptLen = *parseLengthSpec("uniform:100:200", "p");
  o.outputLen = *parseLengthSpec("lognormal:300:0.5", "o");
  o.numRequests = 20000;
  o.rate = 50;
  o.seed = 7;
  auto w = buildWorkload(o);
  REQUIRE(w.ok());
  REQUIRE(w->requests.size() == 20000);
  CHECK(w->arrival == ArrivalMode::kPoisson);
  double pMin = 1e9, pMax = 0, oSum = 0;
  std::vector<double> gaps;
  for (size_t i = 0; i < w->requests.size(); ++i) {
    const auto& r = w->requests[i];
    pMin = std::min(pMin, static_cast<double>(r.promptTokens));
    pMax = std::max(pMax, static_cast<double>(r.promptTokens));
    oSum += static_cast<double>(r.outputTokens);
    if (i) gaps.push_back(r.scheduledS - w->requests[i - 1].scheduledS);
  }
  CHECK(pMin == 100);
  CHECK(pMax == 200);
  CHECK(oSum / 20000 == Approx(300).epsilon(0.03));
  const Summary g = summarize(gaps);
  CHECK(g.mean == Approx(1.0 / 50).epsilon(0.03));
  CHECK(g.stddev / g.mean == Approx(1.0).epsilon(0.05));  // exponential gaps: CV 1
  // Same seed, same plan; another seed, another plan.
  auto again = buildWorkload(o);
  REQUIRE(again.ok());
  CHECK(again->requests[123].promptTokens == w->requests[123].promptTokens);
  CHECK(again->requests[123].scheduledS == w->requests[123].scheduledS);
  o.seed = 8;
  auto other = buildWorkload(o);
  REQUIRE(other.ok());
  int same = 0;
  for (size_t i = 0; i < 100; ++i) same += other->requests[i].promptTokens == w->requests[i].promptTokens;
  CHECK(same < 20);
}

TEST_CASE("a workload needs a size", "[bench][workload]") {
  WorkloadOptions o;
  auto w = buildWorkload(o);
  REQUIRE_FALSE(w.ok());
  CHECK_THAT(w.status().message(), Catch::Contains("--num-requests"));
  o.durationS = 2;
  o.rate = 10;
  auto d = buildWorkload(o);
  REQUIRE(d.ok());
  for (const auto& r : d->requests) CHECK(r.scheduledS < 2);
  CHECK(d->requests.size() > 5);
}

TEST_CASE("trace replay scales times and lengths", "[bench][workload]") {
  WorkloadOptions o;
  o.tracePath = tracesDir() + "/mooncake_fast25_synthetic_trace.jsonl";
  o.numRequests = 200;
  o.timeScale = 0.5;
  o.maxPromptTokens = 2048;
  o.maxOutputTokens = 128;
  o.warmup = 3;
  auto w = buildWorkload(o);
  INFO(w.status().toString());
  REQUIRE(w.ok());
  CHECK(w->arrival == ArrivalMode::kTrace);
  REQUIRE(w->requests.size() == 200);
  REQUIRE(w->warmups.size() == 3);
  CHECK(w->warmups[0].hashIds.empty());
  int64_t longest = 0;
  for (const auto& r : w->requests) {
    longest = std::max(longest, r.promptTokens);
    CHECK(r.outputTokens <= 128);
    CHECK(r.outputTokens >= 1);
    // Scaled blocks still cover the prompt: ceil(len / block) <= number of hash ids.
    CHECK((r.promptTokens + r.blockTokens - 1) / r.blockTokens <= static_cast<int64_t>(r.hashIds.size()) + 1);
  }
  CHECK(longest == 2048);
  CHECK(w->lengthScale < 1);
  CHECK(w->requests[0].blockTokens == std::max<int64_t>(1, std::llround(512 * w->lengthScale)));
  // Trace timestamps in ms, halved.
  CHECK(w->requests[0].scheduledS == 0);
  CHECK(w->requests[199].scheduledS > 0);
  auto full = buildWorkload([&] {
    auto x = o;
    x.timeScale = 1;
    return x;
  }());
  REQUIRE(full.ok());
  CHECK(w->requests[199].scheduledS == Approx(full->requests[199].scheduledS * 0.5));
}

TEST_CASE("requests sharing hash ids share exactly those prefix blocks", "[bench][workload]") {
  TokenIdRange range{10, 246};
  PlannedRequest a, b, c;
  a.index = 0;
  a.blockTokens = 4;
  a.hashIds = {0, 1, 2};
  a.promptTokens = 11;  // blocks 0,1 whole + 3 tokens of block 2
  b.index = 1;
  b.blockTokens = 4;
  b.hashIds = {0, 1, 9};
  b.promptTokens = 12;
  c.index = 2;
  c.promptTokens = 12;  // no hash ids: unique
  const auto ia = promptTokenIds(a, range, 42), ib = promptTokenIds(b, range, 42), ic = promptTokenIds(c, range, 42);
  REQUIRE(ia.size() == 11);
  REQUIRE(ib.size() == 12);
  REQUIRE(ic.size() == 12);
  for (int i = 0; i < 8; ++i) CHECK(ia[i] == ib[i]);
  int sameThird = 0;
  for (int i = 8; i < 11; ++i) sameThird += ia[i] == ib[i];
  CHECK(sameThird < 3);
  for (auto id : ia) {
    CHECK(id >= 10);
    CHECK(id < 246);
  }
  int sameC = 0;
  for (int i = 0; i < 8; ++i) sameC += ia[i] == ic[i];
  CHECK(sameC < 3);
  // A request whose prompt is longer than its hashed blocks gets a unique tail.
  PlannedRequest d = a;
  d.index = 3;
  d.promptTokens = 20;
  const auto id = promptTokenIds(d, range, 42);
  REQUIRE(id.size() == 20);
  for (int i = 0; i < 11; ++i) CHECK(id[i] == ia[i]);
  // Another seed: other content.
  const auto other = promptTokenIds(a, range, 43);
  int same = 0;
  for (size_t i = 0; i < other.size(); ++i) same += other[i] == ia[i];
  CHECK(same < 4);
}

TEST_CASE("request bodies carry exact lengths", "[bench][workload]") {
  PlannedRequest r;
  r.index = 5;
  r.promptTokens = 37;
  r.outputTokens = 9;
  BodyOptions o;
  o.model = "small";
  o.ids = {10, 246};
  o.extraJson = R"({"top_k": 1})";
  auto j = nlohmann::json::parse(buildRequestBody(r, o));
  CHECK(j["model"] == "small");
  CHECK(j["stream"] == true);
  CHECK(j["stream_options"]["include_usage"] == true);
  CHECK(j["max_tokens"] == 9);
  CHECK(j["ignore_eos"] == true);
  CHECK(j["top_k"] == 1);
  REQUIRE(j["prompt"].is_array());
  CHECK(j["prompt"].size() == 37);
  CHECK(j["prompt"].get<std::vector<int32_t>>() == promptTokenIds(r, o.ids, 0));
  o.endpoint = Endpoint::kChat;
  auto c = nlohmann::json::parse(buildRequestBody(r, o));
  CHECK_FALSE(c.contains("prompt"));
  CHECK(c["max_completion_tokens"] == 9);
  REQUIRE(c["messages"].size() == 1);
  CHECK(c["messages"][0]["role"] == "user");
  const std::string text = c["messages"][0]["content"];
  CHECK(text.size() == 37);  // byte-approx: one ASCII byte per token
  for (char ch : text) CHECK(((ch >= 'a' && ch <= 'z') || ch == ' '));
}

TEST_CASE("spread ticks smooth the Mooncake conversation trace's 3-second ticks", "[bench][workload]") {
  WorkloadOptions o;
  o.tracePath = tracesDir() + "/mooncake_fast25_conversation_trace.jsonl";
  o.numRequests = 1000;
  auto burst = buildWorkload(o);
  REQUIRE(burst.ok());
  o.spreadTicks = true;
  auto smooth = buildWorkload(o);
  REQUIRE(smooth.ok());
  std::set<double> a, b;
  for (const auto& r : burst->requests) a.insert(r.scheduledS);
  for (const auto& r : smooth->requests) b.insert(r.scheduledS);
  CHECK(a.size() < 150);    // ~10 requests per tick
  CHECK(b.size() == 1000);  // every request at its own time
  // Same span, same order; each tick's first request keeps its time.
  for (size_t i = 1; i < smooth->requests.size(); ++i) {
    CHECK(smooth->requests[i].scheduledS >= smooth->requests[i - 1].scheduledS);
    if (burst->requests[i].scheduledS != burst->requests[i - 1].scheduledS)
      CHECK(smooth->requests[i].scheduledS == burst->requests[i].scheduledS);
  }
  std::vector<double> gaps;
  for (size_t i = 1; i < smooth->requests.size(); ++i)
    gaps.push_back(smooth->requests[i].scheduledS - smooth->requests[i - 1].scheduledS);
  const Summary g = summarize(gaps);
  CHECK(g.stddev / g.mean < 1.0);  // the recorded ticks have CV 3.03
}
