// End to end (docs/security.md, "Weights fingerprint"; docs/reliability.md): workers that may
// not join a cluster -- other weights under the same model name and shape, another KV block
// size, an id already taken -- are refused at registration by the real router, and both sides
// say why: the router's pdserve_worker_registrations_refused_total{pool,reason}, the worker's
// /health (503 {"status":"refused","reason":...}). The cluster serves on meanwhile.
#include <filesystem>
#include <fstream>
#include <thread>

#include <catch2/catch.hpp>

#include "engine/model_maker.h"
#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"

using namespace pd;
using namespace pd::tools;
using pd::test::routerMetric;
using namespace std::chrono_literals;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e_identity";

// The e2e model's twin: the same preset (name, config, shapes), weights from another seed.
std::string otherWeightsModelDir() {
  const std::string d = std::string(PD_BINARY_DIR) + "/test_models/e2e_small_seed2";
  if (!std::filesystem::exists(d + "/config.json")) {
    engine::MakeModelOptions o;
    o.preset = "small";
    o.seed = 2;
    const std::string tmp = d + ".tmp." + std::to_string(::getpid());
    REQUIRE(engine::makeModel(o, tmp).isOk());
    std::error_code ec;
    std::filesystem::rename(tmp, d, ec);
    if (ec) std::filesystem::remove_all(tmp);  // another test process won the race
  }
  return d;
}

// A config for the cluster `c` (its secret), serving modelDir as "small", `engine` more keys.
std::string workerConfig(LocalCluster& c, const std::string& name, const std::string& modelDir,
                         const std::string& engine = "") {
  const std::string path = kWork + "/" + name + ".yaml";
  std::ofstream(path) << "cluster: {secret_file: " << c.config().cluster.secretFile << "}\n"
                      << "model: {path: " << modelDir << ", name: small}\n"
                      << "engine: {backend: cpu, threads: 1, kv_cache_bytes: 33554432" << engine << "}\n"
                      << "kv_transfer: {transports: [tcp]}\n"
                      << "logging: {level: info}\n";
  return path;
}

std::unique_ptr<LocalCluster> startCluster(const std::string& name) {
  auto c = pd::test::startLocalCluster(kWork, name,
                                       "model: {path: " + pd::test::e2eModelDir() +
                                           ", name: small}\n"
                                           "router: {routing: {short_prompt_tokens: 0, prefix_aware_routing: false}}\n"
                                           "pools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"
                                           "engine: {backend: cpu, threads: 1, kv_cache_bytes: 33554432}\n"
                                           "kv_transfer: {transports: [tcp]}\n"
                                           "logging: {level: warn}\n");
  REQUIRE(c->config().cluster.authenticated());
  return c;
}

// Starts `program` (pdserve-prefill / pdserve-decode) as worker `id` of `c` with `config`;
// returns its /health port once it wrote its ports file.
int startExtraWorker(LocalCluster& c, const std::string& program, const std::string& id, const std::string& config) {
  const std::string portsFile = c.runDir() + "/" + id + ".extra.ports";
  std::filesystem::remove(portsFile);
  auto pid = c.processes().spawn(id + "-extra", {std::string(PD_BINARY_DIR) + "/bin/" + program, "--config", config,
                                                 "--id", id, "--router", "127.0.0.1:" + std::to_string(c.controlPort()),
                                                 "--metrics-port", "0", "--port", "0", "--ports-file", portsFile});
  REQUIRE(pid.ok());
  const int port = pd::test::waitForPort(portsFile, "metrics", 120s);
  REQUIRE(port > 0);
  return port;
}

// The worker's /health once it says "refused" (generous: its model loads on a busy machine
// first), else the last answer seen.
tools::HttpReply waitRefused(int healthPort) {
  tools::HttpReply last;
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = httpGet(healthPort, "/health", 5s);
    if (r.ok()) {
      last = *r;
      if (r->status == 503 && r->body.find("\"refused\"") != std::string::npos) return last;
    }
    std::this_thread::sleep_for(100ms);
  }
  return last;
}

double waitRouterMetric(LocalCluster& c, const std::string& series, double atLeast) {
  double v = -1;
  for (int i = 0; i < 100 && v < atLeast; ++i) {
    v = routerMetric(c, series);
    if (v < atLeast) std::this_thread::sleep_for(100ms);
  }
  return v;
}

int completion(LocalCluster& c) {
  auto r = httpRequest(c.httpPort(), "POST", "/v1/completions",
                       R"({"model": "small", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 4})", 60s,
                       {"Content-Type: application/json"});
  return r.ok() ? r->status : -1;
}

}  // namespace

TEST_CASE("e2e identity: a worker with same-named, same-shaped but other weights is refused at registration") {
  auto c = startCluster("weights");
  const int health =
      startExtraWorker(*c, "pdserve-prefill", "prefill-9", workerConfig(*c, "weights-worker", otherWeightsModelDir()));
  const auto h = waitRefused(health);
  INFO(h.body);
  CHECK(h.status == 503);
  CHECK(h.body.find("\"status\":\"refused\"") != std::string::npos);
  CHECK(h.body.find("worker 'prefill-9' serves weights ") != std::string::npos);
  CHECK(h.body.find("the cluster (worker '") != std::string::npos);
  CHECK(waitRouterMetric(*c, R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="weights"})", 1) >= 1);
  CHECK(routerMetric(*c, R"(pdserve_pool_workers{pool="prefill"})") == 1);
  CHECK(completion(*c) == 200);
}

TEST_CASE("e2e identity: a prefill worker with another KV block size is refused at registration") {
  auto c = startCluster("block_size");
  const int health = startExtraWorker(*c, "pdserve-prefill", "prefill-9",
                                      workerConfig(*c, "block-worker", pd::test::e2eModelDir(), ", block_size: 32"));
  const auto h = waitRefused(health);
  INFO(h.body);
  CHECK(h.status == 503);
  CHECK(h.body.find("KV block size 32 but the cluster has 16") != std::string::npos);
  CHECK(waitRouterMetric(*c, R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="block_size"})", 1) >=
        1);
  CHECK(routerMetric(*c, R"(pdserve_pool_workers{pool="prefill"})") == 1);
  CHECK(completion(*c) == 200);
}

TEST_CASE("e2e identity: a prefill worker with an int8 KV cache in an f32 cluster is refused, naming both dtypes") {
  auto c = startCluster("kv_dtype");
  const int health =
      startExtraWorker(*c, "pdserve-prefill", "prefill-9",
                       workerConfig(*c, "kv-dtype-worker", pd::test::e2eModelDir(), ", kv_cache_dtype: int8"));
  const auto h = waitRefused(health);
  INFO(h.body);
  CHECK(h.status == 503);
  CHECK(h.body.find("worker 'prefill-9' keeps its KV cache in int8-tks32 but the cluster in f32") != std::string::npos);
  CHECK(h.body.find("engine.kv_cache_dtype must match") != std::string::npos);
  CHECK(waitRouterMetric(*c, R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="dtype"})", 1) >= 1);
  CHECK(routerMetric(*c, R"(pdserve_pool_workers{pool="prefill"})") == 1);
  CHECK(completion(*c) == 200);
}

TEST_CASE("e2e identity: a duplicate --id is refused, with its reason on the worker's /health") {
  auto c = startCluster("duplicate");
  const int health =
      startExtraWorker(*c, "pdserve-decode", "decode-0", workerConfig(*c, "duplicate-worker", pd::test::e2eModelDir()));
  const auto h = waitRefused(health);
  INFO(h.body);
  CHECK(h.status == 503);
  CHECK(h.body.find("worker id 'decode-0' is already registered") != std::string::npos);
  CHECK(waitRouterMetric(*c, R"(pdserve_worker_registrations_refused_total{pool="decode",reason="duplicate_id"})", 1) >=
        1);
  // The registered decode-0 keeps serving.
  CHECK(routerMetric(*c, R"(pdserve_pool_workers{pool="decode"})") == 1);
  CHECK(completion(*c) == 200);
}
