// The metrics timeline of `pdserve bench --metrics-url`: the Prometheus text parser (labels,
// escapes, comments, NaN / Inf, timestamps, malformed lines), the series a timeline keeps,
// its JSON, and the scraper against a loopback server and against nothing (gaps, no abort).
#include "tools/bench/timeline.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tools/bench/scraper.h"

using namespace pd::bench;

TEST_CASE("Prometheus text: samples, labels, escapes, comments, NaN and Inf", "[bench][timeline]") {
  const char* text =
      "# HELP pdserve_pool_workers Workers registered and reporting, per pool.\n"
      "# TYPE pdserve_pool_workers gauge\n"
      "pdserve_pool_workers{pool=\"prefill\"} 1\n"
      "pdserve_pool_workers{pool=\"decode\"} 2\r\n"
      "\n"
      "   # an indented comment\n"
      "pdserve_short_prompt_tokens 256\n"
      "pdserve_slo_observed_seconds{pool=\"decode\"} NaN\n"
      "x_bucket{le=\"+Inf\",z=\"a\\\"b\\\\c\\nd\"} +Inf 1700000000000\n"
      "neg -Inf\n"
      "sci{a=\"1\", b=\"2\",} 1.5e-3\n"
      "vllm:num_requests_running{model_name=\"m\"} 3\n"
      "broken{pool=\"x\" 1\n"
      "novalue\n"
      "bad_value{a=\"b\"} twelve\n"
      "bad_ts 1 soon\n"
      "{pool=\"x\"} 1\n";
  const PromText p = parsePrometheusText(text);
  CHECK(p.malformedLines == 5);
  REQUIRE(p.samples.size() == 8);
  CHECK(p.samples[0].name == "pdserve_pool_workers");
  CHECK(p.samples[0].labels.at("pool") == "prefill");
  CHECK(p.samples[0].value == 1);
  CHECK(p.samples[1].value == 2);  // CRLF line ends
  CHECK(p.samples[2].labels.empty());
  CHECK(p.samples[2].value == 256);
  CHECK(std::isnan(p.samples[3].value));
  CHECK(p.samples[4].value == INFINITY);
  CHECK(p.samples[4].labels.at("le") == "+Inf");
  CHECK(p.samples[4].labels.at("z") == "a\"b\\c\nd");
  CHECK(p.samples[5].value == -INFINITY);
  CHECK(p.samples[6].value == Approx(0.0015));
  CHECK(p.samples[6].labels.size() == 2);  // spaces and a trailing comma are allowed
  CHECK(p.samples[7].name == "vllm:num_requests_running");
  // One key per series: labels sorted, values re-escaped.
  CHECK(p.samples[0].key() == "pdserve_pool_workers{pool=\"prefill\"}");
  CHECK(p.samples[2].key() == "pdserve_short_prompt_tokens");
  CHECK(p.samples[4].key() == "x_bucket{le=\"+Inf\",z=\"a\\\"b\\\\c\\nd\"}");
  CHECK(parsePrometheusText("").samples.empty());
  CHECK(parsePrometheusText("# only a comment").malformedLines == 0);
}

TEST_CASE("the timeline keeps the pools' workers, the autoscaler, the threshold and SLO gauges", "[bench][timeline]") {
  auto keeps = [](const char* name, std::map<std::string, std::string> labels = {}) {
    PromSample s;
    s.name = name;
    s.labels = std::move(labels);
    return timelineKeeps(s);
  };
  CHECK(keeps("pdserve_pool_workers", {{"pool", "decode"}}));
  CHECK(keeps("pdserve_role_workers", {{"pool", "prefill"}}));  // any *_workers gauge of a pool
  CHECK(keeps("pdserve_desired_replicas", {{"pool", "decode"}}));
  CHECK(keeps("pdserve_short_prompt_tokens"));
  CHECK(keeps("pdserve_slo_observed_seconds", {{"pool", "prefill"}}));
  CHECK(keeps("pdserve_slo_attainment_ratio", {{"pool", "prefill"}}));
  CHECK(keeps("pdserve_autoscaler_capacity_replicas", {{"pool", "prefill"}}));
  CHECK(keeps("pdserve_route_decisions_total", {{"route", "colocated"}}));
  CHECK(keeps("pdserve_worker_role_switches_total"));
  CHECK_FALSE(keeps("pdserve_time_to_first_token_seconds_bucket", {{"le", "0.5"}}));
  CHECK_FALSE(keeps("pdserve_worker_workers"));  // no pool label
  CHECK_FALSE(keeps("process_cpu_seconds_total"));
}

TEST_CASE("timeline series, gaps, time shift and JSON", "[bench][timeline]") {
  MetricsTimeline t;
  t.url = "http://127.0.0.1:1/metrics";
  t.intervalMs = 500;
  t.addScrape(10.0,
              parsePrometheusText("pdserve_pool_workers{pool=\"decode\"} 1\nignored_total 5\n"
                                  "pdserve_slo_observed_seconds{pool=\"decode\"} NaN\n"),
              3);
  t.addGap(10.5, "timeout after 500 ms", 500);
  t.addScrape(11.0,
              parsePrometheusText("pdserve_pool_workers{pool=\"decode\"} 2\n"
                                  "pdserve_pool_workers{pool=\"prefill\"} 1\n"),
              2);
  t.shift(9.0);
  CHECK(t.failedScrapes() == 1);
  CHECK(t.keys() == std::vector<std::string>{"pdserve_pool_workers{pool=\"decode\"}",
                                             "pdserve_pool_workers{pool=\"prefill\"}",
                                             "pdserve_slo_observed_seconds{pool=\"decode\"}"});
  const auto decode = t.series("pdserve_pool_workers{pool=\"decode\"}");
  REQUIRE(decode.size() == 2);  // the gap is no point
  CHECK(decode[0] == std::make_pair(1.0, 1.0));
  CHECK(decode[1] == std::make_pair(2.0, 2.0));

  const nlohmann::json j = nlohmann::json::parse(timelineJson(t).dump());  // survives a round trip
  CHECK(j["url"] == "http://127.0.0.1:1/metrics");
  CHECK(j["interval_ms"] == 500);
  CHECK(j["scrapes"] == 3);
  CHECK(j["failed_scrapes"] == 1);
  REQUIRE(j["gaps"].size() == 1);
  CHECK(j["gaps"][0]["t_s"] == Approx(1.5));
  CHECK(j["gaps"][0]["error"] == "timeout after 500 ms");
  REQUIRE(j["series"].size() == 3);
  const auto& s0 = j["series"][0];
  CHECK(s0["name"] == "pdserve_pool_workers");
  CHECK(s0["labels"]["pool"] == "decode");
  CHECK(s0["points"] == nlohmann::json::parse("[[1.0, 1.0], [2.0, 2.0]]"));
  CHECK(j["series"][2]["points"][0][1].is_null());  // NaN is null
}

TEST_CASE("metrics URLs", "[bench][timeline]") {
  auto a = parseMetricsUrl("http://10.0.0.1:8000/metrics");
  REQUIRE(a.ok());
  CHECK(a->server.host == "10.0.0.1");
  CHECK(a->server.port == "8000");
  CHECK(a->path == "/metrics");
  auto b = parseMetricsUrl("127.0.0.1:9");
  REQUIRE(b.ok());
  CHECK(b->path == "/metrics");
  auto c = parseMetricsUrl("https://x/metrics");
  REQUIRE_FALSE(c.ok());
  CHECK_THAT(c.status().message(), Catch::Contains("--metrics-url"));
  CHECK_FALSE(parseMetricsUrl("http://:80/metrics").ok());
}

namespace {
// A loopback HTTP server answering every request with `body` (Connection: close), for the
// scraper; it stops answering (drops connections) once `silent` is set.
class TinyServer {
 public:
  explicit TinyServer(std::string body) : body_(std::move(body)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    ::listen(fd_, 16);
    thread_ = std::thread([this] {
      while (!stop_) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        char buf[4096];
        (void)::recv(c, buf, sizeof buf, 0);
        ++requests_;
        if (!silent_) {
          const std::string r =
              "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body_.size()) +
              "\r\nConnection: close\r\n\r\n" + body_;
          (void)::send(c, r.data(), r.size(), MSG_NOSIGNAL);
        }
        ::close(c);
      }
    });
  }
  ~TinyServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  int port() const { return port_; }
  void goSilent() { silent_ = true; }
  int requests() const { return requests_; }

 private:
  std::string body_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false}, silent_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;
};
}  // namespace

TEST_CASE("the scraper samples a live endpoint and records failures as gaps", "[bench][timeline]") {
  TinyServer server(
      "# TYPE pdserve_pool_workers gauge\npdserve_pool_workers{pool=\"decode\"} 2\n"
      "pdserve_short_prompt_tokens 300\n");
  auto o = parseMetricsUrl("http://127.0.0.1:" + std::to_string(server.port()) + "/metrics");
  REQUIRE(o.ok());
  o->intervalMs = 50;
  o->timeoutMs = 200;
  MetricsScraper scraper(*o);
  scraper.start();
  const auto zero = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  server.goSilent();  // connections now close without an answer
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const MetricsTimeline t = scraper.stop(zero);
  CHECK(t.intervalMs == 50);
  CHECK(t.samples.size() >= 5);
  const auto workers = t.series("pdserve_pool_workers{pool=\"decode\"}");
  REQUIRE(workers.size() >= 3);
  CHECK(workers.front().second == 2);
  CHECK(t.series("pdserve_short_prompt_tokens").front().second == 300);
  CHECK(t.failedScrapes() >= 1);
  for (size_t i = 1; i < t.samples.size(); ++i) CHECK(t.samples[i].tS > t.samples[i - 1].tS);
  CHECK(t.samples.front().tS < 0.05);  // times are relative to `zero`
}

TEST_CASE("a scraper with nothing to scrape records gaps and stops promptly", "[bench][timeline]") {
  // A port nothing listens on: bind one and close it.
  int port = 0;
  {
    TinyServer s("");
    port = s.port();
  }
  auto o = parseMetricsUrl("http://127.0.0.1:" + std::to_string(port) + "/metrics");
  REQUIRE(o.ok());
  o->intervalMs = 50;
  o->timeoutMs = 100;
  MetricsScraper scraper(*o);
  scraper.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  const auto before = std::chrono::steady_clock::now();
  const MetricsTimeline t = scraper.stop(before);
  CHECK(std::chrono::steady_clock::now() - before < std::chrono::milliseconds(500));
  REQUIRE(t.samples.size() >= 2);
  CHECK(t.failedScrapes() == static_cast<int64_t>(t.samples.size()));
  CHECK_FALSE(t.samples.front().error.empty());
  CHECK(t.info.empty());
}
