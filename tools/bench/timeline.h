// The server-side timeline of a `pdserve bench` run: the router's Prometheus gauges sampled
// during the run (`--metrics-url`), so the report can show the pools' worker counts, the
// autoscaler's desired replicas, the routing threshold and the observed SLO percentiles next
// to what the client measured.
//
// This file is the pure part: the Prometheus text parser, the selection of series a timeline
// keeps, and the timeline's JSON. The thread that scrapes lives in scraper.h.
// Contract: plain functions and values, safe from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pd::bench {

// One sample line of the Prometheus text exposition format (version 0.0.4):
//   name{label="value",...} VALUE [TIMESTAMP]
// Values may be NaN, +Inf, -Inf; label values may hold \" \\ and \n escapes.
struct PromSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
  // `name{a="x",b="y"}` with labels in name order and values re-escaped: one key per series.
  std::string key() const;
};
struct PromText {
  std::vector<PromSample> samples;
  int64_t malformedLines = 0;  // lines that are neither comments, blank nor samples (skipped)
};
// Comment (# HELP / # TYPE / anything after #) and blank lines are skipped; a malformed line
// is counted and skipped, never an error: a scrape of a server mid-upgrade still gives data.
PromText parsePrometheusText(std::string_view text);

// Which series a timeline keeps: the pools' worker counts (every *_workers gauge with a pool
// label, so a worker that changes role shows as one pool's count falling and the other's
// rising), the autoscaler's output and inputs, the routing threshold, the SLO window gauges,
// route decisions and any role-switch series (name containing "role").
bool timelineKeeps(const PromSample& s);

struct TimelineSample {
  double tS = 0;  // seconds after the measured phase began (warm-up samples are < 0)
  bool ok = false;
  std::string error;                     // why a failed scrape failed ("timeout after 1000 ms", "HTTP 401")
  double scrapeMs = 0;                   // how long the scrape took
  std::map<std::string, double> values;  // PromSample::key() -> value, the kept series only
};

struct MetricsTimeline {
  std::string url;
  int64_t intervalMs = 0;
  std::vector<TimelineSample> samples;  // in time order
  struct SeriesInfo {
    std::string name;
    std::map<std::string, std::string> labels;
  };
  std::map<std::string, SeriesInfo> info;  // key -> name and labels, for every kept series seen

  // Records a successful scrape (the kept series of `text`) or a failed one (a gap).
  void addScrape(double tS, const PromText& text, double scrapeMs);
  void addGap(double tS, std::string error, double scrapeMs);
  // Shifts every sample's time by -offsetS (the scraper's clock to the run's).
  void shift(double offsetS);
  // A series' points (time, value) over the successful scrapes that carried it.
  std::vector<std::pair<double, double>> series(const std::string& key) const;
  // Every series key seen, sorted.
  std::vector<std::string> keys() const;
  int64_t failedScrapes() const;
};

// {"url", "interval_ms", "scrapes", "failed_scrapes", "gaps": [{"t_s", "error"}],
//  "series": [{"key", "name", "labels": {...}, "points": [[t_s, value|null], ...]}]}
// (docs/bench.md, "Metrics timeline"). Non-finite values are null.
nlohmann::json timelineJson(const MetricsTimeline& t);

}  // namespace pd::bench
