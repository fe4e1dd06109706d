#include "worker/kv_tier_metrics.h"

namespace pd::worker {
namespace {

metrics::Counter counter(metrics::Registry& r, const char* name, const char* help, const char* label,
                         const char* value) {
  return r.counter(name, help, {{label, value}});
}

}  // namespace

KvTierMetrics::KvTierMetrics(metrics::Registry& r) {
  for (int t = 0; t < engine::kNumKvTiers; ++t) {
    const char* tier = engine::kvTierName(engine::KvTier(t));
    blocks_[t] =
        r.gauge("pdserve_kv_tier_blocks",
                "Named KV blocks each tier holds now (region: the KV cache's cached prefix blocks).", {{"tier", tier}});
    bytes_[t] =
        r.gauge("pdserve_kv_tier_bytes", "Bytes of KV the named blocks of each tier take now.", {{"tier", tier}});
    hits_[t] = {counter(r, "pdserve_kv_tier_hit_blocks_total",
                        "Prefix-cache blocks requests attached instead of computing, by the tier that held them "
                        "(host, disk: promoted into the region for it).",
                        "tier", tier)};
    evictions_[t] = {counter(r, "pdserve_kv_tier_evictions_total",
                             "Named blocks each tier dropped to make room (region: demoted to host when it is on).",
                             "tier", tier)};
  }
  demoteHost_ = {counter(r, "pdserve_kv_tier_demotions_total",
                         "Blocks copied down a tier: to host when the region evicts them, to disk when written.", "to",
                         "host")};
  demoteDisk_ = {counter(r, "pdserve_kv_tier_demotions_total",
                         "Blocks copied down a tier: to host when the region evicts them, to disk when written.", "to",
                         "disk")};
  promoteHost_ = {counter(r, "pdserve_kv_tier_promotions_total",
                          "Blocks copied back into the KV region from a lower tier instead of recomputed.", "from",
                          "host")};
  promoteDisk_ = {counter(r, "pdserve_kv_tier_promotions_total",
                          "Blocks copied back into the KV region from a lower tier instead of recomputed.", "from",
                          "disk")};
  waitedEvictions_ = {r.counter("pdserve_kv_tier_waited_evictions_total",
                                "Region evictions the worker loop waited for a device-to-host copy on (cuda: demotion "
                                "ahead of need did not keep up).",
                                {})};
  const char* writeWhy[3] = {"queue_full", "disk_full", "error"};
  const char* fileWhy[3] = {"corrupt", "truncated", "foreign"};
  for (int i = 0; i < 3; ++i) {
    writesDropped_[i] = {counter(r, "pdserve_kv_tier_disk_writes_dropped_total",
                                 "Blocks not written to the disk tier (the write queue full, the disk full or its "
                                 "byte bound taken by queued writes, a write error).",
                                 "reason", writeWhy[i])};
    filesDropped_[i] = {counter(r, "pdserve_kv_tier_disk_files_dropped_total",
                                "Disk tier files deleted instead of loaded: corrupt (checksum, header), truncated, "
                                "or made for another model identity.",
                                "reason", fileWhy[i])};
  }
}

void KvTierMetrics::sync(const engine::KvCacheManager& kv, const engine::KvTierStore* tiers) {
  const auto& ks = kv.stats();
  const double stride = double(kv.blockStrideBytes());
  blocks_[0].set(kv.numNamedBlocks());
  bytes_[0].set(kv.numNamedBlocks() * stride);
  for (int t = 0; t < engine::kNumKvTiers; ++t) hits_[t].to(ks.hitBlocks[t]);
  evictions_[0].to(ks.evictions);
  promoteHost_.to(ks.promotedBlocks[int(engine::KvTier::kHost)]);
  promoteDisk_.to(ks.promotedBlocks[int(engine::KvTier::kDisk)]);
  if (tiers == nullptr) return;
  const engine::KvTierStats s = tiers->stats();
  blocks_[1].set(double(s.hostBlocks));
  bytes_[1].set(double(s.hostBlocks) * double(s.blockBytes));  // every rank's share
  blocks_[2].set(double(s.diskBlocks));
  bytes_[2].set(double(s.diskBytes));
  evictions_[1].to(s.hostEvictions);
  evictions_[2].to(s.diskEvictions);
  demoteHost_.to(s.demotionsToHost);
  demoteDisk_.to(s.diskWrites);
  waitedEvictions_.to(s.waitedEvictions);
  for (int i = 0; i < 3; ++i) {
    writesDropped_[i].to(s.diskWritesDropped[i]);
    filesDropped_[i].to(s.diskFilesDropped[i]);
  }
}

}  // namespace pd::worker
