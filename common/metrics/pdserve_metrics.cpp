#include "common/metrics/pdserve_metrics.h"

#include <string>

namespace pd::metrics {

namespace {
std::string s(std::string_view v) { return std::string(v); }
}  // namespace

void exportVllmNames(Registry& registry, MetricsProcess process, const std::string& modelName) {
  std::vector<Registry::Alias> aliases;
  if (process == MetricsProcess::kRouter) {
    aliases = {{"pdserve_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"},
               {"pdserve_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"},
               // vLLM's name for the same per-token gap before 0.11; dashboards still use it.
               {"pdserve_inter_token_latency_seconds", "vllm:time_per_output_token_seconds"},
               {"pdserve_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"},
               {"pdserve_requests_finished_total", "vllm:request_success_total"}};
  } else {
    aliases = {{"pdserve_num_requests_running", "vllm:num_requests_running"},
               {"pdserve_num_requests_waiting", "vllm:num_requests_waiting"},
               {"pdserve_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"},
               {"pdserve_prompt_tokens_total", "vllm:prompt_tokens_total"},
               {"pdserve_generation_tokens_total", "vllm:generation_tokens_total"},
               {"pdserve_num_preemptions_total", "vllm:num_preemptions_total"},
               {"pdserve_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"},
               {"pdserve_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"}};
  }
  registry.setAliases(std::move(aliases), {{"model_name", modelName}});
}

void exportProcessInfo(Registry& registry, std::string_view component) {
  registry
      .gauge("pdserve_build_info", "pdserve's version and this process's component (value 1).",
             {{"component", s(component)}, {"version", PD_VERSION}})
      .set(1);
  registry.enableProcessMetrics();
}

void setInternalAuth(Registry& registry, bool authenticated) {
  registry
      .gauge("pdserve_internal_auth_enabled",
             "1 when the internal planes require the cluster secret (cluster.secret_file), 0 when they are open.")
      .set(authenticated ? 1 : 0);
}

void authFailure(Registry& registry, std::string_view plane) {
  registry
      .counter("pdserve_auth_failures_total", "Internal connections refused for failing cluster authentication.",
               {{"plane", std::string(plane)}})
      .inc();
}

void handshakeFailure(Registry& registry, std::string_view plane, std::string_view reason) {
  registry
      .counter("pdserve_handshake_failures_total",
               "Accepted internal connections closed before their handshake finished, by reason.",
               {{"plane", std::string(plane)}, {"reason", std::string(reason)}})
      .inc();
}

void leaseExpired(Registry& registry, std::string_view plane) {
  registry
      .counter("pdserve_peer_leases_expired_total",
               "Internal connections closed because the peer sent nothing (not even a heartbeat) for its lease.",
               {{"plane", std::string(plane)}})
      .inc();
}

void RouterMetrics::controlMessageDropped(std::string_view reason) {
  r_.counter("pdserve_control_messages_dropped_total",
             "Worker messages the router dropped (a request that was not dispatched to that worker).",
             {{"reason", std::string(reason)}})
      .inc();
}

constexpr const char* kRequestErrorsHelp =
    "Requests answered with an error, by type and where it arose (pool: router, prefill, decode).";

RouterMetrics::RouterMetrics(Registry& registry, LatencyBuckets buckets) : r_(registry), buckets_(std::move(buckets)) {
  // Shedding's series exist from the start, at 0: the shed ratio (deploy/prometheus) then reads
  // 0 rather than nothing until the first 429.
  for (std::string_view pool : {kPoolPrefill, kPoolDecode})
    r_.counter("pdserve_request_errors_total", kRequestErrorsHelp, {{"type", "overloaded"}, {"pool", s(pool)}});
  inFlight = r_.gauge("pdserve_requests_in_flight", "Requests accepted and not yet finished.");
  sseHeartbeats = r_.counter("pdserve_router_sse_heartbeats_total",
                             "SSE comment lines sent on streams silent for router.requests.stream_heartbeat_ms.");
  const std::string scaleHelp =
      "What overload admission multiplies its predictions by so that the SLO percentile holds: "
      "slo=ttft (predicted TTFT, per route), slo=itl (predicted decode step, route=all).";
  const char* routes[] = {"colocated", "disaggregated"};  // in router::Route's order
  for (size_t i = 0; i < admissionScaleTtft.size(); ++i) {
    admissionScaleTtft[i] =
        r_.gauge("pdserve_router_admission_scale", scaleHelp, {{"slo", "ttft"}, {"route", routes[i]}});
    admissionScaleTtft[i].set(1);
  }
  admissionScaleItl = r_.gauge("pdserve_router_admission_scale", scaleHelp, {{"slo", "itl"}, {"route", "all"}});
  admissionScaleItl.set(1);
  const auto sli = [this](const char* pool, const char* slo) {
    return Sli{r_.counter("pdserve_slo_observations_total",
                          "Latencies observed against a pool's SLO target (slo=ttft: requests' time to first token; "
                          "slo=itl: gaps between tokens).",
                          {{"pool", pool}, {"slo", slo}}),
               r_.counter("pdserve_slo_good_observations_total",
                          "Latencies observed within the pool's SLO target (pdserve_slo_target_seconds; ttft of "
                          "colocated requests against the prefill pool's TTFT target).",
                          {{"pool", pool}, {"slo", slo}})};
  };
  prefillTtft_ = sli("prefill", "ttft");
  colocatedTtft_ = sli("decode", "ttft");
  decodeItl_ = sli("decode", "itl");
  promptTokens_ = r_.counter("pdserve_router_prompt_tokens_total",
                             "Prompt tokens of finished requests, as billed (the workers' pdserve_prompt_tokens_total "
                             "counts the tokens each computed).");
  generationTokens_ = r_.counter("pdserve_router_generation_tokens_total",
                                 "Tokens generated for finished requests, as billed (the workers' "
                                 "pdserve_generation_tokens_total counts each worker's).");
}

void RouterMetrics::observeTtft(std::string_view route, double seconds) {
  r_.histogram("pdserve_time_to_first_token_seconds",
               "Time from request arrival to the first token sent to the client.", buckets_.ttftS,
               {{"route", s(route)}})
      .observe(seconds);
  // Disaggregated (recomputed ones too: they were routed to the prefill pool) or colocated.
  if (const double target = ttftTargetS_.load(std::memory_order_relaxed); target > 0)
    (route == kRouteColocated ? colocatedTtft_ : prefillTtft_).observe(seconds, target);
}

void RouterMetrics::observeItl(std::string_view route, double seconds) {
  r_.histogram("pdserve_inter_token_latency_seconds", "Time between successive tokens sent to the client.",
               buckets_.itlS, {{"route", s(route)}})
      .observe(seconds);
  if (const double target = itlTargetS_.load(std::memory_order_relaxed); target > 0)
    decodeItl_.observe(seconds, target);
}

void RouterMetrics::observeE2e(std::string_view route, double seconds) {
  r_.histogram("pdserve_e2e_request_latency_seconds", "Time from request arrival to the last byte of the response.",
               buckets_.e2eS, {{"route", s(route)}})
      .observe(seconds);
}

void RouterMetrics::observeQueueTime(std::string_view route, double seconds) {
  r_.histogram("pdserve_request_queue_time_seconds",
               "Time requests waited in worker queues before their first forward step.", buckets_.e2eS,
               {{"route", s(route)}})
      .observe(seconds);
}

void RouterMetrics::observeTtftPhase(std::string_view route, std::string_view phase, double seconds) {
  r_.histogram("pdserve_request_ttft_phase_seconds",
               "Time to first token split into phases (router_queue, decode_admission, kv_connect, "
               "prefill_queue, prefill_compute, kv_transfer, decode_first_token, other), each measured "
               "by the process it happens in.",
               buckets_.ttftS, {{"route", s(route)}, {"phase", s(phase)}})
      .observe(seconds);
}

void RouterMetrics::routeDecision(std::string_view route, std::string_view reason) {
  r_.counter("pdserve_route_decisions_total", "Routing decisions by route and reason.",
             {{"route", s(route)}, {"reason", s(reason)}})
      .inc();
}

void RouterMetrics::predictedCachedTokens(int64_t tokens) {
  r_.counter("pdserve_router_predicted_cached_tokens_total",
             "Prompt tokens the router routed to a worker it expected to hold them in its prefix "
             "cache (compare with the workers' pdserve_prefix_cache_hits_total).")
      .inc(double(tokens));
}

void RouterMetrics::prefixHit(int64_t predicted, int64_t exact, int64_t actual) {
  const auto tokens = [&](const char* source, int64_t n) {
    r_.counter("pdserve_router_prefix_hit_tokens_total",
               "Prompt tokens served from a prefix cache: as the predicted index expected (source=predicted), "
               "as the exact KV-event index expected (source=exact, requests whose worker's index was current) "
               "and as the worker reported (source=actual, and actual_exact_indexed for the requests counted "
               "in source=exact).",
               {{"source", source}})
        .inc(double(n));
  };
  const auto outcome = [&](const char* index, int64_t n) {
    r_.counter("pdserve_router_prefix_predictions_total",
               "Requests whose predicted prefix hit matched the worker's actual one, by index "
               "(outcome=match|over|under).",
               {{"index", index},
                {"outcome", n == actual  ? "match"
                            : n > actual ? "over"
                                         : "under"}})
        .inc();
  };
  tokens("predicted", predicted);
  tokens("actual", actual);
  outcome("predicted", predicted);
  if (exact >= 0) {
    tokens("exact", exact);
    tokens("actual_exact_indexed", actual);
    outcome("exact", exact);
  }
}

void RouterMetrics::setPrefixIndexBlocks(std::string_view worker, std::string_view index, int64_t blocks) {
  r_.gauge("pdserve_router_prefix_index_blocks",
           "Blocks the router's prefix index holds for a worker (index=exact: from its KV events; "
           "predicted: from what was routed to it).",
           {{"worker", s(worker)}, {"index", s(index)}})
      .set(double(blocks));
}

void RouterMetrics::setKvIndexCurrent(std::string_view worker, bool current) {
  r_.gauge("pdserve_router_kv_index_current",
           "1 while the worker is routed on its exact KV-event index, 0 on the predicted one.", {{"worker", s(worker)}})
      .set(current ? 1.0 : 0.0);
}

void RouterMetrics::observeKvEventLag(double seconds) {
  r_.histogram("pdserve_router_kv_event_lag_seconds",
               "KV event batch created on the worker -> applied to the router's exact index (two hosts' "
               "clocks: skew adds to it).",
               {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5})
      .observe(seconds);
}

void RouterMetrics::kvEventResync(std::string_view reason) {
  r_.counter("pdserve_router_kv_event_resyncs_total", "KV event snapshots the router asked a worker for.",
             {{"reason", s(reason)}})
      .inc();
}

void RouterMetrics::requestFinished(std::string_view finishedReason, int64_t promptTokens, int64_t completionTokens) {
  r_.counter("pdserve_requests_finished_total", "Finished requests by finish reason.",
             {{"finished_reason", s(finishedReason)}})
      .inc();
  promptTokens_.inc(static_cast<double>(promptTokens));
  generationTokens_.inc(static_cast<double>(completionTokens));
}

void RouterMetrics::requestError(std::string_view type, std::string_view pool) {
  r_.counter("pdserve_request_errors_total", kRequestErrorsHelp, {{"type", s(type)}, {"pool", s(pool)}}).inc();
  // A request shed for its predicted latency did not get its first token within the target:
  // a miss of the TTFT SLI of the pool that refused it (pool=decode: a stream refused for the
  // ITL target never started, so its TTFT is the one missed), as the autoscaler counts it.
  if (type == "overloaded" && ttftTargetS_.load(std::memory_order_relaxed) > 0) {
    if (pool == kPoolPrefill) prefillTtft_.all.inc();
    if (pool == kPoolDecode) colocatedTtft_.all.inc();
  }
}

void RouterMetrics::requestMigrated(std::string_view reason) {
  r_.counter("pdserve_request_migrations_total",
             "Requests whose unfinished choices continued on another decode worker, by reason.",
             {{"reason", s(reason)}})
      .inc();
}

void RouterMetrics::setSlo(std::string_view pool, double targetSeconds, double percentile) {
  (pool == kPoolPrefill ? ttftTargetS_ : itlTargetS_).store(targetSeconds, std::memory_order_relaxed);
  r_.gauge("pdserve_slo_target_seconds", "The pool's latency SLO target (prefill: TTFT, decode: ITL).",
           {{"pool", s(pool)}})
      .set(targetSeconds);
  r_.gauge("pdserve_slo_percentile", "The percentile the pool's SLO target applies to.", {{"pool", s(pool)}})
      .set(percentile);
}

void RouterMetrics::setSloWindow(std::string_view pool, double observedSeconds, double attainmentRatio) {
  r_.gauge("pdserve_slo_observed_seconds", "The SLO percentile of the pool's latency over the autoscaler window.",
           {{"pool", s(pool)}})
      .set(observedSeconds);
  r_.gauge("pdserve_slo_attainment_ratio", "Fraction of the window's observations within the pool's SLO target.",
           {{"pool", s(pool)}})
      .set(attainmentRatio);
}

void RouterMetrics::setPoolWorkers(std::string_view pool, int workers) {
  r_.gauge("pdserve_pool_workers", "Workers registered and reporting, per pool.", {{"pool", s(pool)}}).set(workers);
}

void RouterMetrics::setShortPromptTokens(int64_t tokens) {
  r_.gauge("pdserve_short_prompt_tokens",
           "Uncached prompt tokens at or under which a request is served colocated (the "
           "routing threshold now in use).")
      .set(double(tokens));
}

void RouterMetrics::setDesiredReplicas(std::string_view pool, int replicas) {
  r_.gauge("pdserve_desired_replicas", "Replicas the autoscaler recommends for the pool to meet its SLO.",
           {{"pool", s(pool)}})
      .set(replicas);
}

void RouterMetrics::setAutoscalerSignals(std::string_view pool, const AutoscalerSignals& a) {
  const struct {
    const char* name;
    const char* help;
    double value;
  } gauges[] = {
      {"pdserve_autoscaler_capacity_replicas",
       "Replicas the capacity model needs for the pool's work now at the scale-up utilization (-1: no measured "
       "prefill rate or fitted step line yet).",
       double(a.capacityReplicas)},
      {"pdserve_autoscaler_latency_replicas",
       "Replicas the observed-percentile rule recommends (-1: too few samples in the window).",
       double(a.latencyReplicas)},
      {"pdserve_autoscaler_demand",
       "The pool's work as the capacity model sees it: prefill, prompt tokens/s to serve (queued tokens / TTFT "
       "target + arrival rate); decode, streams running or waiting.",
       a.demand},
      {"pdserve_autoscaler_worker_capacity",
       "What one worker serves within the SLO: prefill, its measured prompt tokens/s; decode, streams its fitted "
       "step line allows within the ITL target at the scale-up utilization.",
       a.workerCapacity},
      {"pdserve_autoscaler_predicted_seconds",
       "Predicted from the load reports: prefill, the queue's share of TTFT (queued tokens / pool rate); decode, "
       "the step time at the pool's streams per worker.",
       a.predictedSeconds},
      {"pdserve_autoscaler_idle_seconds", "How long the pool has had no queued or running work and no arrival.",
       a.idleSeconds},
  };
  for (const auto& g : gauges) r_.gauge(g.name, g.help, {{"pool", s(pool)}}).set(g.value);
}

void WorkerMetrics::observeStep(int decodeRows, int64_t promptTokens, double seconds, double gapSeconds) {
  if (seconds <= 0) return;
  if (gapSeconds > 0) stepGapSeconds_.observe(gapSeconds);
  if (promptTokens > 0) {
    (decodeRows > 0 ? mixedStepSeconds_ : prefillStepSeconds_).observe(seconds);
  } else if (decodeRows > 0) {
    decodeStepSeconds_.observe(seconds);
  }
}

WorkerMetrics::WorkerMetrics(Registry& registry) : r_(registry) {
  running = r_.gauge("pdserve_num_requests_running", "Requests in the running batch.");
  waiting = r_.gauge("pdserve_num_requests_waiting", "Requests waiting to be scheduled.");
  kvCacheUsage = r_.gauge("pdserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).");
  queuedPrefillTokens = r_.gauge("pdserve_queued_prefill_tokens", "Prompt tokens waiting to be prefilled.");
  prefillChunkTokens =
      r_.gauge("pdserve_prefill_chunk_tokens",
               "Prompt tokens a step that also decodes may compute now (SLO-sized chunked prefill), counted at the "
               "start of a prompt: fewer deeper in, each priced by its attention context.");
  decodeStepBaseSeconds =
      r_.gauge("pdserve_decode_step_cost_seconds",
               "Fitted decode step time: the fixed part (part=base), per stream (part=per_stream) and what a "
               "minimum prompt chunk adds (part=small_chunk); 0 until the steps spread over two batch sizes.",
               {{"part", "base"}});
  decodeStepPerStreamSeconds = r_.gauge("pdserve_decode_step_cost_seconds", "", {{"part", "per_stream"}});
  decodeSmallChunkSeconds = r_.gauge("pdserve_decode_step_cost_seconds", "", {{"part", "small_chunk"}});
  kvNumBlocks = r_.gauge("pdserve_kv_cache_num_blocks", "KV cache blocks in the pool.");
  kvCapacityTokens =
      r_.gauge("pdserve_kv_cache_capacity_tokens", "Tokens of context the KV cache holds (blocks x block size).");
  kvFreeBlocks = r_.gauge("pdserve_kv_cache_free_blocks", "KV cache blocks free.");
  modelLoadSeconds = r_.gauge("pdserve_model_load_seconds",
                              "Seconds from opening the model to the backend ready (weights loaded, KV allocated).");
  transfersInFlight = r_.gauge("pdserve_kv_transfers_in_flight", "KV transfers posted and not complete.");
  kvBlocksQuarantined = r_.gauge("pdserve_kv_blocks_quarantined",
                                 "KV blocks held after their remote prefill ended, until its writer is known done.");
  kvQuarantineSeconds = r_.histogram("pdserve_kv_quarantine_seconds",
                                     "Time KV blocks spent quarantined, from the remote prefill's end to release.",
                                     {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300});
  const auto stepHistogram = [this](const char* kind) {
    return r_.histogram("pdserve_engine_step_seconds",
                        "One engine step (schedule, forward, sample), by what it computed: streams only (decode), "
                        "streams and prompt tokens (mixed), prompt tokens only (prefill).",
                        {0.005, 0.01, 0.025, 0.05, 0.075, 0.09, 0.1, 0.125, 0.15, 0.25, 0.5, 1, 2.5}, {{"kind", kind}});
  };
  decodeStepSeconds_ = stepHistogram("decode");
  mixedStepSeconds_ = stepHistogram("mixed");
  prefillStepSeconds_ = stepHistogram("prefill");
  stepGapSeconds_ = r_.histogram("pdserve_engine_step_gap_seconds",
                                 "The worker loop's time between one step's end and the next one's start while work "
                                 "was waiting (tokens out, messages, timers).",
                                 {0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1});
  promptTokens = r_.counter("pdserve_prompt_tokens_total", "Prompt tokens prefilled.");
  generationTokens = r_.counter("pdserve_generation_tokens_total", "Tokens generated.");
  preemptions = r_.counter("pdserve_num_preemptions_total", "Requests preempted.");
  prefixCacheQueries = r_.counter("pdserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.");
  prefixCacheHits = r_.counter("pdserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.");
}

void WorkerMetrics::setCacheConfig(int blockSize, int64_t numBlocks) {
  r_.gauge("pdserve_cache_config_info", "KV cache configuration (value 1).",
           {{"block_size", std::to_string(blockSize)}, {"num_blocks", std::to_string(numBlocks)}})
      .set(1);
  kvNumBlocks.set(static_cast<double>(numBlocks));
  kvCapacityTokens.set(static_cast<double>(numBlocks) * blockSize);
}

void WorkerMetrics::syncEngineCounters(int64_t totalPreemptions, int64_t totalQueryTokens, int64_t totalHitTokens) {
  preemptions.inc(double(totalPreemptions - seenPreemptions_));
  prefixCacheQueries.inc(double(totalQueryTokens - seenQueries_));
  prefixCacheHits.inc(double(totalHitTokens - seenHits_));
  seenPreemptions_ = totalPreemptions;
  seenQueries_ = totalQueryTokens;
  seenHits_ = totalHitTokens;
}

void WorkerMetrics::remotePrefillsIn(std::string_view state, int64_t count) {
  // Called every loop poll: the series is looked up in the registry once per state.
  auto it = remotePrefillStates_.find(state);
  if (it == remotePrefillStates_.end()) {
    Gauge g = r_.gauge("pdserve_remote_prefills",
                       "Remote prefills in each state of their lifecycle now (docs/architecture.md): waiting_blocks, "
                       "connecting, requested on decode workers; computing, pushing, ending on prefill workers.",
                       {{"state", s(state)}});
    it = remotePrefillStates_.emplace(s(state), g).first;
  }
  it->second.set(double(count));
}

void WorkerMetrics::remotePrefill(std::string_view outcome) {
  r_.counter("pdserve_remote_prefill_total", "Remote prefills by outcome (ok, recomputed locally, failed).",
             {{"outcome", s(outcome)}})
      .inc();
}

}  // namespace pd::metrics
