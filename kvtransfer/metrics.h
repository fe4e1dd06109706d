// TransferMetrics: the pdserve_kv_transfer_* series (docs/design.md §6), labelled per transport.
//
//   pdserve_kv_transfer_bytes_total{transport}            bytes of completed transfers
//   pdserve_kv_transfers_total{transport,outcome}         outcome = ok | failed | cancelled
//   pdserve_kv_transfer_latency_seconds{transport}        post -> completion, ok transfers
//   pdserve_kv_transfer_failures_total{transport,code}    failed transfers by status code
//   pdserve_kv_transfer_fallbacks_total{from,to}          fabric transfers retried over tcp
//   pdserve_kv_peers{transport}                           peers loaded now, by the lane their
//                                                         transfers use (cma = same node)
//   pdserve_kv_transfer_gpu_path_total{path}              GPU-memory transfers posted, by path:
//                                                         direct (ucx / verbs dma-buf) | staged
//                                                         (tcp through pinned host memory)
//   pdserve_kv_writes_rejected_total{reason}              incoming writes refused by the
//                                                         receiver (writeRejectCounter below)
//
// The registry is owned by the caller and must outlive this object. prometheus-cpp metrics
// are thread-safe, so any thread may call these.
#pragma once

#include <functional>
#include <map>
#include <string>

#include "common/base/status.h"

namespace prometheus {
class Registry;
class Counter;
class Histogram;
class Gauge;
template <typename T>
class Family;
}  // namespace prometheus

namespace pd::kvt {

// pdserve_kv_writes_rejected_total{reason}: the TransportOptions::onWriteRejected the agent
// gives its transports (thread-safe; reasons as transport_factory.h lists them).
std::function<void(const std::string& reason)> writeRejectCounter(prometheus::Registry& registry);

class TransferMetrics {
 public:
  explicit TransferMetrics(prometheus::Registry& registry);

  void onSuccess(const std::string& transport, size_t bytes, double seconds);
  void onFailure(const std::string& transport, StatusCode code);
  void onCancel(const std::string& transport);
  void onFallback(const std::string& from, const std::string& to);
  void onGpuPath(const std::string& path);
  // A peer was loaded with `transport` as its primary lane / unloaded.
  void onPeerLane(const std::string& transport, int delta);

 private:
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Counter>& transfers_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Family<prometheus::Counter>& fallbacks_;
  prometheus::Family<prometheus::Counter>& gpuPath_;
  prometheus::Family<prometheus::Gauge>& peers_;
};

}  // namespace pd::kvt
