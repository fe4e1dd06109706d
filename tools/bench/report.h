// Reports of a `pdserve bench` run: the terminal table, the JSON result (key names and units
// of `vllm bench serve`, plus a "pdserve" section), a per-request CSV, a self-contained HTML
// page with inline SVG charts, and the side-by-side comparison of saved JSON results.
//
// Contract: plain functions, safe from any thread; file writers return a Status naming the
// path on failure. docs/bench.md lists every JSON key.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "tools/bench/stats.h"
#include "tools/bench/timeline.h"
#include "tools/bench/workload.h"

namespace pd::bench {

struct RunInfo {
  std::string date;  // "20261129-113314" (UTC), as vLLM writes it
  std::string commandLine;
  std::string url;
  std::string endpoint;  // "/v1/completions"
  std::string backend;   // "openai" | "openai-chat" (vLLM's names for the two endpoints)
  std::string model;
  std::string workload;        // Workload::describe
  std::string arrival;         // "trace" | "poisson" | "immediate"
  double requestRate = 0;      // 0: inf (not rate-limited)
  int64_t maxConcurrency = 0;  // 0: none
  double timeScale = 1;
  uint64_t seed = 0;
  int64_t numPrompts = 0;       // measured requests sent
  int64_t plannedRequests = 0;  // measured requests in the plan (more when --duration or an abort cut it short)
  int64_t warmupRequests = 0;
  std::string promptSource;  // "token-ids" | "byte-approx" ...
  Slo slo;
  std::string abortReason;
  std::vector<PhaseWindow> phases;  // a phased workload's phases (--phase), else empty
  bool haveTimeline = false;        // --metrics-url: `timeline` holds the router's gauges
  MetricsTimeline timeline;
};

// One phase's figures: the requests scheduled in [startS, endS), rates over the phase's length.
struct PhaseResult {
  PhaseWindow window;
  int64_t requests = 0;
  Aggregate agg;
  double sloAttainment = kNaN;  // good / requests (failed ones count as misses); NaN without an SLO
};
std::vector<PhaseResult> phaseResults(const RunInfo& info, const std::vector<RequestRecord>& records);
// good / (completed + failed); NaN without an SLO or a request.
double sloAttainment(const Aggregate& a);

// The vLLM-style result table (plus percentiles, goodput and generator lag).
// With records, a phased run also gets its per-phase rows.
std::string formatTable(const RunInfo& info, const Aggregate& a, const std::vector<RequestRecord>& records = {});

// The JSON result object and its file.
std::string resultJson(const RunInfo& info, const Aggregate& a, const std::vector<RequestRecord>& records);
Status writeJson(const std::string& path, const RunInfo& info, const Aggregate& a,
                 const std::vector<RequestRecord>& records);
Status writeCsv(const std::string& path, const std::vector<RequestRecord>& records, const Slo& slo);
// One HTML file with no external resources: tables and SVG charts (CDFs of TTFT and ITL with
// the SLO lines, latency over time, throughput and concurrency over time).
std::string htmlReport(const RunInfo& info, const Aggregate& a, const std::vector<RequestRecord>& records,
                       double durationS);
Status writeHtml(const std::string& path, const RunInfo& info, const Aggregate& a,
                 const std::vector<RequestRecord>& records, double durationS);

// `pdserve bench compare`: the main figures of saved JSON results side by side, each run's
// value with its ratio to the first run. Errors name the file that could not be read.
Result<std::string> compareResults(const std::vector<std::string>& paths);

// `pdserve bench check`: the invariants an end-to-end run must satisfy, read back from its
// JSON: every planned request accounted for (completed + failed == num_prompts, the per-request
// lists that long), no failures unless allowFailures, and for each completed request
// TTFT <= E2EL and exactly output_tokens - 1 inter-token gaps. Returns a summary line, or an
// error listing the first violations (request index and values).
Result<std::string> checkResult(const std::string& path, bool allowFailures);

// Building blocks, exposed for tests and for the other HTML reports (pdserve plan --html).
Status writeFile(const std::string& path, const std::string& text);
std::string htmlEscape(const std::string& s);
struct ChartSeries {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;
  enum class Style { kLine, kStep, kDots } style = Style::kLine;
};
struct ChartMarker {
  double x;
  std::string label;
};
std::string svgChart(const std::string& title, const std::string& xLabel, const std::string& yLabel,
                     const std::vector<ChartSeries>& series, const std::vector<ChartMarker>& xMarkers,
                     bool logX = false);
// Empirical CDF of `values` as at most maxPoints (value, fraction <= value) points.
std::vector<std::pair<double, double>> cdfPoints(std::vector<double> values, size_t maxPoints = 400);

}  // namespace pd::bench
