#include "common/config/cluster_config.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <unistd.h>

#include "tests/scratch_dir.h"

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
    CHECK(r.ok());
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
                                                              TransportKind::kVerbs,
                                                              TransportKind::kTcp});
  CHECK(c.kvTransfer.onRemotePrefillFailure == RemotePrefillFailure::kRecompute);
  CHECK(c.logging.level == LogLevel::kInfo);
  // The SLO targets (1 s, 50 ms) are already bucket bounds of the defaults.
  CHECK(c.router.ttftBucketsS == defaultTtftBucketsS());
  CHECK(c.router.itlBucketsS == defaultItlBucketsS());
  CHECK(c.router.e2eBucketsS == defaultE2eBucketsS());
}

TEST_CASE("the SLO target becomes a histogram bound") {
  ClusterConfig c = parseOk(
      "router:\n  ttft_buckets_s: [0.1, 1, 10]\n  itl_buckets_s: [0.01, 0.1]\n"
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
  CHECK(errorOf("pools: {decode: {replicas: 0}}") ==
        "test.yaml: pools.decode.replicas: 0 is out of range [1, 1024]");
  CHECK(parseOk("pools: {prefill: {replicas: 0}}").pools.prefill.replicas == 0);
}

TEST_CASE("unknown keys name the full path and a suggestion") {
  CHECK(errorOf("router:\n  prot: 8000\n") ==
        "test.yaml: router.prot: unknown key (did you mean port?)");
  CHECK(errorOf("engine: {blocksize: 16}") ==
        "test.yaml: engine.blocksize: unknown key (did you mean block_size?)");
  CHECK(errorOf("pools: {decode: {slo: {ttft_ms: 5}}}") ==
        "test.yaml: pools.decode.slo.ttft_ms: unknown key (allowed: itl_ms, percentile)");
  CHECK(errorOf("logging: {level: info, colour: true}") ==
        "test.yaml: logging.colour: unknown key (allowed: level, step_trace_dir)");
  CHECK(errorOf("modle: {path: x}") == "test.yaml: modle: unknown key (did you mean model?)");
  CHECK(errorOf("router: {port: 1, port: 2}") == "test.yaml: router.port: duplicate key");
}

TEST_CASE("wrong types are named with what was expected") {
  CHECK(errorOf("router: {port: http}") ==
        "test.yaml: router.port: expected an integer, got \"http\"");
  CHECK(errorOf("router: {port: \"8000\"}") ==
        "test.yaml: router.port: expected an integer, got \"8000\"");
  CHECK(errorOf("router: {port: 80.5}") ==
        "test.yaml: router.port: expected an integer, got \"80.5\"");
  CHECK(errorOf("router: {port: [1]}") ==
        "test.yaml: router.port: expected an integer, got a list");
  CHECK(errorOf("router: {port: }") ==
        "test.yaml: router.port: expected an integer, got an empty value");
  CHECK(errorOf("router: 8000") == "test.yaml: router: expected a map of keys, got \"8000\"");
  CHECK(errorOf("- a\n- b\n") == "test.yaml: the document: expected a map of keys, got a list");
  CHECK(errorOf("router: {adaptive_threshold: true, short_prompt_tokens: 0}") ==
        "test.yaml: router.adaptive_threshold: true needs short_prompt_tokens >= 1 (0 sends "
        "every prompt to the prefill pool, on purpose)");
  CHECK(errorOf("router: {prefix_aware_routing: 1}") ==
        "test.yaml: router.prefix_aware_routing: expected true or false, got \"1\"");
  CHECK(errorOf("engine: {enable_prefix_caching: yes}") ==
        "test.yaml: engine.enable_prefix_caching: expected true or false, got \"yes\"");
  CHECK(errorOf("model: {path: {a: 1}}") == "test.yaml: model.path: expected a string, got a map");
  CHECK(errorOf("pools: {prefill: {slo: {ttft_ms: fast}}}") ==
        "test.yaml: pools.prefill.slo.ttft_ms: expected a number, got \"fast\"");
  CHECK(errorOf("router: {api_keys: secret}") ==
        "test.yaml: router.api_keys: expected a list of strings, got \"secret\"");
}

TEST_CASE("out-of-range and not-allowed values say what is allowed") {
  CHECK(errorOf("engine: {block_size: 17}") ==
        "test.yaml: engine.block_size: 17 is not one of 8, 16, 32");
  CHECK(errorOf("router: {port: 70000}") ==
        "test.yaml: router.port: 70000 is out of range [1, 65535]");
  CHECK(errorOf("engine: {backend: gpu}") ==
        "test.yaml: engine.backend: gpu is not one of cpu, cuda");
  CHECK(errorOf("model: {dtype: fp8}") ==
        "test.yaml: model.dtype: fp8 is not one of auto, f32, bf16, f16");
  CHECK(errorOf("model: {preset: huge}") ==
        "test.yaml: model.preset: huge is not one of tiny, small");
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
  CHECK(errorOf("router: {ttft_buckets_s: [0.1, 0.5, 0.5]}") ==
        "test.yaml: router.ttft_buckets_s[2]: 0.5 is not greater than the previous bound 0.5 "
        "(bounds must be strictly increasing)");
  CHECK(errorOf("router: {itl_buckets_s: [0, 0.1]}") ==
        "test.yaml: router.itl_buckets_s[0]: 0 is not positive");
  CHECK(errorOf("router: {e2e_buckets_s: [1, x]}") ==
        "test.yaml: router.e2e_buckets_s[1]: expected a number, got \"x\"");
  CHECK(errorOf("router: {e2e_buckets_s: []}") ==
        "test.yaml: router.e2e_buckets_s: must list at least one bound");
  CHECK(errorOf("router: {api_keys: [a, b, a]}") ==
        "test.yaml: router.api_keys[2]: duplicate of an earlier entry");
  CHECK(parseOk("kv_transfer: {transports: [tcp, ucx]}").kvTransfer.transports ==
        std::vector<TransportKind>{TransportKind::kTcp, TransportKind::kUcx});
}

TEST_CASE("cross-field rules") {
  CHECK(errorOf("router: {port: 9000}") ==
        "test.yaml: router.control_port: 9000 is the same as router.port");
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
  CHECK(errorOf("router: {load_report_interval_ms: 1000}") ==
        "test.yaml: router.load_report_interval_ms: 1000 must be less than "
        "router.worker_report_timeout_ms (1000)");
  CHECK(errorOf("model: {max_model_len: 2048}\nrouter: {max_prompt_tokens: 4096}") ==
        "test.yaml: router.max_prompt_tokens: 4096 exceeds model.max_model_len (2048)");
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
  CHECK(errorOf("engine:\n  block_size: 17\nrouter:\n  prot: 1\n  port: 0\n") ==
        "test.yaml: engine.block_size: 17 is not one of 8, 16, 32\n"
        "test.yaml: router.prot: unknown key (did you mean port?)\n"
        "test.yaml: router.port: 0 is out of range [1, 65535]");
}

TEST_CASE("syntax errors and missing files") {
  std::string msg = errorOf("router:\n  port: [8000\n");
  CHECK(msg.rfind("test.yaml:3:1: YAML syntax error: ", 0) == 0);
  auto missing = loadClusterConfig("deploy/configs/no-such-file.yaml");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message() ==
        "deploy/configs/no-such-file.yaml: cannot open the cluster config file");
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
      "router:\n  max_connections: 100\n  header_timeout_ms: 2000\n  tls: {cert_file: /c.pem, key_file: /k.pem}\n"
      "  api_keys: [sk-1, 'sha256:2179e632e89277f18aa600491b68ad55121fd6caa045e047fdeb426088a5a5f1']\n"
      "  rate_limits: {requests_per_s: 0.5, request_burst: 3, tokens_per_s: 1000}\n"
      "  metrics_auth: bearer_file\n  metrics_bearer_file: /run/secrets/metrics-token\n");
  CHECK(c.router.maxConnections == 100);
  CHECK(c.router.tlsKeyFile == "/k.pem");
  CHECK(c.router.rateLimits.requestsPerS == 0.5);
  CHECK(c.router.rateLimits.requestBurst == 3);
  CHECK(c.router.rateLimits.enabled());
  CHECK(c.router.metricsAuth == MetricsAuth::kBearerFile);

  CHECK(errorOf("router: {tls: {cert_file: /c.pem}}").find(
            "router.tls: cert_file is set but key_file is not; give both (TLS) or neither") != std::string::npos);
  CHECK(errorOf("router: {tls: {key_file: /k.pem}}").find("router.tls: key_file is set but cert_file is not") !=
        std::string::npos);
  CHECK(errorOf("router: {tls: {cert: /c.pem}}").find("router.tls.cert: unknown key") != std::string::npos);
  // A malformed hash entry is named by index; its value is never echoed.
  std::string bad = errorOf("router: {api_keys: [sk-secret-1, 'sha256:abcd']}");
  CHECK(bad.find("router.api_keys[1]: a sha256: entry needs 64 hex digits") != std::string::npos);
  CHECK(bad.find("abcd") == std::string::npos);
  CHECK(errorOf("router: {rate_limits: {requests_per_s: -1}}").find("router.rate_limits.requests_per_s") !=
        std::string::npos);
  CHECK(errorOf("router: {rate_limits: {tokens: 5}}").find("router.rate_limits.tokens: unknown key") !=
        std::string::npos);
  CHECK(errorOf("router: {metrics_auth: basic}").find("router.metrics_auth: basic is not one of none, api_key, "
                                                       "bearer_file") != std::string::npos);
  CHECK(errorOf("router: {metrics_auth: bearer_file}").find(
            "router.metrics_bearer_file: required when metrics_auth is bearer_file") != std::string::npos);
  CHECK(errorOf("router: {metrics_auth: api_key}").find("router.metrics_auth: api_key needs router.api_keys") !=
        std::string::npos);
  CHECK(errorOf("router: {max_connections: 0}").find("router.max_connections") != std::string::npos);
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

// ---- cluster.secret_file (issue 13) -------------------------------------------------------

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
      "router: {exact_prefix_routing: false, kv_event_max_lag_ms: 250}\n"
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
  CHECK(errorOf("router: {kv_event_max_lag_ms: 0}").find("router.kv_event_max_lag_ms") != std::string::npos);
}
