// WorkerLoop: the one loop a worker process runs (docs/design.md §3, §10; docs/architecture.md).
// It owns the engine, the KV cache (through the engine), the transfer agent, the links to
// every router, the load reporter, the /health + /metrics endpoint, the per-request deadlines
// and the drain, and runs them on ONE loop thread. What a worker does with them is its role, a RolePolicy
// plugged in at start: the prefill role (prefill_worker/) and the decode role with colocated
// prefill (decode_worker/).
//
// One iteration: run what other threads posted -> fire due timers -> role.poll() (transfers,
// peers) -> one engine step (the role sees each finished layer and the step's events) ->
// publish the load snapshot. The loop never waits on another process: exchanges with peers
// are asynchronous (Asio callbacks post their results here) and every wait is a timer. Load
// reports and /health are served from the I/O pool, so they keep flowing during a long step.
//
// Threads: the constructor, prepare(), run(), drain() and stop() are for the owner (the
// service); post() and draining() from any thread; every other method, and every RolePolicy method, on the loop thread
// (before run(): on the owner's, while no loop runs).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "common/config/endpoints.h"
#include "common/metrics/metrics.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/io_pool.h"
#include "kvtransfer/agent.h"
#include "worker/engine_setup.h"
#include "worker/flags.h"
#include "worker/kv_event_publisher.h"
#include "worker/kv_tier_metrics.h"
#include "worker/load_reporter.h"
#include "worker/loop_inbox.h"
#include "worker/router_links.h"
#include "worker/status_endpoint.h"
#include "worker/step_trace.h"
#include "worker/zmq_kv_publisher.h"

namespace pd::worker {

// A role plugged into the loop. Every method runs on the loop thread.
class RolePolicy {
 public:
  virtual ~RolePolicy() = default;
  // From router `from` (a worker serves every router it is linked to).
  virtual void onRouterMessage(RouterId from, proto::Envelope&& env) = 0;
  virtual void onRouterState(RouterId router, bool up, const Status& why) {}
  // Layer `layer` of the step being computed is in the KV cache (prefill: push it now).
  virtual void onLayerDone(int layer, const engine::StepView& step) {}
  virtual void onStepEvents(const std::vector<engine::EngineEvent>& events) = 0;
  // Once per iteration before the step: settle transfers, admit what waited.
  virtual void poll() {}
  // How soon poll() must run again when nothing arrives: 0 while transfers we post are in
  // flight, ~1 ms while KV arrives (fabric transports progress in the agent), else the
  // loop's idle tick.
  virtual std::chrono::microseconds pollInterval() const { return std::chrono::milliseconds(20); }
  // What the role holds outside the engine.
  virtual void addLoad(LoadSnapshot& load) const {}
  // No request of this role is in flight (the drain waits for it).
  virtual bool idle() const = 0;
  // The loop is stopping: end every request with `why` (clients read it).
  virtual void shutdown(const Status& why) = 0;
};

class WorkerLoop {
 public:
  using TimerId = uint64_t;

  WorkerLoop(config::ClusterConfig config, WorkerFlags flags, EngineBundle bundle, proto::Role role);
  ~WorkerLoop();

  // Checks the endpoints' bind and advertised addresses (config::checkEndpoints: a wildcard
  // or, facing other hosts, a loopback address is never advertised), then starts the status
  // endpoint and the transfer agent; the role binds its own servers after, to bindHost().
  Status prepare();
  // Starts the loop thread, the router links (saying `hello`) and the load reporter.
  void run(RolePolicy& role, proto::Hello hello);
  // Drains: /health says 503 "draining", load reports say draining (the router routes nothing
  // new here), the role refuses new work (it asks draining()), and this waits until the role
  // is idle or `timeout` passed. stop() ends whatever is left.
  void drain(std::chrono::milliseconds timeout);
  // Stops the router links and the reporter, lets the role end its requests on the loop
  // thread, joins it, then stops the I/O pool. Idempotent.
  void stop();

  // Any thread: runs `fn` on the loop thread.
  void post(std::function<void()> fn) { inbox_.post(std::move(fn)); }
  // Inside a posted closure (a message handler): when it was posted (LoopInbox::postedAt).
  SteadyTime postedAt() const { return inbox_.postedAt(); }

  // Loop thread: `fn` runs at or after `when` unless cancelled first. Cancelling a timer that
  // fired or never existed is a no-op.
  TimerId at(SteadyTime when, std::function<void()> fn);
  // Loop thread: a lease that may be renewed. When it comes due, `fn` runs only if `expiry()`
  // (read then) has passed; otherwise the same timer waits on until expiry(). Renewing is
  // moving what expiry() returns: no timer is cancelled or armed per renewal. cancelTimer
  // ends it like any timer.
  TimerId lease(std::function<SteadyTime()> expiry, std::function<void()> fn);
  void cancelTimer(TimerId id);

  // Options for a control connection of this worker on `plane` (router_link, prefill_control,
  // prefill_link): the cluster secret when one is configured, and its auth failures counted in
  // pdserve_auth_failures_total{plane}. Any thread.
  net::ConnectionOptions controlOptions(std::string plane);
  // The same with the kv_transfer lease (heartbeat_ms, lease_ms): the decode <-> prefill planes,
  // where a remote prefill lives under it (docs/reliability.md, "Leases"). Leases that expire
  // are counted in pdserve_peer_leases_expired_total{plane}.
  net::ConnectionOptions leasedControlOptions(std::string plane);
  const auth::ClusterSecret& clusterSecret() const { return secret_; }

  const config::ClusterConfig& config() const { return config_; }
  const WorkerFlags& flags() const { return flags_; }
  const EngineBundle& bundle() const { return bundle_; }
  engine::Engine& engine() { return *bundle_.engine; }
  net::IoPool& io() { return io_; }
  metrics::Registry& registry() { return registry_; }
  metrics::WorkerMetrics& metrics() { return metrics_; }
  kvt::TransferAgent& agent() { return *agent_; }
  RouterLinks& routers() { return *routers_; }
  int metricsPort() const { return status_.port(); }
  bool draining() const { return draining_.load(); }
  // Where control and metrics endpoints bind: --bind-host, else pools.<role>.host.
  const std::string& bindHost() const { return bindHost_; }
  const char* roleName() const;

 private:
  void loop();
  void onRouterMessage(RouterId from, proto::Envelope&& env);
  void onRouterState(RouterId router, bool up, const Status& why);
  void runDueTimers();
  void insertTimer(TimerId id, SteadyTime when, std::function<void()> fn);
  struct Lease;
  void armLease(TimerId id, SteadyTime when, std::shared_ptr<Lease> lease);
  std::vector<std::string> routerHosts() const;
  std::chrono::microseconds idleWait() const;

  config::ClusterConfig config_;
  WorkerFlags flags_;
  EngineBundle bundle_;
  proto::Role role_;
  auth::ClusterSecret secret_;  // null: unauthenticated internal planes
  std::string bindHost_;
  net::IoPool io_;
  metrics::Registry registry_;
  metrics::WorkerMetrics metrics_;
  std::atomic<bool> routersUp_{false};  // registered with at least one router: /health says 200
  // routers_ as /health (an I/O thread) reads it: set once it exists, never reset.
  std::atomic<const RouterLinks*> healthLinks_{nullptr};
  std::atomic<bool> draining_{false};
  std::atomic<bool> idle_{true};  // the role's idle(), as of the last iteration
  // The last step planned nothing (its queue head waits for blocks others hold): the loop
  // waits for a change like an idle one instead of planning again at once (a spin at ~100%
  // CPU before). Loop thread only.
  bool stalled_ = false;
  StatusEndpoint status_;
  LoopInbox inbox_;
  std::unique_ptr<kvt::TransferAgent> agent_;
  std::unique_ptr<RouterLinks> routers_;
  std::unique_ptr<LoadReporter> reporter_;
  // Set when prefix caching and engine.kv_events.publish or .zmq_endpoint are on
  // (docs/kv_events.md); zmq_ is bound in prepare() when zmq_endpoint is set.
  std::unique_ptr<KvEventPublisher> kvEvents_;
  std::unique_ptr<ZmqKvPublisher> zmq_;
  std::unique_ptr<KvTierMetrics> kvTierMetrics_;
  std::unique_ptr<StepTrace> stepTrace_;  // logging.step_trace_dir
  bool kvToRouters_ = false;              // engine.kv_events.publish: batches and snapshots go to routers
  RolePolicy* policy_ = nullptr;

  // Timers, loop thread only.
  std::map<std::pair<SteadyTime, TimerId>, std::function<void()>> timers_;
  std::unordered_map<TimerId, SteadyTime> timerAt_;
  TimerId nextTimer_ = 1;

  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

}  // namespace pd::worker
