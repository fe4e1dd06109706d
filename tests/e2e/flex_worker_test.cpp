// End to end (docs/serving.md): a worker switches role at run time with no request lost. A real
// router, a decode worker and a `pdserve-worker --role prefill` (flex-0) serve short prompts
// (colocated) and long ones (prefilled on flex-0) from client threads that never pause; SIGUSR1
// makes flex-0 drain and come back as a decode worker under the same id -- sent in the middle
// of a burst of long prompts, so PrefillRequests routed before the router knew of the drain
// reach flex-0 while it drains, with decode-0 streaming and a 5 ms ITL target (the decode
// worker's stall rule would refuse to recompute them: none may be refused) -- a second SIGUSR1
// makes it drain its streams (what is left migrates) and come back as a prefill worker. Every
// request completes with the greedy ids of `pdserve generate`; the router sees the pools
// change; pdserve_role_switches_total counts each direction once; the KV caches end idle; and
// SIGUSR1, SIGUSR1, SIGTERM in quick succession still end the process with status 0. No timing is
// asserted beyond generous deadlines: a busy 2-core machine only makes it slower.
#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "engine/model_maker.h"
#include "tests/e2e/e2e_util.h"
#include "tests/faults/fault_report.h"
#include "tools/local_cluster.h"
#include "tools/process_group.h"

using namespace pd;
using namespace pd::tools;
using nlohmann::json;
using namespace std::chrono;
using namespace std::chrono_literals;
using pd::test::randomPrompt;
using pd::test::readFile;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e_flex_worker";
constexpr int kTokens = 16;
constexpr int kBurst = 8;  // long prompts sent with the SIGUSR1 that leaves the prefill role

struct Outcome {
  size_t promptIndex = 0;
  int status = 0;
  std::string route;   // x-pdserve-route
  std::string worker;  // x-pdserve-decode-worker (the first one, before any migration)
  std::vector<int32_t> ids;
  bool done = false;  // data: [DONE] arrived
  std::string error;  // transport error, non-200 body or an error event
};

std::string header(const std::string& headers, const std::string& name) {
  const auto at = headers.find(name + ": ");
  if (at == std::string::npos) return "";
  const auto from = at + name.size() + 2;
  return headers.substr(from, headers.find('\r', from) - from);
}

// One streamed completion (SSE), read to its end.
Outcome stream(int port, const std::vector<int32_t>& p, size_t index) {
  json req{{"model", "small"},   {"prompt", p},    {"max_tokens", kTokens},   {"temperature", 0},
           {"ignore_eos", true}, {"stream", true}, {"return_token_ids", true}};
  Outcome o;
  o.promptIndex = index;
  auto r = httpRequest(port, "POST", "/v1/completions", req.dump(), 120s);
  if (!r.ok()) {
    o.error = r.status().toString();
    return o;
  }
  o.status = r->status;
  o.route = header(r->headers, "x-pdserve-route");
  o.worker = header(r->headers, "x-pdserve-decode-worker");
  if (o.status != 200) {
    o.error = r->body.substr(0, 300);
    return o;
  }
  std::istringstream in(r->body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: [DONE]", 0) == 0) o.done = true;
    if (line.rfind("data: {", 0) != 0) continue;
    json event = json::parse(line.substr(6), nullptr, false);
    if (event.is_discarded() || event.contains("error")) {
      o.error = line.substr(0, 300);
      continue;
    }
    if (!event.contains("choices") || event["choices"].empty()) continue;
    for (const auto& id : event["choices"][0].value("token_ids", json::array())) o.ids.push_back(id.get<int32_t>());
  }
  return o;
}

}  // namespace

TEST_CASE("pdserve-worker switches prefill -> decode -> prefill on SIGUSR1 under load, no request lost") {
  std::filesystem::create_directories(kWork);
  const std::string config = kWork + "/cluster.yaml";
  // Prompts over 64 tokens go to the prefill pool when it has a worker; a refused remote
  // prefill (the prefill worker draining) is recomputed on the decode worker.
  std::ofstream(config) << "model: {path: " << pd::test::e2eModelDir() << ", name: small}\n"
                        << "router:\n"
                        << "  routing: {short_prompt_tokens: 64, prefix_aware_routing: false}\n"
                        << "  requests: {request_timeout_ms: 110000}\n"
                        << "  admission: {overload_shedding: false}\n"
                        // A 5 ms ITL target and whole 512-token prefill chunks: recomputing a long
                        // prompt beside running streams always breaks it, so the decode worker's
                        // stall rule would refuse every recompute of a prefill flex-0 failed.
                        << "pools: {prefill: {replicas: 0}, decode: {replicas: 1, slo: {itl_ms: 5}}}\n"
                        << "engine: {backend: cpu, threads: 1, kv_cache_bytes: 67108864, max_batch_tokens: 512,\n"
                        << "         slo_sized_prefill_chunks: false, enable_prefix_caching: false,\n"
                        << "         drain_timeout_ms: 20000}\n"
                        << "kv_transfer: {transports: [tcp], timeout_ms: 20000, on_remote_prefill_failure: "
                           "recompute}\n"
                        << "logging: {level: info}\n";
  const std::vector<std::vector<int32_t>> prompts{randomPrompt(12, 1),  randomPrompt(30, 2), randomPrompt(200, 3),
                                                  randomPrompt(450, 4), randomPrompt(20, 5), randomPrompt(700, 6)};
  std::vector<std::vector<int32_t>> expected;
  for (const auto& p : prompts) expected.push_back(pd::test::generateCli(p, kTokens, 1));  // the reference ids

  LocalClusterOptions o;
  o.configPath = config;
  o.binDir = std::string(PD_BINARY_DIR) + "/bin";
  o.httpPort = 0;
  o.controlPort = 0;
  o.runDir = kWork + "/run";
  auto started = LocalCluster::start(o);
  INFO(started.status().toString());
  REQUIRE(started.ok());
  auto& c = *started.value();

  const std::string log = kWork + "/flex-0.log";
  const std::string portsFile = kWork + "/flex-0.ports";
  std::filesystem::remove(portsFile);
  // Through a shell only to send its output to a file the test reads; exec keeps its pid, so
  // signals reach the worker itself.
  REQUIRE(c.processes()
              .spawn("flex-0", {"/bin/sh", "-c",
                                "exec " + o.binDir + "/pdserve-worker --role prefill --config " + c.configPath() +
                                    " --id flex-0 --router 127.0.0.1:" + std::to_string(c.controlPort()) +
                                    " --metrics-port 0 --ports-file " + portsFile + " > " + log + " 2>&1"})
              .ok());
  const auto pool = [&](const char* name) {
    auto m = c.routerMetrics(5s);
    return m.ok() ? poolGauge(*m, "pdserve_pool_workers", name) : -1.0;
  };
  const auto flexMetric = [&](const std::string& series) {
    // Read each time: a switch binds a new port (--metrics-port 0) and rewrites the file.
    auto r = httpGet(pd::test::waitForPort(portsFile, "metrics", 5s), "/metrics", 5s);
    return r.ok() ? pd::test::metricValue(r->body, series) : -1.0;
  };
  // Waits up to `limit` for the router's pools to be `prefill` + `decode` workers.
  const auto waitPools = [&](int prefill, int decode, seconds limit) {
    for (auto deadline = steady_clock::now() + limit; steady_clock::now() < deadline;
         std::this_thread::sleep_for(100ms)) {
      if (auto dead = c.processes().waitAny(0ms))
        FAIL(dead->name << " " << dead->description << ":\n" << readFile(log));
      if (pool("prefill") == prefill && pool("decode") == decode) return true;
    }
    return false;
  };
  {
    INFO(readFile(log));
    REQUIRE(waitPools(1, 1, 60s));
  }

  std::mutex mu;
  std::vector<Outcome> outcomes;
  std::atomic<bool> stopClients{false};
  std::vector<std::thread> clients;
  // A failed REQUIRE below must not leave the clients running (a joinable thread's destructor
  // aborts the test binary).
  struct JoinClients {
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~JoinClients() {
      stop = true;
      for (auto& t : threads)
        if (t.joinable()) t.join();
    }
  } joinClients{stopClients, clients};
  // Three clients, each cycling through the prompts from its own offset without pause, and a
  // fourth with the short ones only, so decode-0 always has a stream running.
  for (int k = 0; k < 4; ++k) {
    clients.emplace_back([&, k] {
      for (size_t i = size_t(k) * 2; !stopClients.load(); ++i) {
        const size_t index = k < 3 ? i % prompts.size() : std::array<size_t, 3>{0, 1, 4}[i % 3];
        Outcome out = stream(c.httpPort(), prompts[index], index);
        std::lock_guard<std::mutex> lock(mu);
        outcomes.push_back(std::move(out));
      }
    });
  }
  const auto served = [&](auto pred) {
    std::lock_guard<std::mutex> lock(mu);
    return std::count_if(outcomes.begin(), outcomes.end(), pred);
  };
  // Waits up to `limit` until `pred` holds for at least `n` outcomes.
  const auto waitServed = [&](long n, seconds limit, auto pred) {
    for (auto deadline = steady_clock::now() + limit; steady_clock::now() < deadline;
         std::this_thread::sleep_for(100ms)) {
      if (served(pred) >= n) return true;
    }
    return false;
  };
  const auto disaggregated = [](const Outcome& x) { return x.route == "disaggregated"; };
  const auto onFlexDecode = [](const Outcome& x) { return x.worker == "flex-0"; };

  // Phase 1: flex-0 prefills the long prompts.
  CHECK(waitServed(2, 60s, disaggregated));
  const size_t beforeFirst = served([](const Outcome&) { return true; });

  // Phase 2: SIGUSR1 -> flex-0 drains its prefill jobs and registers as a decode worker.
  // With it a burst of long prompts: the router routes them to flex-0 until it reads flex-0's
  // draining load report, so their PrefillRequests reach flex-0 after its drain began, while
  // decode-0 streams the clients' requests. Each must still be served (prefilled by flex-0, or
  // recomputed on decode-0 when flex-0 is already gone), none refused.
  std::vector<std::thread> burst;
  struct JoinBurst {
    std::vector<std::thread>& threads;
    ~JoinBurst() {
      for (auto& t : threads)
        if (t.joinable()) t.join();
    }
  } joinBurst{burst};
  const auto sendBurst = [&](int from, int to) {
    for (int k = from; k < to; ++k) {
      burst.emplace_back([&, k] {
        const size_t index = std::array<size_t, 3>{2, 3, 5}[k % 3];  // 200, 450, 700 tokens
        Outcome out = stream(c.httpPort(), prompts[index], index);
        std::lock_guard<std::mutex> lock(mu);
        outcomes.push_back(std::move(out));
      });
    }
  };
  // The first half keeps flex-0 computing (no prefix cache), so its drain lasts seconds; the
  // second half's PrefillRequests arrive during that drain.
  sendBurst(0, kBurst / 2);
  std::this_thread::sleep_for(50ms);
  REQUIRE(c.processes().signal("flex-0", SIGUSR1).isOk());
  sendBurst(kBurst / 2, kBurst);
  {
    INFO(readFile(log));
    REQUIRE(waitPools(0, 2, 60s));
  }
  CHECK(flexMetric("pdserve_role_switches_total{from=\"prefill\",to=\"decode\"}") == 1);
  CHECK(flexMetric("pdserve_role_switches_total{from=\"decode\",to=\"prefill\"}") == 0);
  // It takes streams as a decode worker now (least loaded of two).
  CHECK(waitServed(2, 60s, onFlexDecode));

  // Phase 3: SIGUSR1 again, while it streams -> it drains them and is a prefill worker again.
  const long disaggregatedBefore = served(disaggregated);
  REQUIRE(c.processes().signal("flex-0", SIGUSR1).isOk());
  {
    INFO(readFile(log));
    REQUIRE(waitPools(1, 1, 60s));
  }
  CHECK(waitServed(disaggregatedBefore + 2, 60s, disaggregated));
  stopClients = true;
  for (auto& t : clients) t.join();
  clients.clear();
  for (auto& t : burst) t.join();
  burst.clear();

  // Every request completed, with the reference's ids.
  size_t ok = 0;
  for (const auto& out : outcomes) {
    INFO("prompt " << out.promptIndex << " (" << prompts[out.promptIndex].size() << " tokens), status " << out.status
                   << ", route " << out.route << ", worker " << out.worker << ": " << out.error);
    CHECK(out.status == 200);
    CHECK(out.error.empty());
    CHECK(out.done);
    CHECK(out.ids == expected[out.promptIndex]);
    ok += out.status == 200 && out.error.empty() && out.done && out.ids == expected[out.promptIndex];
  }
  CHECK(outcomes.size() > beforeFirst);

  CHECK(flexMetric("pdserve_role_switches_total{from=\"prefill\",to=\"decode\"}") == 1);
  CHECK(flexMetric("pdserve_role_switches_total{from=\"decode\",to=\"prefill\"}") == 1);
  // Idle again: every KV block free on both workers, nothing in flight at the router.
  const auto allFree = [&](auto metric) {
    for (auto deadline = steady_clock::now() + 20s; steady_clock::now() < deadline;
         std::this_thread::sleep_for(100ms)) {
      const double total = metric("pdserve_kv_cache_num_blocks"), free = metric("pdserve_kv_cache_free_blocks");
      if (total > 0 && free == total) return true;
    }
    return false;
  };
  CHECK(allFree(flexMetric));
  CHECK(allFree([&](const std::string& s) { return pd::test::workerMetric(c, "decode-0", s); }));

  // A third switch, a fourth request and SIGTERM at once: whether each lands during the switch
  // (ignored / the switch's drain finishes and no role starts) or after it, the process
  // drains and ends with status 0.
  REQUIRE(c.processes().signal("flex-0", SIGUSR1).isOk());
  std::this_thread::sleep_for(20ms);
  REQUIRE(c.processes().signal("flex-0", SIGUSR1).isOk());
  std::this_thread::sleep_for(20ms);
  REQUIRE(c.processes().signal("flex-0", SIGTERM).isOk());
  auto exit = c.processes().waitAny(40s);
  REQUIRE(exit.has_value());
  CHECK(exit->name == "flex-0");
  CHECK(exit->description == "exited with status 0");

  const std::string text = readFile(log);
  INFO(text);
  CHECK(text.find("switching role prefill -> decode") != std::string::npos);
  CHECK(text.find("switching role decode -> prefill") != std::string::npos);
  CHECK(text.find("weights kept from the previous role") != std::string::npos);
  pd::test::recordFault(
      {"prefill worker switched to decode (SIGUSR1) while long prompts are routed to it",
       "every request completes with the greedy ids of pdserve generate: those routed before the drain was known are "
       "prefilled or recomputed, never refused (ITL target 5 ms, so the stall rule would refuse)",
       "SIGUSR1: at once; the router stops routing to it within a load report (100 ms)",
       std::to_string(outcomes.size()) + " requests (a burst of " + std::to_string(kBurst) + " with the signal), " +
           std::to_string(ok) + " complete and identical"});
  std::printf(
      "flex worker e2e: %zu requests, %zu complete and identical, %ld disaggregated, %ld on flex-0 "
      "as decode\n",
      outcomes.size(), ok, served(disaggregated), served(onFlexDecode));
}
