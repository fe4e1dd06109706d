// A worker process's main(): flags, config, create the service, start it, wait for SIGINT or
// SIGTERM, stop it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "common/metrics/metrics.h"
#include "engine/model_weights.h"
#include "worker/flags.h"

namespace pd::worker {

// What a worker process runs.
class Service {
 public:
  virtual ~Service() = default;
  virtual Status start() = 0;
  // The port /health and /metrics listen on (the bound one when --metrics-port is 0); valid
  // after start().
  virtual int metricsPort() const = 0;
  // Takes no new work and waits up to `timeout` for the in-flight requests to finish.
  virtual void drain(std::chrono::milliseconds timeout) = 0;
  // Ends in-flight work with an error the client can read and joins every thread.
  virtual void stop() = 0;
  // The model the engine computes from (EngineBundle::model), for the next service of this
  // process to be built on (a role switch, flex_worker/): cpu: the f32 host weights; cuda:
  // the description. Valid after create(); the pointer outlives the service.
  virtual std::shared_ptr<const engine::ModelWeights> weights() const = 0;
  // The service's metrics (one registry per service, constant labels role and worker): what
  // /metrics serves. Valid for the service's life; any thread.
  virtual metrics::Registry& registry() = 0;
  // KV blocks a remote writer may still write into: on a decode worker, those quarantined
  // after a remote prefill ended over a one-sided lane (cma, ucx, verbs; docs/reliability.md).
  // While any are held the process must not free or reuse that memory -- a role switch
  // waits for 0 (flex_worker/). Any thread.
  virtual int64_t kvBlocksQuarantined() { return 0; }
};
using ServiceFactory = std::function<Result<std::unique_ptr<Service>>(config::ClusterConfig, WorkerFlags)>;

// Writes --ports-file (when given) for a started service: "metrics N" (the router learns the
// control port at registration). Errors as writePortsFile.
Status writeServicePorts(const WorkerFlags& flags, const Service& service);

// Returns the process exit code (2 for usage and config errors, 1 for start-up failures).
// `description` heads --help, above the flags addWorkerFlags defines.
int runWorkerMain(int argc, char** argv, const char* program, const char* description, const ServiceFactory& create);

}  // namespace pd::worker
