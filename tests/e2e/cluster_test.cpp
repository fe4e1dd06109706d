// End to end: router + prefill + decode processes on loopback, driven over HTTP.
// Every cluster here is real (the same binaries `pdserve up` starts); nothing is faked.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "engine/cuda_backend.h"
#include "engine/model_maker.h"
#include "tests/e2e/e2e_util.h"
#include "tests/faults/fault_report.h"
#include "tests/test_skip.h"
#include "tools/local_cluster.h"
#include "tools/process_group.h"

using namespace pd;
using namespace pd::tools;
using nlohmann::json;
using pd::test::randomPrompt;
using pd::test::recordFault;
using pd::test::routerMetric;
using pd::test::workerMetric;
using namespace std::chrono_literals;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e";

struct ClusterSpec {
  int64_t shortPromptTokens = 64;
  std::string transports = "[tcp]";
  std::string onFailure = "recompute";
  std::string extraRouter{};
  int64_t timeoutMs = 20000;
  std::string backend = "cpu";  // cuda: both workers on GPU 0, weights and KV in f32
  // Off by default here: these tests send repeats and expect routing by length alone.
  bool prefixAwareRouting = false;
  std::string pools = "{prefill: {replicas: 1}, decode: {replicas: 1}}";
  std::string kvCache = "kv_cache_bytes: 67108864";  // or "num_blocks: N"
  int threads = 2;                                   // engine.threads of every worker
  std::string extraEngine{};                         // more keys of the engine map: ", drain_timeout_ms: 200"
  std::string extraKvTransfer{};                     // more keys of the kv_transfer map: ", lease_ms: 800"
  std::string extraTop{};  // more top-level sections: "metrics: {vllm_compatible_names: true}\n"
  // extraRouter: more groups of the router map ("  admission: {overload_shedding: false}\n");
  // these, more keys of the two it always has.
  std::string extraRouting{};   // ", exact_prefix_routing: false"
  std::string extraRequests{};  // ", drain_timeout_ms: 300"
  std::string modelDir{};       // "" = the small Llama model (e2eModelDir)
};

std::unique_ptr<LocalCluster> startCluster(const std::string& name, const ClusterSpec& spec) {
  std::filesystem::create_directories(kWork);
  std::string path = kWork + "/" + name + ".yaml";
  const bool cuda = spec.backend == "cuda";
  const std::string modelDir = spec.modelDir.empty() ? pd::test::e2eModelDir() : spec.modelDir;
  std::ofstream(path) << "model: {path: " << modelDir << ", name: small" << (cuda ? ", dtype: f32" : "") << "}\n"
                      << "router:\n  routing: {short_prompt_tokens: " << spec.shortPromptTokens
                      << ", prefix_aware_routing: " << (spec.prefixAwareRouting ? "true" : "false") << spec.extraRouting
                      << "}\n"
                      << "  requests: {request_timeout_ms: 60000" << spec.extraRequests << "}\n"
                      << spec.extraRouter << "pools: " << spec.pools << "\n"
                      << "engine: {backend: " << spec.backend << ", threads: " << spec.threads << ", " << spec.kvCache
                      << ", max_batch_tokens: 512" << spec.extraEngine << "}\n"
                      << "kv_transfer: {transports: " << spec.transports << ", timeout_ms: " << spec.timeoutMs
                      << ", on_remote_prefill_failure: " << spec.onFailure << spec.extraKvTransfer << "}\n"
                      << "logging: {level: warn}\n"
                      << spec.extraTop;
  LocalClusterOptions o;
  o.configPath = path;
  o.binDir = std::string(PD_BINARY_DIR) + "/bin";
  o.httpPort = 0;
  o.controlPort = 0;
  auto c = LocalCluster::start(o);
  INFO(c.status().toString());
  REQUIRE(c.ok());
  return std::move(c).value();
}

struct Completion {
  int status = 0;
  std::string headers;
  json body;
  std::vector<int32_t> ids;
};

Completion complete(LocalCluster& c, const std::vector<int32_t>& p, int maxTokens, json extra = {}) {
  json req{{"model", "small"}, {"prompt", p},        {"max_tokens", maxTokens},
           {"temperature", 0}, {"ignore_eos", true}, {"return_token_ids", true}};
  for (auto& [k, v] : extra.items()) req[k] = v;
  auto r = httpRequest(c.httpPort(), "POST", "/v1/completions", req.dump(), 120s);
  REQUIRE(r.ok());
  Completion out{r->status, r->headers, json::parse(r->body, nullptr, false), {}};
  if (out.status == 200) out.ids = out.body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  return out;
}

// The workers here run two engine threads; the reference does too.
std::vector<int32_t> generateCli(const std::vector<int32_t>& p, int maxTokens, const std::string& sampling = "") {
  return pd::test::generateCli(p, maxTokens, 2, sampling);
}

// A worker series whose labels contain `label` (e.g. `reason="x"` or just `x`), or -1.
double workerMetricWith(LocalCluster& c, const std::string& worker, const std::string& name, const std::string& label) {
  return workerMetric(c, worker, name + "{" + label + "}");
}

bool allBlocksFree(LocalCluster& c, const std::string& worker) {
  for (int i = 0; i < 100; ++i) {
    double total = workerMetric(c, worker, "pdserve_kv_cache_num_blocks");
    double free = workerMetric(c, worker, "pdserve_kv_cache_free_blocks");
    if (total > 0 && free == total) return true;
    std::this_thread::sleep_for(100ms);
  }
  return false;
}

// Opens a streaming request and returns the socket once `events` SSE events arrived.
int openStream(LocalCluster& c, const json& req, int events, std::string* seen) {
  int fd = pd::test::connectLoopback(c.httpPort(), 30);
  std::string body = req.dump();
  std::string http =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  REQUIRE(::send(fd, http.data(), http.size(), 0) == ssize_t(http.size()));
  auto count = [&] {
    int n = 0;
    for (size_t at = seen->find("data: "); at != std::string::npos; at = seen->find("data: ", at + 1)) ++n;
    return n;
  };
  // A reply that is not a 200 carries no events: stop at its headers instead of waiting for
  // the receive timeout (the caller's checks then see the reply).
  const auto refused = [&] {
    return seen->find("\r\n\r\n") != std::string::npos && seen->rfind("HTTP/1.1 200", 0) != 0;
  };
  char buf[4096];
  while (count() < events && !refused()) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    seen->append(buf, size_t(n));
  }
  return fd;
}

// Reads a stream to its end; returns the token ids of its events (return_token_ids).
std::vector<int32_t> readStreamIds(int fd, std::string* seen) {
  char buf[4096];
  for (ssize_t n; seen->find("data: [DONE]") == std::string::npos && (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    seen->append(buf, size_t(n));
  ::close(fd);
  std::vector<int32_t> ids;
  std::istringstream in(*seen);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    json event = json::parse(line.substr(6), nullptr, false);
    if (event.is_discarded() || !event.contains("choices") || event["choices"].empty()) continue;
    for (const auto& id : event["choices"][0].value("token_ids", json::array())) ids.push_back(id.get<int32_t>());
  }
  return ids;
}

std::string msSince(std::chrono::steady_clock::time_point t0) {
  return std::to_string(
             std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count()) +
         " ms";
}

std::string headerValue(const std::string& seen, const std::string& name) {
  const auto at = seen.find(name + ": ");
  if (at == std::string::npos) return "";
  const auto from = at + name.size() + 2;
  return seen.substr(from, seen.find('\r', from) - from);
}

}  // namespace

// Each setup serves 20 prompts of 5..2,000 tokens (and two repeats from the prefix cache) with
// the greedy ids of `pdserve generate`.
static void checkGreedyIdentity(const std::vector<std::pair<std::string, ClusterSpec>>& setups) {
  const std::vector<int> lengths{5,   9,   16,  17,  31,  48,  64,   100,  128,  200,
                                 256, 300, 400, 512, 700, 900, 1100, 1400, 1700, 2000};
  const int kTokens = 6;
  // Catch2 runs the case once per SECTION: the reference ids are computed on the first run only.
  static std::vector<std::vector<int32_t>> expected;
  if (expected.empty())
    for (size_t i = 0; i < lengths.size(); ++i) expected.push_back(generateCli(randomPrompt(lengths[i], i), kTokens));
  for (auto& [name, spec] : setups) {
    SECTION(name) {
      auto c = startCluster("identity", spec);
      const std::string route = spec.shortPromptTokens > 0 ? "colocated" : "disaggregated";
      for (size_t i = 0; i < lengths.size(); ++i) {
        INFO(name << ", prompt of " << lengths[i] << " tokens");
        auto r = complete(*c, randomPrompt(lengths[i], i), kTokens);
        REQUIRE(r.status == 200);
        CHECK(r.headers.find("x-pdserve-route: " + route) != std::string::npos);
        CHECK(r.ids == expected[i]);
        CHECK(r.body["usage"]["prompt_tokens"] == lengths[i]);
        CHECK(r.body["usage"]["completion_tokens"] == kTokens);
      }
      // Again: the prefill worker now has these prompts in its prefix cache, and the cached
      // blocks must reach the decode worker too.
      for (size_t i : {size_t(9), size_t(19)})
        CHECK(complete(*c, randomPrompt(lengths[i], i), kTokens).ids == expected[i]);
      // The repeats were served from a prefix cache (the prefill worker's when disaggregated).
      const std::string prefixWorker = route == "disaggregated" ? "prefill-0" : "decode-0";
      for (int i = 0; i < 50 && workerMetric(*c, prefixWorker, "pdserve_prefix_cache_hits_total") <= 0; ++i) {
        std::this_thread::sleep_for(100ms);
      }
      CHECK(workerMetric(*c, prefixWorker, "pdserve_prefix_cache_hits_total") >= 16);
      // Each worker timed the steps it ran, by kind: the decode worker decoded every stream;
      // a prefill worker only prefills; colocated prompts were prefilled on the decode worker.
      CHECK(workerMetricWith(*c, "decode-0", "pdserve_engine_step_seconds_count", "kind=\"decode\"") >= kTokens - 1);
      CHECK(workerMetricWith(*c, "prefill-0", "pdserve_engine_step_seconds_count", "kind=\"decode\"") == 0);
      CHECK(workerMetricWith(*c, route == "disaggregated" ? "prefill-0" : "decode-0",
                             "pdserve_engine_step_seconds_count", "kind=\"prefill\"") >= 1);
      CHECK(workerMetric(*c, "decode-0", "pdserve_engine_step_gap_seconds_count") >= 1);
      if (route == "disaggregated") {
        CHECK(workerMetric(*c, "decode-0", "pdserve_remote_prefill_total") == lengths.size() + 2);
        // The KV really moved over the transport this section names.
        const std::string transport = name.substr(name.rfind(' ') + 1);
        auto metrics = httpGet(c->metricsPort("prefill-0"), "/metrics", 5s);
        REQUIRE(metrics.ok());
        CHECK(metrics->body.find("pdserve_kv_transfers_total{outcome=\"ok\",transport=\"" + transport) !=
              std::string::npos);
      }
      CHECK(allBlocksFree(*c, "decode-0"));
      CHECK(allBlocksFree(*c, "prefill-0"));
    }
  }
}

TEST_CASE("greedy ids are identical: pdserve generate, colocated, disaggregated over each transport") {
  std::vector<std::pair<std::string, ClusterSpec>> setups{{"colocated", ClusterSpec{/*shortPromptTokens=*/100000}},
                                                          {"disaggregated over tcp", ClusterSpec{0, "[tcp]"}}};
#if PD_HAVE_CMA
  // Both workers run on this machine, so cma connects (docs/kvtransfer.md); tcp is its fallback lane.
  setups.push_back({"disaggregated over cma", ClusterSpec{0, "[cma, tcp]"}});
#endif
#if PD_HAVE_UCX
  setups.push_back({"disaggregated over ucx", ClusterSpec{0, "[ucx, tcp]"}});
#endif
  checkGreedyIdentity(setups);
}

// engine.kv_cache_dtype int8 / fp8 on both workers (docs/kv_cache.md, "Quantized KV cache"):
// the blocks cross the split in their 8-bit form, so a remote prefill gives the greedy ids the
// same cache gives colocated (the decode worker continues from the very bytes it would have
// written), over tcp and cma, and moves about a quarter of the f32 cache's bytes.
TEST_CASE("an 8-bit KV cache: disaggregated over tcp and cma gives the colocated greedy ids, a quarter of the bytes") {
  const std::vector<int> lengths{5, 17, 64, 300, 900};
  const int kTokens = 8;
  auto serve = [&](const std::string& dtype, ClusterSpec spec, std::vector<std::vector<int32_t>>* ids) {
    spec.extraEngine = ", kv_cache_dtype: " + dtype;
    spec.extraRouter = "  admission: {overload_shedding: false}\n";
    auto c = startCluster("kv_" + dtype, spec);
    const std::string route = spec.shortPromptTokens > 0 ? "colocated" : "disaggregated";
    ids->clear();
    for (size_t i = 0; i < lengths.size(); ++i) {
      INFO(dtype << " " << route << " " << spec.transports << ", prompt of " << lengths[i] << " tokens");
      auto r = complete(*c, randomPrompt(lengths[i], 60 + i), kTokens);
      REQUIRE(r.status == 200);
      CHECK(r.headers.find("x-pdserve-route: " + route) != std::string::npos);
      ids->push_back(r.ids);
    }
    CHECK(allBlocksFree(*c, "decode-0"));
    if (route == "colocated") return 0.0;
    CHECK(workerMetric(*c, "decode-0", "pdserve_remote_prefill_total") == lengths.size());
    const std::string transport = spec.transports.substr(1, spec.transports.find_first_of(",]") - 1);
    return workerMetric(*c, "prefill-0", "pdserve_kv_transfer_bytes_total{transport=\"" + transport + "\"}");
  };
  std::vector<std::vector<int32_t>> f32Ids, ids;
  const double f32Bytes = serve("f32", ClusterSpec{0, "[tcp]"}, &f32Ids);
  REQUIRE(f32Bytes > 0);
  for (const std::string dtype : {"int8", "fp8"}) {
    std::vector<std::vector<int32_t>> colocated;
    serve(dtype, ClusterSpec{100000}, &colocated);
    std::vector<std::string> transports{"[tcp]"};
#if PD_HAVE_CMA
    transports.push_back("[cma, tcp]");
#endif
    for (const std::string& t : transports) {
      INFO(dtype << " over " << t);
      const double bytes = serve(dtype, ClusterSpec{0, t}, &ids);
      CHECK(ids == colocated);
      // Codes of 1 byte and an f32 scale per head_dim values: (head_dim + 4) / (4 head_dim).
      std::printf("%s KV over %s: %.0f bytes moved, %.3f of the f32 cache's %.0f\n", dtype.c_str(), t.c_str(), bytes,
                  bytes / f32Bytes, f32Bytes);
      CHECK(bytes > 0);
      CHECK(bytes <= 0.3 * f32Bytes);
    }
    int same = 0, total = 0;
    for (size_t i = 0; i < ids.size(); ++i)
      for (size_t j = 0; j < ids[i].size() && j < f32Ids[i].size(); ++j, ++total) same += ids[i][j] == f32Ids[i][j];
    std::printf("%s KV: greedy agreement with the f32 cache %d/%d\n", dtype.c_str(), same, total);
  }
}

// The small preset of make-model's `arch` (qwen3: per-head q/k RMSNorm, q 2x the hidden
// width; qwen3_moe: the same attention, 16 experts of which each token runs 4; mixtral: 8 of
// which each token runs 2; deepseek_v3: multi-head latent attention with YaRN, 32 group-routed
// experts and a shared one), made once.
// quantization "fp8": an FP8 block-scaled checkpoint (F8_E4M3 projections, the rest bf16).
static std::string smallModelDir(const std::string& arch, const std::string& quantization = "") {
  const std::string d =
      std::string(PD_BINARY_DIR) + "/test_models/e2e_small_" + arch + (quantization.empty() ? "" : "_" + quantization);
  if (!std::filesystem::exists(d + "/config.json")) {
    engine::MakeModelOptions o;
    o.preset = "small";
    o.arch = arch;
    o.quantization = quantization;
    if (!quantization.empty()) o.dtype = "bf16";
    const std::string tmp = d + ".tmp." + std::to_string(::getpid());
    REQUIRE(engine::makeModel(o, tmp).isOk());
    std::error_code ec;
    std::filesystem::rename(tmp, d, ec);
    if (ec) std::filesystem::remove_all(tmp);  // another process made it first
  }
  return d;
}

// `pdserve generate` on `model` (two engine threads, as the workers): the greedy ids and, for
// each, its log-probability under that step's raw logits (--logits-out).
static std::pair<std::vector<int32_t>, std::vector<double>> generateWithLogprobs(const std::string& model,
                                                                                 const std::vector<int32_t>& p,
                                                                                 int maxTokens, int vocab) {
  std::filesystem::create_directories(kWork);
  const std::string logitsPath = kWork + "/qwen3_logits." + std::to_string(::getpid());
  const std::vector<int32_t> gen = pd::test::generateCliOn(model, p, maxTokens, 2, "--logits-out " + logitsPath);
  REQUIRE(int(gen.size()) == maxTokens);
  std::vector<float> logits(size_t(maxTokens) * vocab);
  std::ifstream in(logitsPath, std::ios::binary);
  REQUIRE(in.read(reinterpret_cast<char*>(logits.data()), std::streamsize(logits.size() * sizeof(float))));
  std::filesystem::remove(logitsPath);
  std::vector<double> lp;
  for (int s = 0; s < maxTokens; ++s) {
    const float* row = logits.data() + size_t(s) * vocab;
    const double mx = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - mx);
    lp.push_back(double(row[gen[s]]) - mx - std::log(sum));
  }
  return {gen, lp};
}

// Qwen3ForCausalLM and Qwen3MoeForCausalLM served as the Llama model is above: on the
// colocated path and across the prefill/decode split over each lane, the greedy ids are those
// of `pdserve generate` and each chosen token's logprob matches its raw logits there (prompts
// of 5..900 tokens: chunked prefill, partial and full blocks; repeats from the prefill
// worker's prefix cache).
static void checkArchAcrossSplit(const std::string& arch, const std::string& quantization = "") {
  const std::string model = smallModelDir(arch, quantization);
  const std::vector<int> lengths{5, 17, 64, 300, 900};
  const int kTokens = 6, kVocab = 259;
  // Catch2 runs the case once per SECTION: each model's references are computed once.
  static std::map<std::string, std::vector<std::pair<std::vector<int32_t>, std::vector<double>>>> references;
  auto& expected = references[model];
  if (expected.empty())
    for (size_t i = 0; i < lengths.size(); ++i)
      expected.push_back(generateWithLogprobs(model, randomPrompt(lengths[i], 40 + i), kTokens, kVocab));
  std::vector<std::pair<std::string, ClusterSpec>> setups{{"colocated", ClusterSpec{100000}},
                                                          {"disaggregated over tcp", ClusterSpec{0, "[tcp]"}}};
#if PD_HAVE_CMA
  setups.push_back({"disaggregated over cma", ClusterSpec{0, "[cma, tcp]"}});
#endif
  for (auto& [name, spec] : setups) {
    SECTION(name) {
      spec.modelDir = model;
      spec.extraRouter = "  admission: {overload_shedding: false}\n";
      auto c = startCluster(quantization.empty() ? arch : arch + "-" + quantization, spec);
      const std::string route = spec.shortPromptTokens > 0 ? "colocated" : "disaggregated";
      for (int pass = 0; pass < 2; ++pass) {  // the second pass: prefixes cached
        for (size_t i = 0; i < lengths.size(); ++i) {
          INFO(name << ", pass " << pass << ", prompt of " << lengths[i] << " tokens");
          auto r = complete(*c, randomPrompt(lengths[i], 40 + i), kTokens, {{"logprobs", 1}});
          REQUIRE(r.status == 200);
          CHECK(r.headers.find("x-pdserve-route: " + route) != std::string::npos);
          CHECK(r.ids == expected[i].first);
          const auto& got = r.body["choices"][0]["logprobs"]["token_logprobs"];
          REQUIRE(got.size() == size_t(kTokens));
          for (int s = 0; s < kTokens; ++s) CHECK(std::abs(got[s].get<double>() - expected[i].second[s]) < 1e-3);
        }
      }
      if (route == "disaggregated") {
        CHECK(workerMetric(*c, "decode-0", "pdserve_remote_prefill_total") == 2 * lengths.size());
        const std::string transport = name.substr(name.rfind(' ') + 1);
        auto metrics = httpGet(c->metricsPort("prefill-0"), "/metrics", 5s);
        REQUIRE(metrics.ok());
        CHECK(metrics->body.find("pdserve_kv_transfers_total{outcome=\"ok\",transport=\"" + transport) !=
              std::string::npos);
      }
      CHECK(allBlocksFree(*c, "decode-0"));
      CHECK(allBlocksFree(*c, "prefill-0"));
    }
  }
}

TEST_CASE("qwen3: greedy ids and logprobs match pdserve generate: colocated, disaggregated over tcp and cma") {
  checkArchAcrossSplit("qwen3");
}

TEST_CASE("qwen3_moe: greedy ids and logprobs match pdserve generate: colocated, disaggregated over tcp and cma") {
  checkArchAcrossSplit("qwen3_moe");
}

// MixtralForCausalLM: Llama's attention with 8 softmax-routed experts of which each token runs 2.
TEST_CASE("mixtral: greedy ids and logprobs match pdserve generate: colocated, disaggregated over tcp and cma") {
  checkArchAcrossSplit("mixtral");
}

// An FP8 block-scaled checkpoint (docs/models.md, "FP8 checkpoints"): both workers dequantize
// it at load and must agree with `pdserve generate` and with each other across the split.
TEST_CASE("fp8 checkpoint: greedy ids and logprobs match pdserve generate: colocated, disaggregated over tcp and cma") {
  checkArchAcrossSplit("llama", "fp8");
}

// DeepseekV3ForCausalLM: the prefill worker pushes latent KV (kv_lora_rank + rope values per
// token and layer, no V) and the decode worker attends to it as if it had computed it.
TEST_CASE("deepseek_v3: greedy ids and logprobs match pdserve generate: colocated, disaggregated over tcp and cma") {
  checkArchAcrossSplit("deepseek_v3");
}

// The CUDA workers in f32 (cuBLAS f32 GEMMs) pick the CPU's greedy ids; over tcp the KV goes
// device -> pinned host -> socket -> pinned host -> device.
TEST_CASE("greedy ids are identical with cuda workers: colocated, disaggregated over tcp") {
  Status gpu = engine::cudaDeviceAvailable();
  pd::test::requireGpu(gpu.isOk() ? "" : gpu.message());
  ClusterSpec colocated{100000}, disaggregated{0, "[tcp]"};
  colocated.backend = disaggregated.backend = "cuda";
  checkGreedyIdentity(
      {{"cuda workers, colocated", colocated}, {"cuda workers, disaggregated over tcp", disaggregated}});
}

TEST_CASE("prefix-aware routing: a prompt extending one the decode worker received stays colocated") {
  ClusterSpec spec{/*shortPromptTokens=*/64};
  spec.prefixAwareRouting = true;
  auto c = startCluster("prefix-routing", spec);
  const auto first = randomPrompt(600, 77);
  auto r = complete(*c, first, 4);
  REQUIRE(r.status == 200);
  CHECK(r.headers.find("x-pdserve-route: disaggregated") != std::string::npos);

  // The same 600 tokens and 30 more: 592 of them (37 full blocks) are on decode-0, which got
  // them from the prefill worker; 38 uncached tokens are under the threshold of 64.
  auto longer = first;
  for (int32_t t : randomPrompt(31, 78))
    if (longer.size() < 630) longer.push_back(t);
  const double hitsBefore = workerMetric(*c, "decode-0", "pdserve_prefix_cache_hits_total");
  r = complete(*c, longer, 6);
  REQUIRE(r.status == 200);
  CHECK(r.headers.find("x-pdserve-route: colocated") != std::string::npos);
  CHECK(r.ids == generateCli(longer, 6));
  // The decode worker really served the prefix from its cache.
  CHECK(workerMetric(*c, "decode-0", "pdserve_prefix_cache_hits_total") - hitsBefore >= 592);
  auto m = httpGet(c->httpPort(), "/metrics", 5s);
  REQUIRE(m.ok());
  CHECK(m->body.find("pdserve_route_decisions_total{reason=\"cached_prefix\",route=\"colocated\"} 1") !=
        std::string::npos);
  CHECK(m->body.find("pdserve_router_predicted_cached_tokens_total 592") != std::string::npos);
  CHECK(allBlocksFree(*c, "decode-0"));
}

// Waits (bounded) until the router's /metrics series reaches `pred`; returns its last value.
template <typename Pred>
double waitRouterMetric(LocalCluster& c, const std::string& series, Pred pred) {
  double v = routerMetric(c, series);
  for (int i = 0; i < 100 && !pred(v); ++i) {
    std::this_thread::sleep_for(50ms);
    v = routerMetric(c, series);
  }
  return v;
}

TEST_CASE("KV events: the router's exact index predicts the worker's actual prefix hit, evictions included") {
  ClusterSpec spec;
  spec.prefixAwareRouting = true;
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 1}}";
  spec.kvCache = "num_blocks: 40";  // 640 tokens of 16: one long generation evicts
  // The ZeroMQ publisher rides on the same events (its wire format: test_worker_kv_events);
  // here it must not disturb them. A build without ZeroMQ refuses the key, so only with it.
  if (PD_HAVE_ZMQ) spec.extraEngine = ", kv_events: {zmq_endpoint: 'tcp://127.0.0.1:*'}";
  auto c = startCluster("kv-events", spec);
  const std::string exactBlocks = "pdserve_router_prefix_index_blocks{index=\"exact\",worker=\"decode-0\"}";
  const auto hit = [&](const std::string& source) {
    return routerMetric(*c, "pdserve_router_prefix_hit_tokens_total{source=\"" + source + "\"}");
  };
  // The worker's snapshot on registration makes its exact index current.
  REQUIRE(waitRouterMetric(*c, "pdserve_router_kv_index_current{worker=\"decode-0\"}",
                           [](double v) { return v == 1; }) == 1);

  const auto a = randomPrompt(200, 91);
  REQUIRE(complete(*c, a, 4).status == 200);
  // 203 tokens computed (the last generated token's KV is never needed): 12 full blocks named.
  CHECK(waitRouterMetric(*c, exactBlocks, [](double v) { return v >= 12; }) >= 12);
  auto ext = a;
  for (int32_t t : randomPrompt(21, 92))
    if (ext.size() < 220) ext.push_back(t);
  REQUIRE(complete(*c, ext, 4).status == 200);
  // Both indexes expected a's 12 blocks, and the worker served them.
  CHECK(hit("exact") == 192);
  CHECK(hit("predicted") == 192);
  CHECK(hit("actual") == 192);
  CHECK(routerMetric(*c, exactBlocks) == 13);  // ext's 223 computed tokens

  // A short prompt generating 500 tokens needs 33 of the 40 blocks: the worker evicts the
  // tail of ext's cached blocks. The predicted index, which only counts prompt blocks routed
  // (14 + 1 of 40), still believes a is cached; the exact index heard the evictions.
  REQUIRE(complete(*c, randomPrompt(20, 93), 500).status == 200);
  // Its 32 computed blocks named, ext's evicted to make room: never more than the pool.
  CHECK(routerMetric(*c, exactBlocks) <= 40);
  CHECK(routerMetric(*c, "pdserve_router_prefix_index_blocks{index=\"predicted\",worker=\"decode-0\"}") == 14);
  REQUIRE(complete(*c, a, 4).status == 200);
  const double exact = hit("exact") - 192;
  const double predicted = hit("predicted") - 192;
  const double actual = hit("actual") - 192;
  INFO("exact " << exact << " predicted " << predicted << " actual " << actual);
  CHECK(actual < 192);                                  // the worker really lost part of a
  CHECK(exact == actual);                               // the exact index knew which part
  CHECK(predicted == 192);                              // the predicted one would have been wrong
  CHECK(hit("actual_exact_indexed") == hit("actual"));  // every request was exactly indexed
  CHECK(routerMetric(*c, "pdserve_router_prefix_predictions_total{index=\"exact\",outcome=\"match\"}") == 4);
  CHECK(routerMetric(*c, "pdserve_router_prefix_predictions_total{index=\"predicted\",outcome=\"over\"}") == 1);
  // Lag was measured for every applied batch.
  CHECK(routerMetric(*c, "pdserve_router_kv_event_lag_seconds_count") >= 1);
  CHECK(workerMetric(*c, "decode-0", "pdserve_kv_event_batches_total{kind=\"snapshot\"}") >= 1);
}

TEST_CASE("KV events, disaggregated: the prefill worker's actual hit is what its exact index predicted") {
  ClusterSpec spec{/*shortPromptTokens=*/64};
  spec.prefixAwareRouting = true;
  auto c = startCluster("kv-events-disagg", spec);
  for (const char* w : {"prefill-0", "decode-0"}) {
    REQUIRE(waitRouterMetric(*c, "pdserve_router_kv_index_current{worker=\"" + std::string(w) + "\"}",
                             [](double v) { return v == 1; }) == 1);
  }
  const auto a = randomPrompt(300, 95);
  auto r = complete(*c, a, 2);
  REQUIRE(r.status == 200);
  CHECK(r.headers.find("x-pdserve-route: disaggregated") != std::string::npos);
  // 200 of a's tokens and 200 new ones: 192 cached on both workers, 208 uncached > 64.
  std::vector<int32_t> b(a.begin(), a.begin() + 200);
  for (int32_t t : randomPrompt(200, 96)) b.push_back(t);
  r = complete(*c, b, 2);
  REQUIRE(r.status == 200);
  CHECK(r.headers.find("x-pdserve-route: disaggregated") != std::string::npos);
  CHECK(routerMetric(*c, "pdserve_router_prefix_hit_tokens_total{source=\"exact\"}") == 192);
  CHECK(routerMetric(*c, "pdserve_router_prefix_hit_tokens_total{source=\"actual\"}") == 192);
  CHECK(routerMetric(*c, "pdserve_router_prefix_predictions_total{index=\"exact\",outcome=\"match\"}") == 2);
}

TEST_CASE("KV events off on either side: the router routes on the predicted index") {
  ClusterSpec spec;
  spec.prefixAwareRouting = true;
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 1}}";
  SECTION("a router that does not take them (an old router): the worker sends none") {
    spec.extraRouting = ", exact_prefix_routing: false";
  }
  SECTION("a worker that does not publish them (an old worker)") { spec.extraEngine = ", kv_events: {publish: false}"; }
  auto c = startCluster("kv-events-off", spec);
  const auto a = randomPrompt(200, 94);
  REQUIRE(complete(*c, a, 4).status == 200);
  REQUIRE(complete(*c, a, 4).status == 200);
  CHECK(routerMetric(*c, "pdserve_router_prefix_hit_tokens_total{source=\"predicted\"}") == 192);
  CHECK(routerMetric(*c, "pdserve_router_prefix_hit_tokens_total{source=\"actual\"}") == 192);
  CHECK(routerMetric(*c, "pdserve_router_prefix_hit_tokens_total{source=\"exact\"}") == -1);  // never counted
  CHECK(routerMetric(*c, "pdserve_router_kv_index_current{worker=\"decode-0\"}") == -1);
  // No snapshot went out: the worker has no publisher, or the router did not ask.
  CHECK(workerMetric(*c, "decode-0", "pdserve_kv_event_batches_total{kind=\"snapshot\"}") <= 0);
}

TEST_CASE("adaptive threshold: a prefill pool missing its SLO pulls prompts onto the decode pool") {
  // A TTFT target no request can meet and an ITL target every one meets: after one tick with
  // enough samples in both windows the router raises short_prompt_tokens from 64. (Overload
  // shedding, which would refuse these prompts against that target, is not what is tested.)
  ClusterSpec spec{/*shortPromptTokens=*/64};
  spec.extraRouting = ", adaptive_threshold: true";
  spec.extraRouter = "  admission: {overload_shedding: false}\n";
  spec.pools = "{prefill: {replicas: 1, slo: {ttft_ms: 1}}, decode: {replicas: 1, slo: {itl_ms: 60000}}}";
  auto c = startCluster("adaptive-threshold", spec);
  CHECK(routerMetric(*c, "pdserve_short_prompt_tokens") == 64);
  const auto longPrompt = randomPrompt(70, 5);
  CHECK(complete(*c, longPrompt, 2).headers.find("x-pdserve-route: disaggregated") != std::string::npos);
  for (int i = 0; i < 24; ++i) REQUIRE(complete(*c, randomPrompt(70 + i, 100 + uint64_t(i)), 2).status == 200);
  double threshold = 64;
  for (int i = 0; i < 80 && threshold <= 64; ++i) {  // the tick is every 5 s
    std::this_thread::sleep_for(100ms);
    threshold = routerMetric(*c, "pdserve_short_prompt_tokens");
  }
  // Steps of 25%: 80 after the first tick (a slow machine may fit a second one, 100).
  CHECK((threshold == 80 || threshold == 100));
  // The same 70-token prompt is now short: served colocated.
  auto r = complete(*c, longPrompt, 2);
  CHECK(r.headers.find("x-pdserve-route: colocated") != std::string::npos);
}

// The logits processors requests of the next test: greedy, so any difference between the
// paths is a processor applied differently (the prefill worker samples the first token).
const json kPenalised{{"presence_penalty", 0.8}, {"frequency_penalty", 0.6}, {"repetition_penalty", 1.5}};
constexpr int32_t kBiasedToken = 200;
const json kBiased{{"logit_bias", {{std::to_string(kBiasedToken), 100}}}};

// Penalties, stop_token_ids, min_tokens and logit_bias, greedy, on one cluster: the ids of
// each. `first` is the unprocessed greedy run's first token: as a stop id it ends the request
// at once, unless min_tokens masks it.
std::vector<std::vector<int32_t>> processedIds(LocalCluster& c, const std::string& route, int32_t first) {
  const json stopAtFirst{{"ignore_eos", false}, {"stop_token_ids", {first}}};
  json minTokens = stopAtFirst;
  minTokens["min_tokens"] = 6;
  std::vector<std::vector<int32_t>> out;
  for (const json& extra : {kPenalised, stopAtFirst, minTokens, kBiased}) {
    INFO(extra.dump());
    auto r = complete(c, randomPrompt(300, 5), 8, extra);
    INFO(r.body.dump());
    REQUIRE(r.status == 200);
    CHECK(r.headers.find("x-pdserve-route: " + route) != std::string::npos);
    out.push_back(r.ids);
  }
  return out;
}

TEST_CASE("seeded sampling and the logits processors give the same tokens colocated and disaggregated") {
  json sampling{{"temperature", 0.9}, {"top_p", 0.95}, {"top_k", 50}, {"seed", 11}};
  std::vector<std::vector<int32_t>> colocated, disaggregated, processedColocated, processedDisaggregated;
  std::vector<int32_t> plain;
  // Back-to-back requests on a busy machine must not be shed: this test is about tokens.
  ClusterSpec colocatedSpec{100000}, disaggregatedSpec{0};
  colocatedSpec.extraRouter = disaggregatedSpec.extraRouter = "  admission: {overload_shedding: false}\n";
  {
    auto c = startCluster("seeded-colocated", colocatedSpec);
    for (int n : {40, 300, 800}) colocated.push_back(complete(*c, randomPrompt(n, n), 10, sampling).ids);
    plain = complete(*c, randomPrompt(300, 5), 8).ids;
    REQUIRE(plain.size() == 8);
    processedColocated = processedIds(*c, "colocated", plain[0]);
    // logprobs: 20 returns 20 alternatives (texts that collide are keyed by token id).
    auto lp = complete(*c, randomPrompt(40, 1), 2, {{"logprobs", 20}});
    REQUIRE(lp.status == 200);
    for (const auto& top : lp.body["choices"][0]["logprobs"]["top_logprobs"]) CHECK(top.size() == 20);
    // echo with max_tokens 0: the prompt alone, no token, no completion tokens.
    auto echo = complete(*c, randomPrompt(40, 1), 0, {{"echo", true}});
    REQUIRE(echo.status == 200);
    CHECK(echo.ids.empty());
    CHECK(echo.body["usage"]["completion_tokens"] == 0);
    CHECK(echo.body["choices"][0]["finish_reason"] == "length");
    // A stop string of the first token's text ends the answer at once, unless min_tokens.
    REQUIRE(plain[0] < 128);  // a byte-level id: its text is that one ASCII character
    const json stopString{{"stop", std::string(1, char(plain[0]))}};
    auto cut = complete(*c, randomPrompt(300, 5), 8, stopString);
    CHECK(cut.body["choices"][0]["text"] == "");
    CHECK(cut.body["choices"][0]["finish_reason"] == "stop");
    json held = stopString;
    held["min_tokens"] = 3;
    auto notCut = complete(*c, randomPrompt(300, 5), 8, held);
    CHECK(notCut.body["usage"]["completion_tokens"] >= 3);
    CHECK(notCut.ids.size() >= 3);
  }
  {
    auto c = startCluster("seeded-disaggregated", disaggregatedSpec);
    for (int n : {40, 300, 800}) {
      auto r = complete(*c, randomPrompt(n, n), 10, sampling);
      CHECK(r.headers.find("x-pdserve-route: disaggregated") != std::string::npos);
      disaggregated.push_back(r.ids);
    }
    processedDisaggregated = processedIds(*c, "disaggregated", plain[0]);
  }
  REQUIRE(colocated.size() == 3);
  CHECK(colocated[0].size() == 10);
  CHECK(colocated == disaggregated);
  // The processors: identical on both paths, and each really changed the greedy output.
  CHECK(processedColocated == processedDisaggregated);
  REQUIRE(processedColocated.size() == 4);
  CHECK(processedColocated[0] != plain);
  CHECK(processedColocated[1] == std::vector<int32_t>{plain[0]});  // the stop id ends it at once
  REQUIRE(processedColocated[2].size() >= 6);                      // min_tokens: not before 6 tokens
  for (int i = 0; i < 6; ++i) CHECK(processedColocated[2][size_t(i)] != plain[0]);
  CHECK(processedColocated[3] == std::vector<int32_t>(8, kBiasedToken));
  CHECK(std::count(plain.begin(), plain.end(), kBiasedToken) < 8);
  // And the same as the engine in one process with the same seed.
  CHECK(colocated[1] == generateCli(randomPrompt(300, 300), 10, "--temperature 0.9 --top-p 0.95 --top-k 50 --seed 11"));
}

TEST_CASE("a client that disconnects mid-stream frees its blocks on both workers") {
  auto c = startCluster("disconnect", ClusterSpec{0});
  std::string seen;
  json req{{"model", "small"},
           {"prompt", randomPrompt(600, 3)},
           {"max_tokens", 400},
           {"stream", true},
           {"ignore_eos", true}};
  int fd = openStream(*c, req, 3, &seen);
  CHECK(seen.find("x-pdserve-route: disaggregated") != std::string::npos);
  CHECK(seen.find("\"text\"") != std::string::npos);
  ::close(fd);
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
  CHECK(workerMetric(*c, "decode-0", "pdserve_num_requests_running") == 0);
}

// The abort leak users file most. 100 clients leave, half before their first token
// (right after sending) and half mid-stream, on colocated and disaggregated prompts; then
// every block is free on both workers, nothing is in flight, and greedy output is unchanged.
TEST_CASE("100 client aborts, before the first token and mid-stream: no block leaks, output unchanged") {
  ClusterSpec spec{/*shortPromptTokens=*/64};
  // Not an overload test: on a slow (sanitized) build the requests still queued behind an
  // abort's cancel would be predicted past the TTFT target and shed.
  spec.extraRouter = "  admission: {overload_shedding: false}\n";
  auto c = startCluster("aborts", spec);
  for (int i = 0; i < 100; ++i) {
    const bool early = i % 2 == 0;
    json req{{"model", "small"},
             {"prompt", randomPrompt(i % 4 < 2 ? 20 : 100, 500 + i)},
             {"max_tokens", 100},
             {"stream", true},
             {"ignore_eos", true}};
    std::string seen;
    int fd = openStream(*c, req, early ? 0 : 2, &seen);
    ::close(fd);
  }
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
  CHECK(routerMetric(*c, "pdserve_requests_in_flight") == 0);
  const auto p = randomPrompt(300, 77);
  CHECK(complete(*c, p, 8).ids == generateCli(p, 8));
  recordFault({"client abort, before the first token and mid-stream, 100 times",
               "blocks free on decode and prefill workers, 0 requests in flight, the next request's greedy ids equal",
               "the HTTP connection closes: at once", "100 aborts, 0 blocks held after"});
}

TEST_CASE("the prefill worker killed mid-request: recomputed on the decode worker, or failed") {
  const auto p = randomPrompt(2000, 42);
  const auto expected = generateCli(p, 4);
  std::string measured;
  {
    auto c = startCluster("kill-prefill-recompute", ClusterSpec{0, "[tcp]", "recompute"});
    std::thread killer([&] {
      std::this_thread::sleep_for(150ms);
      (void)c->kill("prefill-0");
    });
    const auto t0 = std::chrono::steady_clock::now();
    auto r = complete(*c, p, 4);
    measured = "recompute: answered in " + msSince(t0);
    killer.join();
    REQUIRE(r.status == 200);
    CHECK(r.ids == expected);
    CHECK(allBlocksFree(*c, "decode-0"));
  }
  {
    auto c = startCluster("kill-prefill-fail", ClusterSpec{0, "[tcp]", "fail"});
    std::thread killer([&] {
      std::this_thread::sleep_for(150ms);
      (void)c->kill("prefill-0");
    });
    auto start = std::chrono::steady_clock::now();
    auto r = complete(*c, p, 4);
    killer.join();
    CHECK(r.status == 503);
    CHECK(r.body["error"]["message"].get<std::string>().find("remote prefill failed") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < 30s);
    measured += "; fail: 503 in " + msSince(start);
    CHECK(allBlocksFree(*c, "decode-0"));
  }
  recordFault({"prefill worker killed mid-transfer",
               "recompute: same greedy ids; fail: 503 naming it; blocks free on the decode worker; ends < 30 s",
               "its connection resets: at once", measured});
}

TEST_CASE("a decode worker killed mid-stream: an error event, then 503s") {
  auto c = startCluster("kill-decode", ClusterSpec{100000});
  std::string seen;
  json req{{"model", "small"},
           {"prompt", randomPrompt(20, 1)},
           {"max_tokens", 3000},
           {"stream", true},
           {"ignore_eos", true}};
  int fd = openStream(*c, req, 2, &seen);
  REQUIRE(c->kill("decode-0").isOk());
  char buf[4096];
  // The connection stays open (keep-alive): read until the stream's end.
  for (ssize_t n; seen.find("data: [DONE]") == std::string::npos && (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) {
    seen.append(buf, size_t(n));
  }
  ::close(fd);
  CHECK(seen.find("\"error\"") != std::string::npos);
  CHECK(seen.find("disconnected") != std::string::npos);
  CHECK(seen.find("data: [DONE]") != std::string::npos);
  auto health = httpGet(c->httpPort(), "/health", 5s);
  REQUIRE(health.ok());
  CHECK(health->status == 503);
  CHECK(complete(*c, randomPrompt(10, 2), 2).status == 503);
}

// Request migration. The stream goes on on the other decode worker from the next
// token, and the whole answer is the unmigrated greedy one (pdserve generate). The prompt is
// long enough to be prefilled remotely, before and after the move.
TEST_CASE("a decode worker killed mid-stream: the stream continues on another one, same greedy tokens") {
  ClusterSpec spec{/*shortPromptTokens=*/64};
  spec.pools = "{prefill: {replicas: 1}, decode: {replicas: 2}}";
  auto c = startCluster("migrate-kill", spec);
  const auto p = randomPrompt(100, 31);
  const int kTokens = 160;
  const auto expected = generateCli(p, kTokens);
  json req{{"model", "small"},   {"prompt", p},    {"max_tokens", kTokens},   {"temperature", 0},
           {"ignore_eos", true}, {"stream", true}, {"return_token_ids", true}};
  std::string seen;
  int fd = openStream(*c, req, 4, &seen);
  const std::string first = headerValue(seen, "x-pdserve-decode-worker");
  REQUIRE(!first.empty());
  REQUIRE(c->kill(first).isOk());
  const auto killedAt = std::chrono::steady_clock::now();
  const auto ids = readStreamIds(fd, &seen);
  const std::string tookToEnd = msSince(killedAt);
  INFO(seen.substr(0, 600));
  CHECK(seen.find("\"error\"") == std::string::npos);
  CHECK(seen.find("\"finish_reason\":\"length\"") != std::string::npos);
  CHECK(ids == expected);
  CHECK(routerMetric(*c, "pdserve_request_migrations_total{reason=\"worker_lost\"}") == 1);
  const std::string other = first == "decode-0" ? "decode-1" : "decode-0";
  CHECK(allBlocksFree(*c, other));
  CHECK(allBlocksFree(*c, "prefill-0"));
  recordFault(
      {"decode worker killed mid-stream",
       "the stream goes on with no duplicated or missing token, greedy ids equal; blocks free on the survivors",
       "its control connection closes: at once",
       "1 migration; the rest of the stream (" + std::to_string(kTokens) + " tokens in all) took " + tookToEnd});
}

// A stopped decode worker (SIGSTOP: a hung host, a partition) keeps its connection open but
// stops reporting: after router.workers.worker_report_timeout_ms its stream moves on. Resumed, it
// gets the cancel and frees everything.
TEST_CASE("a decode worker stopped mid-stream: the stream moves on after the report timeout, same tokens") {
  ClusterSpec spec{/*shortPromptTokens=*/100000};
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 2}}";
  spec.extraRouter = "  workers: {worker_report_timeout_ms: 800}\n";
  auto c = startCluster("migrate-stop", spec);
  const auto p = randomPrompt(20, 33);
  const int kTokens = 300;
  const auto expected = generateCli(p, kTokens);
  json req{{"model", "small"},   {"prompt", p},    {"max_tokens", kTokens},   {"temperature", 0},
           {"ignore_eos", true}, {"stream", true}, {"return_token_ids", true}};
  std::string seen;
  int fd = openStream(*c, req, 4, &seen);
  const std::string stopped = headerValue(seen, "x-pdserve-decode-worker");
  REQUIRE(c->processes().signal(stopped, SIGSTOP).isOk());
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = readStreamIds(fd, &seen);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(c->processes().signal(stopped, SIGCONT).isOk());
  CHECK(seen.find("\"error\"") == std::string::npos);
  CHECK(ids == expected);
  CHECK(took < 20s);
  CHECK(routerMetric(*c, "pdserve_request_migrations_total{reason=\"worker_lost\"}") == 1);
  CHECK(allBlocksFree(*c, stopped));
  recordFault({"decode worker stopped (SIGSTOP) mid-stream",
               "stream complete with the same greedy ids; the stopped worker frees everything once resumed",
               "its load reports stop: router.workers.worker_report_timeout_ms (800 ms here)",
               "stream finished " +
                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
                   " ms after the stop"});
}

// A drain that times out ends the worker's requests with `unavailable`: they move on too.
TEST_CASE("a decode worker whose drain times out: its stream moves to another one and finishes") {
  ClusterSpec spec{/*shortPromptTokens=*/100000};
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 2}}";
  spec.extraEngine = ", drain_timeout_ms: 150";
  auto c = startCluster("migrate-drain", spec);
  const auto p = randomPrompt(20, 32);
  const int kTokens = 400;
  const auto expected = generateCli(p, kTokens);
  json req{{"model", "small"},   {"prompt", p},    {"max_tokens", kTokens},   {"temperature", 0},
           {"ignore_eos", true}, {"stream", true}, {"return_token_ids", true}};
  std::string seen;
  int fd = openStream(*c, req, 4, &seen);
  const std::string draining = headerValue(seen, "x-pdserve-decode-worker");
  REQUIRE(c->processes().signal(draining, SIGTERM).isOk());
  const auto termAt = std::chrono::steady_clock::now();
  const auto ids = readStreamIds(fd, &seen);
  const std::string streamEnd = msSince(termAt);
  CHECK(seen.find("\"error\"") == std::string::npos);
  CHECK(ids == expected);
  // It gave the request up (an unavailable error), or its connection closed first at exit.
  CHECK(std::max(0.0, routerMetric(*c, "pdserve_request_migrations_total{reason=\"worker_gave_up\"}")) +
            std::max(0.0, routerMetric(*c, "pdserve_request_migrations_total{reason=\"worker_lost\"}")) ==
        1);
  auto exit = c->processes().waitAny(15s);
  REQUIRE(exit.has_value());
  CHECK(exit->name == draining);
  CHECK(exit->description == "exited with status 0");
  recordFault({"SIGTERM under load, the drain past engine.drain_timeout_ms",
               "the stream moves to another decode worker and finishes with the same greedy ids; exit 0",
               "SIGTERM: at once; the request is given up after drain_timeout_ms (150 ms here)",
               "stream complete " + streamEnd + " after SIGTERM"});
}

// Overload. A burst of long prompts far past what the prefill worker can start within
// its TTFT target: the router admits what fits and refuses the rest at once with 429 and a
// Retry-After (never a hang or a timeout), every admitted request completes, nothing leaks,
// and once the queue drained a request passes again.
TEST_CASE("a burst past the prefill pool's capacity: 429 with Retry-After for what would miss the TTFT target") {
  ClusterSpec spec{/*shortPromptTokens=*/64};
  spec.pools = "{prefill: {replicas: 1, slo: {ttft_ms: 400}}, decode: {replicas: 1}}";
  auto c = startCluster("overload", spec);
  REQUIRE(complete(*c, randomPrompt(600, 40), 2).status == 200);  // the prefill worker measures its rate
  // ... and the router learns it from the next load report: admission predicts no wait (and
  // sheds nothing) while a worker's rate is unknown, so the burst starts once it is known.
  const std::string rate = "pdserve_worker_prefill_tokens_per_second{pool=\"prefill\",worker=\"prefill-0\"}";
  for (int i = 0; i < 100 && !(routerMetric(*c, rate) > 0); ++i) std::this_thread::sleep_for(50ms);
  REQUIRE(routerMetric(*c, rate) > 0);
  const int kBurst = 12;
  std::vector<Result<HttpReply>> replies(kBurst, Result<HttpReply>(unavailable("not sent")));
  std::vector<std::thread> clients;
  for (int i = 0; i < kBurst; ++i) {
    clients.emplace_back([&, i] {
      json req{{"model", "small"},
               {"prompt", randomPrompt(1500, 41 + i)},
               {"max_tokens", 4},
               {"temperature", 0},
               {"ignore_eos", true}};
      replies[i] = httpRequest(c->httpPort(), "POST", "/v1/completions", req.dump(), 120s);
      std::this_thread::sleep_for(1ms);
    });
    std::this_thread::sleep_for(5ms);
  }
  for (auto& t : clients) t.join();
  int ok = 0, shed = 0;
  for (const auto& r : replies) {
    REQUIRE(r.ok());
    INFO(r->status << " " << r->body);
    if (r->status == 200) ++ok;
    if (r->status == 429) {
      ++shed;
      CHECK(r->body.find("overloaded") != std::string::npos);
      CHECK(r->headers.find("retry-after: ") != std::string::npos);
    }
    CHECK((r->status == 200 || r->status == 429));
  }
  INFO("the first reply: " << replies[0]->status << " " << replies[0]->body);
  CHECK(ok >= 1);
  CHECK(shed >= 1);
  // Shed by either pool's admission (pdserve_request_errors_total's pool label says which).
  const auto shedBy = [&](const char* pool) {
    return std::max(
        0.0, routerMetric(*c, std::string("pdserve_request_errors_total{pool=\"") + pool + "\",type=\"overloaded\"}"));
  };
  CHECK(shedBy("prefill") + shedBy("decode") == shed);
  // Before shedding, the router gave the decode worker (SLO-sized chunks, the default) what it
  // could prefill in time: at least the first prompt the prefill worker could not take.
  const double overflowed =
      routerMetric(*c, "pdserve_route_decisions_total{reason=\"prefill_overflow\",route=\"colocated\"}");
  CHECK(overflowed >= 1);
  CHECK(overflowed < ok);
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
  // The router's own count of outstanding work is back to 0 (the choices end on its strand just
  // after the replies): a leak there would shed forever.
  const auto settlesAtZero = [&](const std::string& series) {
    for (int i = 0; i < 50; ++i, std::this_thread::sleep_for(100ms))
      if (routerMetric(*c, series) == 0) return true;
    return false;
  };
  CHECK(settlesAtZero("pdserve_router_routed_prefill_tokens{pool=\"prefill\",worker=\"prefill-0\"}"));
  CHECK(settlesAtZero("pdserve_router_routed_streams{pool=\"decode\",worker=\"decode-0\"}"));
  CHECK(complete(*c, randomPrompt(1500, 99), 2).status == 200);  // drained: admitted again
  recordFault({"overload: a burst of 12 long prompts past the prefill pool's TTFT target",
               "every request answered (200 or 429 with Retry-After, never a timeout); blocks free; admitted again "
               "once drained",
               "at admission: predicted TTFT (tokens ahead + the prompt, over the prefill rate) > "
               "pools.prefill.slo.ttft_ms (400 ms here)",
               std::to_string(ok) + " admitted (" + std::to_string(int(overflowed)) +
                   " prefilled on the decode worker), " + std::to_string(shed) +
                   " shed; the 3x trace run is in docs/performance.md"});
}

TEST_CASE("bad requests get OpenAI errors with the right status") {
  auto c = startCluster(
      "errors", ClusterSpec{64, "[tcp]", "recompute", "  http: {api_keys: [sk-test], max_body_bytes: 65536}\n"});
  const std::vector<std::string> auth{"Authorization: Bearer sk-test"};
  auto post = [&](const std::string& body, std::vector<std::string> headers) {
    auto r = httpRequest(c->httpPort(), "POST", "/v1/completions", body, 30s, headers);
    REQUIRE(r.ok());
    return std::make_pair(r->status, json::parse(r->body, nullptr, false));
  };
  CHECK(post(R"({"model":"small","prompt":"hi"})", {}).first == 401);
  auto [s400, b400] = post(R"({"model":"small","prompt":"hi","temperature":"hot"})", auth);
  CHECK(s400 == 400);
  CHECK(b400["error"]["param"] == "temperature");
  CHECK(post("{not json", auth).first == 400);
  auto [s404, b404] = post(R"({"model":"gpt-9","prompt":"hi"})", auth);
  CHECK(s404 == 404);
  CHECK(b404["error"]["code"] == "model_not_found");
  json tooLong{{"model", "small"}, {"prompt", randomPrompt(5000, 1)}};
  auto [sLong, bLong] = post(tooLong.dump(), auth);
  CHECK(sLong == 400);
  CHECK(bLong["error"]["code"] == "context_length_exceeded");
  CHECK(post(std::string(70000, ' '), auth).first == 413);
  // The cluster still serves after all of that.
  auto ok = post(R"({"model":"small","prompt":"hello","max_tokens":3})", auth);
  CHECK(ok.first == 200);
  CHECK(ok.second["usage"]["completion_tokens"] == 3);
  auto health = httpGet(c->httpPort(), "/health", 5s);  // no key needed
  CHECK(health->status == 200);
}

// The decode worker never waits on a peer. A prefill worker stopped (SIGSTOP) in the
// middle of a remote prefill delays that request alone: a colocated stream on the same decode
// worker keeps its pace, both workers stay healthy in the router (the stop is shorter than
// router.workers.worker_report_timeout_ms), and the delayed request still gets its exact greedy ids.
TEST_CASE("a prefill worker stopped mid-request delays only its own request") {
  ClusterSpec spec;
  spec.extraRouter = "  workers: {worker_report_timeout_ms: 3000}\n";
  auto c = startCluster("sigstop-prefill", spec);
  // Long enough that its prefill outlasts the polls below even on an optimised build.
  const auto longPrompt = randomPrompt(2000, 77);
  const auto expected = generateCli(longPrompt, 8);
  auto healthy = [&](const std::string& worker) {
    auto r = httpGet(c->httpPort(), "/metrics", 5s);
    if (!r.ok()) return false;
    return r->body.find("pdserve_worker_healthy{pool=\"" + std::string(worker[0] == 'p' ? "prefill" : "decode") +
                        "\",worker=\"" + worker + "\"} 1") != std::string::npos;
  };
  REQUIRE(healthy("prefill-0"));
  REQUIRE(healthy("decode-0"));
  // One disaggregated request first: the decode worker's KV connection to the prefill worker
  // (its KvConnect exchange) is then in place, so the stop lands on the prefill, not on a
  // handshake that a slow (sanitized) build had not finished.
  REQUIRE(complete(*c, randomPrompt(400, 78), 1).status == 200);

  // A colocated stream: we record when each event arrives.
  std::vector<std::chrono::steady_clock::time_point> arrivals;
  std::string seen;
  std::thread streamer([&] {
    json req{{"model", "small"},   {"prompt", randomPrompt(20, 5)},
             {"max_tokens", 250},  {"temperature", 0},
             {"ignore_eos", true}, {"stream", true}};
    int fd = openStream(*c, req, 1, &seen);
    char buf[4096];
    while (seen.find("[DONE]") == std::string::npos) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      seen.append(buf, size_t(n));
      arrivals.push_back(std::chrono::steady_clock::now());
    }
    ::close(fd);
  });
  std::this_thread::sleep_for(300ms);
  Completion delayed;
  std::chrono::steady_clock::duration delayedTook{};
  std::thread longRequest([&] {
    auto t0 = std::chrono::steady_clock::now();
    delayed = complete(*c, longPrompt, 8);
    delayedTook = std::chrono::steady_clock::now() - t0;
  });
  // Stop the prefill worker once the PrefillRequest went to it (the decode worker's REQUESTED).
  auto requested = [&] { return workerMetricWith(*c, "decode-0", "pdserve_remote_prefills", "state=\"requested\""); };
  for (int i = 0; i < 2000 && requested() != 1; ++i) std::this_thread::sleep_for(1ms);
  REQUIRE(c->processes().signal("prefill-0", SIGSTOP).isOk());
  const auto stoppedAt = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(100ms);
  // The lifecycle's state gauge (docs/reliability.md): the decode worker waits on it in REQUESTED.
  const double requestedWhileStopped = requested();
  // 1.5 s stopped, by the clock: the health probes take longer under a sanitizer, and a stop
  // that outgrew the 3 s report timeout would be a different test.
  bool alwaysHealthy = true;
  while (std::chrono::steady_clock::now() - stoppedAt < 1500ms) {
    std::this_thread::sleep_for(100ms);
    alwaysHealthy = alwaysHealthy && healthy("decode-0") && healthy("prefill-0");
  }
  REQUIRE(c->processes().signal("prefill-0", SIGCONT).isOk());
  longRequest.join();
  streamer.join();

  CHECK(alwaysHealthy);
  CHECK(requestedWhileStopped == 1);
  for (const char* state : {"waiting_blocks", "connecting", "requested"})
    CHECK(workerMetricWith(*c, "decode-0", "pdserve_remote_prefills", "state=\"" + std::string(state) + "\"") == 0);
  for (const char* state : {"computing", "pushing", "ending"})
    CHECK(workerMetricWith(*c, "prefill-0", "pdserve_remote_prefills", "state=\"" + std::string(state) + "\"") == 0);
  CHECK(delayed.status == 200);
  CHECK(delayed.ids == expected);
  CHECK(delayed.headers.find("x-pdserve-route: disaggregated") != std::string::npos);
  CHECK(delayedTook >= 1500ms);
  CHECK(seen.find("[DONE]") != std::string::npos);
  std::chrono::steady_clock::duration maxGap{};
  for (size_t i = 1; i < arrivals.size(); ++i) maxGap = std::max(maxGap, arrivals[i] - arrivals[i - 1]);
  INFO("max gap between stream reads: " << std::chrono::duration_cast<std::chrono::milliseconds>(maxGap).count()
                                        << " ms");
  CHECK(maxGap < 500ms);  // a decode step here is ~10-30 ms; the stop lasts 1.5 s
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
  recordFault({"prefill worker stopped for 1.5 s (shorter than its lease), short streams beside it",
               "the delayed request's ids equal; the other stream's largest gap < 500 ms; blocks free",
               "not a fault yet: within kv_transfer.lease_ms (3 s) and timeout_ms",
               "delayed request " +
                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(delayedTook).count()) +
                   " ms; largest stream gap " +
                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(maxGap).count()) + " ms"});
}

// A request that can never fit the decode workers' KV cache (4 blocks of 16 tokens here, one
// kept free by admission: prompts of at most 48 tokens) is refused at once with a 400 naming
// the limit, never queued (it waited for the request timeout before, the decode worker
// spinning at ~98% CPU) nor refused with a retryable 429; the cluster serves on.
TEST_CASE("a request that can never fit the KV cache: a 400 at once naming the limit, no spinning worker") {
  ClusterSpec spec;  // prompts of over 64 tokens go to the prefill worker
  spec.kvCache = "num_blocks: 4";
  auto c = startCluster("tiny-kv-cache", spec);
  // The router learns the limit from the decode worker's load reports.
  for (int i = 0;
       i < 200 && routerMetric(*c, "pdserve_worker_kv_total_blocks{pool=\"decode\",worker=\"decode-0\"}") != 4; ++i)
    std::this_thread::sleep_for(50ms);
  REQUIRE(routerMetric(*c, "pdserve_worker_kv_total_blocks{pool=\"decode\",worker=\"decode-0\"}") == 4);
  auto pid = c->processes().pidOf("decode-0");
  REQUIRE(pid.ok());
  auto cpuSeconds = [&] {  // utime + stime of the decode worker, /proc/<pid>/stat fields 14 and 15
    std::string stat = pd::test::readFile("/proc/" + std::to_string(*pid) + "/stat");
    std::istringstream in(stat.substr(stat.rfind(')') + 2));
    std::string field;
    double ticks = 0;
    for (int i = 3; i <= 15 && in >> field; ++i)
      if (i >= 14) ticks += std::stod(field);
    return ticks / double(::sysconf(_SC_CLK_TCK));
  };
  for (int tokens : {49, 64, 300}) {
    INFO("a prompt of " << tokens << " tokens");
    json req{{"model", "small"}, {"prompt", randomPrompt(tokens, 3000 + tokens)}, {"max_tokens", 2}};
    Result<HttpReply> reply = unavailable("not sent");
    const auto t0 = std::chrono::steady_clock::now();
    // Bounded well below the request timeout: before, the request waited for it.
    std::chrono::steady_clock::duration repliedAfter{};
    std::thread client([&] {
      reply = httpRequest(c->httpPort(), "POST", "/v1/completions", req.dump(), 15s);
      repliedAfter = std::chrono::steady_clock::now() - t0;
    });
    // While such a request would wait, the decode worker must not spin: an idle loop takes a
    // few ms of CPU a second, a spinning one all of it.
    std::this_thread::sleep_for(200ms);
    const double cpu0 = cpuSeconds();
    std::this_thread::sleep_for(1s);
    const double cpuUsed = cpuSeconds() - cpu0;
    client.join();
    REQUIRE(reply.ok());
    INFO(reply->status << " " << reply->body << " after "
                       << std::chrono::duration_cast<std::chrono::milliseconds>(repliedAfter).count()
                       << " ms; decode worker CPU " << cpuUsed << " s over 1 s");
    CHECK(reply->status == 400);
    const json body = json::parse(reply->body, nullptr, false);
    CHECK(body["error"]["code"] == "context_length_exceeded");
    CHECK(reply->body.find("more than the 48") != std::string::npos);
    CHECK(repliedAfter < 2s);  // milliseconds; generous for a loaded host
    CHECK(cpuUsed < 0.3);
  }
  // What fits is served: 48 prompt tokens and their generated ones take all 4 blocks.
  auto fits = complete(*c, randomPrompt(48, 3048), 4);
  INFO(fits.body.dump());
  CHECK(fits.status == 200);
  CHECK(fits.ids.size() == 4);
  CHECK(allBlocksFree(*c, "decode-0"));
}

// Overload shedding reads the workers' load reports; a report whose figures were taken before
// a long local prefill ended, arriving after its first token, counted that prompt as still
// queued, and an idle cluster refused the next request with a 429 for ~50-100 ms. The router
// now takes what finished after the report's figures off them (docs/serving.md, "Overload").
TEST_CASE("no spurious 429 right after a long local prefill on an idle cluster") {
  ClusterSpec spec;
  spec.shortPromptTokens = 4000;   // every prompt is prefilled on the decode worker
  spec.prefixAwareRouting = true;  // as deployed: the router then counts uncached tokens
  spec.pools = "{prefill: {replicas: 1, slo: {ttft_ms: 100}}, decode: {replicas: 1}}";
  auto c = startCluster("no-spurious-429", spec);
  REQUIRE(complete(*c, randomPrompt(1500, 4000), 1).status == 200);  // the decode worker measures its rate
  int shed = 0;
  std::string why;
  for (int i = 0; i < 12; ++i) {
    // A 1,500-token prompt predicts far past the 100 ms TTFT target: anything left of it in
    // the router's view sheds the short request right behind it.
    auto longOne = complete(*c, randomPrompt(1500, 4001 + i), 1);
    REQUIRE(longOne.status == 200);
    CHECK(longOne.headers.find("x-pdserve-route: colocated") != std::string::npos);
    auto shortOne = complete(*c, randomPrompt(8, 4100 + i), 1);
    if (shortOne.status != 200) {
      ++shed;
      why = shortOne.body.dump();
    }
    CHECK(shortOne.status == 200);
  }
  INFO(why);
  CHECK(shed == 0);
}

// The remote-prefill deadline is a lease on progress (docs/reliability.md, "Remote prefill
// deadlines"): a prompt whose prefill takes longer than kv_transfer.timeout_ms (1 s here, one
// engine thread) is computed once, not given up on and recomputed; a prefill worker that stops
// still fails its request within the lease of its last progress.
TEST_CASE("a remote prefill longer than kv_transfer.timeout_ms is computed once, and a stopped one fails in time") {
  ClusterSpec spec;  // prompts of over 64 tokens go to the prefill worker
  spec.threads = 1;
  spec.timeoutMs = 1000;
  spec.extraRouter = "  workers: {worker_report_timeout_ms: 10000}\n";
  auto c = startCluster("progress-lease", spec);
  REQUIRE(complete(*c, randomPrompt(200, 5000), 1).status == 200);  // the KV lane is up
  const auto longPrompt = randomPrompt(3000, 5001);
  const auto expected = pd::test::generateCli(longPrompt, 4, 1);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = complete(*c, longPrompt, 4);
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(r.status << " " << r.body.dump() << " after " << msSince(t0));
  REQUIRE(r.status == 200);
  // Without this the case proves nothing: the prefill must outlast the 1 s timeout.
  REQUIRE(took > 1500ms);
  CHECK(r.ids == expected);
  CHECK(r.headers.find("x-pdserve-route: disaggregated") != std::string::npos);
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_remote_prefill_total", "outcome=\"ok\"") == 2);
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_remote_prefill_total", "outcome=\"recomputed\"") <= 0);

  // Stopped mid-prefill: no progress, so the decode worker gives up a lease after the last
  // one and recomputes (on_remote_prefill_failure: recompute), long before any report timeout.
  Completion stopped;
  std::thread client([&] { stopped = complete(*c, randomPrompt(3000, 5002), 2); });
  auto requested = [&] { return workerMetricWith(*c, "decode-0", "pdserve_remote_prefills", "state=\"requested\""); };
  for (int i = 0; i < 3000 && requested() != 1; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(300ms);  // computing
  REQUIRE(c->processes().signal("prefill-0", SIGSTOP).isOk());
  const auto stoppedAt = std::chrono::steady_clock::now();
  auto recomputed = [&] {
    return workerMetricWith(*c, "decode-0", "pdserve_remote_prefill_total", "outcome=\"recomputed\"");
  };
  while (recomputed() < 1 && std::chrono::steady_clock::now() - stoppedAt < 20s) std::this_thread::sleep_for(20ms);
  const auto gaveUpAfter = std::chrono::steady_clock::now() - stoppedAt;
  REQUIRE(c->processes().signal("prefill-0", SIGCONT).isOk());
  client.join();
  INFO("the decode worker gave up " << std::chrono::duration_cast<std::chrono::milliseconds>(gaveUpAfter).count()
                                    << " ms after the stop");
  CHECK(recomputed() == 1);
  CHECK(gaveUpAfter < 1000ms + 2s);  // the 1 s lease after the last progress, with room for a loaded host
  CHECK(stopped.status == 200);
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
}

// KV fencing (docs/reliability.md): the slow-but-alive writer: the prefill worker is stopped (SIGSTOP) in
// the middle of request A's prefill; the decode worker gives up on it (kv_transfer.timeout_ms,
// on_remote_prefill_failure: fail) and A's reserved blocks leave it; request B then runs on the
// decode worker (colocated; freed blocks are reused first, so without fencing B gets A's
// blocks) while the prefill worker resumes (SIGCONT) and pushes the stale layers of its step.
// tcp: the revoked grant is refused at the receiver, so A's blocks were free at once; cma: the
// writes land without the receiver's check, so A's blocks are quarantined until the prefill
// worker acknowledges the cancel. Either way B's greedy ids equal `pdserve generate`'s (without
// the fence the stale layers overwrite B's KV), and every block comes back.
// leaseMs: the decode <-> prefill lease; longer than the 3.2 s stop, the cancel is acknowledged
// on the connection that stayed up; shorter, the lease closes it during the stop and the decode
// worker dials the resumed writer again for the acknowledgement.
static void checkSlowButAliveWriter(const std::string& transports, const std::string& lane, int leaseMs = 10000) {
  const int stopAfterMs = 100;
  ClusterSpec spec;
  spec.shortPromptTokens = 400;
  spec.transports = transports;
  spec.timeoutMs = 1500;
  spec.extraKvTransfer = ", heartbeat_ms: 100, lease_ms: " + std::to_string(leaseMs);
  spec.onFailure = "fail";
  spec.extraRouter = "  workers: {worker_report_timeout_ms: 10000}\n";
  auto c = startCluster("fence-" + lane, spec);
  const auto promptA = randomPrompt(1200, 1201);
  const auto promptB = randomPrompt(380, 1202);  // 30 blocks with its tokens: A's first 30 without fencing
  const auto expectedB = generateCli(promptB, 100);
  // One disaggregated request first: the lane is up, and it is the one this case is about.
  auto warm = complete(*c, randomPrompt(420, 1203), 2);
  INFO(warm.body.dump());
  REQUIRE(warm.status == 200);
  if (workerMetricWith(*c, "decode-0", "pdserve_kv_peers", "transport=\"" + lane + "\"") != 1) {
    pd::test::skipTest("the " + lane + " lane did not come up here");
  }
  INFO("decode KV blocks: " << workerMetric(*c, "decode-0", "pdserve_kv_cache_num_blocks"));

  Completion a, b;
  std::thread first([&] { a = complete(*c, promptA, 4); });
  std::this_thread::sleep_for(std::chrono::milliseconds(stopAfterMs));  // A's prefill is computing and pushing layers
  REQUIRE(c->processes().signal("prefill-0", SIGSTOP).isOk());
  std::this_thread::sleep_for(2000ms);  // past the decode's 1.5 s deadline: A failed
  const double quarantined = workerMetric(*c, "decode-0", "pdserve_kv_blocks_quarantined");
  std::thread second([&] { b = complete(*c, promptB, 100); });
  std::this_thread::sleep_for(1200ms);  // B's prompt is in its blocks and it decodes
  REQUIRE(c->processes().signal("prefill-0", SIGCONT).isOk());
  const auto resumed = std::chrono::steady_clock::now();
  // Quarantined blocks come back once the prefill worker acknowledged the cancel.
  double releaseMs = -1;
  for (int i = 0; i < 400; ++i) {
    if (workerMetric(*c, "decode-0", "pdserve_kv_blocks_quarantined") == 0) {
      releaseMs = double(
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - resumed).count());
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  first.join();
  second.join();
  INFO("lane " << lane << ": " << quarantined << " blocks quarantined while the prefill worker was stopped; released "
               << releaseMs << " ms after SIGCONT; writes rejected: "
               << workerMetricWith(*c, "decode-0", "pdserve_kv_writes_rejected_total", "reason="));
  std::printf("fencing e2e (%s): %.0f blocks quarantined during the stop, released %.0f ms after SIGCONT\n",
              lane.c_str(), quarantined, releaseMs);
  INFO("A (given up on by the decode worker): HTTP " << a.status);  // 503, or 200 where the router migrates it
  CHECK(b.status == 200);
  CHECK(b.ids == expectedB);
  CHECK(b.headers.find("x-pdserve-route: colocated") != std::string::npos);
  if (lane == "tcp") {
    CHECK(quarantined == 0);  // the receiver's check is the fence: A's blocks were free at once
    // ... and the stale writer did write: its writes under A's revoked grant were refused
    // (they land whenever the resumed writer gets to them: wait for the count, bounded).
    double rejected = -1;
    for (int i = 0; i < 100 && rejected < 1; ++i) {
      rejected = workerMetricWith(*c, "decode-0", "pdserve_kv_writes_rejected_total", "unknown_grant");
      if (rejected < 1) std::this_thread::sleep_for(50ms);
    }
    CHECK(rejected >= 1);
  } else {
    CHECK(quarantined > 0);  // one-sided writer: held until it acknowledged
  }
  CHECK(releaseMs >= 0);
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_peer_leases_expired_total", "plane=\"prefill_link\"") ==
        (leaseMs < 3200 ? 1 : -1));  // -1: never expired, the series does not exist
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_remote_prefill_total", "outcome=\"failed\"") >= 1);
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
  char measured[160];
  std::snprintf(measured, sizeof measured, "%.0f blocks quarantined during the stop, released %.0f ms after SIGCONT",
                quarantined, releaseMs);
  recordFault({"prefill worker stopped during its transfer, resumed after the decode gave up (" + lane +
                   (leaseMs < 3200 ? ", its lease ran out meanwhile" : "") + ")",
               "the next request that got those blocks keeps its greedy ids; stale writes refused (tcp) or landing "
               "in quarantined blocks only (cma); every block back",
               leaseMs < spec.timeoutMs ? "kv_transfer.lease_ms (" + std::to_string(leaseMs) + " ms here)"
                                        : "kv_transfer.timeout_ms (1.5 s here)",
               measured});
}

TEST_CASE("KV fencing over tcp: a prefill worker stopped mid-transfer cannot write into the next request's blocks") {
  checkSlowButAliveWriter("[tcp]", "tcp");
}

TEST_CASE("KV fencing over cma: a stopped prefill worker's blocks stay quarantined until it acknowledges") {
  checkSlowButAliveWriter("[cma, tcp]", "cma");
}

TEST_CASE(
    "KV fencing over cma, the lease ran out during the stop: the resumed writer is dialled again to acknowledge") {
  checkSlowButAliveWriter("[cma, tcp]", "cma", /*leaseMs=*/1000);
}

// Leases (docs/reliability.md): a prefill worker stopped (SIGSTOP: a hung host) in the middle of a remote
// prefill sends no heartbeat any more; the decode worker's lease on the connection runs out
// (kv_transfer.lease_ms, far below kv_transfer.timeout_ms here) and it recomputes the request
// itself, with the same greedy ids. Resumed, the prefill worker finds its connection gone and
// frees what it held.
TEST_CASE(
    "a prefill worker stopped mid-request: its lease runs out long before the KV timeout, the decode recomputes") {
  ClusterSpec spec;
  spec.timeoutMs = 30000;
  spec.extraKvTransfer = ", heartbeat_ms: 100, lease_ms: 800";
  spec.extraRouter = "  workers: {worker_report_timeout_ms: 20000}\n";  // the router keeps both in rotation
  auto c = startCluster("lease-prefill", spec);
  const auto p = randomPrompt(1200, 1301);
  const auto expected = generateCli(p, 4);
  REQUIRE(complete(*c, randomPrompt(300, 1302), 2).status == 200);  // the lane to the prefill worker is up
  Completion r;
  std::chrono::steady_clock::time_point stoppedAt;
  std::thread client([&] { r = complete(*c, p, 4); });
  std::this_thread::sleep_for(100ms);  // its prefill is computing on the prefill worker
  REQUIRE(c->processes().signal("prefill-0", SIGSTOP).isOk());
  stoppedAt = std::chrono::steady_clock::now();
  client.join();
  const auto detectedIn = std::chrono::steady_clock::now() - stoppedAt;
  REQUIRE(c->processes().signal("prefill-0", SIGCONT).isOk());
  INFO(r.body.dump());
  CHECK(r.status == 200);
  CHECK(r.ids == expected);
  CHECK(detectedIn < 8s);  // lease 0.8 s + the recompute here; the KV timeout is 30 s
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_peer_leases_expired_total", "plane=\"prefill_link\"") == 1);
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_remote_prefill_total", "outcome=\"recomputed\"") == 1);
  CHECK(allBlocksFree(*c, "decode-0"));
  CHECK(allBlocksFree(*c, "prefill-0"));
  CHECK(complete(*c, randomPrompt(300, 1303), 2).status == 200);  // and the prefill worker serves again
  recordFault({"prefill worker stopped (SIGSTOP) mid-request, not resumed in time",
               "the decode worker recomputes with the same greedy ids long before kv_transfer.timeout_ms; "
               "blocks free on both once resumed; the prefill worker serves again",
               "its heartbeats stop: kv_transfer.lease_ms (800 ms here, heartbeat 100 ms)",
               "answered " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(detectedIn).count()) +
                   " ms after the stop (lease + local recompute)"});
}

// Graceful drain (docs/reliability.md): SIGTERM on a decode worker stops new work at once (the router
// routes around it) while its stream finishes with every token and [DONE]; then the process
// exits 0.
TEST_CASE("a decode worker drains on SIGTERM: its stream finishes, new requests go elsewhere, it exits 0") {
  ClusterSpec spec{/*shortPromptTokens=*/100000};
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 2}}";
  auto c = startCluster("drain-decode", spec);
  json req{{"model", "small"},   {"prompt", randomPrompt(20, 11)},
           {"max_tokens", 200},  {"temperature", 0},
           {"ignore_eos", true}, {"stream", true}};
  std::string seen;
  int fd = openStream(*c, req, 3, &seen);
  const auto at = seen.find("x-pdserve-decode-worker: ");
  REQUIRE(at != std::string::npos);
  const std::string draining = seen.substr(at + 25, seen.find('\r', at) - at - 25);
  const std::string other = draining == "decode-0" ? "decode-1" : "decode-0";
  REQUIRE(c->processes().signal(draining, SIGTERM).isOk());

  // The router stops routing to it within a few load reports.
  bool routedAround = false;
  for (int i = 0; i < 50 && !routedAround; ++i) {
    auto m = httpGet(c->httpPort(), "/metrics", 5s);
    routedAround = m.ok() && m->body.find("pdserve_worker_healthy{pool=\"decode\",worker=\"" + draining + "\"} 0") !=
                                 std::string::npos;
    if (!routedAround) std::this_thread::sleep_for(50ms);
  }
  CHECK(routedAround);
  for (int i = 0; i < 3; ++i) {
    auto r = complete(*c, randomPrompt(12, 100 + i), 4);
    CHECK(r.status == 200);
    CHECK(r.headers.find("x-pdserve-decode-worker: " + other) != std::string::npos);
  }
  // The stream it was serving finishes whole.
  char buf[4096];
  while (seen.find("[DONE]") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    seen.append(buf, size_t(n));
  }
  ::close(fd);
  CHECK(seen.find("[DONE]") != std::string::npos);
  CHECK(seen.find("\"error\"") == std::string::npos);
  CHECK(seen.find("\"finish_reason\":\"length\"") != std::string::npos);
  auto exit = c->processes().waitAny(15s);
  REQUIRE(exit.has_value());
  CHECK(exit->name == draining);
  CHECK(exit->description == "exited with status 0");
  recordFault({"SIGTERM under load (graceful drain)",
               "the stream finishes whole; new requests go to the other worker; exit 0",
               "SIGTERM: at once; the router stops routing to it within a few load reports",
               routedAround ? "routed around, stream whole, exit 0" : "not routed around"});
}

// A router stopped with SIGTERM ends every open stream with an error event and
// [DONE] (after router.requests.drain_timeout_ms), never by just dropping the connection; it exits 0.
TEST_CASE("a router stopped under traffic ends its streams with an error event and [DONE]") {
  ClusterSpec spec{/*shortPromptTokens=*/100000};
  spec.extraRequests = ", drain_timeout_ms: 300";
  auto c = startCluster("drain-router", spec);
  json req{{"model", "small"},   {"prompt", randomPrompt(20, 21)},
           {"max_tokens", 1500}, {"temperature", 0},
           {"ignore_eos", true}, {"stream", true}};
  std::string seen;
  int fd = openStream(*c, req, 3, &seen);
  REQUIRE(c->processes().signal("router", SIGTERM).isOk());
  char buf[4096];
  while (true) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    seen.append(buf, size_t(n));
  }
  ::close(fd);
  CHECK(seen.find("\"error\"") != std::string::npos);
  CHECK(seen.find("shutting down") != std::string::npos);
  CHECK(seen.find("data: [DONE]") != std::string::npos);
  auto exit = c->processes().waitAny(15s);
  REQUIRE(exit.has_value());
  CHECK(exit->name == "router");
  CHECK(exit->description == "exited with status 0");
  recordFault({"router stopped (SIGTERM) under traffic",
               "every open stream ends with an error event and [DONE]; exit 0",
               "SIGTERM: at once; streams get router.requests.drain_timeout_ms (300 ms here)",
               "stream ended with the error event"});
}

// The router's HTTP plane, against the real router: hostile bodies get 400s that
// name the field (and the router keeps serving), keys configured as hashes work, /metrics has
// its own credential, and an HTTP/1.0 client gets a close-delimited stream.
TEST_CASE("the router's HTTP plane: hostile bodies get 400s, hashed keys, /metrics auth, HTTP/1.0 streams") {
  std::filesystem::create_directories(kWork);
  const std::string tokenFile = kWork + "/metrics-token";
  std::ofstream(tokenFile) << "metrics-secret\n";
  ClusterSpec spec;
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 1}}";
  // sk-hashed is given as its hash: printf %s sk-hashed | sha256sum
  spec.extraRouter =
      "  http:\n"
      "    api_keys:\n"
      "    - 'sha256:c291001835042e213221b2f9fca79c9c91d08813d599b717bc695a268edb2ea6'\n"
      "    - sk-plain\n"
      "    metrics_auth: bearer_file\n    metrics_bearer_file: " +
      tokenFile + "\n";
  auto c = startCluster("http-plane", spec);
  const std::vector<std::string> key{"Authorization: Bearer sk-hashed"};
  auto post = [&](const std::string& path, const std::string& body) {
    auto r = httpRequest(c->httpPort(), "POST", path, body, 10s, key);
    REQUIRE(r.ok());  // answered, within 10 s
    return std::make_pair(r->status, json::parse(r->body, nullptr, false));
  };

  // 1. 70k nested arrays (140 KB): a 400 with a short message, not a crashed router.
  auto [sDeep, bDeep] = post("/detokenize", "{\"tokens\":" + std::string(70000, '[') + std::string(70000, ']') + "}");
  CHECK(sDeep == 400);
  CHECK(bDeep["error"]["message"].get<std::string>().find("deeper than 64 levels") != std::string::npos);
  CHECK(bDeep["error"]["message"].get<std::string>().size() < 200);
  // A huge non-id element is named by position, not echoed.
  auto [sBig, bBig] = post("/detokenize", "{\"tokens\":[1,\"" + std::string(100000, 'x') + "\"]}");
  CHECK(sBig == 400);
  CHECK(bBig["error"]["message"].get<std::string>().rfind("tokens[1]: ", 0) == 0);
  CHECK(bBig["error"]["message"].get<std::string>().size() < 200);
  // 2. Wrong-typed fields and unknown content parts: answered, naming the field.
  auto [sYes, bYes] = post("/tokenize", R"({"prompt":"hi","add_special_tokens":"yes"})");
  CHECK(sYes == 400);
  CHECK(bYes["error"]["param"] == "add_special_tokens");
  auto [sPart, bPart] = post("/tokenize", R"({"messages":[{"role":"user","content":[{"type":5}]}]})");
  CHECK(sPart == 400);
  CHECK(bPart["error"]["param"] == "messages[0].content[0].type");
  auto [sChat, bChat] =
      post("/v1/chat/completions", R"({"model":"small","messages":[{"role":"user","content":[{"type":5}]}]})");
  CHECK(sChat == 400);
  CHECK(bChat["error"]["param"] == "messages[0].content[0].type");

  // 3. Keys: the hashed one and the plain one work, anything else is a 401.
  CHECK(post("/v1/completions", R"({"model":"small","prompt":"hello","max_tokens":2})").first == 200);
  CHECK(httpRequest(c->httpPort(), "GET", "/v1/models", "", 5s, {"Authorization: Bearer sk-plain"})->status == 200);
  CHECK(httpRequest(c->httpPort(), "GET", "/v1/models", "", 5s, {"Authorization: Bearer sk-other"})->status == 401);
  CHECK(httpRequest(c->httpPort(), "GET", "/v1/models", "", 5s,
                    {"Authorization: Bearer c291001835042e213221b2f9fca79c9c91d08813d599b717bc695a268edb2ea6"})
            ->status == 401);  // the hash is not the key
  // 4. /metrics wants its own token, not an API key.
  CHECK(httpGet(c->httpPort(), "/metrics", 5s)->status == 401);
  CHECK(httpRequest(c->httpPort(), "GET", "/metrics", "", 5s, key)->status == 401);
  auto m = httpRequest(c->httpPort(), "GET", "/metrics", "", 5s, {"Authorization: Bearer metrics-secret"});
  REQUIRE(m.ok());
  CHECK(m->status == 200);
  CHECK(m->body.find("pdserve_router_http_connections ") != std::string::npos);

  // 5. HTTP/1.0: a close-delimited SSE stream, no chunked encoding.
  {
    int fd = pd::test::connectLoopback(c->httpPort(), 30);
    std::string body = R"({"model":"small","prompt":"hello","max_tokens":4,"stream":true})";
    std::string http = "POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer sk-plain\r\nContent-Length: " +
                       std::to_string(body.size()) + "\r\n\r\n" + body;
    REQUIRE(::send(fd, http.data(), http.size(), 0) == ssize_t(http.size()));
    std::string seen;
    char buf[4096];
    ssize_t n = 0;
    while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) seen.append(buf, size_t(n));
    ::close(fd);
    CHECK(n == 0);  // the router closed the connection: that ends the body
    CHECK(seen.rfind("HTTP/1.0 200", 0) == 0);
    CHECK(seen.find("Transfer-Encoding") == std::string::npos);
    CHECK(seen.size() > 14);
    CHECK(seen.substr(seen.size() - 14) == "data: [DONE]\n\n");
  }
  // The router served on through all of that.
  CHECK(post("/v1/completions", R"({"model":"small","prompt":"hello again","max_tokens":2})").first == 200);
  CHECK(httpGet(c->httpPort(), "/health", 5s)->status == 200);
}

// Per-key token buckets on the real router. 8 requests at once against a burst of 3:
// exactly 3 are served, 5 get a 429 with Retry-After; another key is not affected; after
// Retry-After the key passes again.
TEST_CASE("per-key rate limits: a burst of M out of N at once, the rest 429 with Retry-After, then they pass") {
  ClusterSpec spec;
  spec.pools = "{prefill: {replicas: 0}, decode: {replicas: 1}}";
  spec.extraRouter =
      "  http: {api_keys: [sk-a, sk-b]}\n"
      "  admission: {rate_limits: {requests_per_s: 0.5, request_burst: 3}}\n";
  auto c = startCluster("rate-limits", spec);
  const std::string body = R"({"model":"small","prompt":"hello","max_tokens":1})";
  std::vector<std::thread> threads;
  std::vector<Result<HttpReply>> replies(8, Result<HttpReply>(unavailable("not sent")));
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      replies[i] = httpRequest(c->httpPort(), "POST", "/v1/completions", body, 60s, {"Authorization: Bearer sk-a"});
    });
  }
  for (auto& t : threads) t.join();
  int served = 0, limited = 0, retryAfter = 0;
  for (auto& r : replies) {
    REQUIRE(r.ok());
    if (r->status == 200) ++served;
    if (r->status != 429) continue;
    ++limited;
    auto j = json::parse(r->body, nullptr, false);
    CHECK(j["error"]["type"] == "rate_limit_exceeded");
    CHECK(j["error"]["code"] == "rate_limit_exceeded");
    CHECK(j["error"]["param"] == "requests_per_s");
    auto at = r->headers.find("retry-after: ");
    REQUIRE(at != std::string::npos);
    retryAfter = std::max(retryAfter, std::atoi(r->headers.c_str() + at + 13));
  }
  CHECK(served == 3);
  CHECK(limited == 5);
  CHECK((retryAfter >= 1 && retryAfter <= 2));  // one request at 0.5/s
  // Another key has its own bucket.
  CHECK(httpRequest(c->httpPort(), "POST", "/v1/completions", body, 60s, {"Authorization: Bearer sk-b"})->status ==
        200);
  std::this_thread::sleep_for(std::chrono::seconds(retryAfter));
  CHECK(httpRequest(c->httpPort(), "POST", "/v1/completions", body, 60s, {"Authorization: Bearer sk-a"})->status ==
        200);
  auto m = httpGet(c->httpPort(), "/metrics", 5s);
  REQUIRE(m.ok());
  const std::string series = "pdserve_router_rate_limited_total{limit=\"requests_per_s\"} ";
  auto at = m->body.find(series);
  REQUIRE(at != std::string::npos);
  CHECK(std::atof(m->body.c_str() + at + series.size()) == 5);
}

// Router.http.tls on the real router binary. Certificates are made here with the openssl
// CLI (never committed); curl is the client: verified against the right CA it is answered, a
// plain-HTTP client and a client trusting another CA fail, and so does TLS 1.1.
TEST_CASE("router.tls: the real router answers HTTPS, refuses plain HTTP, a wrong CA and TLS 1.1") {
  if (std::system("command -v openssl >/dev/null 2>&1 && command -v curl >/dev/null 2>&1") != 0) {
    pd::test::skipTest("needs the openssl and curl CLIs (scripts/setup installs both)");
  }
  const std::string dir = kWork + "/tls." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  auto sh = [&](const std::string& cmd) { return std::system(("cd " + dir + " && " + cmd).c_str()); };
  const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1";
  REQUIRE(sh("openssl req -x509" + ec + " -keyout ca.key -out ca.pem -subj /CN=ca >/dev/null 2>&1") == 0);
  REQUIRE(sh("openssl req" + ec + " -keyout s.key -out s.csr -subj /CN=localhost >/dev/null 2>&1") == 0);
  REQUIRE(sh("printf 'subjectAltName=IP:127.0.0.1\\n' > ext && openssl x509 -req -in s.csr -CA ca.pem -CAkey ca.key "
             "-CAcreateserial -out s.pem -days 1 -extfile ext >/dev/null 2>&1") == 0);
  REQUIRE(sh("openssl req -x509" + ec + " -keyout other.key -out other.pem -subj /CN=other >/dev/null 2>&1") == 0);
  std::ofstream(dir + "/cluster.yaml") << "model: {path: " << pd::test::e2eModelDir() << ", name: small}\n"
                                       << "router: {http: {tls: {cert_file: " << dir << "/s.pem, key_file: " << dir
                                       << "/s.key}}}\nlogging: {level: warn}\n";
  ProcessGroup group;
  REQUIRE(group
              .spawn("router", {std::string(PD_BINARY_DIR) + "/bin/pdserve-router", "--config", dir + "/cluster.yaml",
                                "--port", "0", "--control-port", "0", "--ports-file", dir + "/router.ports"})
              .ok());
  const int port = pd::test::waitForPort(dir + "/router.ports", "http", 30s);
  REQUIRE(port != 0);
  const std::string url = " https://127.0.0.1:" + std::to_string(port) + "/v1/models";
  // curl's exit status and the HTTP status it saw ("000" when there was no HTTP answer).
  auto curl = [&](const std::string& flags, std::string* code) {
    std::string cmd = "curl -s -m 5 -o /dev/null -w '%{http_code}' " + flags + url + " 2>/dev/null";
    FILE* f = ::popen(cmd.c_str(), "r");
    char buf[16] = {0};
    size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    *code = std::string(buf, n);
    int st = ::pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  std::string code;
  for (int i = 0; i < 100 && curl("--cacert " + dir + "/ca.pem", &code) != 0; ++i) std::this_thread::sleep_for(100ms);
  CHECK(code == "200");
  CHECK(curl("--cacert " + dir + "/other.pem", &code) == 60);  // peer certificate cannot be verified
  CHECK(curl("--cacert " + dir + "/ca.pem --tlsv1.1 --tls-max 1.1", &code) != 0);
  CHECK(code == "000");
  // Plain HTTP to the TLS port: no HTTP answer (curl 52: empty reply), not a hang.
  std::string plain = "curl -s -m 5 -o /dev/null http://127.0.0.1:" + std::to_string(port) + "/v1/models";
  int st = std::system(plain.c_str());
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 52));
  CHECK(curl("--cacert " + dir + "/ca.pem", &code) == 0);  // still serving
  CHECK(code == "200");
  group.stopAll();
  std::filesystem::remove_all(dir);
}

// ---- the TTFT split, the dashboard's queries, vLLM's names (docs/metrics.md) -------------------------

namespace {

// The metric names a PromQL expression reads: identifiers that are not functions, keywords,
// grouping labels, label matchers, strings, ranges or Grafana variables.
std::set<std::string> promqlMetricNames(std::string expr) {
  static const std::regex kDrop(
      R"re("[^"]*"|\{[^}]*\}|\[[^\]]*\]|\$\w+|\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\))re");
  expr = std::regex_replace(expr, kDrop, " ");
  static const std::set<std::string> kKeywords{"and", "or", "unless", "bool", "offset", "by", "without"};
  static const std::regex kIdent(R"([A-Za-z_:][A-Za-z0-9_:]*)");
  std::set<std::string> names;
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), kIdent); it != std::sregex_iterator(); ++it) {
    const size_t end = size_t(it->position() + it->length());
    size_t next = expr.find_first_not_of(' ', end);
    const bool call = next != std::string::npos && expr[next] == '(';
    const bool number = it->position() > 0 &&
                        (std::isdigit(expr[size_t(it->position()) - 1]) || expr[size_t(it->position()) - 1] == '.');
    if (!call && !number && !kKeywords.count(it->str())) names.insert(it->str());
  }
  return names;
}

bool hasSeries(const std::string& body, const std::string& name) {
  std::istringstream in(body);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name, 0) == 0 && line.size() > name.size() && (line[name.size()] == '{' || line[name.size()] == ' '))
      return true;
  return false;
}

// Every "<phase>_ms" of a pdserve_timing object: non-negative, and their sum within ttft_ms.
double checkSplit(const json& t, const std::string& route) {
  INFO(t.dump());
  REQUIRE(t.is_object());
  CHECK(t["route"] == route);
  const double ttft = t["ttft_ms"].get<double>();
  CHECK(ttft > 0);
  double sum = 0;
  for (const auto& [k, v] : t.items()) {
    if (k == "route" || k == "ttft_ms") continue;
    CHECK(v.get<double>() >= 0);
    sum += v.get<double>();
  }
  CHECK(sum <= ttft + 0.01);  // each figure is rounded to a microsecond
  return ttft;
}

}  // namespace

TEST_CASE("TTFT split: colocated and disaggregated requests report non-negative phases within their TTFT") {
  ClusterSpec spec{/*shortPromptTokens=*/64};
  spec.extraTop = "metrics: {vllm_compatible_names: true}\n";
  auto c = startCluster("ttft-split", spec);

  // Colocated, not streamed: usage.pdserve_timing and a Server-Timing header.
  const auto t0 = std::chrono::steady_clock::now();
  auto r = complete(*c, randomPrompt(20, 5), 4);
  const double wallMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(r.status == 200);
  CHECK(r.headers.find("x-pdserve-route: colocated") != std::string::npos);
  const json& colo = r.body["usage"]["pdserve_timing"];
  CHECK(checkSplit(colo, "colocated") <= wallMs);  // the router's TTFT is inside what the client measured
  CHECK(colo.contains("prefill_compute_ms"));
  CHECK_FALSE(colo.contains("kv_transfer_ms"));
  CHECK(colo["prefill_compute_ms"].get<double>() > 0);
  const std::string st = headerValue(r.headers, "server-timing");
  CHECK(st.find("decode_admission;dur=") != std::string::npos);
  CHECK(st.find("ttft;dur=") != std::string::npos);

  // Disaggregated, streamed with include_usage: the split is in the usage chunk.
  json req{{"model", "small"},
           {"prompt", randomPrompt(300, 6)},
           {"max_tokens", 4},
           {"temperature", 0},
           {"ignore_eos", true},
           {"stream", true},
           {"stream_options", {{"include_usage", true}}}};
  const auto t1 = std::chrono::steady_clock::now();
  auto s = httpRequest(c->httpPort(), "POST", "/v1/completions", req.dump(), 120s);
  const double streamWallMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  REQUIRE(s.ok());
  REQUIRE(s->status == 200);
  CHECK(s->headers.find("x-pdserve-route: disaggregated") != std::string::npos);
  json disagg;
  std::istringstream in(s->body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    json ev = json::parse(line.substr(6), nullptr, false);
    if (!ev.is_discarded() && ev.contains("usage") && ev["usage"].is_object()) disagg = ev["usage"]["pdserve_timing"];
  }
  CHECK(checkSplit(disagg, "disaggregated") <= streamWallMs);
  for (const char* phase : {"router_queue_ms", "decode_admission_ms", "kv_connect_ms", "prefill_queue_ms",
                            "prefill_compute_ms", "kv_transfer_ms", "decode_first_token_ms", "other_ms"})
    CHECK(disagg.contains(phase));
  CHECK(disagg["prefill_compute_ms"].get<double>() > 0);
  CHECK(disagg["kv_transfer_ms"].get<double>() > 0);

  // The histograms: one observation per phase per request.
  CHECK(routerMetric(*c, R"(pdserve_request_ttft_phase_seconds_count{phase="kv_transfer",route="disaggregated"})") ==
        1);
  CHECK(routerMetric(*c, R"(pdserve_request_ttft_phase_seconds_count{phase="prefill_compute",route="colocated"})") ==
        1);
  CHECK(routerMetric(*c, R"(pdserve_request_ttft_phase_seconds_count{phase="kv_transfer",route="colocated"})") == -1);

  // vLLM's names, switched on: the same values as pdserve's, with model_name.
  const std::string router = httpGet(c->httpPort(), "/metrics", 5s).value().body;
  const std::string decode = httpGet(c->metricsPort("decode-0"), "/metrics", 5s).value().body;
  using pd::test::metricValue;
  for (const char* route : {"colocated", "disaggregated"}) {
    const std::string l = std::string("{route=\"") + route + "\"";
    CHECK(metricValue(router, "vllm:time_to_first_token_seconds_count" + l + ",model_name=\"small\"}") ==
          metricValue(router, "pdserve_time_to_first_token_seconds_count" + l + "}"));
    CHECK(metricValue(router, "vllm:inter_token_latency_seconds_count" + l + ",model_name=\"small\"}") ==
          metricValue(router, "pdserve_inter_token_latency_seconds_count" + l + "}"));
    CHECK(metricValue(router, "vllm:time_per_output_token_seconds_sum" + l + ",model_name=\"small\"}") ==
          metricValue(router, "pdserve_inter_token_latency_seconds_sum" + l + "}"));
    CHECK(metricValue(router, "vllm:e2e_request_latency_seconds_sum" + l + ",model_name=\"small\"}") ==
          metricValue(router, "pdserve_e2e_request_latency_seconds_sum" + l + "}"));
  }
  CHECK(metricValue(router, R"(vllm:time_to_first_token_seconds_count{route="disaggregated",model_name="small"})") ==
        1);
  CHECK(metricValue(router, R"(vllm:request_success_total{finished_reason="length",model_name="small"})") == 2);
  CHECK(metricValue(router, R"(pdserve_requests_finished_total{finished_reason="length"})") == 2);
  for (const char* name :
       {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
        "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"}) {
    INFO(name);
    const double ours = metricValue(decode, std::string("pdserve_") + name);
    CHECK(ours >= 0);
    CHECK(metricValue(decode, std::string("vllm:") + name +
                                  "{role=\"decode\",worker=\"decode-0\",model_name=\"small\"}") == ours);
  }
  CHECK(metricValue(decode, "vllm:prompt_tokens_total") == 320);  // both prompts were submitted here
  CHECK(metricValue(decode, "vllm:generation_tokens_total") == 8);

  // The Grafana dashboard (deploy/grafana/pdserve.json): every metric a panel queries is in the
  // live /metrics of the router or a worker, once traffic of both routes and an error ran.
  REQUIRE(complete(*c, randomPrompt(8, 7), 2, {{"model", "no-such-model"}}).status == 404);
  std::ifstream file(std::string(PD_SOURCE_DIR) + "/deploy/grafana/pdserve.json");
  REQUIRE(file);
  const json dash = json::parse(file);
  const std::vector<std::string> bodies{httpGet(c->httpPort(), "/metrics", 5s).value().body,
                                        httpGet(c->metricsPort("decode-0"), "/metrics", 5s).value().body,
                                        httpGet(c->metricsPort("prefill-0"), "/metrics", 5s).value().body};
  int queried = 0;
  // The dashboard's "Metric names" variable reads pdserve's names or vLLM's (both on here).
  for (const std::string prefix : {"pdserve_", "vllm:"}) {
    for (const auto& panel : dash["panels"]) {
      for (const auto& target : panel["targets"]) {
        std::string expr = target["expr"].get<std::string>();
        for (size_t at; (at = expr.find("${metric_prefix}")) != std::string::npos;)
          expr.replace(at, std::string("${metric_prefix}").size(), prefix);
        const auto names = promqlMetricNames(expr);
        INFO(panel["title"].get<std::string>() << ": " << expr);
        CHECK_FALSE(names.empty());
        for (const auto& name : names) {
          INFO(name);
          ++queried;
          bool found = false;
          for (const auto& b : bodies) found = found || hasSeries(b, name);
          CHECK(found);
        }
      }
    }
  }
  CHECK(queried >= 60);
  // The extraction itself: a made-up name is found, functions and labels are not names.
  CHECK(
      promqlMetricNames(
          R"(histogram_quantile(0.9, sum by (le, route) (rate(pdserve_x_bucket{a="b"}[$__rate_interval]))) / on (pool) pdserve_y)") ==
      std::set<std::string>{"pdserve_x_bucket", "pdserve_y"});
  CHECK_FALSE(hasSeries(bodies[0], "pdserve_no_such_metric"));
}

TEST_CASE("vLLM metric names are off by default") {
  auto c = startCluster("vllm-names-off", ClusterSpec{64});
  REQUIRE(complete(*c, randomPrompt(20, 8), 2).status == 200);
  const std::string router = httpGet(c->httpPort(), "/metrics", 5s).value().body;
  CHECK(router.find("pdserve_time_to_first_token_seconds_count") != std::string::npos);
  CHECK(router.find("vllm:") == std::string::npos);
  CHECK(httpGet(c->metricsPort("decode-0"), "/metrics", 5s).value().body.find("vllm:") == std::string::npos);
}

TEST_CASE("a recomputed remote prefill says so: x-pdserve-route: disaggregated-recomputed, and its metrics' route") {
  ClusterSpec spec;
  spec.timeoutMs = 2500;  // the stopped prefill worker's request fails after this (or its 3 s lease)
  spec.extraRouter = "  workers: {worker_report_timeout_ms: 30000}\n";  // still routed to while stopped
  auto c = startCluster("recomputed-route", spec);
  // The KV connection in place first: the stop then lands on the prefill itself.
  auto warm = complete(*c, randomPrompt(400, 78), 1);
  REQUIRE(warm.status == 200);
  CHECK(warm.headers.find("x-pdserve-route: disaggregated\r\n") != std::string::npos);
  const auto prompt = randomPrompt(300, 79);
  const auto expected = generateCli(prompt, 4);
  REQUIRE(c->processes().signal("prefill-0", SIGSTOP).isOk());
  struct Resume {
    LocalCluster& c;
    ~Resume() { (void)c.processes().signal("prefill-0", SIGCONT); }
  } resume{*c};
  auto r = complete(*c, prompt, 4);
  INFO(r.headers);
  REQUIRE(r.status == 200);
  CHECK(r.ids == expected);
  CHECK(r.headers.find("x-pdserve-route: disaggregated-recomputed") != std::string::npos);
  CHECK(workerMetricWith(*c, "decode-0", "pdserve_remote_prefill_total", "outcome=\"recomputed\"") == 1);
  CHECK(routerMetric(*c, R"(pdserve_time_to_first_token_seconds_count{route="disaggregated-recomputed"})") == 1);
  CHECK(routerMetric(*c, R"(pdserve_time_to_first_token_seconds_count{route="disaggregated"})") == 1);  // the warm-up
}
