// The prefill worker (`pdserve-prefill`, docs/design.md §1 steps 2-4): decode workers dial its
// control port, run the kvtransfer exchange (KvConnect) and send PrefillRequests naming their
// reserved blocks. The prefill role plugged into the WorkerLoop batches the prompts under its
// token budget with chunked prefill, pushes each layer's KV into the target blocks as soon as
// that layer is computed (transfer overlaps the next layers' compute) and answers with
// PrefillDone once the transport confirmed every write (PrefillJobs owns that lifecycle).
//
// Threads: start()/stop() from the owner; all request state lives on the loop thread.
#pragma once

#include <memory>

#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "worker/flags.h"
#include "worker/worker_main.h"

namespace pd::prefill {

class PrefillService : public worker::Service {
 public:
  // `weights`: see worker::buildEngine's `preloaded` (null: load config.model.path).
  static Result<std::unique_ptr<PrefillService>> create(config::ClusterConfig config, worker::WorkerFlags flags,
                                                        std::shared_ptr<const engine::ModelWeights> weights = nullptr);
  virtual int controlPort() const = 0;
};

}  // namespace pd::prefill
