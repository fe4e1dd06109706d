// The prefill worker (`pdserve-prefill`, DESIGN.md §1 steps 2-4): decode workers send it
// PrefillRequests naming their reserved blocks (a KvTarget); it batches the prompts under
// its token budget with chunked prefill, pushes each layer's KV into the target blocks as
// soon as that layer is computed (so the transfer overlaps the next layers' compute),
// samples the first token, and sends PrefillDone only after the transport confirmed every
// write at the target. Its own KV blocks stay held until then, so no block is reused while
// a transfer still reads it.
//
// A Cancel, a deadline (PrefillRequest.deadline_ms) or the decode worker disconnecting ends
// the request: its transfers are cancelled and its blocks freed. A transfer failure is
// reported to the decode worker as an Error (it then recomputes or fails the request).
//
// Threads: start()/stop() from the owner; all request state lives on the loop thread.
#pragma once

#include <memory>

#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "common/worker/worker_runtime.h"

namespace pd::prefill {

class PrefillService : public worker::Service {
 public:
  static Result<std::unique_ptr<PrefillService>> create(config::ClusterConfig config,
                                                        worker::WorkerFlags flags);
  virtual int controlPort() const = 0;
  virtual int metricsPort() const = 0;
};

}  // namespace pd::prefill
