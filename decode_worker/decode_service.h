// The decode worker (`pdserve-decode`, docs/design.md §1): it owns every request the router gives
// it. Short prompts are prefilled here (colocated, chunked into the decode batches); long ones
// go through RemotePrefills (blocks reserved, a prefill worker pushes the prompt's KV, the
// first token comes with PrefillDone), then decode here like any other. Tokens stream to the
// router as TokenChunks; the WorkerLoop sends LoadReports from its I/O pool.
//
// Failure handling: see remote_prefills.h (recompute or fail per
// kv_transfer.on_remote_prefill_failure). A Cancel, or the router connection dropping, ends
// the request at once; a pending remote prefill is cancelled on the prefill worker.
//
// Threads: start()/stop() from the owner; all request state lives on the loop thread.
#pragma once

#include <memory>

#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "worker/flags.h"
#include "worker/worker_main.h"

namespace pd::decode {

class DecodeService : public worker::Service {
 public:
  // `weights`: see worker::buildEngine's `preloaded` (null: load config.model.path).
  static Result<std::unique_ptr<DecodeService>> create(config::ClusterConfig config, worker::WorkerFlags flags,
                                                       std::shared_ptr<const engine::ModelWeights> weights = nullptr);
};

}  // namespace pd::decode
