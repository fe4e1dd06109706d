// The peer-pull metrics (docs/metrics.md; docs/kv_cache.md, "Peer pulls"), counted the same way
// by both pull targets: a decode worker's pulls (decode_worker/remote_prefills.h) and a prefill
// worker's (prefill_worker/prefill_pulls.h).
//
// Threads: the worker loop thread (the registry's own locking makes any thread safe).
#pragma once

#include <cstdint>
#include <string>

#include "common/metrics/metrics.h"

namespace pd::worker {

// One pull ended: pdserve_kv_pulls_total{outcome, transport}, and for a done one its bytes
// (pdserve_kv_pull_bytes_total) and its time, blocks reserved -> PullDone
// (pdserve_kv_pull_seconds). `transport` "" (nothing moved) is counted as lane "none".
void countPeerPull(metrics::Registry& registry, const std::string& outcome, uint64_t bytes,
                   const std::string& transport, double seconds);

}  // namespace pd::worker
