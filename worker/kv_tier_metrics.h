// KvTierMetrics: the KV tiers' figures (engine/kv_tiers.h, docs/kv_cache.md) as the worker's
// metrics (docs/metrics.md, "KV tiers"). The engine keeps counters since start; sync() turns
// them into Prometheus counters by their increase and sets the gauges.
//
// Threads: the worker loop thread (the one that owns the engine).
#pragma once

#include <cstdint>

#include "common/metrics/metrics.h"
#include "engine/kv_cache_manager.h"
#include "engine/kv_tiers.h"

namespace pd::worker {

class KvTierMetrics {
 public:
  explicit KvTierMetrics(metrics::Registry& registry);
  // `tiers` may be null (no lower tier): the region's figures only.
  void sync(const engine::KvCacheManager& kv, const engine::KvTierStore* tiers);

 private:
  struct Delta {
    metrics::Counter c;
    uint64_t seen = 0;
    void to(uint64_t total) {
      if (total > seen) c.inc(double(total - seen));
      seen = total;
    }
  };
  metrics::Gauge blocks_[engine::kNumKvTiers], bytes_[engine::kNumKvTiers];
  Delta hits_[engine::kNumKvTiers], evictions_[engine::kNumKvTiers];
  Delta demoteHost_, demoteDisk_, promoteHost_, promoteDisk_;
  Delta writesDropped_[3], filesDropped_[3];
  Delta waitedEvictions_;
};

}  // namespace pd::worker
