// The cluster configuration: one YAML file -> plain structs, validated at load (docs/design.md §7).
//
//   PD_ASSIGN_OR_RETURN(pd::config::ClusterConfig cfg,
//                       pd::config::loadClusterConfig("deploy/configs/local.yaml"));
//   listen(cfg.router.host, cfg.router.port);
//   for (const auto& w : cfg.warnings) std::cerr << w << "\n";  // also logged at load
//
// Every key is optional and has a documented default (docs/config.md), so an empty file is a
// valid single-machine CPU cluster. Loading rejects, with a message naming the file, the full
// key path and what is allowed:
//   - unknown keys     "local.yaml: router.prot: unknown key (did you mean port?)"
//   - wrong types      "local.yaml: router.port: expected an integer, got \"http\""
//   - bad values       "local.yaml: engine.block_size: 17 is not one of 8, 16, 32"
//   - inconsistencies  "local.yaml: pools.decode.replicas: 9 is outside [min_replicas,
//                       max_replicas] = [1, 4]"
// When a file has several problems they are all reported, one per line, in file order.
//
// Renamed keys (the router's keys moved into groups, docs/config.md "Renamed keys") still load:
// each old path given adds "router.port is deprecated: use router.http.port" to
// ClusterConfig::warnings and logs it once; giving an old path and its new one is an error.
// Boolean toggles are marked stable or experimental below and in docs/config.md; an
// experimental one turned on is named in ClusterConfig::experimental and logged once.
//
// The structs are plain values: copy them freely, read them from any thread. Nothing here
// touches the model directory or the network; checks that need those (does model.path exist,
// is the port free) belong to the process that uses the value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace pd::config {

enum class ModelPreset { kTiny, kSmall };
enum class DType { kAuto, kF32, kBF16, kF16 };
enum class Backend { kCpu, kCuda };
enum class TransportKind { kCma, kUcx, kVerbs, kTcp };  // cma: same-node only (docs/kvtransfer.md)
enum class RemotePrefillFailure { kRecompute, kFail };

// The YAML spelling of each value ("small", "bf16", "cuda", "ucx", "recompute"): one table
// per enum, which loading parses with too.
inline constexpr EnumNames<ModelPreset, 2> kModelPresetNames{
    {{ModelPreset::kTiny, "tiny"}, {ModelPreset::kSmall, "small"}}};
inline constexpr EnumNames<DType, 4> kDTypeNames{
    {{DType::kAuto, "auto"}, {DType::kF32, "f32"}, {DType::kBF16, "bf16"}, {DType::kF16, "f16"}}};
inline constexpr EnumNames<Backend, 2> kBackendNames{{{Backend::kCpu, "cpu"}, {Backend::kCuda, "cuda"}}};
inline constexpr EnumNames<TransportKind, 4> kTransportKindNames{{{TransportKind::kCma, "cma"},
                                                                  {TransportKind::kUcx, "ucx"},
                                                                  {TransportKind::kVerbs, "verbs"},
                                                                  {TransportKind::kTcp, "tcp"}}};
inline constexpr EnumNames<RemotePrefillFailure, 2> kRemotePrefillFailureNames{
    {{RemotePrefillFailure::kRecompute, "recompute"}, {RemotePrefillFailure::kFail, "fail"}}};
std::string_view toString(ModelPreset v);
std::string_view toString(DType v);
std::string_view toString(Backend v);
std::string_view toString(TransportKind v);
std::string_view toString(RemotePrefillFailure v);

struct ModelConfig {
  std::string path = "models/small";         // a Hugging Face model directory (relative: to the cwd)
  ModelPreset preset = ModelPreset::kSmall;  // what `pdserve up` makes when path is missing
  std::string name;                          // served model id; "" in the file -> the last component of path
  int64_t maxModelLen = 0;                   // 0 -> max_position_embeddings of the model's config.json
  DType dtype = DType::kAuto;                // auto: f32 on the cpu backend, bf16 on cuda
};

// Per-API-key token buckets (docs/security.md). 0 disables a limit; a burst of 0 means
// one second's worth of its rate (at least 1).
struct RateLimitConfig {
  double requestsPerS = 0;
  int64_t requestBurst = 0;
  double tokensPerS = 0;  // prompt tokens + max_tokens, charged at admission
  int64_t tokenBurst = 0;
  bool enabled() const { return requestsPerS > 0 || tokensPerS > 0; }
};

// Who may read the router's /metrics: anyone on the port (Prometheus, KEDA), holders of an
// API key, or holders of the bearer token in metrics_bearer_file.
enum class MetricsAuth { kNone, kApiKey, kBearerFile };
inline constexpr EnumNames<MetricsAuth, 3> kMetricsAuthNames{
    {{MetricsAuth::kNone, "none"}, {MetricsAuth::kApiKey, "api_key"}, {MetricsAuth::kBearerFile, "bearer_file"}}};
std::string_view toString(MetricsAuth v);

// router.requests.tool_call_parser: the syntax of a model's tool calls (router/tool_calls.h);
// auto reads it off the chat template.
enum class ToolCallParser { kAuto, kHermes, kLlama3Json, kMistral };
inline constexpr EnumNames<ToolCallParser, 4> kToolCallParserNames{{{ToolCallParser::kAuto, "auto"},
                                                                    {ToolCallParser::kHermes, "hermes"},
                                                                    {ToolCallParser::kLlama3Json, "llama3_json"},
                                                                    {ToolCallParser::kMistral, "mistral"}}};

// The router's keys. In the YAML they sit in groups under router: (docs/config.md), noted per
// field: [http] router.http, [routing] router.routing, [admission] router.admission,
// [workers] router.workers, [requests] router.requests, [metrics] router.metrics; the
// fields keep one flat struct (code reads cfg.router.port).
// Latency buckets (seconds) of the router's histograms: each pool's SLO target is always a
// bucket boundary (loading inserts it) so attainment at the target is read exactly.
struct RouterConfig {
  std::string host = "127.0.0.1";  // [http]
  int port = 8000;                 // [http] OpenAI HTTP API, /metrics, /health
  int controlPort = 9000;          // [workers] workers dial this (framed protobuf)
  // [http] Empty -> no authentication. An entry is a key, or "sha256:<64 hex>" (the key's SHA-256);
  // the router keeps only hashes in memory either way.
  std::vector<std::string> apiKeys;
  // [http] HTTP hardening (docs/security.md).
  int64_t maxConnections = 4096;       // open HTTP connections beyond this are closed at accept
  int64_t headerTimeoutMs = 10000;     // accept / first byte of a request -> end of its headers
  int64_t bodyTimeoutMs = 60000;       // end of the headers -> end of the body
  int64_t keepaliveTimeoutMs = 60000;  // idle between requests on one connection
  std::string tlsCertFile;             // router.tls.cert_file / key_file: both or none (PEM)
  std::string tlsKeyFile;
  RateLimitConfig rateLimits;                    // [admission] router.admission.rate_limits
  MetricsAuth metricsAuth = MetricsAuth::kNone;  // [http]
  std::string metricsBearerFile;                 // [http] metrics_auth: bearer_file reads the token here
  int64_t shortPromptTokens = 256;               // [routing] uncached prompt tokens <= this: decode worker
  // [routing] Stable. Route on predicted prefix-cache hits (router/prefix_index.h).
  bool prefixAwareRouting = true;
  // [routing] Stable. With prefix-aware routing: route a worker that publishes KV events on its
  // exact index (router/kv_event_index.h, docs/kv_events.md); the predicted index when off/stale.
  bool exactPrefixRouting = true;
  int64_t kvEventMaxLagMs = 1000;  // [routing] a worker's exact index this far behind: stale
  // [routing] Experimental (off by default: it moves work between the pools under load).
  // Move shortPromptTokens with the pools' SLO headroom (router/adaptive_threshold.h).
  bool adaptiveThreshold = false;
  int64_t maxBodyBytes = 8 << 20;        // [http] larger HTTP bodies get 413
  int64_t maxPromptTokens = 0;           // [admission] 0 -> model.max_model_len
  int64_t loadReportIntervalMs = 100;    // [workers] how often workers send LoadReport
  int64_t workerReportTimeoutMs = 1000;  // [workers] a worker silent this long: out of rotation
  int64_t drainTimeoutMs = 30000;        // [requests] SIGTERM: in-flight streams get this long
  int64_t requestTimeoutMs = 600000;     // [requests] whole-request deadline
  // [requests] A stream silent this long (waiting for its first token, or between tokens) gets
  // an SSE comment line, so that proxies with an idle read timeout keep it open; 0: never.
  int64_t streamHeartbeatMs = 15000;
  ToolCallParser toolCallParser = ToolCallParser::kAuto;  // [requests] docs/serving.md "Tool calls"
  // [admission] Stable. Refuse (429 + Retry-After) a request predicted to miss the pools' SLO
  // targets (router/admission.h, docs/serving.md "Overload").
  bool overloadShedding = true;
  // [requests] A request whose decode worker dies or gives it up (drain, shutdown) continues
  // on another one this many times at most (0: it fails with the worker's error instead).
  int maxMigrations = 2;
  std::vector<double> ttftBucketsS;  // [metrics]
  std::vector<double> itlBucketsS;   // [metrics]
  std::vector<double> e2eBucketsS;   // [metrics]
  // router.autoscaler: how pdserve_desired_replicas is computed (router/autoscaler.h,
  // docs/serving.md "Autoscaling"), and whether `pdserve up` acts on it.
  struct Autoscaler {
    int64_t tickMs = 5000;                // how often the recommendation is recomputed
    int64_t windowMs = 60000;             // the observed-percentile window
    int minSamples = 20;                  // fewer in the window: the percentile rule abstains
    double scaleUpUtilization = 0.8;      // the capacity model plans workers this full
    double scaleDownUtilization = 0.6;    // and shrinks only to a size this full (< up)
    int64_t scaleUpCooldownMs = 10000;    // between two scale-ups
    int64_t scaleDownCooldownMs = 60000;  // a lower target must hold this long
    int64_t idleAfterMs = 60000;          // no work this long: the pool's min_replicas
    int maxStepUp = 2;                    // replicas per decision, up
    int maxStepDown = 1;                  // and down (idle goes to the minimum at once)
    // Stable. `pdserve up`: start and stop worker processes of a pool whose max_replicas
    // exceeds its min_replicas to follow the recommendation (tools/local_actuator.h).
    bool localActuator = true;
    // Experimental (`pdserve up` only; an HPA per pool expects each pool in its own bounds).
    // The pools' max_replicas as one budget, and `pdserve up` moving a worker between the
    // pools (pdserve-worker, SIGUSR1) when one grows while the other shrinks, instead of
    // draining one process and starting another (docs/serving.md "Role moves").
    bool roleMoves = false;
  } autoscaler;
};

struct PrefillSlo {
  double ttftMs = 1000;
  double percentile = 99;  // (0, 100]
};
struct DecodeSlo {
  double itlMs = 50;
  double percentile = 99;
};

// Replica bounds: min_replicas <= replicas <= max_replicas; both bounds default to replicas
// (a fixed-size pool) when absent. Worker i of a pool binds host:(base_port + i), base_port 0
// meaning an OS-chosen port that the worker reports when it registers.
struct PrefillPoolConfig {
  int replicas = 1;  // 0 allowed: every request is served colocated
  int minReplicas = 1;
  int maxReplicas = 1;
  std::string host = "127.0.0.1";
  int basePort = 0;
  PrefillSlo slo;
};
struct DecodePoolConfig {
  int replicas = 1;  // >= 1: decode workers own every request
  int minReplicas = 1;
  int maxReplicas = 1;
  std::string host = "127.0.0.1";
  int basePort = 0;
  DecodeSlo slo;
};
struct PoolsConfig {
  PrefillPoolConfig prefill;
  DecodePoolConfig decode;
};

// KV cache size: num_blocks when given; gpu_memory_utilization (backend cuda) when given: what
// that fraction of each GPU's memory leaves after the weights and the measured activation
// peak (engine/kv_budget.h); otherwise as many blocks as fit in kv_cache_bytes. The
// three keys are exclusive.
struct EngineConfig {
  Backend backend = Backend::kCpu;
  int threads = 0;                            // cpu compute threads; 0 -> all cores
  int blockSize = 16;                         // tokens per KV block: 8, 16 or 32
  int64_t numBlocks = 0;                      // 0 -> derived from kvCacheBytes
  int64_t kvCacheBytes = int64_t{256} << 20;  // 0 when num_blocks or gpu_memory_utilization
  double gpuMemoryUtilization = 0;            // (0, 1]; 0: not given
  int64_t maxBatchTokens = 2048;              // per-step token budget (prefill chunks + decode tokens)
  int maxRunningRequests = 128;
  int maxQueue = 1024;         // waiting requests beyond this are rejected (503)
  int tensorParallelSize = 1;  // 1, 2, 4, 8; > 1 needs the cuda backend
  // engine.weight_format (cpu backend): how the linear layers' weights are held, "f32", "bf16"
  // or "q8_0" (engine::CpuBackendOptions::weightFormat; compute and KV stay f32).
  std::string weightFormat = "f32";
  // engine.kv_cache_dtype: what the KV cache stores (and transfers, and the tiers keep): "auto"
  // (cpu f32; cuda model.dtype), "f32", "bf16", "int8" (cpu backend only) or "fp8".
  std::string kvCacheDtype = "auto";
  bool enablePrefixCaching = true;  // Stable.
  // engine.kv_events (docs/kv_events.md): the prefix cache's block events.
  struct KvEvents {
    bool publish = true;      // Stable. To routers that take them, over the control connection.
    std::string zmqEndpoint;  // also on a ZeroMQ PUB socket bound here (vLLM's schema); "": off
    std::string zmqTopic = "kv-events";
  } kvEvents;
  // engine.kv_tiers (docs/kv_cache.md): the host-memory and local-disk tiers below the KV
  // cache, per worker; 0 bytes turns a tier off. cpu backend only for now.
  struct KvTiers {
    int64_t hostBytes = 0;
    int64_t diskBytes = 0;
    std::string diskPath;  // the worker's files go under <disk_path>/<worker id>/
    int64_t diskWriteQueueBytes = int64_t{64} << 20;
    bool on() const { return hostBytes > 0 || diskBytes > 0; }
  } kvTiers;
  // SIGTERM: the worker stops taking work and gives its in-flight requests this long to
  // finish before it ends the rest (docs/architecture.md, "Shutdown and drain").
  int64_t drainTimeoutMs = 30000;
  // SLO-sized chunked prefill (engine::PrefillChunkOptions): a step that also decodes
  // computes at most the prompt tokens predicted to keep it within pools.decode.slo.itl_ms,
  // and at least minPrefillChunkTokens. Off: max_batch_tokens alone. Stable.
  bool sloSizedPrefillChunks = true;
  int minPrefillChunkTokens = 32;
};

struct KvTransferConfig {
  // Preference order; the first one both peers support and that connects is used, tcp is the
  // fallback. cma connects only to peers on this node, so it goes first.
  std::vector<TransportKind> transports = {TransportKind::kCma, TransportKind::kUcx, TransportKind::kVerbs,
                                           TransportKind::kTcp};
  std::string listenHost = "127.0.0.1";
  int64_t timeoutMs = 10000;  // a remote prefill (compute + transfer) past this has failed
  // Leases on the decode <-> prefill control connections (net keepalive): each side sends a
  // heartbeat every heartbeatMs; a peer silent for leaseMs is lost (0: no lease).
  int64_t heartbeatMs = 500;
  int64_t leaseMs = 3000;
  RemotePrefillFailure onRemotePrefillFailure = RemotePrefillFailure::kRecompute;
  // Peer pulls (docs/kv_cache.md, "Peer pulls"): decode workers serve their KV region's
  // blocks to peers on a control port and pull prefixes the router names. pullTimeoutMs
  // bounds one pull, start to PullDone; past it the request computes the prefix itself.
  bool peerPulls = false;
  int64_t pullTimeoutMs = 2000;
};

struct LoggingConfig {
  LogLevel level = LogLevel::kInfo;
  // Each worker writes one CSV row per engine step to <dir>/<worker id>.steps.csv
  // (worker/step_trace.h); empty: no trace.
  std::string stepTraceDir;
};

// What /metrics exports besides pdserve's own names (docs/metrics.md).
struct MetricsConfig {
  // Also export vLLM's names (vllm:time_to_first_token_seconds, vllm:num_requests_waiting,
  // ...) with a model_name label, for the metrics that mean the same thing, so dashboards,
  // alerts and autoscalers written against vLLM work unchanged. Stable.
  bool vllmCompatibleNames = false;
};

// Cluster identity (docs/security.md). With a secret file every internal
// connection (router <- workers, prefill <- decode, KV TCP) is mutually authenticated with
// it; without one the internal planes are open and every process warns at start. Loading
// reads the file (the one exception to "nothing here touches the filesystem": a secret that
// is missing, short or readable by others must stop the process at start, naming the key).
struct ClusterIdentityConfig {
  std::string secretFile;  // "" -> unauthenticated internal planes
  std::string secret;      // the file's bytes (trailing whitespace stripped); never logged
  bool authenticated() const { return !secret.empty(); }
};

struct ClusterConfig {
  std::string sourceName;  // the file (or name) it was parsed from, for messages
  ClusterIdentityConfig cluster;
  ModelConfig model;
  RouterConfig router;
  PoolsConfig pools;
  EngineConfig engine;
  KvTransferConfig kvTransfer;
  LoggingConfig logging;
  MetricsConfig metrics;
  // What loading found worth saying but not refusing, in file order, each also logged once:
  // "router.port is deprecated: use router.http.port" for each renamed key given by its old
  // path. The shipped configs have none.
  std::vector<std::string> warnings;
  // The experimental toggles turned on, by key path ("router.routing.adaptive_threshold").
  std::vector<std::string> experimental;
};

// The default buckets (before the SLO targets are inserted).
std::vector<double> defaultTtftBucketsS();
std::vector<double> defaultItlBucketsS();
std::vector<double> defaultE2eBucketsS();

// Reads and validates a file. Errors: kNotFound (cannot open), kInvalidArgument (YAML syntax,
// with line and column; or any schema problem). Thread-safe (no shared state).
Result<ClusterConfig> loadClusterConfig(const std::string& path);

// Same, from text; sourceName prefixes the messages ("<string>" if empty).
Result<ClusterConfig> parseClusterConfig(std::string_view yaml, std::string sourceName);

}  // namespace pd::config
