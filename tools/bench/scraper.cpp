#include "tools/bench/scraper.h"

#include <utility>

namespace pd::bench {

using Clock = std::chrono::steady_clock;

Result<ScrapeOptions> parseMetricsUrl(std::string_view url) {
  auto t = parseServerUrl(url);
  if (!t.ok()) {
    std::string m = t.status().message();
    if (m.rfind("--url", 0) == 0) m = "--metrics-url" + m.substr(5);
    return invalidArgument(m);
  }
  ScrapeOptions o;
  o.server = *t;
  o.path = t->basePath.empty() ? "/metrics" : t->basePath;
  o.server.basePath.clear();
  return o;
}

MetricsScraper::MetricsScraper(ScrapeOptions o) : o_(std::move(o)) {
  timeline_.url = "http://" + o_.server.host + ":" + o_.server.port + o_.path;
  timeline_.intervalMs = o_.intervalMs;
}

MetricsScraper::~MetricsScraper() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MetricsScraper::start() {
  origin_ = Clock::now();
  thread_ = std::thread([this] { loop(); });
}

MetricsTimeline MetricsScraper::stop(Clock::time_point zero) {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  MetricsTimeline t = std::move(timeline_);
  t.shift(std::chrono::duration<double>(zero - origin_).count());
  return t;
}

void MetricsScraper::loop() {
  auto next = Clock::now();
  while (true) {
    const auto begin = Clock::now();
    const double tS = std::chrono::duration<double>(begin - origin_).count();
    auto reply = httpGetText(o_.server, o_.path, static_cast<double>(o_.timeoutMs) / 1000.0, o_.bearer);
    const double tookMs = std::chrono::duration<double, std::milli>(Clock::now() - begin).count();
    if (!reply.ok()) {
      timeline_.addGap(tS, reply.status().message(), tookMs);
    } else if (reply->httpStatus != 200) {
      timeline_.addGap(tS, "HTTP " + std::to_string(reply->httpStatus), tookMs);
    } else {
      PromText text = parsePrometheusText(reply->body);
      if (text.samples.empty())
        timeline_.addGap(tS, "no samples in the body (" + std::to_string(text.malformedLines) + " malformed lines)",
                         tookMs);
      else
        timeline_.addScrape(tS, text, tookMs);
    }
    // Fixed-rate ticks; a scrape that overran its slot skips the missed ones.
    next += std::chrono::milliseconds(o_.intervalMs);
    if (next < Clock::now()) next = Clock::now();
    std::unique_lock<std::mutex> l(mu_);
    if (cv_.wait_until(l, next, [this] { return stopping_; })) return;
  }
}

}  // namespace pd::bench
