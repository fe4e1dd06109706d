// What the prefill and decode workers share (DESIGN.md §2: the workers are thin): the loop
// thread's inbox, command-line flags, the engine built from the cluster config, the link to
// the router (registration and load reports, reconnecting when it drops), the /health and
// /metrics HTTP endpoint, and proto <-> engine conversions.
//
// Threading model (DESIGN.md §3): each worker has ONE loop thread that owns the engine, the
// transfer agent and every request table. Asio threads (net::IoPool) never touch them: their
// callbacks post closures into the LoopInbox, which the loop thread runs between steps.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "common/engine/engine.h"
#include "common/engine/model_weights.h"
#include "common/metrics/metrics.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/framed.h"
#include "common/net/http_server.h"
#include "common/proto/pdserve.pb.h"
#include "kvtransfer/agent.h"

namespace pd::worker {

// A multi-producer queue of closures that one consumer thread runs.
class LoopInbox {
 public:
  // Any thread.
  void post(std::function<void()> fn);
  // Loop thread: runs everything queued; when nothing was queued, first waits up to
  // `timeout` for something to arrive. Returns how many closures ran.
  size_t runPending(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

// pdserve-prefill / pdserve-decode flags (docs/deploy.md lists them).
struct WorkerFlags {
  std::string configPath = "deploy/configs/local.yaml";
  std::string routerHost = "127.0.0.1";
  int routerPort = 0;       // 0: the config's router.control_port
  std::string workerId;     // required
  std::string advertiseHost = "127.0.0.1";
  int port = 0;             // control RPC from peers (prefill); 0 = OS-chosen
  int transferPort = 0;     // kvtransfer tcp data port; 0 = --port + 1 when --port is set
  int metricsPort = 0;      // /health and /metrics; 0 = OS-chosen
  std::string modelPath;    // overrides model.path
};

// Parses argv (after the program name). Errors name the flag. --help prints `usage`
// and returns kCancelled.
Result<WorkerFlags> parseWorkerFlags(int argc, char** argv, const char* usage);

struct EngineBundle {
  std::shared_ptr<const engine::ModelWeights> model;
  std::unique_ptr<engine::Engine> engine;
  // The KV cache as the transfer agent registers it: one region per tensor-parallel rank, in
  // rank order, each laid out as engine->kv().layout() (a rank's share of the kv heads).
  std::vector<MemDesc> kvRegions;
  std::string modelName;        // served model id
  std::string fingerprint;      // model name + KV layout; peers must agree
  int64_t maxModelLen = 0;
};

// Loads the model and builds the engine as the config says. releaseKvOnFinish as for
// EngineOptions. Errors name the model path, the backend or the KV size.
Result<EngineBundle> buildEngine(const config::ClusterConfig& config, bool releaseKvOnFinish);

// The transfer agent a worker runs: the config's transports in preference order, listening
// on --transfer-port, with every KV region (one per rank) registered in all of them.
Result<std::unique_ptr<kvt::TransferAgent>> startTransferAgent(const config::ClusterConfig& config,
                                                               const WorkerFlags& flags,
                                                               const std::vector<MemDesc>& kvRegions,
                                                               metrics::Registry& registry);

// What a worker says in its first frame to the router and to peers.
proto::Hello workerHello(proto::Role role, const WorkerFlags& flags, const EngineBundle& bundle);

// proto <-> engine conversions.
engine::SamplingParams fromProto(const proto::SamplingParams& p);
proto::SamplingParams toProto(const engine::SamplingParams& p);
proto::TokenLogprob toProto(const engine::SampledToken& t);
engine::SampledToken fromProto(uint32_t tokenId, const proto::TokenLogprob& lp);

// The link to the router: dials it (retrying with backoff), says Hello with our role,
// keeps reconnecting after a drop. Incoming envelopes and state changes are posted to the
// inbox; send() may be called from the loop thread at any time (it fails while down).
class RouterLink {
 public:
  struct Handlers {
    std::function<void(proto::Envelope&&)> onMessage;  // loop thread
    std::function<void(bool up, const Status& why)> onState;  // loop thread
  };
  RouterLink(net::IoPool& io, LoopInbox& inbox, std::string host, int port, proto::Hello hello,
             Handlers handlers);
  ~RouterLink();
  void start();
  void stop();
  Status send(proto::Envelope env);
  bool isUp() const { return up_.load(); }

 private:
  void connectLoop();

  net::IoPool& io_;
  LoopInbox& inbox_;
  std::string host_;
  int port_;
  proto::Hello hello_;
  Handlers handlers_;
  std::mutex mu_;
  std::condition_variable cv_;
  net::ConnectionPtr conn_;
  std::atomic<bool> up_{false};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// Sets the worker's load gauges and, when the router link is up, sends a LoadReport.
// `load.waiting` should include requests the worker holds outside the engine.
void publishLoad(proto::Role role, const std::string& workerId, const engine::EngineLoad& load,
                 uint32_t inflightTransfers, metrics::WorkerMetrics& metrics, RouterLink& router);

// /health (200 when healthy() says so, else 503) and /metrics (the registry) on one port.
class StatusEndpoint {
 public:
  StatusEndpoint(net::IoPool& io, metrics::Registry& registry, std::function<bool()> healthy);
  // Binds host:port (0: OS-chosen). The callbacks run on the pool's threads.
  Status start(const std::string& host, int port);
  int port() const;

 private:
  net::IoPool& io_;
  metrics::Registry& registry_;
  std::function<bool()> healthy_;
  std::unique_ptr<net::HttpServer> server_;
};

// What every worker holds: its config, flags and engine, an I/O pool, a metrics registry
// with the {role, worker} labels, the /health + /metrics endpoint (healthy once registered
// with the router), the loop inbox and the transfer agent. Prefill and decode services
// derive from it and add their request tables. Members are for the derived loop thread,
// except where their own headers say otherwise.
class WorkerParts {
 protected:
  WorkerParts(config::ClusterConfig config, WorkerFlags flags, EngineBundle bundle,
              const std::string& role);

  config::ClusterConfig config_;
  WorkerFlags flags_;
  EngineBundle bundle_;
  engine::Engine& engine_;
  net::IoPool io_;
  metrics::Registry registry_;
  metrics::WorkerMetrics metrics_;
  std::atomic<bool> ready_{false};
  StatusEndpoint status_;
  LoopInbox inbox_;
  std::unique_ptr<kvt::TransferAgent> agent_;
};

// What a worker process runs.
class Service {
 public:
  virtual ~Service() = default;
  virtual Status start() = 0;
  // Ends in-flight work with an error the client can read and joins every thread.
  virtual void stop() = 0;
};
using ServiceFactory =
    std::function<Result<std::unique_ptr<Service>>(config::ClusterConfig, WorkerFlags)>;

// A worker's main(): flags, config, create, start, wait for SIGINT or SIGTERM, stop.
// Returns the process exit code (2 for usage and config errors, 1 for start-up failures).
int runWorkerMain(int argc, char** argv, const char* program, const char* usage,
                  const ServiceFactory& create);

}  // namespace pd::worker
