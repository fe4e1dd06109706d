// End to end (docs/serving.md): `pdserve up`'s local actuator really scales a pool. The real
// `pdserve up` process runs a cluster whose decode pool has bounds 1..2; a queue of
// concurrent streams makes the router recommend 2 and the actuator start a second worker,
// which then serves; once the cluster is idle the recommendation falls back to 1 and the
// actuator drains the extra worker (SIGTERM, exit 0). No request fails. The config's short
// autoscaler windows and cooldowns keep the whole run well under a minute. A second case runs
// role moves: the two pools as one budget, an idle prefill worker moved into the decode pool.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"
#include "tools/process_group.h"

using namespace pd;
using namespace pd::tools;
using nlohmann::json;
using namespace std::chrono;
using namespace std::chrono_literals;
using pd::test::readFile;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e_autoscale";

struct Outcome {
  int status = 0;
  std::string worker;  // x-pdserve-decode-worker
  std::string finishReason;
  std::string error;
};

Outcome complete(int port, int maxTokens, int seed) {
  json req{{"model", "small"},
           {"prompt", "request " + std::to_string(seed) + " of the autoscaling test"},
           {"max_tokens", maxTokens},
           {"temperature", 0},
           {"ignore_eos", true}};
  auto r = httpRequest(port, "POST", "/v1/completions", req.dump(), 170s);
  Outcome o;
  if (!r.ok()) {
    o.error = r.status().toString();
    return o;
  }
  o.status = r->status;
  const std::string key = "x-pdserve-decode-worker: ";
  if (auto at = r->headers.find(key); at != std::string::npos) {
    o.worker = r->headers.substr(at + key.size(), r->headers.find('\r', at) - at - key.size());
  }
  auto body = json::parse(r->body, nullptr, false);
  if (o.status == 200 && body.is_object())
    o.finishReason = body["choices"][0].value("finish_reason", "");
  else
    o.error = r->body.substr(0, 300);
  return o;
}

// The tests' cluster: every prompt on the decode pool (short_prompt_tokens), a worker running 3
// streams at once, shedding off (a request must queue, not be refused: the tests count every
// request), short autoscaler windows; `idleAfterMs`, `extra` autoscaler keys and the pools
// vary.
void writeConfig(const std::string& path, int idleAfterMs, const std::string& extra, const std::string& pools) {
  std::ofstream(path) << "model: {path: " << pd::test::e2eModelDir() << ", name: small}\n"
                      << "router:\n"
                      << "  routing: {short_prompt_tokens: 100000, prefix_aware_routing: false}\n"
                      << "  requests: {request_timeout_ms: 160000}\n"
                      << "  admission: {overload_shedding: false}\n"
                      << "  autoscaler: {tick_ms: 250, window_ms: 4000, min_samples: 20, scale_up_cooldown_ms: 1000,\n"
                      << "               scale_down_cooldown_ms: 60000, idle_after_ms: " << idleAfterMs << extra
                      << "}\n"
                      << "pools:\n"
                      << pools
                      << "engine: {backend: cpu, threads: 1, kv_cache_bytes: 67108864, max_batch_tokens: 512,\n"
                      << "         max_running_requests: 3, drain_timeout_ms: 20000}\n"
                      << "logging: {level: info}\n";
}

// The router's `series` now; -1 when /metrics does not answer.
double routerMetric(int port, const std::string& series) {
  auto r = httpGet(port, "/metrics", 5s);
  return r.ok() ? pd::test::metricValue(r->body, series) : -1.0;
}

// Waits up to `limit` for the router's `series` to read n; fails the test if `pdserve up`
// exits meanwhile.
bool waitMetric(ProcessGroup& up, const std::string& log, int port, const std::string& series, double n,
                seconds limit) {
  for (const auto deadline = steady_clock::now() + limit; steady_clock::now() < deadline;) {
    if (auto dead = up.waitAny(0ms)) FAIL("pdserve up " << dead->description << ":\n" << readFile(log));
    if (routerMetric(port, series) == n) return true;
    std::this_thread::sleep_for(100ms);
  }
  return false;
}

// The processes in `pdserve up`'s Prometheus file_sd targets file (the path it printed),
// waiting up to 5 s for it to list `want` (it is rewritten within a poll, 1 s, of a change).
std::vector<std::string> targetsFileProcesses(const std::string& log, const std::vector<std::string>& want) {
  const std::string text = readFile(log);
  const std::string marker = "prometheus targets (file_sd, kept current): ";
  const auto at = text.find(marker);
  if (at == std::string::npos) return {"<no targets file printed>"};
  const std::string path = text.substr(at + marker.size(), text.find('\n', at) - at - marker.size());
  std::vector<std::string> got;
  for (auto deadline = steady_clock::now() + 5s; steady_clock::now() < deadline; std::this_thread::sleep_for(100ms)) {
    got.clear();
    try {
      for (const auto& g : nlohmann::json::parse(readFile(path)))
        got.push_back(g["labels"]["pdserve_process"].get<std::string>());
    } catch (const nlohmann::json::exception&) {
      got = {"<unparsable " + path + ">"};
    }
    std::sort(got.begin(), got.end());
    if (got == want) break;
  }
  return got;
}

}  // namespace

TEST_CASE(
    "pdserve up scales a decode pool 1..2 out under a queue and back to 1 when idle, no request "
    "failing") {
  std::filesystem::create_directories(kWork);
  const std::string config = kWork + "/cluster.yaml";
  // A worker runs 3 streams at once (max_running_requests) and the rest wait: 10 streams
  // make a queue that no ITL shows (the running ones step in ~15 ms against a 200 ms
  // target), so it is the capacity model (10 / 3 -> 4, clamped to 2) that scales out.
  writeConfig(config, 2000, "",
              "  prefill: {replicas: 0}\n"
              "  decode: {replicas: 1, min_replicas: 1, max_replicas: 2, slo: {itl_ms: 200, percentile: 90}}\n");
  const std::string log = kWork + "/up.log";
  ProcessGroup up;
  const int port = pd::test::startPdserveUp(up, config, log);
  const auto metric = [&](const std::string& series) { return routerMetric(port, series); };
  const std::string workers = "pdserve_pool_workers{pool=\"decode\"}";
  const auto waitWorkers = [&](int n, seconds limit) { return waitMetric(up, log, port, workers, n, limit); };
  const auto t0 = steady_clock::now();
  REQUIRE(waitWorkers(1, 60s));

  std::mutex mu;
  std::vector<Outcome> outcomes;
  std::vector<std::thread> clients;
  const auto send = [&](int maxTokens, int seed) {
    clients.emplace_back([&, maxTokens, seed] {
      Outcome o = complete(port, maxTokens, seed);
      std::lock_guard<std::mutex> lock(mu);
      outcomes.push_back(o);
    });
  };
  // A queue building up: 10 streams arriving 150 ms apart (so the worker's steps spread over
  // batch sizes and its step line is fitted while they arrive). 160 tokens: long enough to
  // queue for seconds, short enough that a sanitized build (~10x slower steps) finishes them
  // within request_timeout_ms.
  for (int i = 0; i < 10; ++i) {
    send(160, i);
    std::this_thread::sleep_for(150ms);
  }
  double capacitySeen = -1, desiredSeen = -1;
  {
    const auto deadline = steady_clock::now() + 30s;
    bool scaled = false;
    while (!scaled && steady_clock::now() < deadline) {
      if (auto dead = up.waitAny(0ms)) FAIL("pdserve up " << dead->description << ":\n" << readFile(log));
      capacitySeen = std::max(capacitySeen, metric("pdserve_autoscaler_capacity_replicas{pool=\"decode\"}"));
      desiredSeen = std::max(desiredSeen, metric("pdserve_desired_replicas{pool=\"decode\"}"));
      scaled = metric(workers) == 2;
      if (!scaled) std::this_thread::sleep_for(100ms);
    }
    INFO(readFile(log));
    REQUIRE(scaled);
  }
  const double scaledUpAfterS = duration<double>(steady_clock::now() - t0).count();
  // Prometheus' file_sd file follows the pool: the new worker is a target.
  CHECK(targetsFileProcesses(log, {"decode-0", "decode-1", "router"}) ==
        std::vector<std::string>{"decode-0", "decode-1", "router"});
  CHECK(desiredSeen == 2);
  CHECK(capacitySeen >= 2);  // the queue, not a latency, asked for the second worker
  // The second worker serves: new requests go to the least loaded worker, the new one.
  for (int i = 0; i < 4; ++i) send(40, 100 + i);
  for (auto& t : clients) t.join();
  clients.clear();
  int onNew = 0;
  for (const auto& o : outcomes) {
    INFO("status " << o.status << " worker " << o.worker << " " << o.error);
    CHECK(o.status == 200);
    CHECK(o.finishReason == "length");
    onNew += o.worker == "decode-1";
  }
  CHECK(outcomes.size() == 14);
  CHECK(onNew >= 1);

  // Idle for idle_after_ms: back to one worker, the extra one drained.
  {
    INFO(readFile(log));
    REQUIRE(waitWorkers(1, 30s));
  }
  const double backDownAfterS = duration<double>(steady_clock::now() - t0).count();
  // The drained worker's exit is reaped on pdserve up's next round.
  std::string text;
  for (auto deadline = steady_clock::now() + 10s; steady_clock::now() < deadline; std::this_thread::sleep_for(100ms)) {
    text = readFile(log);
    if (text.find("decode-1 stopped") != std::string::npos) break;
  }
  INFO(text);
  CHECK(text.find("recommending 2 (scale up: capacity: ") != std::string::npos);
  // The way back is idleness (the scale-down cooldown is longer than the whole test).
  CHECK(text.find("recommending 1 (idle: no work for 2 s") != std::string::npos);
  CHECK(text.find("pdserve up: scaling decode pool 1 -> 2: started decode-1") != std::string::npos);
  CHECK(text.find("pdserve up: scaling decode pool 2 -> 1: draining decode-1") != std::string::npos);
  CHECK(text.find("pdserve up: decode-1 stopped (drained, exited with status 0)") != std::string::npos);
  CHECK(targetsFileProcesses(log, {"decode-0", "router"}) == std::vector<std::string>{"decode-0", "router"});
  CHECK_FALSE(up.waitAny(0ms).has_value());  // pdserve up itself is still running
  std::printf(
      "autoscale e2e: scaled to 2 after %.1f s, back to 1 after %.1f s (capacity model's peak "
      "%g)\n",
      scaledUpAfterS, backDownAfterS, capacitySeen);
  up.stopAll(30s);  // SIGTERM: pdserve up stops its cluster
}

TEST_CASE(
    "with role moves, pdserve up moves an idle prefill worker into a decode pool at its maximum, "
    "no request failing") {
  std::filesystem::create_directories(kWork);
  const std::string config = kWork + "/role-moves.yaml";
  // One budget of 2 workers (prefill 0..1 + decode 1..1). Eight clients sending back to back
  // to the decode worker (3 streams at once) make the capacity model want 3 decode workers,
  // which the budget trims to 1 while the prefill worker is recommended. Once the prefill pool
  // has been idle for idle_after_ms (counted from its worker's registration) that worker is
  // moved, not drained and replaced.
  writeConfig(config, 20000, ", role_moves: true",
              "  prefill: {replicas: 1, min_replicas: 0, max_replicas: 1}\n"
              "  decode: {replicas: 1, min_replicas: 1, max_replicas: 1, slo: {itl_ms: 200, percentile: 90}}\n");
  const std::string log = kWork + "/role-moves.log";
  ProcessGroup up;
  const int port = pd::test::startPdserveUp(up, config, log);
  REQUIRE(waitMetric(up, log, port, "pdserve_pool_workers{pool=\"prefill\"}", 1, 60s));

  std::mutex mu;
  std::vector<Outcome> outcomes;
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  for (int c = 0; c < 8; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; !stop; ++i) {
        Outcome o = complete(port, 40, 1000 * c + i);
        std::lock_guard<std::mutex> lock(mu);
        outcomes.push_back(o);
      }
    });
  }
  const auto t0 = steady_clock::now();
  const bool moved = waitMetric(up, log, port, "pdserve_pool_workers{pool=\"decode\"}", 2, 90s);
  const double movedAfterS = duration<double>(steady_clock::now() - t0).count();
  // The clients go on until a request has finished on the moved worker (new requests go to
  // the least loaded worker; a sanitized build takes seconds per request), then stop.
  const auto servedByMoved = [&] {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& o : outcomes)
      if (o.worker == "worker-0") return true;
    return false;
  };
  for (const auto deadline = steady_clock::now() + 90s; moved && !servedByMoved() && steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(100ms);
  }
  stop = true;
  for (auto& t : clients) t.join();
  const std::string text = readFile(log);
  INFO(text);
  REQUIRE(moved);
  int onMoved = 0;
  for (const auto& o : outcomes) {
    INFO("status " << o.status << " worker " << o.worker << " " << o.error);
    CHECK(o.status == 200);
    CHECK(o.finishReason == "length");
    onMoved += o.worker == "worker-0";
  }
  CHECK(onMoved >= 1);  // the moved worker serves decode
  CHECK(routerMetric(port, "pdserve_pool_workers{pool=\"prefill\"}") == 0);
  CHECK(text.find("recommending 0 (idle: no work for 20 s") != std::string::npos);
  CHECK(text.find("pdserve up: moving worker-0 from the prefill pool (1 -> 0, router recommends 0) to the decode "
                  "pool") != std::string::npos);
  CHECK(text.find("switched role prefill -> decode") != std::string::npos);
  // Moved, not replaced: no worker was started or drained after the two of the start.
  CHECK(text.find("started worker-2") == std::string::npos);
  CHECK(text.find("draining worker-") == std::string::npos);
  CHECK_FALSE(up.waitAny(0ms).has_value());
  std::printf("role-move e2e: decode pool at 2 after %.1f s of load, %zu requests, %d on the moved worker\n",
              movedAfterS, outcomes.size(), onMoved);
  up.stopAll(30s);
}
