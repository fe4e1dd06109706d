#include "worker/pull_metrics.h"

namespace pd::worker {

void countPeerPull(metrics::Registry& registry, const std::string& outcome, uint64_t bytes,
                   const std::string& transport, double seconds) {
  const std::string lane = transport.empty() ? "none" : transport;
  registry
      .counter("pdserve_kv_pulls_total",
               "Peer pulls by outcome (done, fell_back, refused) and lane (docs/kv_cache.md, \"Peer pulls\").",
               {{"outcome", outcome}, {"transport", lane}})
      .inc();
  if (outcome != "done") return;
  registry.counter("pdserve_kv_pull_bytes_total", "KV bytes received by peer pulls, by lane.", {{"transport", lane}})
      .inc(double(bytes));
  registry
      .histogram("pdserve_kv_pull_seconds", "Peer pulls that were done: blocks reserved -> PullDone, by lane.",
                 {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}, {{"transport", lane}})
      .observe(seconds);
}

}  // namespace pd::worker
