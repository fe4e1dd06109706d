#include "common/config/cluster_config.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include <catch2/catch.hpp>

#include "tests/scratch_dir.h"
#include "tests/test_skip.h"

using namespace pd;
using namespace pd::config;

namespace {

// The message of a config that must fail to load.
std::string errorOf(const std::string& yaml) {
  auto r = parseClusterConfig(yaml, "test.yaml");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  return r.status().message();
}

ClusterConfig parseOk(const std::string& yaml) {
  auto r = parseClusterConfig(yaml, "test.yaml");
  INFO(r.status().message());
  REQUIRE(r.ok());
  return std::move(r).value();
}

}  // namespace

TEST_CASE("every example in deploy/configs loads") {
  // Tests run from the source root (pd_add_test sets WORKING_DIRECTORY), so the directory is
  // listed at test time: a new example is covered without touching this file.
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("deploy/configs")) {
    if (entry.path().extension() != ".yaml" && entry.path().extension() != ".yml") continue;
    names.insert(entry.path().filename().string());
    auto r = loadClusterConfig(entry.path().string());
    INFO(entry.path().string() << ": " << r.status().message());
    REQUIRE(r.ok());
    // Shipped examples use the current key paths: no deprecation warning.
    CHECK(r->warnings == std::vector<std::string>{});
    // ... and say how their internal planes get a secret (docs/security.md, "Without a secret").
    std::ifstream in(entry.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text.find("secret_file") != std::string::npos);
  }
  CHECK(names.count("local.yaml") == 1);
  CHECK(names.count("disaggregated-gpu.yaml") == 1);
  CHECK(names.count("colocated.yaml") == 1);
}

TEST_CASE("the example configs hold what they say") {
  auto local = loadClusterConfig("deploy/configs/local.yaml");
  REQUIRE(local.ok());
  CHECK(local->sourceName == "deploy/configs/local.yaml");
  CHECK(local->engine.backend == Backend::kCpu);
  CHECK(local->pools.prefill.replicas == 1);
  CHECK(local->pools.decode.replicas == 1);
  CHECK(local->router.host == "127.0.0.1");
  CHECK(local->kvTransfer.transports == std::vector<TransportKind>{TransportKind::kTcp});
  CHECK(local->model.name == "small");
  CHECK(local->engine.kvTiers.hostBytes == int64_t{512} << 20);  // docs/kv_cache.md, "Sizes"
  CHECK(local->engine.kvTiers.diskBytes == int64_t{2} << 30);
  CHECK(local->engine.kvTiers.diskPath == "kv-cache");

  auto gpu = loadClusterConfig("deploy/configs/disaggregated-gpu.yaml");
  REQUIRE(gpu.ok());
  CHECK(gpu->engine.backend == Backend::kCuda);
  CHECK(gpu->kvTransfer.transports.front() == TransportKind::kUcx);
  CHECK(gpu->pools.prefill.replicas == 2);
  CHECK(gpu->pools.decode.replicas == 4);
  CHECK(gpu->pools.decode.maxReplicas == 16);
  CHECK(gpu->model.dtype == DType::kBF16);
  CHECK(gpu->router.apiKeys.size() == 2);

  auto colo = loadClusterConfig("deploy/configs/colocated.yaml");
  REQUIRE(colo.ok());
  CHECK(colo->pools.prefill.replicas == 0);
  CHECK(colo->engine.numBlocks == 4096);
  CHECK(colo->engine.kvCacheBytes == 0);
  CHECK(colo->engine.kvTiers.on());
}

TEST_CASE("an empty file is a valid cluster with the documented defaults") {
  ClusterConfig c = parseOk("");
  CHECK(c.model.path == "models/small");
  CHECK(c.model.name == "small");
  CHECK(c.model.preset == ModelPreset::kSmall);
  CHECK(c.model.dtype == DType::kAuto);
  CHECK(c.router.port == 8000);
  CHECK(c.router.controlPort == 9000);
  CHECK(c.router.shortPromptTokens == 256);
  CHECK(c.router.prefixAwareRouting);
  CHECK_FALSE(c.router.adaptiveThreshold);
  CHECK(c.router.workerReportTimeoutMs == 1000);
  CHECK(c.router.apiKeys.empty());
  CHECK(c.pools.prefill.replicas == 1);
  CHECK(c.pools.prefill.minReplicas == 1);
  CHECK(c.pools.prefill.maxReplicas == 1);
  CHECK(c.pools.prefill.slo.ttftMs == 1000);
  CHECK(c.pools.decode.slo.itlMs == 50);
  CHECK(c.pools.decode.slo.percentile == 99);
  CHECK(c.engine.blockSize == 16);
  CHECK(c.engine.tensorParallelSize == 1);
  CHECK(c.kvTransfer.transports == std::vector<TransportKind>{TransportKind::kCma, TransportKind::kUcx,
                                                              TransportKind::kVerbs, TransportKind::kTcp});
  CHECK(c.kvTransfer.onRemotePrefillFailure == RemotePrefillFailure::kRecompute);
  CHECK(c.logging.level == LogLevel::kInfo);
  // The SLO targets (1 s, 50 ms) are already bucket bounds of the defaults.
  CHECK(c.router.ttftBucketsS == defaultTtftBucketsS());
  CHECK(c.router.itlBucketsS == defaultItlBucketsS());
  CHECK(c.router.e2eBucketsS == defaultE2eBucketsS());
}

TEST_CASE("the SLO target becomes a histogram bound") {
  ClusterConfig c = parseOk(
      "router:\n  metrics:\n    ttft_buckets_s: [0.1, 1, 10]\n    itl_buckets_s: [0.01, 0.1]\n"
      "pools:\n  prefill: {slo: {ttft_ms: 350}}\n  decode: {slo: {itl_ms: 100}}\n");
  CHECK(c.router.ttftBucketsS == std::vector<double>{0.1, 0.35, 1, 10});
  CHECK(c.router.itlBucketsS == std::vector<double>{0.01, 0.1});
}

TEST_CASE("the model name defaults to the directory's name") {
  CHECK(parseOk("model: {path: /models/Llama-3-8B/}").model.name == "Llama-3-8B");
  CHECK(parseOk("model: {path: tiny}").model.name == "tiny");
  CHECK(parseOk("model: {path: /m/x, name: served}").model.name == "served");
}

TEST_CASE("replica bounds default to replicas and are checked") {
  ClusterConfig c = parseOk("pools: {decode: {replicas: 3, max_replicas: 6}}");
  CHECK(c.pools.decode.minReplicas == 3);
  CHECK(c.pools.decode.maxReplicas == 6);
  CHECK(errorOf("pools:\n  decode:\n    replicas: 9\n    min_replicas: 1\n    max_replicas: 4\n") ==
        "test.yaml: pools.decode.replicas: 9 is outside [min_replicas, max_replicas] = [1, 4]");
  CHECK(errorOf("pools: {prefill: {replicas: 2, min_replicas: 3, max_replicas: 2}}") ==
        "test.yaml: pools.prefill.min_replicas: 3 is greater than max_replicas (2)");
  CHECK(errorOf("pools: {decode: {replicas: 0}}") == "test.yaml: pools.decode.replicas: 0 is out of range [1, 1024]");
  CHECK(parseOk("pools: {prefill: {replicas: 0}}").pools.prefill.replicas == 0);
}

TEST_CASE("unknown keys name the full path and a suggestion") {
  CHECK(errorOf("router:\n  http:\n    prot: 8000\n") ==
        "test.yaml: router.http.prot: unknown key (did you mean port?)");
  // A typo of a key that moved into a group is pointed at its group.
  CHECK(errorOf("router:\n  prot: 8000\n") == "test.yaml: router.prot: unknown key (did you mean http.port?)");
  CHECK(errorOf("router: {htpp: {port: 1}}") == "test.yaml: router.htpp: unknown key (did you mean http?)");
  CHECK(errorOf("engine: {blocksize: 16}") == "test.yaml: engine.blocksize: unknown key (did you mean block_size?)");
  CHECK(errorOf("pools: {decode: {slo: {ttft_ms: 5}}}") ==
        "test.yaml: pools.decode.slo.ttft_ms: unknown key (allowed: itl_ms, percentile)");
  CHECK(errorOf("logging: {level: info, colour: true}") ==
        "test.yaml: logging.colour: unknown key (allowed: level, step_trace_dir)");
  CHECK(errorOf("modle: {path: x}") == "test.yaml: modle: unknown key (did you mean model?)");
  CHECK(errorOf("router: {http: {port: 1, port: 2}}") == "test.yaml: router.http.port: duplicate key");
  CHECK(errorOf("router: {http: {}, http: {}}") == "test.yaml: router.http: duplicate key");
}

TEST_CASE("wrong types are named with what was expected") {
  CHECK(errorOf("router: {http: {port: http}}") == "test.yaml: router.http.port: expected an integer, got \"http\"");
  CHECK(errorOf("router: {http: {port: \"8000\"}}") ==
        "test.yaml: router.http.port: expected an integer, got \"8000\"");
  CHECK(errorOf("router: {http: {port: 80.5}}") == "test.yaml: router.http.port: expected an integer, got \"80.5\"");
  CHECK(errorOf("router: {http: {port: [1]}}") == "test.yaml: router.http.port: expected an integer, got a list");
  CHECK(errorOf("router: {http: {port: }}") == "test.yaml: router.http.port: expected an integer, got an empty value");
  CHECK(errorOf("router: 8000") == "test.yaml: router: expected a map of keys, got \"8000\"");
  CHECK(errorOf("- a\n- b\n") == "test.yaml: the document: expected a map of keys, got a list");
  CHECK(errorOf("router: {routing: {adaptive_threshold: true, short_prompt_tokens: 0}}") ==
        "test.yaml: router.routing.adaptive_threshold: true needs short_prompt_tokens >= 1 (0 "
        "sends every prompt to the prefill pool, on purpose)");
  CHECK(errorOf("router: {routing: {prefix_aware_routing: 1}}") ==
        "test.yaml: router.routing.prefix_aware_routing: expected true or false, got \"1\"");
  CHECK(errorOf("engine: {enable_prefix_caching: yes}") ==
        "test.yaml: engine.enable_prefix_caching: expected true or false, got \"yes\"");
  CHECK(errorOf("model: {path: {a: 1}}") == "test.yaml: model.path: expected a string, got a map");
  CHECK(errorOf("pools: {prefill: {slo: {ttft_ms: fast}}}") ==
        "test.yaml: pools.prefill.slo.ttft_ms: expected a number, got \"fast\"");
  CHECK(errorOf("router: {http: {api_keys: secret}}") ==
        "test.yaml: router.http.api_keys: expected a list of strings, got \"secret\"");
}

TEST_CASE("out-of-range and not-allowed values say what is allowed") {
  CHECK(errorOf("engine: {block_size: 17}") == "test.yaml: engine.block_size: 17 is not one of 8, 16, 32");
  CHECK(errorOf("router: {http: {port: 70000}}") == "test.yaml: router.http.port: 70000 is out of range [1, 65535]");
  CHECK(errorOf("engine: {backend: gpu}") == "test.yaml: engine.backend: gpu is not one of cpu, cuda");
  CHECK(errorOf("model: {dtype: fp8}") == "test.yaml: model.dtype: fp8 is not one of auto, f32, bf16, f16");
  CHECK(errorOf("model: {preset: huge}") == "test.yaml: model.preset: huge is not one of tiny, small");
  CHECK(errorOf("engine: {tensor_parallel_size: 3, backend: cuda}") ==
        "test.yaml: engine.tensor_parallel_size: 3 is not one of 1, 2, 4, 8");
  CHECK(errorOf("pools: {decode: {slo: {percentile: 0}}}") ==
        "test.yaml: pools.decode.slo.percentile: 0 is out of range (0, 100]");
  CHECK(errorOf("pools: {decode: {slo: {percentile: 100.5}}}") ==
        "test.yaml: pools.decode.slo.percentile: 100.5 is out of range (0, 100]");
  CHECK(errorOf("kv_transfer: {on_remote_prefill_failure: retry}") ==
        "test.yaml: kv_transfer.on_remote_prefill_failure: retry is not one of recompute, fail");
  CHECK(errorOf("logging: {level: verbose}") ==
        "test.yaml: logging.level: verbose is not one of debug, info, warn, error, off");
  CHECK(errorOf("model: {path: \"\"}") == "test.yaml: model.path: must not be empty");
  CHECK(errorOf("router: {requests: {tool_call_parser: pythonic}}") ==
        "test.yaml: router.requests.tool_call_parser: pythonic is not one of auto, hermes, llama3_json, mistral");
}

TEST_CASE("router.requests.tool_call_parser: auto by default, or a named syntax") {
  CHECK(parseOk("").router.toolCallParser == ToolCallParser::kAuto);
  CHECK(parseOk("router: {requests: {tool_call_parser: llama3_json}}").router.toolCallParser ==
        ToolCallParser::kLlama3Json);
  // A new key: it never sat under router: itself.
  CHECK(errorOf("router: {tool_call_parser: hermes}").find("router.tool_call_parser: unknown key") !=
        std::string::npos);
}

TEST_CASE("lists are validated element by element") {
  CHECK(errorOf("kv_transfer: {transports: [ucx, rdma]}") ==
        "test.yaml: kv_transfer.transports[1]: rdma is not one of cma, ucx, verbs, tcp");
  CHECK(errorOf("kv_transfer: {transports: [tcp, ucx, tcp]}") ==
        "test.yaml: kv_transfer.transports[2]: tcp is listed twice");
  CHECK(errorOf("kv_transfer: {transports: []}") ==
        "test.yaml: kv_transfer.transports: must list at least one of cma, ucx, verbs, tcp");
  CHECK(errorOf("kv_transfer: {transports: tcp}") ==
        "test.yaml: kv_transfer.transports: expected a list of cma, ucx, verbs, tcp, got \"tcp\"");
  CHECK(errorOf("router: {metrics: {ttft_buckets_s: [0.1, 0.5, 0.5]}}") ==
        "test.yaml: router.metrics.ttft_buckets_s[2]: 0.5 is not greater than the previous bound "
        "0.5 "
        "(bounds must be strictly increasing)");
  CHECK(errorOf("router: {metrics: {itl_buckets_s: [0, 0.1]}}") ==
        "test.yaml: router.metrics.itl_buckets_s[0]: 0 is not positive");
  CHECK(errorOf("router: {metrics: {e2e_buckets_s: [1, x]}}") ==
        "test.yaml: router.metrics.e2e_buckets_s[1]: expected a number, got \"x\"");
  CHECK(errorOf("router: {metrics: {e2e_buckets_s: []}}") ==
        "test.yaml: router.metrics.e2e_buckets_s: must list at least one bound");
  CHECK(errorOf("router: {http: {api_keys: [a, b, a]}}") ==
        "test.yaml: router.http.api_keys[2]: duplicate of an earlier entry");
  CHECK(parseOk("kv_transfer: {transports: [tcp, ucx]}").kvTransfer.transports ==
        std::vector<TransportKind>{TransportKind::kTcp, TransportKind::kUcx});
}

TEST_CASE("cross-field rules") {
  // The cpu backend computes in f32: a 16-bit dtype there would be silently ignored.
  CHECK(errorOf("model: {dtype: bf16}\nengine: {backend: cpu}") ==
        "test.yaml: model.dtype: bf16 needs engine.backend cuda; the cpu backend computes in f32 (use auto or f32; "
        "engine.weight_format: bf16 stores its weights in bf16)");
  CHECK_THAT(errorOf("model: {dtype: f16}"), Catch::Contains("model.dtype: f16 needs engine.backend cuda"));
  // bf16 weights on the cpu backend: a key of their own (docs/engine-cpu.md, "bf16 weights").
  CHECK(parseOk("engine: {backend: cpu, weight_format: bf16}").engine.weightFormat == "bf16");
  CHECK(parseOk("engine: {backend: cpu, weight_format: bf16}").experimental ==
        std::vector<std::string>{"engine.weight_format"});
  CHECK(parseOk("engine: {backend: cpu, weight_format: f32}").experimental.empty());
  CHECK(parseOk("engine: {backend: cpu}").engine.weightFormat == "f32");
  CHECK(errorOf("engine: {weight_format: q4}") ==
        "test.yaml: engine.weight_format: 'q4' is not a weight format (f32, bf16, q8_0)");
  CHECK(parseOk("engine: {backend: cpu, weight_format: q8_0}").engine.weightFormat == "q8_0");
  CHECK(errorOf("engine: {backend: cuda, weight_format: bf16}") ==
        "test.yaml: engine.weight_format: bf16 needs backend cpu (on cuda the weights follow model.dtype)");
  // The KV cache's dtype (docs/kv_cache.md, "Quantized KV cache"): int8 has no CUDA kernels.
  CHECK(parseOk("engine: {backend: cpu}").engine.kvCacheDtype == "auto");
  CHECK(parseOk("engine: {backend: cpu}").experimental.empty());
  for (const char* d : {"f32", "bf16", "int8", "fp8"}) {
    CHECK(parseOk(std::string("engine: {backend: cpu, kv_cache_dtype: ") + d + "}").engine.kvCacheDtype == d);
    CHECK(parseOk(std::string("engine: {backend: cpu, kv_cache_dtype: ") + d + "}").experimental ==
          std::vector<std::string>{"engine.kv_cache_dtype"});
  }
  CHECK(parseOk("engine: {backend: cuda, kv_cache_dtype: fp8}").engine.kvCacheDtype == "fp8");
  CHECK(errorOf("engine: {kv_cache_dtype: f16}") ==
        "test.yaml: engine.kv_cache_dtype: 'f16' is not a KV cache dtype (auto, f32, bf16, int8, fp8)");
  CHECK_THAT(errorOf("engine: {backend: cuda, kv_cache_dtype: int8}"),
             Catch::Contains("engine.kv_cache_dtype: int8 needs backend cpu"));
  CHECK(parseOk("model: {dtype: f32}\nengine: {backend: cpu}").model.dtype == DType::kF32);
  CHECK(parseOk("model: {dtype: bf16}\nengine: {backend: cuda}").model.dtype == DType::kBF16);
  CHECK(errorOf("router: {http: {port: 9000}}") ==
        "test.yaml: router.workers.control_port: 9000 is the same as router.http.port");
  CHECK(errorOf("engine: {num_blocks: 100, kv_cache_bytes: 1048576}") ==
        "test.yaml: engine: num_blocks and kv_cache_bytes are exclusive; give one");
  CHECK(errorOf("engine: {backend: cuda, gpu_memory_utilization: 0.9, num_blocks: 100}") ==
        "test.yaml: engine: gpu_memory_utilization and num_blocks are exclusive; give one");
  CHECK(errorOf("engine: {backend: cuda, gpu_memory_utilization: 0.9, kv_cache_bytes: 1048576}") ==
        "test.yaml: engine: gpu_memory_utilization and kv_cache_bytes are exclusive; give one");
  CHECK(errorOf("engine: {gpu_memory_utilization: 0.5}") ==
        "test.yaml: engine.gpu_memory_utilization: is a fraction of a GPU's memory and needs backend "
        "cuda (the cpu backend's KV cache is sized by kv_cache_bytes or num_blocks)");
  CHECK_THAT(errorOf("engine: {backend: cuda, gpu_memory_utilization: 1.5}"),
             Catch::StartsWith("test.yaml: engine.gpu_memory_utilization: "));
  CHECK_THAT(errorOf("engine: {backend: cuda, gpu_memory_utilization: 0}"),
             Catch::StartsWith("test.yaml: engine.gpu_memory_utilization: "));
  CHECK(errorOf("engine: {tensor_parallel_size: 2}") ==
        "test.yaml: engine.tensor_parallel_size: 2 needs backend cuda (the cpu backend runs one "
        "shard)");
  CHECK(errorOf("router: {workers: {load_report_interval_ms: 1000}}") ==
        "test.yaml: router.workers.load_report_interval_ms: 1000 must be less than "
        "router.workers.worker_report_timeout_ms (1000)");
  CHECK(errorOf("model: {max_model_len: 2048}\nrouter: {admission: {max_prompt_tokens: 4096}}") ==
        "test.yaml: router.admission.max_prompt_tokens: 4096 exceeds model.max_model_len (2048)");
  CHECK(errorOf("kv_transfer: {heartbeat_ms: 500, lease_ms: 1000}") ==
        "test.yaml: kv_transfer.lease_ms: 1000 must be at least 3 x kv_transfer.heartbeat_ms (500), or 0 for no "
        "lease");
  auto leases = parseClusterConfig("kv_transfer: {heartbeat_ms: 100, lease_ms: 0}", "test.yaml");
  REQUIRE(leases.ok());
  CHECK(leases->kvTransfer.heartbeatMs == 100);
  CHECK(leases->kvTransfer.leaseMs == 0);
  auto defaults = parseClusterConfig("", "test.yaml");
  REQUIRE(defaults.ok());
  CHECK(defaults->kvTransfer.heartbeatMs == 500);
  CHECK(defaults->kvTransfer.leaseMs == 3000);
  CHECK(defaults->engine.sloSizedPrefillChunks);
  CHECK(defaults->engine.minPrefillChunkTokens == 32);
  CHECK(errorOf("engine: {min_prefill_chunk_tokens: 0}") ==
        "test.yaml: engine.min_prefill_chunk_tokens: 0 is out of range [1, 16777216]");
}

TEST_CASE("several problems are all reported, in file order") {
  CHECK(errorOf("engine:\n  block_size: 17\nrouter:\n  http:\n    prot: 1\n    port: 0\n") ==
        "test.yaml: engine.block_size: 17 is not one of 8, 16, 32\n"
        "test.yaml: router.http.prot: unknown key (did you mean port?)\n"
        "test.yaml: router.http.port: 0 is out of range [1, 65535]");
}

TEST_CASE("syntax errors and missing files") {
  std::string msg = errorOf("router:\n  http:\n    port: [8000\n");
  CHECK(msg.rfind("test.yaml:4:1: YAML syntax error: ", 0) == 0);
  auto missing = loadClusterConfig("deploy/configs/no-such-file.yaml");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message() == "deploy/configs/no-such-file.yaml: cannot open the cluster config file");
}

TEST_CASE("a file path is named in messages") {
  auto path = std::filesystem::temp_directory_path() / "pd_config_test_bad.yaml";
  {
    std::ofstream out(path);
    out << "engine:\n  block_size: 17\n";
  }
  auto r = loadClusterConfig(path.string());
  std::filesystem::remove(path);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == path.string() + ": engine.block_size: 17 is not one of 8, 16, 32");
}

TEST_CASE("router HTTP hardening keys: defaults, tls both-or-none, hashed keys, rate limits, metrics auth") {
  auto d = parseOk("");
  CHECK(d.router.maxConnections == 4096);
  CHECK(d.router.headerTimeoutMs == 10000);
  CHECK(d.router.bodyTimeoutMs == 60000);
  CHECK(d.router.keepaliveTimeoutMs == 60000);
  CHECK(d.router.tlsCertFile.empty());
  CHECK(!d.router.rateLimits.enabled());
  CHECK(d.router.metricsAuth == MetricsAuth::kNone);

  auto c = parseOk(
      "router:\n  http:\n    max_connections: 100\n    header_timeout_ms: 2000\n"
      "    tls: {cert_file: /c.pem, key_file: /k.pem}\n"
      "    api_keys: [sk-1,\n"
      "      'sha256:2179e632e89277f18aa600491b68ad55121fd6caa045e047fdeb426088a5a5f1']\n"
      "    metrics_auth: bearer_file\n    metrics_bearer_file: /run/secrets/metrics-token\n"
      "  admission:\n"
      "    rate_limits: {requests_per_s: 0.5, request_burst: 3, tokens_per_s: 1000}\n");
  CHECK(c.warnings.empty());
  CHECK(c.router.maxConnections == 100);
  CHECK(c.router.headerTimeoutMs == 2000);
  CHECK(c.router.tlsCertFile == "/c.pem");
  CHECK(c.router.apiKeys.size() == 2);
  CHECK(c.router.rateLimits.tokensPerS == 1000);
  CHECK(c.router.metricsBearerFile == "/run/secrets/metrics-token");
  CHECK(c.router.tlsKeyFile == "/k.pem");
  CHECK(c.router.rateLimits.requestsPerS == 0.5);
  CHECK(c.router.rateLimits.requestBurst == 3);
  CHECK(c.router.rateLimits.enabled());
  CHECK(c.router.metricsAuth == MetricsAuth::kBearerFile);

  CHECK(errorOf("router: {http: {tls: {cert_file: /c.pem}}}")
            .find("router.http.tls: cert_file is set but key_file is not; give both (TLS) or neither") !=
        std::string::npos);
  CHECK(errorOf("router: {http: {tls: {key_file: /k.pem}}}")
            .find("router.http.tls: key_file is set but cert_file is not") != std::string::npos);
  CHECK(errorOf("router: {http: {tls: {cert: /c.pem}}}").find("router.http.tls.cert: unknown key") !=
        std::string::npos);
  // A malformed hash entry is named by index; its value is never echoed.
  std::string bad = errorOf("router: {http: {api_keys: [sk-secret-1, 'sha256:abcd']}}");
  CHECK(bad.find("router.http.api_keys[1]: a sha256: entry needs 64 hex digits") != std::string::npos);
  CHECK(bad.find("abcd") == std::string::npos);
  CHECK(errorOf("router: {admission: {rate_limits: {requests_per_s: -1}}}")
            .find("router.admission.rate_limits.requests_per_s") != std::string::npos);
  CHECK(errorOf("router: {admission: {rate_limits: {tokens: 5}}}")
            .find("router.admission.rate_limits.tokens: unknown key") != std::string::npos);
  CHECK(errorOf("router: {http: {metrics_auth: basic}}")
            .find("router.http.metrics_auth: basic is not one of none, api_key, bearer_file") != std::string::npos);
  CHECK(errorOf("router: {http: {metrics_auth: bearer_file}}")
            .find("router.http.metrics_bearer_file: required when metrics_auth is bearer_file") != std::string::npos);
  CHECK(errorOf("router: {http: {metrics_auth: api_key}}")
            .find("router.http.metrics_auth: api_key needs router.http.api_keys") != std::string::npos);
  CHECK(errorOf("router: {http: {max_connections: 0}}").find("router.http.max_connections") != std::string::npos);
}

TEST_CASE("router.autoscaler: defaults, every key, and what is refused") {
  auto d = parseOk("model: {path: /m}\n");
  CHECK(d.router.autoscaler.tickMs == 5000);
  CHECK(d.router.autoscaler.windowMs == 60000);
  CHECK(d.router.autoscaler.idleAfterMs == 60000);
  CHECK(d.router.autoscaler.localActuator);
  CHECK_FALSE(d.router.autoscaler.roleMoves);
  auto c = parseOk(
      "router:\n  autoscaler: {tick_ms: 250, window_ms: 4000, min_samples: 5, scale_up_utilization: 0.9,\n"
      "    scale_down_utilization: 0.5, scale_up_cooldown_ms: 1000, scale_down_cooldown_ms: 2000,\n"
      "    idle_after_ms: 3000, max_step_up: 4, max_step_down: 2, local_actuator: false, role_moves: true}\n");
  const auto& a = c.router.autoscaler;
  CHECK(a.tickMs == 250);
  CHECK(a.windowMs == 4000);
  CHECK(a.minSamples == 5);
  CHECK(a.scaleUpUtilization == 0.9);
  CHECK(a.scaleDownUtilization == 0.5);
  CHECK(a.scaleUpCooldownMs == 1000);
  CHECK(a.scaleDownCooldownMs == 2000);
  CHECK(a.idleAfterMs == 3000);
  CHECK(a.maxStepUp == 4);
  CHECK(a.maxStepDown == 2);
  CHECK_FALSE(a.localActuator);
  CHECK(a.roleMoves);
  CHECK(errorOf("router: {autoscaler: {scale_down_utilization: 0.9}}")
            .find("router.autoscaler.scale_down_utilization: 0.900000 is above scale_up_utilization (0.800000)") !=
        std::string::npos);
  CHECK(errorOf("router: {autoscaler: {tick_ms: 0}}").find("router.autoscaler.tick_ms") != std::string::npos);
  CHECK(errorOf("router: {autoscaler: {scale_up_utilization: 0}}").find("router.autoscaler.scale_up_utilization") !=
        std::string::npos);
  CHECK(errorOf("router: {autoscaler: {cooldown_ms: 5}}").find("router.autoscaler.cooldown_ms: unknown key") !=
        std::string::npos);
}

// ---- cluster.secret_file (docs/security.md) -------------------------------------------------------

namespace {

// A file under the test's temp dir with the given bytes and mode.
std::string secretFile(const std::string& name, const std::string& bytes, std::filesystem::perms mode) {
  const auto& dir = pd::test::scratchDir();
  auto path = (dir / name).string();
  std::filesystem::remove(path);
  std::ofstream(path, std::ios::binary) << bytes;
  std::filesystem::permissions(path, mode);
  return path;
}

constexpr auto kOwnerOnly = std::filesystem::perms::owner_read | std::filesystem::perms::owner_write;

}  // namespace

TEST_CASE("cluster.secret_file: a private file of at least 32 bytes is the cluster secret") {
  const std::string bytes(40, 'k');
  auto path = secretFile("good", bytes + "\n", kOwnerOnly);
  auto cfg = parseOk("cluster:\n  secret_file: " + path + "\n");
  CHECK(cfg.cluster.secretFile == path);
  CHECK(cfg.cluster.secret == bytes);  // the editor's newline is not part of it
  CHECK(cfg.cluster.authenticated());
  CHECK_FALSE(parseOk("").cluster.authenticated());
}

TEST_CASE("cluster.secret_file: missing, empty, short or readable by others is refused by key and file") {
  auto missing = errorOf("cluster:\n  secret_file: /nonexistent/pdserve.secret\n");
  CHECK_THAT(missing, Catch::Contains("cluster.secret_file") && Catch::Contains("/nonexistent/pdserve.secret") &&
                          Catch::Contains("does not exist"));

  auto empty = secretFile("empty", "\n", kOwnerOnly);
  CHECK_THAT(errorOf("cluster:\n  secret_file: " + empty + "\n"),
             Catch::Contains("cluster.secret_file") && Catch::Contains(empty) && Catch::Contains("empty"));

  auto shortFile = secretFile("short", std::string(31, 'k'), kOwnerOnly);
  CHECK_THAT(errorOf("cluster:\n  secret_file: " + shortFile + "\n"),
             Catch::Contains("cluster.secret_file") && Catch::Contains("31 bytes") && Catch::Contains("at least 32"));

  auto groupReadable = secretFile("group", std::string(40, 'k'), kOwnerOnly | std::filesystem::perms::group_read);
  CHECK_THAT(errorOf("cluster:\n  secret_file: " + groupReadable + "\n"),
             Catch::Contains("cluster.secret_file") && Catch::Contains(groupReadable) && Catch::Contains("0640"));
  auto worldReadable = secretFile("world", std::string(40, 'k'), kOwnerOnly | std::filesystem::perms::others_read);
  CHECK_THAT(errorOf("cluster:\n  secret_file: " + worldReadable + "\n"), Catch::Contains("0604"));

  CHECK_THAT(errorOf("cluster:\n  secret: abc\n"), Catch::Contains("cluster.secret: unknown key"));
  CHECK_THAT(errorOf("cluster:\n  secret_file: \"\"\n"), Catch::Contains("cluster.secret_file"));
}

TEST_CASE("engine.gpu_memory_utilization: a fraction above 0, at most 1, that replaces the byte-sized KV cache") {
  const ClusterConfig c = parseOk("engine: {backend: cuda, gpu_memory_utilization: 0.85}");
  CHECK(c.engine.gpuMemoryUtilization == 0.85);
  CHECK(c.engine.kvCacheBytes == 0);  // not the default 256 MiB as well
  CHECK(c.engine.numBlocks == 0);
  const ClusterConfig d = parseOk("engine: {backend: cuda}");
  CHECK(d.engine.gpuMemoryUtilization == 0);  // not given: kv_cache_bytes' default applies
  CHECK(d.engine.kvCacheBytes == int64_t{256} << 20);
}

TEST_CASE("KV event keys: defaults, the exact index, the ZeroMQ endpoint checked") {
  auto d = parseOk("");
  CHECK(d.router.exactPrefixRouting);
  CHECK(d.router.kvEventMaxLagMs == 1000);
  CHECK(d.engine.kvEvents.publish);
  CHECK(d.engine.kvEvents.zmqEndpoint.empty());
  CHECK(d.engine.kvEvents.zmqTopic == "kv-events");
  auto c = parseOk(
      "router: {routing: {exact_prefix_routing: false, kv_event_max_lag_ms: 250}}\n"
      "engine: {kv_events: {publish: false, zmq_endpoint: 'tcp://*:5557', zmq_topic: pd}}\n");
  CHECK_FALSE(c.router.exactPrefixRouting);
  CHECK(c.router.kvEventMaxLagMs == 250);
  CHECK_FALSE(c.engine.kvEvents.publish);
  CHECK(c.engine.kvEvents.zmqEndpoint == "tcp://*:5557");
  CHECK(c.engine.kvEvents.zmqTopic == "pd");
  CHECK(errorOf("engine: {kv_events: {zmq_endpoint: 'localhost:5557'}}")
            .find("engine.kv_events.zmq_endpoint: 'localhost:5557' is not a ZeroMQ endpoint") != std::string::npos);
  CHECK(errorOf("engine: {kv_events: {replay_endpoint: x}}").find("engine.kv_events.replay_endpoint: unknown key") !=
        std::string::npos);
  CHECK(errorOf("router: {routing: {kv_event_max_lag_ms: 0}}").find("router.routing.kv_event_max_lag_ms") !=
        std::string::npos);
}

TEST_CASE("engine.kv_tiers: sizes, the disk path, and the errors naming what is wrong") {
  const ClusterConfig d = parseOk("");
  CHECK_FALSE(d.engine.kvTiers.on());
  CHECK(d.engine.kvTiers.diskWriteQueueBytes == int64_t{64} << 20);
  auto c = parseOk(
      "engine: {kv_tiers: {host_bytes: 1073741824, disk_bytes: 4294967296, disk_path: /var/cache/pd, "
      "disk_write_queue_bytes: 8388608}}");
  CHECK(c.engine.kvTiers.on());
  CHECK(c.engine.kvTiers.hostBytes == int64_t{1} << 30);
  CHECK(c.engine.kvTiers.diskBytes == int64_t{4} << 30);
  CHECK(c.engine.kvTiers.diskPath == "/var/cache/pd");
  CHECK(c.engine.kvTiers.diskWriteQueueBytes == int64_t{8} << 20);
  CHECK(errorOf("engine: {kv_tiers: {disk_bytes: 1073741824}}")
            .find("engine.kv_tiers.disk_path: needed when disk_bytes is set") != std::string::npos);
  CHECK(errorOf("engine: {kv_tiers: {disk_path: /tmp/x}}")
            .find("engine.kv_tiers.disk_path: '/tmp/x' is given but disk_bytes is 0") != std::string::npos);
  CHECK(
      errorOf("engine: {kv_tiers: {host_bytes: 1000}}").find("engine.kv_tiers.host_bytes: 1000 bytes is below 1 MiB") !=
      std::string::npos);
  // The tiers work on cuda too: the device blocks are copied down (docs/kv_cache.md).
  CHECK(parseOk("engine: {backend: cuda, kv_tiers: {host_bytes: 1073741824}}").engine.kvTiers.hostBytes == int64_t{1}
                                                                                                               << 30);
  CHECK(errorOf("engine: {enable_prefix_caching: false, kv_tiers: {host_bytes: 1073741824}}")
            .find("need enable_prefix_caching: true") != std::string::npos);
  CHECK(errorOf("engine: {kv_tiers: {ssd_bytes: 1}}").find("engine.kv_tiers.ssd_bytes: unknown key") !=
        std::string::npos);
}

// ---- the router's grouped keys, and their old flat paths (docs/config.md "Renamed keys") ------

namespace {

// One router key that moved into a group: a non-default value, where it lands, and keys it
// needs beside it (inside router.http).
struct Renamed {
  std::string key;
  std::string group;
  std::string value;
  std::function<bool(const RouterConfig&)> landed;
  std::string httpContext{};
};

const std::vector<Renamed>& renamedKeys() {
  using R = const RouterConfig&;
  static const std::vector<Renamed> keys = {
      {"host", "http", "0.0.0.0", [](R r) { return r.host == "0.0.0.0"; }},
      {"port", "http", "8080", [](R r) { return r.port == 8080; }},
      {"api_keys", "http", "[k1, k2]", [](R r) { return r.apiKeys.size() == 2; }},
      {"max_connections", "http", "100", [](R r) { return r.maxConnections == 100; }},
      {"header_timeout_ms", "http", "2000", [](R r) { return r.headerTimeoutMs == 2000; }},
      {"body_timeout_ms", "http", "3000", [](R r) { return r.bodyTimeoutMs == 3000; }},
      {"keepalive_timeout_ms", "http", "4000", [](R r) { return r.keepaliveTimeoutMs == 4000; }},
      {"max_body_bytes", "http", "2048", [](R r) { return r.maxBodyBytes == 2048; }},
      {"tls", "http", "{cert_file: /c.pem, key_file: /k.pem}",
       [](R r) { return r.tlsCertFile == "/c.pem" && r.tlsKeyFile == "/k.pem"; }},
      {"metrics_auth", "http", "api_key", [](R r) { return r.metricsAuth == MetricsAuth::kApiKey; }, "api_keys: [k]"},
      {"metrics_bearer_file", "http", "/t", [](R r) { return r.metricsBearerFile == "/t"; },
       "metrics_auth: bearer_file"},
      {"short_prompt_tokens", "routing", "77", [](R r) { return r.shortPromptTokens == 77; }},
      {"adaptive_threshold", "routing", "true", [](R r) { return r.adaptiveThreshold; }},
      {"prefix_aware_routing", "routing", "false", [](R r) { return !r.prefixAwareRouting; }},
      {"exact_prefix_routing", "routing", "false", [](R r) { return !r.exactPrefixRouting; }},
      {"kv_event_max_lag_ms", "routing", "250", [](R r) { return r.kvEventMaxLagMs == 250; }},
      {"overload_shedding", "admission", "false", [](R r) { return !r.overloadShedding; }},
      {"max_prompt_tokens", "admission", "100", [](R r) { return r.maxPromptTokens == 100; }},
      {"rate_limits", "admission", "{requests_per_s: 2, token_burst: 9}",
       [](R r) { return r.rateLimits.requestsPerS == 2 && r.rateLimits.tokenBurst == 9; }},
      {"control_port", "workers", "9100", [](R r) { return r.controlPort == 9100; }},
      {"load_report_interval_ms", "workers", "50", [](R r) { return r.loadReportIntervalMs == 50; }},
      {"worker_report_timeout_ms", "workers", "900", [](R r) { return r.workerReportTimeoutMs == 900; }},
      {"request_timeout_ms", "requests", "5000", [](R r) { return r.requestTimeoutMs == 5000; }},
      {"max_migrations", "requests", "0", [](R r) { return r.maxMigrations == 0; }},
      {"drain_timeout_ms", "requests", "100", [](R r) { return r.drainTimeoutMs == 100; }},
      // The SLO targets (1 s, 50 ms) are bounds already.
      {"ttft_buckets_s", "metrics", "[0.1, 1]",
       [](R r) {
         return r.ttftBucketsS == std::vector<double>{0.1, 1};
       }},
      {"itl_buckets_s", "metrics", "[0.05, 1]",
       [](R r) {
         return r.itlBucketsS == std::vector<double>{0.05, 1};
       }},
      {"e2e_buckets_s", "metrics", "[1, 2]",
       [](R r) {
         return r.e2eBucketsS == std::vector<double>{1, 2};
       }},
  };
  return keys;
}

// router: with the key flat (old), in its group (new), or both; the context in router.http.
std::string routerYaml(const Renamed& k, bool flat, bool grouped) {
  std::map<std::string, std::string> groups;
  if (grouped) groups[k.group] = k.key + ": " + k.value;
  if (!k.httpContext.empty()) {
    std::string& h = groups["http"];
    h += (h.empty() ? "" : ", ") + k.httpContext;
  }
  std::string y = "router:\n";
  if (flat) y += "  " + k.key + ": " + k.value + "\n";
  for (const auto& [g, body] : groups) y += "  " + g + ": {" + body + "}\n";
  return y;
}

}  // namespace

TEST_CASE("the router's keys load from their groups, with no warnings") {
  // Every renamed key of the list above sits in one group: the list covers the old router: map.
  std::set<std::string> seen;
  for (const Renamed& k : renamedKeys()) {
    INFO(k.key);
    CHECK(seen.insert(k.key).second);
    ClusterConfig c = parseOk(routerYaml(k, false, true));
    CHECK(k.landed(c.router));
    CHECK(c.warnings.empty());
  }
  CHECK(seen.size() == 28);

  // All of them at once, as a file would hold them.
  ClusterConfig c = parseOk(
      "router:\n"
      "  http:\n"
      "    host: 0.0.0.0\n    port: 8080\n    api_keys: [k1]\n    max_connections: 100\n"
      "    header_timeout_ms: 2000\n    body_timeout_ms: 3000\n    keepalive_timeout_ms: 4000\n"
      "    max_body_bytes: 2048\n    tls: {cert_file: /c.pem, key_file: /k.pem}\n"
      "    metrics_auth: api_key\n"
      "  routing:\n"
      "    short_prompt_tokens: 77\n    adaptive_threshold: true\n"
      "    prefix_aware_routing: false\n    exact_prefix_routing: false\n"
      "    kv_event_max_lag_ms: 250\n"
      "  admission:\n"
      "    overload_shedding: false\n    max_prompt_tokens: 100\n"
      "    rate_limits: {requests_per_s: 2, token_burst: 9}\n"
      "  workers:\n"
      "    control_port: 9100\n    load_report_interval_ms: 50\n"
      "    worker_report_timeout_ms: 900\n"
      "  requests:\n"
      "    request_timeout_ms: 5000\n    max_migrations: 0\n    drain_timeout_ms: 100\n"
      "  metrics:\n"
      "    ttft_buckets_s: [0.1, 1]\n    itl_buckets_s: [0.05, 1]\n    e2e_buckets_s: [1, 2]\n"
      "  autoscaler: {tick_ms: 250}\n");
  CHECK(c.warnings.empty());
  for (const Renamed& k : renamedKeys()) {
    INFO(k.key);
    if (k.key != "metrics_bearer_file" && k.key != "api_keys") CHECK(k.landed(c.router));
  }
  CHECK(c.router.apiKeys == std::vector<std::string>{"k1"});
  CHECK(c.router.autoscaler.tickMs == 250);
  CHECK(c.router.port == 8080);
  CHECK(c.router.controlPort == 9100);

  // A key in the wrong group is unknown there.
  CHECK(errorOf("router: {http: {short_prompt_tokens: 5}}").find("router.http.short_prompt_tokens: unknown key") !=
        std::string::npos);
  CHECK(errorOf("router: {routing: 5}") == "test.yaml: router.routing: expected a map of keys, got \"5\"");
}

TEST_CASE("each old flat router key still loads, with one warning naming its new path") {
  for (const Renamed& k : renamedKeys()) {
    INFO(k.key);
    ClusterConfig c = parseOk(routerYaml(k, true, false));
    CHECK(k.landed(c.router));
    CHECK(c.warnings ==
          std::vector<std::string>{"router." + k.key + " is deprecated: use router." + k.group + "." + k.key});
  }
  // Several, in file order, one each.
  ClusterConfig c = parseOk(
      "router:\n  short_prompt_tokens: 64\n  port: 8001\n  routing: {adaptive_threshold: true}\n"
      "  request_timeout_ms: 1000\n");
  CHECK(c.router.shortPromptTokens == 64);
  CHECK(c.router.port == 8001);
  CHECK(c.router.requestTimeoutMs == 1000);
  CHECK(c.warnings ==
        std::vector<std::string>{"router.short_prompt_tokens is deprecated: use router.routing.short_prompt_tokens",
                                 "router.port is deprecated: use router.http.port",
                                 "router.request_timeout_ms is deprecated: use router.requests.request_timeout_ms"});
  // Problems in an old key name the path as given, so the line is found.
  CHECK(errorOf("router: {port: 70000}") == "test.yaml: router.port: 70000 is out of range [1, 65535]");
  CHECK(errorOf("router: {tls: {cert_file: /c.pem}}").find("router.tls: cert_file is set but key_file is not") !=
        std::string::npos);
  CHECK(errorOf("router: {rate_limits: {tokens: 5}}").find("router.rate_limits.tokens: unknown key") !=
        std::string::npos);
  CHECK(
      errorOf("router: {api_keys: [a, 'sha256:ab']}").find("router.api_keys[1]: a sha256: entry needs 64 hex digits") !=
      std::string::npos);
  // The cross-field rules hold whichever path gave the values.
  CHECK(errorOf("router: {port: 9100, workers: {control_port: 9100}}")
            .find("router.workers.control_port: 9100 is the same as router.http.port") != std::string::npos);
}

TEST_CASE("an old flat router key and its new path together are refused, naming both") {
  for (const Renamed& k : renamedKeys()) {
    INFO(k.key);
    const std::string oldPath = "router." + k.key;
    const std::string newPath = "router." + k.group + "." + k.key;
    CHECK(errorOf(routerYaml(k, true, true)) == "test.yaml: " + oldPath + " and " + newPath +
                                                    " are one setting given twice: keep " + newPath + " (" + oldPath +
                                                    " is its old name)");
  }
  // Refused even when the two agree.
  CHECK_THAT(errorOf("router: {port: 8000, http: {port: 8000}}"), Catch::Contains("router.port and router.http.port"));
}

TEST_CASE("experimental toggles turned on are named at load, stable ones are not") {
  CHECK(parseOk("").experimental.empty());
  CHECK(parseOk("router: {routing: {prefix_aware_routing: true, exact_prefix_routing: true},"
                " admission: {overload_shedding: true}}\n"
                "engine: {slo_sized_prefill_chunks: true, enable_prefix_caching: true}\n"
                "metrics: {vllm_compatible_names: true}\n")
            .experimental.empty());
  CHECK(
      parseOk("router: {routing: {adaptive_threshold: false}, autoscaler: {role_moves: false}}").experimental.empty());
  ClusterConfig c = parseOk(
      "router: {routing: {adaptive_threshold: true},"
      " autoscaler: {role_moves: true}}");
  CHECK(c.experimental ==
        std::vector<std::string>{"router.routing.adaptive_threshold", "router.autoscaler.role_moves"});
  CHECK(c.warnings.empty());  // experimental is not deprecated
}

TEST_CASE("the Helm chart's rendered cluster.yaml loads, with no warnings, in every scenario") {
  // tests/deploy/render_chart.py renders the chart as the deploy tests do (python3-yaml).
  if (std::system("/usr/bin/python3 -c 'import yaml' >/dev/null 2>&1") != 0) {
    pd::test::skipTest("no /usr/bin/python3 with yaml (scripts/setup installs python3-yaml)");
  }
  const auto dir = pd::test::scratchDir() / "chart-configs";
  std::filesystem::remove_all(dir);
  const std::string cmd =
      "/usr/bin/python3 tests/deploy/render_chart.py --root . "
      "--write-configs " +
      dir.string() + " >/dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  int loaded = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    auto r = loadClusterConfig(entry.path().string());
    INFO(entry.path().string() << ": " << r.status().message());
    REQUIRE(r.ok());
    CHECK(r->warnings == std::vector<std::string>{});
    ++loaded;
  }
  CHECK(loaded >= 5);  // defaults, every example overlay, everything on, metrics auth
}

TEST_CASE("router.requests.stream_heartbeat_ms: 15 s by default, 0 turns it off, bounded") {
  CHECK(parseOk("").router.streamHeartbeatMs == 15000);
  CHECK(parseOk("router: {requests: {stream_heartbeat_ms: 0}}").router.streamHeartbeatMs == 0);
  CHECK(parseOk("router: {requests: {stream_heartbeat_ms: 2500}}").router.streamHeartbeatMs == 2500);
  CHECK(errorOf("router: {requests: {stream_heartbeat_ms: -1}}") ==
        "test.yaml: router.requests.stream_heartbeat_ms: -1 is out of range [0, 3600000]");
  CHECK(errorOf("router: {requests: {stream_heartbeat_ms: fast}}") ==
        "test.yaml: router.requests.stream_heartbeat_ms: expected an integer, got \"fast\"");
}
