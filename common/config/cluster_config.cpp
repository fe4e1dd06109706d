#include "common/config/cluster_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "common/base/cluster_auth.h"
#include "common/config/yaml_reader.h"

namespace pd::config {

using detail::Choices;
using detail::ErrorList;
using detail::MapReader;

std::string_view toString(ModelPreset v) { return enumName(kModelPresetNames, v); }
std::string_view toString(DType v) { return enumName(kDTypeNames, v); }
std::string_view toString(Backend v) { return enumName(kBackendNames, v); }
std::string_view toString(TransportKind v) { return enumName(kTransportKindNames, v); }
std::string_view toString(RemotePrefillFailure v) { return enumName(kRemotePrefillFailureNames, v); }
std::string_view toString(MetricsAuth v) { return enumName(kMetricsAuthNames, v); }

// TTFT: 5 ms .. 60 s, dense around the usual 0.1-2 s targets.
std::vector<double> defaultTtftBucketsS() {
  return {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60};
}
// ITL: from 1 ms, because a fast decode pool's 5-20 ms targets need resolution below 10 ms.
std::vector<double> defaultItlBucketsS() {
  return {0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
          0.05,  0.075, 0.1,   0.15,  0.2,   0.3,  0.5,   1,    2,     5};
}
std::vector<double> defaultE2eBucketsS() { return {0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600}; }

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr int64_t kMaxTokens = int64_t{1} << 24;  // 16M tokens: beyond any context length
constexpr int64_t kMaxReplicas = 1024;
constexpr int64_t kHourMs = 3600 * 1000;

// The YAML choices: the enums' name tables, in their order.
template <typename E, size_t N>
Choices<E> choicesOf(const EnumNames<E, N>& names) {
  Choices<E> choices;
  for (const EnumName<E>& n : names) choices.emplace_back(n.name, n.value);
  return choices;
}

const Choices<ModelPreset> kPresets = choicesOf(kModelPresetNames);
const Choices<DType> kDTypes = choicesOf(kDTypeNames);
const Choices<Backend> kBackends = choicesOf(kBackendNames);
const Choices<TransportKind> kTransports = choicesOf(kTransportKindNames);
const Choices<RemotePrefillFailure> kFailurePolicies = choicesOf(kRemotePrefillFailureNames);
const Choices<MetricsAuth> kMetricsAuth = choicesOf(kMetricsAuthNames);
const Choices<LogLevel> kLogLevels = choicesOf(kLogLevelNames);
const Choices<ToolCallParser> kToolCallParsers = choicesOf(kToolCallParserNames);

void readModel(MapReader m, ModelConfig* c) {
  m.readString("path", &c->path, false);
  m.readEnum("preset", &c->preset, kPresets);
  m.readString("name", &c->name, true);
  m.readInt("max_model_len", &c->maxModelLen, 0, kMaxTokens);
  m.readEnum("dtype", &c->dtype, kDTypes);
  m.finish();
  if (c->name.empty()) {
    // The served id defaults to the directory's name: "models/small/" -> "small".
    std::string p = c->path;
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    size_t slash = p.find_last_of('/');
    c->name = slash == std::string::npos ? p : p.substr(slash + 1);
  }
}

// router.http: the OpenAI HTTP API's listener, who may call it and read /metrics.
void readRouterHttp(MapReader& m, RouterConfig* c) {
  m.readString("host", &c->host, false);
  m.readInt("port", &c->port, 1, 65535);
  m.readStringList("api_keys", &c->apiKeys);
  if (m.peek("api_keys").IsDefined()) {
    for (size_t i = 0; i < c->apiKeys.size(); ++i) {
      // A hash entry must be one; never echo an entry (it may be a key).
      const std::string& k = c->apiKeys[i];
      if (k.rfind("sha256:", 0) != 0) continue;
      const std::string hex = k.substr(7);
      if (hex.size() != 64 || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
        m.errors()->add(m.node(), m.pathOf("api_keys") + "[" + std::to_string(i) +
                                      "]: a sha256: entry needs 64 hex digits after the prefix "
                                      "(printf %s KEY | sha256sum), got " +
                                      std::to_string(hex.size()) + " characters");
      }
    }
  }
  m.readInt("max_connections", &c->maxConnections, 1, 1 << 20);
  m.readInt("header_timeout_ms", &c->headerTimeoutMs, 100, kHourMs);
  m.readInt("body_timeout_ms", &c->bodyTimeoutMs, 100, kHourMs);
  m.readInt("keepalive_timeout_ms", &c->keepaliveTimeoutMs, 100, kHourMs);
  m.readInt("max_body_bytes", &c->maxBodyBytes, 1024, int64_t{1} << 30);
  {
    MapReader tls = m.child("tls");
    std::string cert, key;  // neither may be empty, so "" is "not given here"
    tls.readString("cert_file", &cert, false);
    tls.readString("key_file", &key, false);
    tls.finish();
    if (cert.empty() != key.empty()) {
      m.errors()->add(m.node(), m.pathOf("tls") + ": " +
                                    (cert.empty() ? "key_file is set but cert_file is not"
                                                  : "cert_file is set but key_file is not") +
                                    "; give both (TLS) or neither (plain HTTP)");
    }
    if (!cert.empty()) c->tlsCertFile = cert;
    if (!key.empty()) c->tlsKeyFile = key;
  }
  m.readEnum("metrics_auth", &c->metricsAuth, kMetricsAuth);
  // "": unset (the chart's default)
  m.readString("metrics_bearer_file", &c->metricsBearerFile, true);
}

// router.routing: which pool and which worker a request goes to.
void readRouterRouting(MapReader& m, RouterConfig* c) {
  m.readInt("short_prompt_tokens", &c->shortPromptTokens, 0, kMaxTokens);
  m.readBool("adaptive_threshold", &c->adaptiveThreshold);
  m.readBool("prefix_aware_routing", &c->prefixAwareRouting);
  m.readBool("exact_prefix_routing", &c->exactPrefixRouting);
  m.readInt("kv_event_max_lag_ms", &c->kvEventMaxLagMs, 1, 600000);
}

// router.admission: what is refused before it is routed.
void readRouterAdmission(MapReader& m, RouterConfig* c) {
  m.readBool("overload_shedding", &c->overloadShedding);
  m.readInt("max_prompt_tokens", &c->maxPromptTokens, 0, kMaxTokens);
  MapReader rl = m.child("rate_limits");
  rl.readDouble("requests_per_s", &c->rateLimits.requestsPerS, 0, false, 1e9);
  rl.readInt("request_burst", &c->rateLimits.requestBurst, 0, int64_t{1} << 40);
  rl.readDouble("tokens_per_s", &c->rateLimits.tokensPerS, 0, false, 1e12);
  rl.readInt("token_burst", &c->rateLimits.tokenBurst, 0, int64_t{1} << 50);
  rl.finish();
}

// router.workers: the control plane the workers dial and report on.
void readRouterWorkers(MapReader& m, RouterConfig* c) {
  m.readInt("control_port", &c->controlPort, 1, 65535);
  m.readInt("load_report_interval_ms", &c->loadReportIntervalMs, 1, 60000);
  m.readInt("worker_report_timeout_ms", &c->workerReportTimeoutMs, 10, 600000);
}

// router.requests: an admitted request's lifetime.
void readRouterRequests(MapReader& m, RouterConfig* c) {
  m.readInt("request_timeout_ms", &c->requestTimeoutMs, 1, 24 * kHourMs);
  m.readInt("max_migrations", &c->maxMigrations, 0, 16);
  m.readInt("drain_timeout_ms", &c->drainTimeoutMs, 0, 3600000);
  m.readInt("stream_heartbeat_ms", &c->streamHeartbeatMs, 0, 3600000);
  m.readEnum("tool_call_parser", &c->toolCallParser, kToolCallParsers);
}

// router.metrics: the bounds of the router's latency histograms.
void readRouterMetrics(MapReader& m, RouterConfig* c) {
  m.readBuckets("ttft_buckets_s", &c->ttftBucketsS);
  m.readBuckets("itl_buckets_s", &c->itlBucketsS);
  m.readBuckets("e2e_buckets_s", &c->e2eBucketsS);
}

struct RouterGroup {
  std::string_view name;
  void (*read)(MapReader&, RouterConfig*);
  std::vector<std::string_view> keys;  // the group's keys, which once sat under router:
};

// The router's groups; every key of a group was router.<key> before (docs/config.md,
// "Renamed keys"). router.autoscaler was a group already.
const std::vector<RouterGroup>& routerGroups() {
  static const std::vector<RouterGroup> groups = {
      {"http",
       readRouterHttp,
       {"host", "port", "api_keys", "max_connections", "header_timeout_ms", "body_timeout_ms", "keepalive_timeout_ms",
        "max_body_bytes", "tls", "metrics_auth", "metrics_bearer_file"}},
      {"routing",
       readRouterRouting,
       {"short_prompt_tokens", "adaptive_threshold", "prefix_aware_routing", "exact_prefix_routing",
        "kv_event_max_lag_ms"}},
      {"admission", readRouterAdmission, {"overload_shedding", "max_prompt_tokens", "rate_limits"}},
      {"workers", readRouterWorkers, {"control_port", "load_report_interval_ms", "worker_report_timeout_ms"}},
      {"requests", readRouterRequests, {"request_timeout_ms", "max_migrations", "drain_timeout_ms"}},
      {"metrics", readRouterMetrics, {"ttft_buckets_s", "itl_buckets_s", "e2e_buckets_s"}},
  };
  return groups;
}

void readAutoscaler(MapReader a, RouterConfig::Autoscaler* as) {
  a.readInt("tick_ms", &as->tickMs, 10, 600000);
  a.readInt("window_ms", &as->windowMs, 100, 3600000);
  a.readInt("min_samples", &as->minSamples, 1, 1000000);
  a.readDouble("scale_up_utilization", &as->scaleUpUtilization, 0, true, 1);
  a.readDouble("scale_down_utilization", &as->scaleDownUtilization, 0, true, 1);
  a.readInt("scale_up_cooldown_ms", &as->scaleUpCooldownMs, 0, 3600000);
  a.readInt("scale_down_cooldown_ms", &as->scaleDownCooldownMs, 0, 3600000);
  a.readInt("idle_after_ms", &as->idleAfterMs, 0, 24 * kHourMs);
  a.readInt("max_step_up", &as->maxStepUp, 1, kMaxReplicas);
  a.readInt("max_step_down", &as->maxStepDown, 1, kMaxReplicas);
  a.readBool("local_actuator", &as->localActuator);
  a.readBool("role_moves", &as->roleMoves);
  a.finish();
  if (as->scaleDownUtilization > as->scaleUpUtilization) {
    a.errors()->add(a.node(), "router.autoscaler.scale_down_utilization: " + std::to_string(as->scaleDownUtilization) +
                                  " is above scale_up_utilization (" + std::to_string(as->scaleUpUtilization) +
                                  "): the pool would flap between two sizes");
  }
}

void readRouter(MapReader m, RouterConfig* c, ErrorList* warnings) {
  // The keys as they sat before the groups: read from router: itself, each with a warning.
  // Errors about them name the path given (router.port), so a reader finds the line.
  for (const RouterGroup& g : routerGroups()) {
    MapReader group = m.child(g.name);
    bool moved = false;
    for (std::string_view key : g.keys) {
      const std::string newPath = group.pathOf(key);
      m.declareMoved(key, std::string(g.name) + "." + std::string(key));
      YAML::Node old = m.peek(key);
      if (!old.IsDefined()) continue;
      moved = true;
      if (group.peek(key).IsDefined()) {
        m.errors()->add(old, m.pathOf(key) + " and " + newPath +
                                 " are one setting given twice: "
                                 "keep " +
                                 newPath + " (" + m.pathOf(key) + " is its old name)");
      } else {
        warnings->add(old, m.pathOf(key) + " is deprecated: use " + newPath);
      }
    }
    if (moved) {
      MapReader flat(m.node(), "router", m.errors());  // router: is a map (a key was found)
      g.read(flat, c);
    }
    g.read(group, c);
    group.finish();
  }
  readAutoscaler(m.child("autoscaler"), &c->autoscaler);
  m.finish();
  if (c->metricsAuth == MetricsAuth::kBearerFile && c->metricsBearerFile.empty()) {
    m.errors()->add(m.node(),
                    "router.http.metrics_bearer_file: required when metrics_auth is "
                    "bearer_file");
  }
  if (c->metricsAuth != MetricsAuth::kBearerFile && !c->metricsBearerFile.empty()) {
    m.errors()->add(m.node(),
                    "router.http.metrics_bearer_file: only used with metrics_auth: "
                    "bearer_file (it is " +
                        std::string(toString(c->metricsAuth)) + ")");
  }
  if (c->metricsAuth == MetricsAuth::kApiKey && c->apiKeys.empty()) {
    m.errors()->add(m.node(), "router.http.metrics_auth: api_key needs router.http.api_keys");
  }
  if (c->adaptiveThreshold && c->shortPromptTokens == 0) {
    m.errors()->add(m.node(),
                    "router.routing.adaptive_threshold: true needs short_prompt_tokens"
                    " >= 1 (0 sends every prompt to the prefill pool, on purpose)");
  }
}

// Reads the replica keys of one pool; the bounds default to replicas.
template <typename Pool>
void readReplicas(MapReader& m, Pool* c, int64_t lowest) {
  m.readInt("replicas", &c->replicas, lowest, kMaxReplicas);
  c->minReplicas = c->replicas;
  c->maxReplicas = c->replicas;
  m.readInt("min_replicas", &c->minReplicas, lowest, kMaxReplicas);
  m.readInt("max_replicas", &c->maxReplicas, lowest, kMaxReplicas);
  m.readString("host", &c->host, false);
  m.readInt("base_port", &c->basePort, 0, 65535);
}

template <typename Pool>
void checkReplicas(MapReader& m, const Pool& c) {
  if (c.minReplicas > c.maxReplicas) {
    m.errors()->add(m.node(), m.pathOf("min_replicas") + ": " + std::to_string(c.minReplicas) +
                                  " is greater than max_replicas (" + std::to_string(c.maxReplicas) + ")");
  } else if (c.replicas < c.minReplicas || c.replicas > c.maxReplicas) {
    m.errors()->add(m.node(), m.pathOf("replicas") + ": " + std::to_string(c.replicas) +
                                  " is outside [min_replicas, max_replicas] = [" + std::to_string(c.minReplicas) +
                                  ", " + std::to_string(c.maxReplicas) + "]");
  }
  if (c.basePort != 0 && c.basePort + c.maxReplicas - 1 > 65535) {
    m.errors()->add(m.node(),
                    m.pathOf("base_port") + ": " + std::to_string(c.basePort) + " + max_replicas - 1 exceeds 65535");
  }
}

void readPools(MapReader m, PoolsConfig* c) {
  {
    MapReader p = m.child("prefill");
    readReplicas(p, &c->prefill, 0);
    MapReader slo = p.child("slo");
    slo.readDouble("ttft_ms", &c->prefill.slo.ttftMs, 0, true, 3600e3);
    slo.readDouble("percentile", &c->prefill.slo.percentile, 0, true, 100);
    slo.finish();
    p.finish();
    checkReplicas(p, c->prefill);
  }
  {
    MapReader d = m.child("decode");
    readReplicas(d, &c->decode, 1);
    MapReader slo = d.child("slo");
    slo.readDouble("itl_ms", &c->decode.slo.itlMs, 0, true, 600e3);
    slo.readDouble("percentile", &c->decode.slo.percentile, 0, true, 100);
    slo.finish();
    d.finish();
    checkReplicas(d, c->decode);
  }
  m.finish();
}

void readEngine(MapReader m, EngineConfig* c) {
  m.readEnum("backend", &c->backend, kBackends);
  m.readInt("threads", &c->threads, 0, 1024);
  m.readIntChoice("block_size", &c->blockSize, {8, 16, 32});
  bool hasBlocks = m.has("num_blocks");
  bool hasBytes = m.has("kv_cache_bytes");
  bool hasUtil = m.has("gpu_memory_utilization");
  m.readInt("num_blocks", &c->numBlocks, 1, int64_t{1} << 32);
  m.readInt("kv_cache_bytes", &c->kvCacheBytes, int64_t{1} << 20, int64_t{1} << 50);
  m.readDouble("gpu_memory_utilization", &c->gpuMemoryUtilization, 0, true, 1);
  m.readInt("max_batch_tokens", &c->maxBatchTokens, 1, kMaxTokens);
  m.readInt("max_running_requests", &c->maxRunningRequests, 1, 65536);
  m.readInt("max_queue", &c->maxQueue, 0, 1 << 20);
  m.readIntChoice("tensor_parallel_size", &c->tensorParallelSize, {1, 2, 4, 8});
  const bool hasWeightFormat = m.has("weight_format");
  m.readString("weight_format", &c->weightFormat, false);
  m.readString("kv_cache_dtype", &c->kvCacheDtype, false);
  m.readBool("enable_prefix_caching", &c->enablePrefixCaching);
  {
    MapReader k = m.child("kv_events");
    k.readBool("publish", &c->kvEvents.publish);
    k.readString("zmq_endpoint", &c->kvEvents.zmqEndpoint, true);
    k.readString("zmq_topic", &c->kvEvents.zmqTopic, true);
    k.finish();
    const std::string& e = c->kvEvents.zmqEndpoint;
    if (!e.empty() && e.rfind("tcp://", 0) != 0 && e.rfind("ipc://", 0) != 0) {
      m.errors()->add(m.node(), "engine.kv_events.zmq_endpoint: '" + e +
                                    "' is not a ZeroMQ endpoint to bind (tcp://host:port or ipc://path)");
    }
  }
  {
    MapReader t = m.child("kv_tiers");
    auto& k = c->kvTiers;
    t.readInt("host_bytes", &k.hostBytes, 0, int64_t{1} << 50);
    t.readInt("disk_bytes", &k.diskBytes, 0, int64_t{1} << 50);
    t.readString("disk_path", &k.diskPath, true);
    t.readInt("disk_write_queue_bytes", &k.diskWriteQueueBytes, int64_t{1} << 20, int64_t{1} << 34);
    t.finish();
    for (const auto& [v, key] : {std::pair{k.hostBytes, "host_bytes"}, std::pair{k.diskBytes, "disk_bytes"}}) {
      if (v > 0 && v < (int64_t{1} << 20)) {
        m.errors()->add(m.node(), std::string("engine.kv_tiers.") + key + ": " + std::to_string(v) +
                                      " bytes is below 1 MiB; give 0 to turn the tier off");
      }
    }
    if (k.diskBytes > 0 && k.diskPath.empty()) {
      m.errors()->add(m.node(),
                      "engine.kv_tiers.disk_path: needed when disk_bytes is set (the directory the "
                      "disk tier keeps its block files in)");
    }
    if (k.diskBytes == 0 && !k.diskPath.empty()) {
      m.errors()->add(m.node(), "engine.kv_tiers.disk_path: '" + k.diskPath +
                                    "' is given but disk_bytes is 0 (the disk tier is off); give disk_bytes");
    }
  }
  m.readInt("drain_timeout_ms", &c->drainTimeoutMs, 0, 3600000);
  m.readBool("slo_sized_prefill_chunks", &c->sloSizedPrefillChunks);
  m.readInt("min_prefill_chunk_tokens", &c->minPrefillChunkTokens, 1, kMaxTokens);
  m.finish();
  if (hasBlocks && hasBytes) {
    m.errors()->add(m.node(), "engine: num_blocks and kv_cache_bytes are exclusive; give one");
  }
  for (const auto& [given, key] : {std::pair{hasBlocks, "num_blocks"}, std::pair{hasBytes, "kv_cache_bytes"}}) {
    if (hasUtil && given) {
      m.errors()->add(m.node(), std::string("engine: gpu_memory_utilization and ") + key + " are exclusive; give one");
    }
  }
  if (hasBlocks || hasUtil) c->kvCacheBytes = 0;
  if (c->kvTiers.on() && !c->enablePrefixCaching) {
    m.errors()->add(m.node(),
                    "engine.kv_tiers: the tiers keep the prefix cache's named blocks and need "
                    "enable_prefix_caching: true");
  }
  if (hasUtil && c->backend != Backend::kCuda) {
    m.errors()->add(m.node()["gpu_memory_utilization"],
                    "engine.gpu_memory_utilization: is a fraction of a GPU's memory and needs backend cuda "
                    "(the cpu backend's KV cache is sized by kv_cache_bytes or num_blocks)");
  }
  // A separate key rather than model.dtype: on cuda model.dtype is the compute and KV dtype
  // (part of the KV layout peers agree on); here only the weights' storage changes.
  if (c->weightFormat != "f32" && c->weightFormat != "bf16" && c->weightFormat != "q8_0") {
    m.errors()->add(m.node()["weight_format"],
                    "engine.weight_format: '" + c->weightFormat + "' is not a weight format (f32, bf16, q8_0)");
  } else if (hasWeightFormat && c->weightFormat != "f32" && c->backend != Backend::kCpu) {
    m.errors()->add(m.node()["weight_format"], "engine.weight_format: " + c->weightFormat +
                                                   " needs backend cpu (on cuda the weights follow model.dtype)");
  }
  // Part of the KV layout fingerprint: prefill and decode workers must give the same.
  {
    const std::string& d = c->kvCacheDtype;
    if (d != "auto" && d != "f32" && d != "bf16" && d != "int8" && d != "fp8") {
      m.errors()->add(m.node()["kv_cache_dtype"],
                      "engine.kv_cache_dtype: '" + d + "' is not a KV cache dtype (auto, f32, bf16, int8, fp8)");
    } else if (d == "int8" && c->backend != Backend::kCpu) {
      m.errors()->add(m.node()["kv_cache_dtype"],
                      "engine.kv_cache_dtype: int8 needs backend cpu (the cuda kernels keep K/V in f32, f16, bf16 "
                      "or fp8: docs/kv_cache.md, \"Quantized KV cache\")");
    }
  }
  if (c->tensorParallelSize > 1 && c->backend != Backend::kCuda) {
    m.errors()->add(m.node(), "engine.tensor_parallel_size: " + std::to_string(c->tensorParallelSize) +
                                  " needs backend cuda (the cpu backend runs one shard)");
  }
}

void readKvTransfer(MapReader m, KvTransferConfig* c) {
  m.readEnumList("transports", &c->transports, kTransports);
  m.readString("listen_host", &c->listenHost, false);
  m.readInt("timeout_ms", &c->timeoutMs, 1, kHourMs);
  m.readInt("heartbeat_ms", &c->heartbeatMs, 10, 60000);
  m.readInt("lease_ms", &c->leaseMs, 0, kHourMs);
  m.readEnum("on_remote_prefill_failure", &c->onRemotePrefillFailure, kFailurePolicies);
  m.readBool("peer_pulls", &c->peerPulls);
  m.readInt("pull_timeout_ms", &c->pullTimeoutMs, 10, 600000);
  m.finish();
}

void readCluster(MapReader m, ClusterIdentityConfig* c) {
  m.readString("secret_file", &c->secretFile, false);
  m.finish();
  if (c->secretFile.empty()) return;
  auto secret = auth::readSecretFile(c->secretFile);
  if (!secret.ok()) {
    m.errors()->add(m.node()["secret_file"], m.pathOf("secret_file") + ": " + secret.status().message());
    return;
  }
  c->secret = std::move(secret).value();
}

void readLogging(MapReader m, LoggingConfig* c) {
  m.readEnum("level", &c->level, kLogLevels);
  m.readString("step_trace_dir", &c->stepTraceDir, true);
  m.finish();
}

void readMetrics(MapReader m, MetricsConfig* c) {
  m.readBool("vllm_compatible_names", &c->vllmCompatibleNames);
  m.finish();
}

// Makes the SLO target a bucket boundary, so `le="<target>"` gives attainment exactly.
void insertBound(std::vector<double>* buckets, double bound) {
  for (double b : *buckets) {
    if (std::fabs(b - bound) <= 1e-12 * std::max(1.0, bound)) return;
  }
  buckets->insert(std::upper_bound(buckets->begin(), buckets->end(), bound), bound);
}

void checkCrossFields(const YAML::Node& root, ClusterConfig* c, ErrorList* errors) {
  if (c->router.port == c->router.controlPort) {
    errors->add(root, "router.workers.control_port: " + std::to_string(c->router.controlPort) +
                          " is the same as router.http.port");
  }
  if (c->router.loadReportIntervalMs >= c->router.workerReportTimeoutMs) {
    errors->add(root, "router.workers.load_report_interval_ms: " + std::to_string(c->router.loadReportIntervalMs) +
                          " must be less than router.workers.worker_report_timeout_ms (" +
                          std::to_string(c->router.workerReportTimeoutMs) + ")");
  }
  if (c->kvTransfer.leaseMs > 0 && c->kvTransfer.leaseMs < 3 * c->kvTransfer.heartbeatMs) {
    errors->add(root, "kv_transfer.lease_ms: " + std::to_string(c->kvTransfer.leaseMs) +
                          " must be at least 3 x kv_transfer.heartbeat_ms (" +
                          std::to_string(c->kvTransfer.heartbeatMs) + "), or 0 for no lease");
  }
  // The cpu backend computes and keeps its KV cache in f32 whatever the checkpoint stores: a
  // 16-bit dtype there would be silently ignored (and its KV layout would differ from a cuda
  // peer's), so it is refused rather than read as a wish.
  if (c->engine.backend == Backend::kCpu && (c->model.dtype == DType::kBF16 || c->model.dtype == DType::kF16)) {
    errors->add(root["model"]["dtype"], std::string("model.dtype: ") +
                                            (c->model.dtype == DType::kBF16 ? "bf16" : "f16") +
                                            " needs engine.backend cuda; the cpu backend computes in f32 (use auto or "
                                            "f32; engine.weight_format: bf16 stores its weights in bf16)");
  }
  if (c->model.maxModelLen > 0 && c->router.maxPromptTokens > c->model.maxModelLen) {
    errors->add(root, "router.admission.max_prompt_tokens: " + std::to_string(c->router.maxPromptTokens) +
                          " exceeds model.max_model_len (" + std::to_string(c->model.maxModelLen) + ")");
  }
  insertBound(&c->router.ttftBucketsS, c->pools.prefill.slo.ttftMs / 1000.0);
  insertBound(&c->router.itlBucketsS, c->pools.decode.slo.itlMs / 1000.0);
}

}  // namespace

Result<ClusterConfig> parseClusterConfig(std::string_view yaml, std::string sourceName) {
  if (sourceName.empty()) sourceName = "<string>";
  ClusterConfig cfg;
  cfg.sourceName = sourceName;
  cfg.router.ttftBucketsS = defaultTtftBucketsS();
  cfg.router.itlBucketsS = defaultItlBucketsS();
  cfg.router.e2eBucketsS = defaultE2eBucketsS();

  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    // yaml-cpp's what() repeats the mark; build the message from its parts instead.
    return invalidArgument(sourceName + ":" + std::to_string(e.mark.line + 1) + ":" +
                           std::to_string(e.mark.column + 1) + ": YAML syntax error: " + e.msg);
  }

  ErrorList errors;
  ErrorList warnings;
  try {
    MapReader top(root, "", &errors);
    readCluster(top.child("cluster"), &cfg.cluster);
    readModel(top.child("model"), &cfg.model);
    readRouter(top.child("router"), &cfg.router, &warnings);
    readPools(top.child("pools"), &cfg.pools);
    readEngine(top.child("engine"), &cfg.engine);
    readKvTransfer(top.child("kv_transfer"), &cfg.kvTransfer);
    readLogging(top.child("logging"), &cfg.logging);
    readMetrics(top.child("metrics"), &cfg.metrics);
    top.finish();
  } catch (const YAML::Exception& e) {
    // Readers check node kinds before converting, so this is a reader bug; still no crash.
    return invalidArgument(sourceName + ": " + e.what());
  }
  if (!errors.empty()) return invalidArgument(errors.join(sourceName));
  checkCrossFields(root, &cfg, &errors);
  if (!errors.empty()) return invalidArgument(errors.join(sourceName));
  cfg.warnings = warnings.texts();
  for (const std::string& w : cfg.warnings) PD_LOG(kWarn, "config") << sourceName << ": " << w;
  // Experimental toggles (docs/config.md): said once at load when turned on.
  if (cfg.router.adaptiveThreshold) cfg.experimental.push_back("router.routing.adaptive_threshold");
  if (cfg.router.autoscaler.roleMoves) cfg.experimental.push_back("router.autoscaler.role_moves");
  if (cfg.engine.weightFormat != "f32") cfg.experimental.push_back("engine.weight_format");
  if (cfg.engine.kvCacheDtype != "auto") cfg.experimental.push_back("engine.kv_cache_dtype");
  for (const std::string& key : cfg.experimental) {
    PD_LOG(kInfo, "config") << sourceName << ": " << key << " is on: experimental (docs/config.md)";
  }
  return cfg;
}

Result<ClusterConfig> loadClusterConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return notFound(path + ": cannot open the cluster config file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return dataLoss(path + ": read error");
  return parseClusterConfig(text.str(), path);
}

}  // namespace pd::config
