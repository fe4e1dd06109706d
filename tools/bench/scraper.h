// The metrics scraper of `pdserve bench --metrics-url`: a thread that GETs the router's
// Prometheus text every interval during the run and keeps the series a timeline keeps
// (timeline.h).
//
// Threads: start() spawns one thread; stop() (or the destructor) wakes and joins it and
// hands the timeline over. Nothing is shared with the load generator's thread but the
// process: the scraper has its own io_context per scrape.
// Errors: a scrape that fails (no answer, timeout, non-200, an unparseable body) is recorded
// as a gap in the timeline with its reason and never stops the run. Every scrape is bounded
// by timeoutMs (from connect to the last byte; resolving a host name is not, so give an address
// where that matters); a slow server delays the next scrape, it never piles them up.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "common/base/status.h"
#include "tools/bench/client.h"
#include "tools/bench/timeline.h"

namespace pd::bench {

struct ScrapeOptions {
  ServerTarget server;
  std::string path = "/metrics";
  std::string bearer;  // Authorization: Bearer, when not empty (router.http.metrics_auth)
  int64_t intervalMs = 1000;
  int64_t timeoutMs = 1000;  // per scrape; at most intervalMs is sensible
};
// "http://HOST:PORT/metrics" (the path defaults to /metrics). https is refused.
Result<ScrapeOptions> parseMetricsUrl(std::string_view url);

class MetricsScraper {
 public:
  explicit MetricsScraper(ScrapeOptions o);
  ~MetricsScraper();
  MetricsScraper(const MetricsScraper&) = delete;
  MetricsScraper& operator=(const MetricsScraper&) = delete;

  void start();
  // Stops the thread and returns the timeline, its times in seconds after `zero` (the run's
  // measured start).
  MetricsTimeline stop(std::chrono::steady_clock::time_point zero);

 private:
  void loop();
  ScrapeOptions o_;
  std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  MetricsTimeline timeline_;  // written by the thread only until it is joined
  std::thread thread_;
};

}  // namespace pd::bench
