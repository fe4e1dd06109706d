// plan::StepSpread (`pdserve plan --step-trace`): a worker's step trace priced by the cost
// model, the ratios drawn by the simulator per kind of step, and the errors that name the row.
#include "tools/plan/step_spread.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>

#include <catch2/catch.hpp>

#include "tools/plan/cluster_sim.h"

using namespace pd::plan;
namespace engine = pd::engine;

namespace {

CostModel h100() {
  auto m = findModel("llama-3-8b");
  REQUIRE(m.ok());
  auto g = findGpu("h100-sxm");
  REQUIRE(g.ok());
  return CostModel(*m, deviceOf(*g), 1);
}

engine::SeqChunk chunk(int tokens, int start) {
  engine::SeqChunk c;
  c.numTokens = tokens;
  c.startPos = start;
  c.wantLogits = true;
  return c;
}

double stepOf(const CostModel& c, std::vector<engine::SeqChunk> batch) { return c.stepSeconds(batch); }

std::vector<int32_t> promptOf(int n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 100);
  return p;
}

// `n` ratios of `value` for steps of one class.
std::vector<std::pair<StepClass, double>> same(StepKind kind, int64_t size, double value, int n = 20) {
  return std::vector<std::pair<StepClass, double>>(size_t(n), {StepClass{kind, size}, value});
}

std::vector<std::pair<StepClass, double>> concat(std::vector<std::vector<std::pair<StepClass, double>>> parts) {
  std::vector<std::pair<StepClass, double>> out;
  for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

const char* kHeader =
    "time_s,role,seconds,gap_seconds,decode_rows,decode_context_tokens,prompt_chunks,prompt_tokens,"
    "prompt_context_tokens\n";

std::string writeTrace(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("pd_spread_" + std::to_string(::getpid()) + name);
  std::ofstream(path) << text;
  return path.string();
}

}  // namespace

TEST_CASE("step spread: each row is priced as the step it describes, by kind") {
  const CostModel c = h100();
  std::string decode = kHeader, prefill = kHeader;
  // Decode: 2 streams at 1,001 tokens of context in all (500 + 501), 10 + 1 ms a period.
  for (int i = 0; i < 25; ++i) decode += "1.0,decode,0.010,0.001,2,1001,0,0,0\n";
  // Prefill: 2 prompt chunks, 1,024 tokens from 1,024 tokens of context (512 + 512 each).
  for (int i = 0; i < 30; ++i) prefill += "1.0,prefill,0.200,0,0,0,2,1024,1024\n";
  decode += "1.0,decode,0.030,0,1,100,1,50,0\n";  // one mixed step: too few of its kind
  const std::string a = writeTrace("a.csv", decode), b = writeTrace("b.csv", prefill);
  auto s = StepSpread::read({a, b}, c);
  INFO(s.status().toString());
  REQUIRE(s.ok());
  CHECK(s->rows() == 56);
  const double decodeRatio = 0.011 / stepOf(c, {chunk(1, 500), chunk(1, 501)});
  const double prefillRatio = 0.2 / stepOf(c, {chunk(512, 512), chunk(512, 512)});
  std::mt19937_64 rng(7);
  CHECK(s->sample(StepClass{StepKind::kDecodeOnly, 2}, rng) == Approx(decodeRatio));
  CHECK(s->sample(StepClass{StepKind::kPrefillPrompt, 1024}, rng) == Approx(prefillRatio));
  CHECK(s->sample(StepClass{StepKind::kDecodeMixed, 64}, rng) == 1);  // 1 row: the modelled time
  CHECK(s->describe().find("25 rows (1 size classes of their own)") != std::string::npos);
  CHECK(s->describe().find("fewer than 20 rows") != std::string::npos);
  std::filesystem::remove(a);
  std::filesystem::remove(b);
}

TEST_CASE("step spread: a step's class is its kind and its size, rounded up to a power of two") {
  const std::vector<engine::SeqChunk> decode = {chunk(1, 10), chunk(1, 20), chunk(1, 30)};
  const std::vector<engine::SeqChunk> mixed = {chunk(1, 10), chunk(100, 0)};
  CHECK(StepClass::of(false, decode).kind == StepKind::kDecodeOnly);
  CHECK(StepClass::of(false, decode).size == 4);
  CHECK(StepClass::of(false, mixed).kind == StepKind::kDecodeMixed);
  CHECK(StepClass::of(false, mixed).size == 128);
  CHECK(StepClass::of(true, mixed).kind == StepKind::kPrefillPrompt);
  CHECK(StepClass::of(true, mixed).size == 128);  // 101 prompt rows
}

TEST_CASE("step spread: draws follow the measured distribution") {
  std::vector<std::pair<StepClass, double>> ratios;
  for (int i = 1; i <= 100; ++i) ratios.push_back({StepClass{StepKind::kDecodeOnly, 1}, double(i)});
  const StepSpread s = StepSpread::fromRatios(ratios);
  const StepClass one{StepKind::kDecodeOnly, 1};
  std::mt19937_64 rng(1), again(1);
  std::vector<double> draws;
  for (int i = 0; i < 20000; ++i) draws.push_back(s.sample(one, rng));
  for (int i = 0; i < 100; ++i) CHECK(s.sample(one, again) == draws[size_t(i)]);  // seeded
  CHECK(*std::min_element(draws.begin(), draws.end()) >= 1);
  CHECK(*std::max_element(draws.begin(), draws.end()) <= 100);
  CHECK(percentileOf(draws, 50) == Approx(50.5).epsilon(0.03));
  CHECK(percentileOf(draws, 90) == Approx(90.1).epsilon(0.03));
  CHECK(s.sample(StepClass{StepKind::kPrefillPrompt, 1}, rng) == 1);  // no rows of that kind
}

TEST_CASE("step spread: a size class with enough rows draws from its own, the others from their kind") {
  const StepSpread s =
      StepSpread::fromRatios(concat({same(StepKind::kDecodeOnly, 1, 0.5), same(StepKind::kDecodeOnly, 8, 2.0),
                                     same(StepKind::kDecodeOnly, 4, 1.0, 5)}));
  std::mt19937_64 rng(3);
  CHECK(s.sample(StepClass{StepKind::kDecodeOnly, 1}, rng) == 0.5);
  CHECK(s.sample(StepClass{StepKind::kDecodeOnly, 8}, rng) == 2.0);
  std::vector<double> draws;  // class 4 (5 rows) and class 16 (none) draw from all 45
  for (int i = 0; i < 200; ++i) draws.push_back(s.sample(StepClass{StepKind::kDecodeOnly, i % 2 ? 4 : 16}, rng));
  CHECK(*std::min_element(draws.begin(), draws.end()) < 0.6);
  CHECK(*std::max_element(draws.begin(), draws.end()) > 1.9);
  CHECK(s.describe().find("45 rows (2 size classes of their own)") != std::string::npos);
}

TEST_CASE("step spread: the simulator multiplies each step by its kind's ratio") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{1, 1, 1, 256};
  so.sloSizedPrefillChunks = false;
  so.kvLinkBytesPerS = 1e12;
  // Constant ratios: prefill worker x3, decode-only x2, decode steps with prompt tokens x1.5
  // (given for size class 1: the steps of other sizes draw from their kind's).
  so.stepSpread = std::make_shared<const StepSpread>(
      StepSpread::fromRatios(concat({same(StepKind::kPrefillPrompt, 1, 3.0), same(StepKind::kDecodeOnly, 1, 2.0),
                                     same(StepKind::kDecodeMixed, 1, 1.5)})));
  const std::vector<SimRequest> two = {{0, promptOf(100), 3}, {10, promptOf(2000), 2}};
  auto r = simulate(c, so, two);
  REQUIRE(r.ok());
  const RequestOutcome& local = r->outcomes.at(0);
  REQUIRE_FALSE(local.disaggregated);
  CHECK(local.ttftS == Approx(1.5 * stepOf(c, {chunk(100, 0)})).epsilon(1e-6));
  REQUIRE(local.itlsS.size() == 2);
  CHECK(local.itlsS[0] == Approx(2 * stepOf(c, {chunk(1, 100)})).epsilon(1e-6));
  const RequestOutcome& remote = r->outcomes.at(1);
  REQUIRE(remote.disaggregated);
  const double prefill = 3 * stepOf(c, {chunk(2000, 0)});
  CHECK(remote.ttftS == Approx(prefill + c.kvTransferSeconds(2000, 1e12, prefill)).epsilon(1e-6));
  CHECK(remote.itlsS.at(0) == Approx(2 * stepOf(c, {chunk(1, 2000)})).epsilon(1e-6));
}

TEST_CASE("step spread: the same seed gives the same run, another seed another") {
  const CostModel c = h100();
  std::vector<std::pair<StepClass, double>> ratios;
  for (int i = 0; i < 50; ++i) {
    ratios.push_back({StepClass{StepKind::kDecodeOnly, 1}, 0.8 + 0.01 * i});
    ratios.push_back({StepClass{StepKind::kDecodeMixed, 1}, 0.8 + 0.01 * i});
  }
  SimOptions so;
  so.layout = Layout{0, 1, 1, 256};
  so.stepSpread = std::make_shared<const StepSpread>(StepSpread::fromRatios(ratios));
  std::vector<SimRequest> rs;
  for (int i = 0; i < 20; ++i) rs.push_back({0.05 * i, promptOf(100 + 10 * i), 8});
  auto a = simulate(c, so, rs), b = simulate(c, so, rs);
  so.seed = 1;
  auto other = simulate(c, so, rs);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(other.ok());
  bool differs = false;
  for (size_t i = 0; i < rs.size(); ++i) {
    CHECK(a->outcomes[i].itlsS == b->outcomes[i].itlsS);
    differs = differs || a->outcomes[i].itlsS != other->outcomes[i].itlsS;
  }
  CHECK(differs);
}

TEST_CASE("step spread: a trace that is not one names the file, the line and the problem") {
  const CostModel c = h100();
  auto error = [&](const std::string& text) {
    const std::string path = writeTrace("bad.csv", text);
    auto s = StepSpread::read({path}, c);
    std::filesystem::remove(path);
    REQUIRE_FALSE(s.ok());
    return s.status().message();
  };
  CHECK(error("time_s,role,seconds\n").find("no \"gap_seconds\" column") != std::string::npos);
  CHECK(error(std::string(kHeader) + "1.0,decode,abc,0,1,10,0,0,0\n").find(":2: \"seconds\" is not") !=
        std::string::npos);
  CHECK(error(std::string(kHeader) + "1.0,router,0.01,0,1,10,0,0,0\n").find("role must be") != std::string::npos);
  CHECK(error(std::string(kHeader) + "1.0,decode,0.01,0,0,0,0,0,0\n").find("computed nothing") != std::string::npos);
  auto missing = StepSpread::read({"/nonexistent/x.steps.csv"}, c);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().message().find("cannot read /nonexistent/x.steps.csv") != std::string::npos);
}
