// The JSON result (re-read, vLLM-compatible keys), the per-request CSV, the HTML report with
// its SVG charts, the terminal table and `bench compare`.
#include "tools/bench/report.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tools/bench/stats.h"

using namespace pd::bench;
namespace fs = std::filesystem;

namespace {

std::vector<RequestRecord> sampleRecords() {
  std::vector<RequestRecord> rs;
  for (int i = 0; i < 40; ++i) {
    RequestRecord r;
    r.index = i;
    r.scheduledS = r.eligibleS = i * 0.1;
    r.startS = r.scheduledS + 0.0005;
    r.ok = i != 7;
    r.httpStatus = r.ok ? 200 : 503;
    r.promptTokens = r.plannedPromptTokens = 100 + i;
    r.plannedOutputTokens = 10;
    if (r.ok) {
      r.ttftMs = 50 + 10 * (i % 5);
      r.itlsMs.assign(9, 20.0 + (i % 3));
      r.outputTokens = r.chunkTokens = 10;
      r.e2eMs = r.ttftMs + 9 * (20.0 + (i % 3));
      r.finishReason = "length";
    } else {
      r.error = "HTTP 503: {\"error\":{\"message\":\"busy, \\\"retry\\\"\"}}";
      r.e2eMs = 3;
    }
    rs.push_back(r);
  }
  return rs;
}

RunInfo sampleInfo() {
  RunInfo i;
  i.date = "20261129-120000";
  i.commandLine = "pdserve bench --url http://127.0.0.1:8000";
  i.url = "http://127.0.0.1:8000";
  i.endpoint = "/v1/completions";
  i.backend = "openai";
  i.model = "small";
  i.workload = "prompt 100, output 10";
  i.arrival = "poisson";
  i.requestRate = 10;
  i.numPrompts = 40;
  i.slo = *parseSlo("ttft_ms=80,itl_ms=21.5");
  return i;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path tempDir() {
  fs::path d = fs::temp_directory_path() / ("pd_bench_report_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST_CASE("JSON result re-reads with vLLM's keys and units", "[bench][report]") {
  const auto rs = sampleRecords();
  const RunInfo info = sampleInfo();
  const Aggregate a = aggregate(rs, 4.0, info.slo);
  const fs::path dir = tempDir();
  REQUIRE(writeJson((dir / "r.json").string(), info, a, rs).isOk());
  const auto j = nlohmann::json::parse(slurp(dir / "r.json"));
  for (const char* k : {"date",
                        "backend",
                        "model_id",
                        "num_prompts",
                        "request_rate",
                        "max_concurrency",
                        "duration",
                        "completed",
                        "failed",
                        "total_input_tokens",
                        "total_output_tokens",
                        "request_throughput",
                        "request_goodput",
                        "output_throughput",
                        "total_token_throughput",
                        "max_output_tokens_per_s",
                        "max_concurrent_requests",
                        "input_lens",
                        "output_lens",
                        "ttfts",
                        "itls",
                        "errors"})
    CHECK(j.contains(k));
  for (const char* m : {"ttft", "tpot", "itl", "e2el"})
    for (const char* s : {"mean", "median", "std", "p90", "p95", "p99"}) {
      const std::string key = std::string(s) + "_" + m + "_ms";
      INFO(key);
      CHECK(j.contains(key));
      CHECK(j[key].is_number());
    }
  CHECK(j["completed"] == 39);
  CHECK(j["failed"] == 1);
  CHECK(j["duration"].get<double>() == Approx(4.0));
  CHECK(j["request_rate"].get<double>() == Approx(10));
  CHECK(j["max_concurrency"].is_null());
  CHECK(j["mean_ttft_ms"].get<double>() == Approx(a.ttft.mean));
  CHECK(j["p99_itl_ms"].get<double>() == Approx(a.itl.p99));
  // Per-request lists are in seconds, as vLLM writes them.
  CHECK(j["ttfts"][0].get<double>() == Approx(0.050));
  CHECK(j["itls"][1].size() == 9);
  CHECK(j["itls"][1][0].get<double>() == Approx(0.021));
  CHECK(j["ttfts"][7].is_null());
  CHECK(j["errors"][7].get<std::string>().find("HTTP 503") == 0);
  // Goodput: TTFT <= 80 (i % 5 < 4) and p99 gap <= 21.5 (i % 3 < 2).
  int64_t good = 0;
  for (int i = 0; i < 40; ++i) good += i != 7 && i % 5 < 4 && i % 3 < 2;
  CHECK(j["pdserve"]["good_requests"] == good);
  CHECK(j["request_goodput"].get<double>() == Approx(good / 4.0));
  CHECK(j["pdserve"]["slo"]["ttft_ms"] == 80);
  CHECK(j["pdserve"]["generator_lag"]["max_ms"].get<double>() == Approx(0.5).margin(1e-6));
  CHECK(j["pdserve"]["errors_by_kind"]["HTTP 503"] == 1);
  fs::remove_all(dir);
}

TEST_CASE("CSV has one parseable row per request", "[bench][report]") {
  const auto rs = sampleRecords();
  const fs::path dir = tempDir();
  REQUIRE(writeCsv((dir / "r.csv").string(), rs, sampleInfo().slo).isOk());
  std::ifstream in(dir / "r.csv");
  std::string header, line;
  std::getline(in, header);
  CHECK(header.rfind("index,scheduled_s,", 0) == 0);
  const size_t cols = static_cast<size_t>(std::count(header.begin(), header.end(), ',')) + 1;
  int rows = 0;
  while (std::getline(in, line)) {
    // Split honouring quotes: the error text holds commas and quotes.
    size_t fields = 1;
    bool quoted = false;
    for (char c : line) {
      if (c == '"')
        quoted = !quoted;
      else if (c == ',' && !quoted)
        ++fields;
    }
    CHECK(fields == cols);
    CHECK_FALSE(quoted);
    ++rows;
  }
  CHECK(rows == 40);
  fs::remove_all(dir);
}

TEST_CASE("HTML report is self-contained with the charts and SLO lines", "[bench][report]") {
  const auto rs = sampleRecords();
  const RunInfo info = sampleInfo();
  const Aggregate a = aggregate(rs, 4.0, info.slo);
  const fs::path dir = tempDir();
  REQUIRE(writeHtml((dir / "r.html").string(), info, a, rs, 4.0).isOk());
  const std::string html = slurp(dir / "r.html");
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  size_t svgs = 0;
  for (size_t p = html.find("<svg"); p != std::string::npos; p = html.find("<svg", p + 1)) ++svgs;
  CHECK(svgs == 5);
  CHECK(html.find("TTFT CDF") != std::string::npos);
  CHECK(html.find("ITL CDF") != std::string::npos);
  CHECK(html.find("SLO 80 ms") != std::string::npos);
  CHECK(html.find("SLO 22 ms") != std::string::npos);  // 21.5 rounded in the label
  CHECK(html.find("Throughput over time") != std::string::npos);
  CHECK(html.find("http://") == html.find("http://127.0.0.1"));  // no external resources
  CHECK(html.find("<script") == std::string::npos);
  CHECK(html.find("</html>") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("CDF points and charts", "[bench][report]") {
  const auto pts = cdfPoints({3, 1, 2, 4});
  REQUIRE(pts.size() == 4);
  CHECK(pts[0] == std::make_pair(1.0, 0.25));
  CHECK(pts[3] == std::make_pair(4.0, 1.0));
  std::vector<double> many(10000);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<double>(i);
  const auto thin = cdfPoints(many, 100);
  REQUIRE(thin.size() == 100);
  CHECK(thin.front().first == 0);
  CHECK(thin.back().second == 1.0);
  const std::string svg = svgChart("t", "x", "y", {{"s", "#000", pts, ChartSeries::Style::kStep}}, {{2.5, "SLO"}});
  CHECK(svg.find("<polyline") != std::string::npos);
  CHECK(svg.find("stroke-dasharray") != std::string::npos);
}

TEST_CASE("table and compare", "[bench][report]") {
  const auto rs = sampleRecords();
  const RunInfo info = sampleInfo();
  const Aggregate a = aggregate(rs, 4.0, info.slo);
  const std::string table = formatTable(info, a);
  CHECK(table.find("Successful requests:                      39") != std::string::npos);
  CHECK(table.find("Request goodput (req/s):") != std::string::npos);
  CHECK(table.find("P99 ITL (ms):") != std::string::npos);
  const fs::path dir = tempDir();
  REQUIRE(writeJson((dir / "a.json").string(), info, a, rs).isOk());
  const Aggregate b = aggregate(rs, 2.0, info.slo);  // same work in half the time
  REQUIRE(writeJson((dir / "b.json").string(), info, b, rs).isOk());
  auto cmp = compareResults({(dir / "a.json").string(), (dir / "b.json").string()});
  REQUIRE(cmp.ok());
  CHECK(cmp->find("request_throughput") != std::string::npos);
  CHECK(cmp->find("(2.00x)") != std::string::npos);
  CHECK(cmp->find("(0.50x)") != std::string::npos);
  auto bad = compareResults({(dir / "missing.json").string()});
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("missing.json"));
  fs::remove_all(dir);
}

TEST_CASE("check verifies an end-to-end run's invariants", "[bench][report]") {
  auto rs = sampleRecords();
  RunInfo info = sampleInfo();
  const fs::path dir = tempDir();
  const std::string good = (dir / "good.json").string();
  REQUIRE(writeJson(good, info, aggregate(rs, 4.0, info.slo), rs).isOk());
  auto ok = checkResult(good, /*allowFailures=*/true);
  INFO(ok.status().toString());
  REQUIRE(ok.ok());
  CHECK_THAT(*ok, Catch::Contains("40 requests accounted for"));
  // The sample has one failed request.
  auto strict = checkResult(good, /*allowFailures=*/false);
  REQUIRE_FALSE(strict.ok());
  CHECK_THAT(strict.status().message(), Catch::Contains("request 7: HTTP 503"));
  // A request missing a gap, one whose TTFT exceeds its E2EL, and a lost request.
  rs[3].itlsMs.pop_back();
  rs[5].ttftMs = rs[5].e2eMs + 1;
  info.numPrompts = 41;
  const std::string bad = (dir / "bad.json").string();
  REQUIRE(writeJson(bad, info, aggregate(rs, 4.0, info.slo), rs).isOk());
  auto r = checkResult(bad, true);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("!= num_prompts 41"));
  CHECK_THAT(r.status().message(), Catch::Contains("request 3: 8 inter-token gaps for 10 output tokens"));
  CHECK_THAT(r.status().message(), Catch::Contains("request 5: TTFT"));
  fs::remove_all(dir);
}

TEST_CASE("the TTFT split: percentiles per route and phase in the table and the JSON", "[bench][report]") {
  auto rs = sampleRecords();
  for (auto& r : rs) {
    if (!r.ok || r.index % 2) continue;  // half carry a split, all disaggregated
    r.ttftSplitRoute = "disaggregated";
    r.ttftSplitMs = {{"router_queue", 0.5}, {"prefill_compute", double(r.index)}, {"kv_transfer", 2}, {"ttft", 40}};
  }
  rs[1].ttftSplitRoute = "colocated";  // odd and ok: one colocated
  rs[1].ttftSplitMs = {{"prefill_compute", 7}, {"ttft", 9}};
  const RunInfo info = sampleInfo();
  const Aggregate a = aggregate(rs, 4.0, info.slo);
  REQUIRE(a.ttftSplit.size() == 2);
  const Summary& pc = a.ttftSplit.at("disaggregated").at("prefill_compute");
  CHECK(pc.count == 20);           // even indexes 0..38
  CHECK(pc.median == Approx(19));  // 0, 2, ..., 38
  CHECK(pc.p99 == Approx(percentile({0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38}, 99)));
  const std::string table = formatTable(info, a);
  CHECK(table.find("TTFT split, disaggregated (server, ms)") != std::string::npos);
  CHECK(table.find("TTFT split, colocated (server, ms)") != std::string::npos);
  // The order a request passes: router_queue before prefill_compute before kv_transfer, ttft last.
  const size_t section = table.find("TTFT split, disaggregated");
  const auto at = [&](const char* s) { return table.find(s, section); };
  CHECK(at("router_queue") < at("prefill_compute"));
  CHECK(at("prefill_compute") < at("kv_transfer"));
  const fs::path dir = tempDir();
  REQUIRE(writeJson((dir / "s.json").string(), info, a, rs).isOk());
  std::ifstream in(dir / "s.json");
  const auto j = nlohmann::json::parse(in);
  const auto& kt = j["pdserve"]["ttft_split"]["disaggregated"]["kv_transfer"];
  CHECK(kt["count"] == 20);
  CHECK(kt["p50_ms"].get<double>() == Approx(2));
  CHECK(kt["p90_ms"].get<double>() == Approx(2));
  CHECK(j["pdserve"]["ttft_split"]["colocated"]["ttft"]["p99_ms"].get<double>() == Approx(9));
  // The CSV: each request's route and phases, '-' for a phase its route does not have.
  REQUIRE(writeCsv((dir / "s.csv").string(), rs, info.slo).isOk());
  std::ifstream csv(dir / "s.csv");
  std::string header, row0, row1;
  std::getline(csv, header);
  std::getline(csv, row0);
  std::getline(csv, row1);
  const auto endsWith = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  CHECK(endsWith(header,
                 ",error,route,router_queue_ms,decode_admission_ms,kv_connect_ms,prefill_queue_ms,"
                 "prefill_compute_ms,kv_transfer_ms,decode_first_token_ms,other_ms"));
  CHECK(endsWith(row0, ",disaggregated,0.500,-,-,-,0.000,2.000,-,-"));
  CHECK(endsWith(row1, ",colocated,-,-,-,-,7.000,-,-,-"));
  fs::remove_all(dir);
}

TEST_CASE("a phased run with a metrics timeline: per-phase figures, the timeline JSON and charts",
          "[bench][report][timeline]") {
  const auto rs = sampleRecords();  // 40 requests scheduled 0.1 s apart
  RunInfo info = sampleInfo();
  PhaseSpec first, second;
  first.rate = 10, first.durationS = 2;
  second.rate = 10, second.durationS = 2;
  info.phases = {{0, 2, first}, {2, 4, second}};
  info.haveTimeline = true;
  info.timeline.url = "http://127.0.0.1:8000/metrics";
  info.timeline.intervalMs = 1000;
  info.timeline.addScrape(-0.5, parsePrometheusText("pdserve_pool_workers{pool=\"decode\"} 1\n"), 1);
  info.timeline.addScrape(0.5,
                          parsePrometheusText("pdserve_pool_workers{pool=\"decode\"} 1\n"
                                              "pdserve_desired_replicas{pool=\"decode\"} 2\n"
                                              "pdserve_short_prompt_tokens 256\n"
                                              "pdserve_slo_observed_seconds{pool=\"prefill\"} 0.07\n"),
                          1);
  info.timeline.addGap(1.5, "timeout after 1000 ms", 1000);
  info.timeline.addScrape(2.5,
                          parsePrometheusText("pdserve_pool_workers{pool=\"decode\"} 2\n"
                                              "pdserve_desired_replicas{pool=\"decode\"} 2\n"),
                          1);
  const Aggregate a = aggregate(rs, 4.0, info.slo);

  const auto phases = phaseResults(info, rs);
  REQUIRE(phases.size() == 2);
  CHECK(phases[0].requests == 20);
  CHECK(phases[1].requests == 20);
  CHECK(phases[0].agg.failed == 1);  // request 7
  CHECK(phases[0].agg.goodRequests + phases[1].agg.goodRequests == a.goodRequests);
  CHECK(phases[1].agg.requestGoodput == Approx(phases[1].agg.goodRequests / 2.0));
  CHECK(phases[0].sloAttainment == Approx(phases[0].agg.goodRequests / 20.0));

  const auto j = nlohmann::json::parse(resultJson(info, a, rs));
  const auto& p = j["pdserve"];
  CHECK(p["slo_attainment"].get<double>() == Approx(double(a.goodRequests) / 40.0));
  REQUIRE(p["phases"].size() == 2);
  CHECK(p["phases"][1]["start_s"] == 2.0);
  CHECK(p["phases"][1]["end_s"] == 4.0);
  CHECK(p["phases"][1]["requests"] == 20);
  CHECK(p["phases"][0]["failed"] == 1);
  CHECK(p["phases"][0]["good_requests"] == phases[0].agg.goodRequests);
  CHECK(p["phases"][0]["prompt_len"] == "256");
  const auto& tl = p["timeline"];
  CHECK(tl["scrapes"] == 4);
  CHECK(tl["failed_scrapes"] == 1);
  CHECK(tl["gaps"][0]["error"] == "timeout after 1000 ms");
  bool sawWorkers = false;
  for (const auto& s : tl["series"])
    if (s["key"] == "pdserve_pool_workers{pool=\"decode\"}") {
      sawWorkers = true;
      CHECK(s["points"].size() == 3);
      CHECK(s["points"][2] == nlohmann::json::parse("[2.5, 2.0]"));
    }
  CHECK(sawWorkers);

  const std::string table = formatTable(info, a, rs);
  CHECK_THAT(table, Catch::Contains("Phases"));
  CHECK_THAT(table, Catch::Contains("SLO attainment"));
  CHECK_THAT(table, Catch::Contains("4 scrapes, 1 failed"));

  const std::string html = htmlReport(info, a, rs, 4.0);
  for (const char* want : {"Over time", "Replicas per pool", "decode workers", "decode desired", "Routing threshold",
                           "TTFT (by request start) over time", "ITL (by token arrival) over time", "phase 2",
                           "router prefill window pct", "client p99 per bin", "SLO 80 ms", "4 scrapes, 1 failed"})
    CHECK_THAT(html, Catch::Contains(want));
  size_t svgs = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1)) ++svgs;
  CHECK(svgs == 5 + 4);

  // Without phases or a timeline the report is as before.
  const RunInfo plain = sampleInfo();
  CHECK(htmlReport(plain, a, rs, 4.0).find("Over time") == std::string::npos);
  CHECK_FALSE(nlohmann::json::parse(resultJson(plain, a, rs))["pdserve"].contains("timeline"));
}
