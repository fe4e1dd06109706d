// Trace parsers on the real public traces in data/traces: the figures below are the
// ones its README states (nearest-rank percentiles, means, totals, prefix reuse).
#include "tools/bench/trace.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>

#include <catch2/catch.hpp>

#include "tools/bench/stats.h"

using namespace pd::bench;

namespace {

std::string tracesDir() {
  if (const char* env = std::getenv("PD_TRACES_DIR")) return env;
  return std::string(PD_SOURCE_DIR) + "/data/traces";
}

Trace load(const std::string& file) {
  const std::string path = tracesDir() + "/" + file;
  INFO("trace file " << path << " (set PD_TRACES_DIR to point elsewhere)");
  REQUIRE(std::filesystem::exists(path));
  auto t = loadTrace(path);
  INFO(t.status().toString());
  REQUIRE(t.ok());
  return std::move(t).value();
}

struct Lengths {
  std::vector<double> prompt, output;
  double promptMean = 0, outputMean = 0;
  int64_t promptTotal = 0, outputTotal = 0;
};

Lengths lengths(const Trace& t) {
  Lengths l;
  for (const auto& r : t.rows) {
    l.prompt.push_back(static_cast<double>(r.promptTokens));
    l.output.push_back(static_cast<double>(r.outputTokens));
    l.promptTotal += r.promptTokens;
    l.outputTotal += r.outputTokens;
  }
  std::sort(l.prompt.begin(), l.prompt.end());
  std::sort(l.output.begin(), l.output.end());
  l.promptMean = static_cast<double>(l.promptTotal) / static_cast<double>(t.rows.size());
  l.outputMean = static_cast<double>(l.outputTotal) / static_cast<double>(t.rows.size());
  return l;
}

void checkPercentiles(const std::vector<double>& sorted, double p50, double p90, double p99, double max) {
  CHECK(nearestRankSorted(sorted, 50) == p50);
  CHECK(nearestRankSorted(sorted, 90) == p90);
  CHECK(nearestRankSorted(sorted, 99) == p99);
  CHECK(sorted.back() == max);
}

}  // namespace

TEST_CASE("Azure code trace matches the README", "[bench][trace]") {
  const Trace t = load("azure_llm_2023_code.csv");
  CHECK(t.format == TraceFormat::kAzureCsv);
  REQUIRE(t.rows.size() == 8819);
  CHECK(t.rows.back().arrivalS == Approx(3435.9).margin(0.06));
  const Lengths l = lengths(t);
  checkPercentiles(l.prompt, 1469, 5194, 7436, 7437);
  checkPercentiles(l.output, 13, 55, 252, 1899);
  CHECK(l.promptMean == Approx(2047.8).margin(0.05));
  CHECK(l.outputMean == Approx(27.9).margin(0.05));
  CHECK(l.prompt.front() == 3);
  CHECK(l.output.front() == 6);
  CHECK(static_cast<double>(l.promptTotal) == Approx(18.06e6).margin(5e3));  // 18.06 M
  CHECK(static_cast<double>(l.outputTotal) == Approx(0.246e6).margin(5e2));  // 0.246 M
}

TEST_CASE("Azure conversation trace matches the README", "[bench][trace]") {
  const Trace t = load("azure_llm_2023_conv.csv");
  REQUIRE(t.rows.size() == 19366);
  CHECK(t.rows.back().arrivalS == Approx(3501.7).margin(0.06));
  const Lengths l = lengths(t);
  checkPercentiles(l.prompt, 1020, 2735, 4142, 14050);
  checkPercentiles(l.output, 129, 424, 601, 1000);
  CHECK(l.promptMean == Approx(1154.7).margin(0.05));
  CHECK(l.outputMean == Approx(211.1).margin(0.05));
  CHECK(l.prompt.front() == 2);
  CHECK(l.output.front() == 7);
  CHECK(static_cast<double>(l.promptTotal) == Approx(22.36e6).margin(5e3));
  CHECK(static_cast<double>(l.outputTotal) == Approx(4.09e6).margin(5e3));
  // Mean rate (rows - 1) / span: 5.53 req/s.
  CHECK((t.rows.size() - 1) / t.rows.back().arrivalS == Approx(5.53).margin(0.005));
}

namespace {
void checkMooncake(const Trace& t, size_t rows, double spanS, double p50, double p90, double p99, double max,
                   double mean, double o50, double o90, double o99, double omax, double omean, int64_t blocks,
                   int64_t unique, int64_t repeated) {
  CHECK(t.format == TraceFormat::kMooncakeJsonl);
  CHECK(t.blockTokens == 512);
  REQUIRE(t.rows.size() == rows);
  CHECK(t.rows.back().arrivalS == Approx(spanS).margin(1e-6));
  const Lengths l = lengths(t);
  checkPercentiles(l.prompt, p50, p90, p99, max);
  checkPercentiles(l.output, o50, o90, o99, omax);
  CHECK(l.promptMean == Approx(mean).margin(0.05));
  CHECK(l.outputMean == Approx(omean).margin(0.05));
  std::set<int64_t> seen;
  int64_t total = 0, rep = 0;
  for (const auto& r : t.rows) {
    CHECK(static_cast<int64_t>(r.hashIds.size()) == (r.promptTokens + 511) / 512);
    for (int64_t h : r.hashIds) {
      ++total;
      rep += !seen.insert(h).second;
    }
  }
  CHECK(total == blocks);
  CHECK(static_cast<int64_t>(seen.size()) == unique);
  CHECK(rep == repeated);
}
}  // namespace

TEST_CASE("Mooncake conversation trace matches the README", "[bench][trace]") {
  const Trace t = load("mooncake_fast25_conversation_trace.jsonl");
  checkMooncake(t, 12031, 3536.999, 6909, 27367, 85401, 126195, 12035.1, 350, 597, 1120, 2000, 342.6, 288500, 182790,
                105710);
  CHECK(t.rows.front().hashIds.front() == 0);
}

TEST_CASE("Mooncake synthetic trace matches the README", "[bench][trace]") {
  const Trace t = load("mooncake_fast25_synthetic_trace.jsonl");
  checkMooncake(t, 3993, 1022.025, 11587, 38615, 66458, 191378, 15325.5, 69, 389, 769, 893, 149.1, 121877, 43924,
                77953);
}

TEST_CASE("bad trace input names the file, line and problem", "[bench][trace]") {
  {
    std::istringstream in("TIMESTAMP,ContextTokens,Flavour\n");
    auto r = parseTraceCsv(in, "x.csv");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("x.csv:1") && Catch::Contains("unknown column 'Flavour'"));
  }
  {
    std::istringstream in(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.9799600,10,5\r\n"
        "2023-11-16 18:17:04.0000000,ten,5\r\n");
    auto r = parseTraceCsv(in, "y.csv");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("y.csv:3") && Catch::Contains("'ten'"));
  }
  {
    std::istringstream in(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:05,10,5\n2023-11-16 18:17:04,1,1\n");
    auto r = parseTraceCsv(in, "z.csv");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("z.csv:3") && Catch::Contains("backwards"));
  }
  {
    std::istringstream in(
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [0]}\n"
        "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 2, \"colour\": 1}\n");
    auto r = parseMooncakeJsonl(in, "m.jsonl");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("m.jsonl:2") && Catch::Contains("unknown key 'colour'"));
  }
  {
    std::istringstream in("{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 2, \"hash_ids\": [0]}\n");
    auto r = parseMooncakeJsonl(in, "m.jsonl");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("m.jsonl:1") && Catch::Contains("needs 2 blocks"));
  }
  {
    std::istringstream in("{\"timestamp\": 0, \"input_length\": 10\n");
    auto r = parseMooncakeJsonl(in, "m.jsonl");
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("m.jsonl:1") && Catch::Contains("not a JSON object"));
  }
  auto missing = loadTrace("/nonexistent/trace.csv");
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(missing.status().message(), Catch::Contains("/nonexistent/trace.csv"));
}

TEST_CASE("BurstGPT layout and datetime parsing", "[bench][trace]") {
  std::istringstream in(
      "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
      "5,ChatGPT,472,18,490,Conversation log\n7.5,GPT-4,1087,230,1317,Conversation log\n");
  auto r = parseTraceCsv(in, "b.csv");
  REQUIRE(r.ok());
  CHECK(r->format == TraceFormat::kBurstGptCsv);
  REQUIRE(r->rows.size() == 2);
  CHECK(r->rows[1].arrivalS == Approx(2.5));
  CHECK(r->rows[1].promptTokens == 1087);
  CHECK(r->rows[1].outputTokens == 230);
  double a = 0, b = 0;
  REQUIRE(parseDateTimeSeconds("2023-11-16 18:17:03.9799600", &a));
  REQUIRE(parseDateTimeSeconds("2023-11-17 00:00:00", &b));
  CHECK(b - a == Approx(5 * 3600 + 42 * 60 + 56.02).margin(1e-6));
  CHECK_FALSE(parseDateTimeSeconds("2023-13-01 00:00:00", &a));
}
