#include "common/metrics/metrics.h"

#include <ctime>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "common/config/cluster_config.h"
#include "common/metrics/pdserve_metrics.h"

using namespace pd::metrics;

namespace {
bool hasLine(const std::string& text, const std::string& line) {
  return ("\n" + text).find("\n" + line + "\n") != std::string::npos;
}
}  // namespace

TEST_CASE("registry renders counters, gauges and constant labels") {
  Registry reg(Labels{{"role", "decode"}});
  Counter c = reg.counter("pdserve_test_total", "A test counter.", {{"kind", "a"}});
  c.inc();
  c.inc(2);
  c.inc(-5);  // ignored
  CHECK(c.value() == 3);
  // The same name and labels give the same metric.
  reg.counter("pdserve_test_total", "A test counter.", {{"kind", "a"}}).inc();
  Gauge g = reg.gauge("pdserve_test_gauge", "A test gauge.");
  g.set(7);
  g.dec(2);
  std::string text = reg.serialize();
  INFO(text);
  CHECK(hasLine(text, "# HELP pdserve_test_total A test counter."));
  CHECK(hasLine(text, "# TYPE pdserve_test_total counter"));
  CHECK(hasLine(text, "pdserve_test_total{role=\"decode\",kind=\"a\"} 4"));
  CHECK(hasLine(text, "# TYPE pdserve_test_gauge gauge"));
  CHECK(hasLine(text, "pdserve_test_gauge{role=\"decode\"} 5"));
}

TEST_CASE("a name reused with another type is a programming error") {
  Registry reg;
  reg.counter("pdserve_dup", "x");
  CHECK_THROWS_AS(reg.gauge("pdserve_dup", "x"), std::invalid_argument);
  CHECK_THROWS_AS(reg.counter("bad name", "x"), std::invalid_argument);
}

TEST_CASE("router histograms use the configured buckets, with the SLO as a bound") {
  auto cfg = pd::config::parseClusterConfig(
      "router: {metrics: {ttft_buckets_s: [0.1, 1], itl_buckets_s: [0.01, 0.1],"
      " e2e_buckets_s: [1, 10]}}\n"
      "pools: {prefill: {slo: {ttft_ms: 250}}, decode: {slo: {itl_ms: 20}}}\n",
      "m.yaml");
  REQUIRE(cfg.ok());
  Registry reg;
  RouterMetrics m(reg, {cfg->router.ttftBucketsS, cfg->router.itlBucketsS, cfg->router.e2eBucketsS});
  m.observeTtft(kRouteDisaggregated, 0.2);  // <= 0.25
  m.observeTtft(kRouteDisaggregated, 0.3);  // <= 1
  m.observeTtft(kRouteDisaggregated, 5.0);  // +Inf only
  m.observeTtft(kRouteColocated, 0.05);
  m.observeItl(kRouteColocated, 0.015);
  m.observeE2e(kRouteColocated, 2);
  m.observeQueueTime(kRouteColocated, 0.5);
  std::string text = reg.serialize();
  INFO(text);
  CHECK(hasLine(text, "# TYPE pdserve_time_to_first_token_seconds histogram"));
  // Cumulative counts per bound: 0.1 -> 0, 0.25 (the SLO) -> 1, 1 -> 2, +Inf -> 3.
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_bucket{route=\"disaggregated\",le=\"0.1\"} 0"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_bucket{route=\"disaggregated\",le=\"0.25\"} 1"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_bucket{route=\"disaggregated\",le=\"1\"} 2"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_bucket{route=\"disaggregated\",le=\"+Inf\"} 3"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_count{route=\"disaggregated\"} 3"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_sum{route=\"disaggregated\"} 5.5"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_bucket{route=\"colocated\",le=\"0.1\"} 1"));
  CHECK(hasLine(text, "pdserve_inter_token_latency_seconds_bucket{route=\"colocated\",le=\"0.01\"} 0"));
  CHECK(hasLine(text, "pdserve_inter_token_latency_seconds_bucket{route=\"colocated\",le=\"0.02\"} 1"));
  CHECK(hasLine(text, "pdserve_e2e_request_latency_seconds_bucket{route=\"colocated\",le=\"1\"} 0"));
  CHECK(hasLine(text, "pdserve_e2e_request_latency_seconds_bucket{route=\"colocated\",le=\"10\"} 1"));
  CHECK(hasLine(text, "pdserve_request_queue_time_seconds_bucket{route=\"colocated\",le=\"1\"} 1"));
}

TEST_CASE("router counters and gauges") {
  Registry reg;
  RouterMetrics m(reg, {{0.1}, {0.01}, {1}});
  m.routeDecision(kRouteColocated, "short_prompt");
  m.routeDecision(kRouteColocated, "short_prompt");
  m.routeDecision(kRouteDisaggregated, "long_prompt");
  m.requestFinished("stop", 100, 20);
  m.requestFinished("length", 50, 16);
  m.requestError("overloaded", kPoolPrefill);
  m.inFlight.inc();
  m.inFlight.inc();
  m.inFlight.dec();
  m.setSlo(kPoolPrefill, 0.5, 99);
  m.setSloWindow(kPoolPrefill, 0.42, 0.995);
  m.setPoolWorkers(kPoolDecode, 4);
  m.setDesiredReplicas(kPoolDecode, 6);
  std::string text = reg.serialize();
  INFO(text);
  CHECK(hasLine(text, "pdserve_route_decisions_total{reason=\"short_prompt\",route=\"colocated\"} 2"));
  CHECK(hasLine(text, "pdserve_route_decisions_total{reason=\"long_prompt\",route=\"disaggregated\"} 1"));
  CHECK(hasLine(text, "pdserve_requests_finished_total{finished_reason=\"stop\"} 1"));
  CHECK(hasLine(text, "pdserve_router_prompt_tokens_total 150"));
  CHECK(hasLine(text, "pdserve_router_generation_tokens_total 36"));
  // The workers' token counters count what each computed: the router's never share their name.
  CHECK(text.find("# TYPE pdserve_prompt_tokens_total") == std::string::npos);
  CHECK(text.find("\npdserve_prompt_tokens_total") == std::string::npos);
  CHECK(hasLine(text, "pdserve_request_errors_total{pool=\"prefill\",type=\"overloaded\"} 1"));
  CHECK(hasLine(text, "pdserve_requests_in_flight 1"));
  CHECK(hasLine(text, "pdserve_slo_target_seconds{pool=\"prefill\"} 0.5"));
  CHECK(hasLine(text, "pdserve_slo_percentile{pool=\"prefill\"} 99"));
  CHECK(hasLine(text, "pdserve_slo_observed_seconds{pool=\"prefill\"} 0.42"));
  CHECK(hasLine(text, "pdserve_slo_attainment_ratio{pool=\"prefill\"} 0.995"));
  CHECK(hasLine(text, "pdserve_pool_workers{pool=\"decode\"} 4"));
  CHECK(hasLine(text, "pdserve_desired_replicas{pool=\"decode\"} 6"));
}

TEST_CASE("worker metrics carry role and worker labels") {
  Registry reg(Labels{{"role", "prefill"}, {"worker", "p0"}});
  WorkerMetrics w(reg);
  w.running.set(3);
  w.waiting.set(5);
  w.kvCacheUsage.set(0.25);
  w.setCacheConfig(16, 1024);
  w.kvFreeBlocks.set(768);
  w.modelLoadSeconds.set(1.5);
  w.promptTokens.inc(512);
  w.syncEngineCounters(1, 300, 100);
  w.syncEngineCounters(2, 512, 128);  // cumulative totals: only the growth is counted
  w.remotePrefill("recomputed");
  std::string text = reg.serialize();
  INFO(text);
  const std::string l = "role=\"prefill\",worker=\"p0\"";
  CHECK(hasLine(text, "pdserve_num_requests_running{" + l + "} 3"));
  CHECK(hasLine(text, "pdserve_num_requests_waiting{" + l + "} 5"));
  CHECK(hasLine(text, "pdserve_kv_cache_usage_perc{" + l + "} 0.25"));
  CHECK(hasLine(text, "pdserve_kv_cache_num_blocks{" + l + "} 1024"));
  CHECK(hasLine(text, "pdserve_kv_cache_capacity_tokens{" + l + "} 16384"));
  CHECK(hasLine(text, "pdserve_kv_cache_free_blocks{" + l + "} 768"));
  CHECK(hasLine(text, "pdserve_model_load_seconds{" + l + "} 1.5"));
  CHECK(hasLine(text, "pdserve_cache_config_info{" + l + ",block_size=\"16\",num_blocks=\"1024\"} 1"));
  CHECK(hasLine(text, "pdserve_prefix_cache_hits_total{" + l + "} 128"));
  CHECK(hasLine(text, "pdserve_prefix_cache_queries_total{" + l + "} 512"));
  CHECK(hasLine(text, "pdserve_num_preemptions_total{" + l + "} 2"));
  CHECK(hasLine(text, "pdserve_remote_prefill_total{" + l + ",outcome=\"recomputed\"} 1"));
}

TEST_CASE("concurrent updates from several threads are all counted") {
  Registry reg;
  RouterMetrics m(reg, {{0.1, 1}, {0.01}, {1}});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < 1000; ++i) {
        m.routeDecision(kRouteColocated, t % 2 == 0 ? "short_prompt" : "prefix_cached");
        m.observeTtft(kRouteColocated, 0.05);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::string text = reg.serialize();
  CHECK(hasLine(text, "pdserve_route_decisions_total{reason=\"short_prompt\",route=\"colocated\"} 2000"));
  CHECK(hasLine(text, "pdserve_route_decisions_total{reason=\"prefix_cached\",route=\"colocated\"} 2000"));
  CHECK(hasLine(text, "pdserve_time_to_first_token_seconds_count{route=\"colocated\"} 4000"));
}

TEST_CASE("aliases: the same series under a second name with extra labels; ':' names are accepted") {
  Registry reg(Labels{{"role", "decode"}});
  // prometheus-cpp takes ':' in a metric's own name too (recording-rule style names).
  CHECK_NOTHROW(reg.gauge("pdserve:colon_test", "A gauge with a colon in its name.").set(1));
  Gauge g = reg.gauge("pdserve_test_waiting", "Waiting.");
  g.set(3);
  Histogram h = reg.histogram("pdserve_test_seconds", "Latency.", {0.1, 1}, {{"route", "colocated"}});
  h.observe(0.05);
  h.observe(0.5);
  reg.setAliases({{"pdserve_test_waiting", "vllm:num_requests_waiting"}, {"pdserve_test_seconds", "vllm:test_seconds"}},
                 {{"model_name", "small"}});
  g.set(4);  // aliases are made at serialize(): they always hold the current value
  std::string text = reg.serialize();
  INFO(text);
  CHECK(hasLine(text, "pdserve_test_waiting{role=\"decode\"} 4"));
  CHECK(hasLine(text, "# TYPE vllm:num_requests_waiting gauge"));
  CHECK(hasLine(text, "vllm:num_requests_waiting{role=\"decode\",model_name=\"small\"} 4"));
  CHECK(
      hasLine(text, "vllm:test_seconds_bucket{role=\"decode\",route=\"colocated\",model_name=\"small\",le=\"0.1\"} 1"));
  CHECK(hasLine(text, "vllm:test_seconds_count{role=\"decode\",route=\"colocated\",model_name=\"small\"} 2"));
  CHECK(text.find("pdserve:colon_test{role=\"decode\"} 1") != std::string::npos);
  CHECK_THROWS_AS(reg.setAliases({{"pdserve_test_waiting", "bad name"}}, {}), std::invalid_argument);
  CHECK_THROWS_AS(reg.setAliases({{"a", "b"}}, {{"bad-label", "x"}}), std::invalid_argument);
  reg.setAliases({}, {});
  CHECK(reg.serialize().find("vllm:") == std::string::npos);
}

TEST_CASE("exportVllmNames: the router's and the worker's vLLM names, only with the switch") {
  Registry router;
  RouterMetrics rm(router, LatencyBuckets{{0.1, 1}, {0.01, 0.1}, {1, 10}});
  rm.observeTtft("disaggregated", 0.2);
  rm.observeItl("disaggregated", 0.02);
  rm.observeE2e("disaggregated", 2);
  rm.requestFinished("length", 10, 4);
  CHECK(router.serialize().find("vllm:") == std::string::npos);
  exportVllmNames(router, MetricsProcess::kRouter, "small");
  std::string text = router.serialize();
  INFO(text);
  CHECK(hasLine(text, "vllm:time_to_first_token_seconds_count{route=\"disaggregated\",model_name=\"small\"} 1"));
  CHECK(hasLine(text, "vllm:inter_token_latency_seconds_count{route=\"disaggregated\",model_name=\"small\"} 1"));
  CHECK(hasLine(text, "vllm:time_per_output_token_seconds_count{route=\"disaggregated\",model_name=\"small\"} 1"));
  CHECK(hasLine(text, "vllm:e2e_request_latency_seconds_sum{route=\"disaggregated\",model_name=\"small\"} 2"));
  CHECK(hasLine(text, "vllm:request_success_total{finished_reason=\"length\",model_name=\"small\"} 1"));
  // Token counters are per engine (workers), as vLLM counts them: not on the router.
  CHECK(text.find("vllm:prompt_tokens_total") == std::string::npos);

  Registry worker(Labels{{"role", "decode"}, {"worker", "decode-0"}});
  WorkerMetrics wm(worker);
  wm.waiting.set(2);
  wm.kvCacheUsage.set(0.25);
  wm.promptTokens.inc(7);
  exportVllmNames(worker, MetricsProcess::kWorker, "small");
  text = worker.serialize();
  CHECK(hasLine(text, "vllm:num_requests_waiting{role=\"decode\",worker=\"decode-0\",model_name=\"small\"} 2"));
  CHECK(hasLine(text, "vllm:kv_cache_usage_perc{role=\"decode\",worker=\"decode-0\",model_name=\"small\"} 0.25"));
  CHECK(hasLine(text, "vllm:prompt_tokens_total{role=\"decode\",worker=\"decode-0\",model_name=\"small\"} 7"));
  CHECK(hasLine(text, "vllm:num_requests_running{role=\"decode\",worker=\"decode-0\",model_name=\"small\"} 0"));
}

TEST_CASE("process metrics and build info on every process") {
  Registry reg(Labels{{"role", "decode"}});
  exportProcessInfo(reg, "decode");
  const std::string text = reg.serialize();
  INFO(text);
  CHECK(hasLine(text, "pdserve_build_info{role=\"decode\",component=\"decode\",version=\"" PD_VERSION "\"} 1"));
  for (const char* family :
       {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
        "process_open_fds", "process_max_fds", "process_start_time_seconds"}) {
    INFO(family);
    CHECK(text.find(std::string("\n") + family + "{role=\"decode\"} ") != std::string::npos);
  }
  // Values from /proc/self: this process has open files, resident memory and started before now.
  const auto value = [&](const std::string& family) {
    const auto at = text.find("\n" + family + "{");
    REQUIRE(at != std::string::npos);
    const auto space = text.find(' ', at + 1);
    return std::stod(text.substr(space + 1, text.find('\n', space) - space - 1));
  };
  CHECK(value("process_open_fds") >= 3);
  CHECK(value("process_resident_memory_bytes") > 1e6);
  const double started = value("process_start_time_seconds");
  const double now = double(std::time(nullptr));
  CHECK(started > now - 24 * 3600 * 365);
  CHECK(started <= now + 1);
  // A registry without exportProcessInfo has neither.
  Registry plain;
  CHECK(plain.serialize().find("process_") == std::string::npos);
}

TEST_CASE("SLI counters compare each latency with its pool's target") {
  Registry reg;
  RouterMetrics m(reg, {{0.1, 1}, {0.01, 0.05}, {1}});
  m.observeTtft(kRouteDisaggregated, 0.2);  // before the targets are known: not counted
  m.setSlo(kPoolPrefill, 1.0, 99);
  m.setSlo(kPoolDecode, 0.05, 90);
  m.observeTtft(kRouteDisaggregated, 0.5);
  m.observeTtft(kRouteDisaggregated, 1.0);  // at the target: within it
  m.observeTtft(kRouteDisaggregated, 2.5);
  m.observeTtft("disaggregated-recomputed", 3.0);
  m.observeTtft(kRouteColocated, 0.1);
  m.observeItl(kRouteColocated, 0.02);
  m.observeItl(kRouteDisaggregated, 0.07);
  m.requestError("overloaded", kPoolPrefill);  // shed: a TTFT miss of the pool that shed it
  m.requestError("invalid_request_error", "router");
  const std::string text = reg.serialize();
  INFO(text);
  CHECK(hasLine(text, "pdserve_slo_observations_total{pool=\"prefill\",slo=\"ttft\"} 5"));
  CHECK(hasLine(text, "pdserve_slo_good_observations_total{pool=\"prefill\",slo=\"ttft\"} 2"));
  CHECK(hasLine(text, "pdserve_slo_observations_total{pool=\"decode\",slo=\"ttft\"} 1"));
  CHECK(hasLine(text, "pdserve_slo_good_observations_total{pool=\"decode\",slo=\"ttft\"} 1"));
  CHECK(hasLine(text, "pdserve_slo_observations_total{pool=\"decode\",slo=\"itl\"} 2"));
  CHECK(hasLine(text, "pdserve_slo_good_observations_total{pool=\"decode\",slo=\"itl\"} 1"));
}
