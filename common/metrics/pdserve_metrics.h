// The pdserve metric sets, with the names of docs/design.md §6 in one place.
//
// Router (one RouterMetrics over the router's Registry, served at the router's /metrics):
//   pdserve_time_to_first_token_seconds{route}     histogram, router.ttft_buckets_s
//   pdserve_inter_token_latency_seconds{route}     histogram, router.itl_buckets_s
//   pdserve_e2e_request_latency_seconds{route}     histogram, router.e2e_buckets_s
//   pdserve_request_queue_time_seconds{route}      histogram, router.e2e_buckets_s
//   pdserve_request_ttft_phase_seconds{route,phase} histogram, router.ttft_buckets_s
//   pdserve_route_decisions_total{route,reason}    counter
//   pdserve_requests_finished_total{finished_reason}, pdserve_request_errors_total{type,pool}
//   pdserve_router_prompt_tokens_total, pdserve_router_generation_tokens_total (of finished
//   requests, as the client was billed; the workers' pdserve_prompt_tokens_total counts what
//   each worker computed, so the two never share a name), pdserve_requests_in_flight
//   pdserve_slo_target_seconds{pool}, pdserve_slo_percentile{pool},
//   pdserve_slo_observed_seconds{pool}, pdserve_slo_attainment_ratio{pool}
//   pdserve_slo_observations_total{pool,slo}, pdserve_slo_good_observations_total{pool,slo}
//     (each TTFT and ITL counted against its target as observed: the SLIs of the burn-rate
//     alerts, deploy/prometheus/pdserve-rules.yaml): pool=prefill,slo=ttft (disaggregated
//     requests), pool=decode,slo=ttft (colocated: the decode pool prefilled them),
//     pool=decode,slo=itl. A request shed with type "overloaded" counts as a TTFT miss of the
//     pool that shed it.
//   pdserve_pool_workers{pool}, pdserve_desired_replicas{pool}
//   pdserve_autoscaler_{capacity_replicas,latency_replicas,demand,worker_capacity,
//                       predicted_seconds,idle_seconds}{pool}
// route is "colocated" or "disaggregated"; pool is "prefill" or "decode".
//
// Worker (one WorkerMetrics over a Registry made with constant labels {role, worker}):
//   pdserve_num_requests_running, pdserve_num_requests_waiting, pdserve_kv_cache_usage_perc
//   (0..1), pdserve_queued_prefill_tokens, pdserve_kv_cache_num_blocks,
//   pdserve_kv_cache_capacity_tokens (blocks x block size: tokens of context the cache holds),
//   pdserve_kv_cache_free_blocks, pdserve_cache_config_info{block_size,num_blocks} (= 1),
//   pdserve_decode_step_cost_seconds{part},
//   pdserve_model_load_seconds (opening the model to the backend ready, at start),
//   pdserve_prompt_tokens_total, pdserve_generation_tokens_total,
//   pdserve_num_preemptions_total, pdserve_prefix_cache_queries_total /
//   pdserve_prefix_cache_hits_total (tokens),
//   pdserve_kv_transfers_in_flight, pdserve_remote_prefill_total{outcome} (ok | recomputed |
//   failed), pdserve_kv_blocks_quarantined (KV blocks a remote prefill that ended may still be
//   writing, held until its writer is known done: docs/reliability.md) and
//   pdserve_kv_quarantine_seconds (histogram: time from quarantine to release). The transfer layer's own metrics
//   (pdserve_kv_transfer_bytes_total, pdserve_kv_transfers_total, pdserve_kv_transfer_latency_seconds,
//   *_failures_total,
//   *_fallbacks_total) are registered by kvt::TransferAgent (kvtransfer/metrics.h) in the same
//   registry.
// Every process (exportProcessInfo): pdserve_build_info{component,version} (= 1) and the
//   standard process_* families (metrics.h, enableProcessMetrics).
// Both (cluster identity; docs/security.md):
//   pdserve_internal_auth_enabled (1: the internal planes require cluster.secret_file's
//   secret, 0: they are open), pdserve_auth_failures_total{plane} (handshakes refused for
//   authentication: router_control, router_link, prefill_control, prefill_link, kv_tcp),
//   pdserve_handshake_failures_total{plane,reason} (servers: accepted connections closed before
//   their handshake finished; reason auth, protocol, silent, timeout, closed, overload;
//   net/framed.h and the KV TCP receiver say when each applies),
//   pdserve_peer_leases_expired_total{plane} (workers: decode <-> prefill connections closed
//   for the peer's silence past kv_transfer.lease_ms: prefill_control, prefill_link).
// Router: pdserve_control_messages_dropped_total{reason} (a worker's message for a request
//   it was not given: wrong_worker).
// The gauges mirror vLLM's num_requests_running/waiting and kv_cache_usage_perc so that an
// Inference-Gateway endpoint picker or a KEDA trigger can use them unchanged.
//
// Threads: as Registry: every method from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/metrics/metrics.h"

namespace pd::metrics {

inline constexpr std::string_view kRouteColocated = "colocated";
inline constexpr std::string_view kRouteDisaggregated = "disaggregated";
inline constexpr std::string_view kPoolPrefill = "prefill";
inline constexpr std::string_view kPoolDecode = "decode";

// Histogram bounds in seconds (take them from config::RouterConfig; queue time uses e2eS).
struct LatencyBuckets {
  std::vector<double> ttftS;
  std::vector<double> itlS;
  std::vector<double> e2eS;
};

// metrics.vllm_compatible_names (docs/metrics.md has the table and why each pair means the
// same): the registry also exports vLLM's names, each series with model_name=<modelName>
// added to its labels (the router's keep their route label; the workers' their role and
// worker). Router: vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
// vllm:time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
// vllm:request_success_total. Worker (per engine, as vLLM counts): vllm:num_requests_running,
// vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:prompt_tokens_total,
// vllm:generation_tokens_total, vllm:num_preemptions_total, vllm:prefix_cache_queries_total,
// vllm:prefix_cache_hits_total.
enum class MetricsProcess { kRouter, kWorker };
void exportVllmNames(Registry& registry, MetricsProcess process, const std::string& modelName);

// pdserve_build_info{component,version} = 1 and the process_* families, on the registry a
// process serves at /metrics. component: router, prefill, decode or worker (a flex worker).
void exportProcessInfo(Registry& registry, std::string_view component);

// Cluster identity metrics, in any registry.
void setInternalAuth(Registry& registry, bool authenticated);
void authFailure(Registry& registry, std::string_view plane);
void handshakeFailure(Registry& registry, std::string_view plane, std::string_view reason);
// pdserve_peer_leases_expired_total{plane}: a connection closed for its peer's silence (docs/reliability.md).
void leaseExpired(Registry& registry, std::string_view plane);

class RouterMetrics {
 public:
  RouterMetrics(Registry& registry, LatencyBuckets buckets);

  void observeTtft(std::string_view route, double seconds);
  void observeItl(std::string_view route, double seconds);
  void observeE2e(std::string_view route, double seconds);
  void observeQueueTime(std::string_view route, double seconds);
  // One phase of a request's TTFT split (router/ttft_split.h: router_queue, decode_admission,
  // kv_connect, prefill_queue, prefill_compute, kv_transfer, decode_first_token, other).
  void observeTtftPhase(std::string_view route, std::string_view phase, double seconds);
  // reason: why this route ("short_prompt", "long_prompt", "no_prefill_worker", ...).
  void routeDecision(std::string_view route, std::string_view reason);
  // Prompt tokens the router expected the chosen worker to hold in its prefix cache.
  void predictedCachedTokens(int64_t tokens);
  // KV events and the exact prefix index (docs/kv_events.md).
  // A request's prefix hit as the predicted index saw it, as the exact index saw it (< 0: the
  // worker's exact index was not current), and as the worker reported it:
  // pdserve_router_prefix_hit_tokens_total{source} and
  // pdserve_router_prefix_predictions_total{index, outcome=match|over|under}.
  void prefixHit(int64_t predicted, int64_t exact, int64_t actual);
  // pdserve_router_prefix_index_blocks{worker, index=exact|predicted}.
  void setPrefixIndexBlocks(std::string_view worker, std::string_view index, int64_t blocks);
  // pdserve_router_kv_index_current{worker}: 1 while the worker is routed on its exact index.
  void setKvIndexCurrent(std::string_view worker, bool current);
  // pdserve_router_kv_event_lag_seconds: batch creation on the worker -> applied here.
  void observeKvEventLag(double seconds);
  // pdserve_router_kv_event_resyncs_total{reason=gap|lag}: snapshots asked of a worker.
  void kvEventResync(std::string_view reason);
  // finishedReason: stop | length | abort | error; tokens add to the token counters.
  void requestFinished(std::string_view finishedReason, int64_t promptTokens, int64_t completionTokens);
  // type: the OpenAI error type or a short class ("overloaded", "timeout"). pool: where the
  // error arose: "router" (refused before routing: authentication, validation, rate limits,
  // draining), "prefill" or "decode" (the pool whose worker or SLO refused or failed it).
  void requestError(std::string_view type, std::string_view pool);
  // A request moved its unfinished choices to another decode worker (reason: worker_lost, worker_gave_up).
  void requestMigrated(std::string_view reason);
  // Also the targets the pdserve_slo_*observations_total counters compare with (prefill: the
  // TTFT target of both routes; decode: the ITL target). Until set, no observation is counted.
  void setSlo(std::string_view pool, double targetSeconds, double percentile);
  // Over the autoscaler's window: the observed percentile and the fraction within target.
  void setSloWindow(std::string_view pool, double observedSeconds, double attainmentRatio);
  void setPoolWorkers(std::string_view pool, int workers);
  void setDesiredReplicas(std::string_view pool, int replicas);
  // The autoscaler's inputs behind pdserve_desired_replicas (router/autoscaler.h,
  // docs/metrics.md): pdserve_autoscaler_{capacity,latency}_replicas (-1: no opinion),
  // _demand, _worker_capacity, _predicted_seconds and _idle_seconds, per pool.
  struct AutoscalerSignals {
    int capacityReplicas = -1;
    int latencyReplicas = -1;
    double demand = 0;
    double workerCapacity = 0;
    double predictedSeconds = 0;
    double idleSeconds = 0;
  };
  void setAutoscalerSignals(std::string_view pool, const AutoscalerSignals& s);
  // Overload admission's prediction multipliers (router/admission.h, PercentileScale): TTFT
  // per route, indexed by router::Route (colocated, disaggregated), and ITL.
  std::array<Gauge, 2> admissionScaleTtft;
  Gauge admissionScaleItl;
  // The routing threshold in use (router.short_prompt_tokens, moved by the adaptive threshold).
  void setShortPromptTokens(int64_t tokens);
  // A worker's message dropped by the router (reason: wrong_worker).
  void controlMessageDropped(std::string_view reason);

  Gauge inFlight;  // requests accepted and not yet finished
  // pdserve_router_sse_heartbeats_total: SSE comment lines sent on silent streams
  // (router.requests.stream_heartbeat_ms).
  Counter sseHeartbeats;

 private:
  // One (pool, slo) SLI: every observation, and those within the target.
  struct Sli {
    Counter all, good;
    void observe(double seconds, double target) {
      all.inc();
      if (seconds <= target) good.inc();
    }
  };
  Registry& r_;
  LatencyBuckets buckets_;
  std::atomic<double> ttftTargetS_{0}, itlTargetS_{0};  // 0: not set yet
  Sli prefillTtft_, colocatedTtft_, decodeItl_;
  Counter promptTokens_;
  Counter generationTokens_;
};

class WorkerMetrics {
 public:
  explicit WorkerMetrics(Registry& registry);

  // The KV pool's shape: pdserve_cache_config_info, pdserve_kv_cache_num_blocks and
  // pdserve_kv_cache_capacity_tokens.
  void setCacheConfig(int blockSize, int64_t numBlocks);
  void remotePrefill(std::string_view outcome);
  // pdserve_remote_prefills{state}: how many remote prefills are in `state` now (every state
  // of the lifecycle has a deadline and a metric). The worker's loop thread only.
  void remotePrefillsIn(std::string_view state, int64_t count);
  // Brings the preemption and prefix-cache counters up to cumulative totals kept elsewhere
  // (the engine's); counts only the growth since the last call.
  void syncEngineCounters(int64_t totalPreemptions, int64_t totalQueryTokens, int64_t totalHitTokens);

  Gauge running;
  Gauge waiting;
  Gauge kvCacheUsage;  // used / total blocks, 0..1
  Gauge queuedPrefillTokens;
  Gauge prefillChunkTokens;
  // The fitted decode step cost, pdserve_decode_step_cost_seconds{part}: set in seconds.
  Gauge decodeStepBaseSeconds, decodeStepPerStreamSeconds, decodeSmallChunkSeconds;
  Gauge kvNumBlocks;
  Gauge kvCapacityTokens;  // set with kvNumBlocks by setCacheConfig
  Gauge kvFreeBlocks;
  Gauge modelLoadSeconds;
  Gauge transfersInFlight;
  Gauge kvBlocksQuarantined;
  Histogram kvQuarantineSeconds;
  // One engine step (engine::StepRecord's fields): pdserve_engine_step_seconds{kind}, by what
  // it computed: "decode" (streams only), "mixed" (streams and prompt tokens), "prefill"
  // (prompt tokens only); and pdserve_engine_step_gap_seconds, the loop's time before it
  // while work was waiting (tokens out, KV events, messages, timers). Together what each
  // stream waited for its next token, before the hop to the router. A step that computed
  // nothing is not counted; a gap of 0 (none) neither.
  void observeStep(int decodeRows, int64_t promptTokens, double seconds, double gapSeconds);
  Counter promptTokens;
  Counter generationTokens;
  Counter preemptions;
  Counter prefixCacheQueries;
  Counter prefixCacheHits;

 private:
  Registry& r_;
  int64_t seenPreemptions_ = 0, seenQueries_ = 0, seenHits_ = 0;
  std::map<std::string, Gauge, std::less<>> remotePrefillStates_;                         // remotePrefillsIn's series
  Histogram decodeStepSeconds_, mixedStepSeconds_, prefillStepSeconds_, stepGapSeconds_;  // observeStep's
};

}  // namespace pd::metrics
