// The decode worker (`pdserve-decode`, DESIGN.md §1): it owns every request the router gives
// it. Short prompts are prefilled here (colocated); for long ones it reserves KV blocks,
// asks a prefill worker to push the prompt's KV into them (PrefillRequest with a KvTarget),
// takes the first token from PrefillDone and decodes on. Tokens stream to the router as
// TokenChunks; LoadReports go out every router.load_report_interval_ms.
// Each connection to a prefill worker starts with the kvtransfer exchange (KvConnect: our
// offer made for that worker, its reply loaded here); its PrefillRequests queue until then.
//
// Failure handling: a remote prefill that fails, times out (kv_transfer.timeout_ms), whose
// prefill worker disconnects, or refuses or never answers KvConnect is recomputed here or
// failed, per
// kv_transfer.on_remote_prefill_failure. A Cancel (or the router going away) ends the request
// at once and frees its blocks; a pending remote prefill is cancelled on the prefill worker.
//
// Threads: start()/stop() from the owner; all request state lives on the loop thread.
#pragma once

#include <memory>

#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "common/worker/worker_runtime.h"

namespace pd::decode {

class DecodeService : public worker::Service {
 public:
  static Result<std::unique_ptr<DecodeService>> create(config::ClusterConfig config,
                                                       worker::WorkerFlags flags);
  virtual int metricsPort() const = 0;
};

}  // namespace pd::decode
