// Statistics for `pdserve bench`: percentiles, per-request records, SLO checks and the run's
// aggregate figures. Pure functions over values; safe from any thread.
//
// Units: per-request times are kept in milliseconds (ms) except the start offsets, which are
// seconds since the measured phase began. Aggregates use the names and units of
// `vllm bench serve` (docs/bench.md lists them).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"

namespace pd::bench {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// numpy.percentile's default ("linear"): rank = p/100 * (n-1), linear interpolation between
// the two neighbouring order statistics. `sorted` must be ascending; empty gives NaN.
double percentileSorted(const std::vector<double>& sorted, double p);
double percentile(std::vector<double> values, double p);
// Nearest rank (the traces README's convention): the ceil(p/100 * n)-th smallest value.
double nearestRankSorted(const std::vector<double>& sorted, double p);

struct Summary {
  size_t count = 0;
  double mean = kNaN, stddev = kNaN, min = kNaN, max = kNaN;
  double median = kNaN, p90 = kNaN, p95 = kNaN, p99 = kNaN;  // numpy linear percentiles
};
// stddev is the population one (numpy's default ddof=0), as vLLM reports it.
Summary summarize(std::vector<double> values);

// One request as the client saw it.
struct RequestRecord {
  int64_t index = 0;         // position in the planned workload
  double scheduledS = 0;     // when the plan wanted it sent
  double eligibleS = 0;      // max(scheduled, when a concurrency slot freed)
  double startS = 0;         // when it was actually sent
  int64_t promptTokens = 0;  // usage.prompt_tokens when the server sent usage, else as planned
  int64_t plannedPromptTokens = 0;
  int64_t plannedOutputTokens = 0;
  int64_t outputTokens = 0;  // usage.completion_tokens when present, else tokens counted in chunks
  int64_t chunkTokens = 0;   // tokens counted in the streamed chunks
  bool ok = false;
  int httpStatus = 0;  // 0 when no HTTP response arrived
  std::string error;   // "HTTP 404: {...}" / "timeout after ..." / "connect: ..."
  std::string finishReason;
  double ttftMs = kNaN;        // send -> first chunk that carries a token
  double e2eMs = kNaN;         // send -> end of the stream
  std::vector<double> itlsMs;  // one entry per token after the first (see docs/bench.md)
  // pdserve's server-side TTFT split (usage.pdserve_timing): phase -> ms, and its route.
  std::map<std::string, double> ttftSplitMs;
  std::string ttftSplitRoute;
  int64_t cachedTokens = -1;  // usage.prompt_tokens_details.cached_tokens; -1 when not sent
  // Multi-turn replay only (multiturn.h): the prompt sent and the ids generated for it.
  std::vector<int32_t> promptIds;
  std::vector<int32_t> generatedIds;
  double endS = kNaN;  // when it finished, seconds since the measured phase began

  double lagMs() const { return (startS - eligibleS) * 1000.0; }
  // (e2e - ttft) / (outputTokens - 1); NaN for fewer than two tokens (vLLM's definition).
  double tpotMs() const;
};

// SLO targets in ms. itl is checked against the request's own itlPercentile of gaps.
struct Slo {
  std::optional<double> ttftMs, itlMs, tpotMs, e2elMs;
  double itlPercentile = 99;
  bool empty() const { return !ttftMs && !itlMs && !tpotMs && !e2elMs; }
  std::string describe() const;  // "ttft_ms=500,itl_ms=50 (request p99 gap)"
};
// Parses "ttft_ms=500,itl_ms=50" (also tpot_ms, e2el_ms, itl_pct). Unknown keys, missing or
// non-positive values are errors naming the key.
Result<Slo> parseSlo(std::string_view spec);

struct SloCheck {
  bool good = false;
  bool missTtft = false, missItl = false, missTpot = false, missE2el = false;
};
SloCheck checkSlo(const RequestRecord& r, const Slo& slo);

struct Aggregate {
  int64_t completed = 0, failed = 0;
  double durationS = 0;
  int64_t totalInputTokens = 0, totalOutputTokens = 0;
  double requestThroughput = 0, outputThroughput = 0, totalTokenThroughput = 0;
  double maxOutputTokensPerS = 0;  // the busiest 1-second bin
  int64_t maxConcurrentRequests = 0;
  Summary ttft, tpot, itl, e2el;  // ms, over successful requests (itl pooled over all gaps)
  // Goodput: requests meeting every SLO target, per second of the run.
  bool haveSlo = false;
  int64_t goodRequests = 0;
  double requestGoodput = 0;
  int64_t missedTtft = 0, missedItl = 0, missedTpot = 0, missedE2el = 0;
  // The generator's own lag: how late requests were sent after they became eligible.
  double lagMeanMs = 0, lagMaxMs = 0;
  int64_t lateStarts = 0;                       // lag > kLateStartMs
  std::map<std::string, int64_t> errorsByKind;  // "HTTP 503" / "timeout" / "connect" -> count
  // Load shedding: requests refused with HTTP 429, and when the first was sent (s from the start).
  int64_t shed = 0;
  double firstShedS = kNaN;
  // pdserve's TTFT split over the successful requests that carried one: route -> phase ->
  // summary (ms; "ttft" is the router's own TTFT, the phases sum to at most it).
  std::map<std::string, std::map<std::string, Summary>> ttftSplit;
};
constexpr double kLateStartMs = 10.0;

Aggregate aggregate(const std::vector<RequestRecord>& records, double durationS, const Slo& slo);

// Series over the run for the report's charts: bins [i*binS, (i+1)*binS) from the start;
// rates are per second whatever the bin width.
struct TimeSeries {
  double binS = 1.0;
  std::vector<double> outputTokensPerS;
  std::vector<double> completedPerS;
  std::vector<double> inFlight;  // requests in flight at each bin's start
};
TimeSeries timeSeries(const std::vector<RequestRecord>& records, double durationS, double binS = 1.0);

}  // namespace pd::bench
