#include "kvtransfer/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace pd::kvt {

namespace {
// 50 us .. ~13 s: a single-layer push on a fast fabric up to a whole long prompt over tcp.
prometheus::Histogram::BucketBoundaries latencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 50e-6; v < 15.0; v *= 2) b.push_back(v);
  return b;
}
}  // namespace

std::function<void(const std::string&)> writeRejectCounter(prometheus::Registry& registry) {
  auto* family = &prometheus::BuildCounter()
                      .Name("pdserve_kv_writes_rejected_total")
                      .Help(
                          "Incoming KV writes the receiver refused, by reason (unknown_grant: stale, replayed "
                          "or forged; outside_grant; grant_required; outside_region)")
                      .Register(registry);
  return [family](const std::string& reason) { family->Add({{"reason", reason}}).Increment(); };
}

TransferMetrics::TransferMetrics(prometheus::Registry& registry)
    : bytes_(prometheus::BuildCounter()
                 .Name("pdserve_kv_transfer_bytes_total")
                 .Help("Bytes of KV cache moved by completed transfers")
                 .Register(registry)),
      transfers_(prometheus::BuildCounter()
                     .Name("pdserve_kv_transfers_total")
                     .Help("KV transfers by transport and outcome (ok, failed, cancelled)")
                     .Register(registry)),
      latency_(prometheus::BuildHistogram()
                   .Name("pdserve_kv_transfer_latency_seconds")
                   .Help("Time from post to confirmed completion of a KV transfer")
                   .Register(registry)),
      failures_(prometheus::BuildCounter()
                    .Name("pdserve_kv_transfer_failures_total")
                    .Help("Failed KV transfers by transport and status code")
                    .Register(registry)),
      fallbacks_(prometheus::BuildCounter()
                     .Name("pdserve_kv_transfer_fallbacks_total")
                     .Help("Fabric KV transfers that failed on a live peer and were retried over tcp")
                     .Register(registry)),
      gpuPath_(prometheus::BuildCounter()
                   .Name("pdserve_kv_transfer_gpu_path_total")
                   .Help("KV transfers of GPU memory posted, by path: direct (ucx, verbs dma-buf) or "
                         "staged (tcp through pinned host memory)")
                   .Register(registry)),
      peers_(prometheus::BuildGauge()
                 .Name("pdserve_kv_peers")
                 .Help("Transfer peers loaded now, by the transport their transfers use (cma: same node)")
                 .Register(registry)) {}

void TransferMetrics::onSuccess(const std::string& transport, size_t bytes, double seconds) {
  bytes_.Add({{"transport", transport}}).Increment(double(bytes));
  transfers_.Add({{"transport", transport}, {"outcome", "ok"}}).Increment();
  latency_.Add({{"transport", transport}}, latencyBuckets()).Observe(seconds);
}

void TransferMetrics::onFailure(const std::string& transport, StatusCode code) {
  transfers_.Add({{"transport", transport}, {"outcome", "failed"}}).Increment();
  failures_.Add({{"transport", transport}, {"code", statusCodeName(code)}}).Increment();
}

void TransferMetrics::onCancel(const std::string& transport) {
  transfers_.Add({{"transport", transport}, {"outcome", "cancelled"}}).Increment();
}

void TransferMetrics::onFallback(const std::string& from, const std::string& to) {
  fallbacks_.Add({{"from", from}, {"to", to}}).Increment();
}

void TransferMetrics::onPeerLane(const std::string& transport, int delta) {
  auto& g = peers_.Add({{"transport", transport}});
  if (delta >= 0) {
    g.Increment(double(delta));
  } else {
    g.Decrement(double(-delta));
  }
}

void TransferMetrics::onGpuPath(const std::string& path) { gpuPath_.Add({{"path", path}}).Increment(); }

}  // namespace pd::kvt
