// The router loop: one Asio strand that owns the router's shared state -- the worker table
// (router/worker_registry.h), the request table (worker request id -> its stream), the
// routing policy, the prefix index, the autoscaler and the adaptive threshold -- and runs the
// route stage of each request (docs/design.md §6). The control plane's callbacks and the HTTP
// handlers post into it; it hands each request's per-token work (detokenizing, stop strings,
// SSE) to that request's own strand (router/request_stream.h), so nothing slow runs here.
//
// Timers, all on the strand, no polling: each worker's report timeout (in the registry), the
// autoscaler tick every router.autoscaler.tick_ms (pdserve_desired_replicas and the signals
// behind it, from the workers' views and the latency windows; the adaptive threshold), and
// each request's deadline (on the request's strand).
//
// Threads: every public method may be called from any thread and never blocks; the work
// runs on the strand, on an IoPool thread. blockHashes() is pure and runs on the caller.
// The loop must outlive the IoPool's threads (stop the pool, then destroy the loop).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "common/config/cluster_config.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/framed.h"
#include "router/adaptive_threshold.h"
#include "router/admission.h"
#include "router/autoscaler.h"
#include "router/kv_event_index.h"
#include "router/prefix_index.h"
#include "router/request_stream.h"
#include "router/routing_policy.h"
#include "router/worker_registry.h"

namespace pd::router {

class RouterLoop final : public StreamOwner {
 public:
  RouterLoop(boost::asio::io_context& io, const config::ClusterConfig& cfg, std::string modelName,
             metrics::Registry& registry, metrics::RouterMetrics& metrics);

  // Starts the autoscaler tick (its first run is immediate).
  void start();

  // Control plane: a worker's connection opened (Hello received), sent a message, closed.
  void workerOpened(net::ConnectionPtr conn);
  void workerMessage(net::ConnectionPtr conn, proto::Envelope env);
  void workerClosed(net::ConnectionPtr conn, Status why);

  // Route stage: picks the workers for a parsed request and starts its stream there, or
  // has the stream answer 503 when no decode worker is healthy.
  void submit(std::shared_ptr<RequestStream> stream);
  // done(number of healthy decode workers) runs on the strand; it must not block.
  void healthyDecodeWorkers(std::function<void(int)> done);

  // Drain (SIGTERM): from now on new requests are refused with a 503 that says so.
  void startDrain() { draining_ = true; }
  bool draining() const { return draining_.load(); }
  // done(requests still streaming) runs on the strand.
  void inFlight(std::function<void(size_t)> done);
  // Ends every request still streaming with `why` (an error event, then [DONE]).
  void failAll(Status why);

  // The prompt's block hashes for prefix-aware routing (none when it is off). Any thread.
  std::vector<uint64_t> blockHashes(std::span<const int32_t> prompt) const;

  // StreamOwner.
  void choicesEnded(std::vector<uint64_t> workerRequestIds) override;
  void observeTokens(const TokenTiming& timing) override;
  void migrate(std::shared_ptr<RequestStream> stream, std::vector<uint64_t> oldIds, int64_t promptTokens,
               std::string leftWorker) override;

 private:
  struct Entry {
    std::shared_ptr<RequestStream> stream;
    std::string decodeWorker;
    uint64_t decodeConnId = 0;  // the connection it was dispatched on: the only one heard for it
    // What this choice counts in the registry's routed work (WorkerRegistry::noteRouted):
    // prompt tokens on `prefillWorker` until the first chunk arrives, a stream on decodeWorker.
    std::string prefillWorker;
    int64_t prefillTokens = 0;
    // Admission's TTFT prediction for it, on which route, and when it was routed, until its
    // first token calibrates that route's next predictions (admission_); 0: none made.
    double predictedTtftS = 0;
    Route predictedRoute = Route::kColocated;
    SteadyTime routedAt{};
  };

  template <typename F>
  void onStrand(F&& f);
  void route(const std::shared_ptr<RequestStream>& stream);
  // The plan for a prompt (prefix blocks: its hashes, or none), skipping worker `exclude`;
  // *prefilling and *decoding get the views of the workers that will prefill and decode it.
  // Per pull-serving decode worker, the peer pull predicted to serve it more of the prompt
  // (router/pull_cost.h); their cachedTokens grow by the pulled tokens.
  std::unordered_map<std::string, PullChoice> pullChoices(std::vector<WorkerView>& views) const;
  // The decode workers as pull sources, each lane the fleet measured filled in where a worker
  // has not measured its own; `fleetRate`: the fleet's mean prefill rate (0: none measured).
  std::vector<PullCandidate> pullCandidates(const std::vector<WorkerView>& views, double* fleetRate) const;
  std::optional<RoutePlan> plan(int64_t promptTokens, const std::vector<uint64_t>& blocks, const std::string& exclude,
                                WorkerView* prefilling, WorkerView* decoding);
  // The plan is taken: metrics and the prefix index learn it.
  void commit(const RoutePlan& plan, const std::vector<uint64_t>& blocks);
  // The Dispatch of `plan`: n fresh worker request ids, entered in the request table, their
  // work counted on the workers (the prompt's uncached tokens once, a stream per choice).
  Dispatch dispatch(const std::shared_ptr<RequestStream>& stream, RoutePlan plan, int n, int64_t promptTokens);
  void onChunk(const net::ConnectionPtr& from, proto::TokenChunk&& chunk);
  // Removes a choice from the request table and its work from the workers' counts.
  void forget(uint64_t workerRequestId);
  // KV events (docs/kv_events.md): a batch, and the seq a load report names.
  void onKvEvents(const net::ConnectionPtr& from, const proto::KvEventBatch& batch);
  void onLoadReport(const net::ConnectionPtr& from, const proto::LoadReport& report);
  // The registered id of the worker on `conn` ("" when conn is not its registered connection).
  std::string registeredId(const net::ConnectionPtr& conn) const;
  void askResync(const net::ConnectionPtr& conn, const std::string& id, std::string_view reason);
  void refuseWorker(const net::ConnectionPtr& conn, const Status& why);
  void onWorkerClosed(const net::ConnectionPtr& conn, const Status& why);
  // Every request streaming from decode worker `id` moves elsewhere (router/request_stream.h).
  void migrateFrom(const std::string& id, const Status& why);
  void scheduleAutoscale(std::chrono::steady_clock::duration after);
  void autoscale(SteadyTime now);

  boost::asio::strand<boost::asio::io_context::executor_type> strand_;
  std::atomic<bool> draining_{false};
  const config::ClusterConfig& cfg_;
  const std::string modelName_;
  metrics::RouterMetrics& metrics_;
  const bool prefixAware_;
  const bool exactRouting_;  // prefixAware_ and router.exact_prefix_routing
  // blockHashes() only reads the block size, so the hasher is shared without the strand;
  // the index (which workers hold what) lives on it.
  const PrefixIndex hasher_;

  // Strand state.
  WorkerRegistry workers_;
  RoutingPolicy policy_;
  PrefixIndex prefixIndex_;  // predicted: every worker, the fallback
  KvEventIndex exactIndex_;  // exact: workers that publish KV events
  Autoscaler autoscaler_;
  std::optional<AdaptiveThreshold> threshold_;            // set when router.adaptive_threshold
  int lastDesiredPrefill_ = -1, lastDesiredDecode_ = -1;  // for the change log
  boost::asio::steady_timer autoscaleTimer_;
  // Overload admission and its learned prediction scales (router/admission.h).
  AdmissionControl admission_;
  std::unordered_map<uint64_t, Entry> requests_;  // by worker request id, until the choice ends
  // Worker request ids are random 64-bit values, not a sequence: workers serve several
  // routers at once (docs/deploy.md), and the ids of two routers must not collide on a worker.
  uint64_t newRequestId();
};

}  // namespace pd::router
