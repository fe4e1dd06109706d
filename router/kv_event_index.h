// router::KvEventIndex: the exact prefix index (docs/kv_events.md). Per worker that publishes
// KV events (Hello.kv_events), the set of block names its prefix cache holds, kept from its
// KvEventBatch frames: BLOCK_STORED adds names, BLOCK_REMOVED drops them, ALL_BLOCKS_CLEARED
// empties the set. The names are those of common/base/hash.h, the same the router computes
// for a prompt, so cachedTokens() is what the worker's cache would find now -- as of the
// last batch applied.
//
// Sync: a worker's index starts unsynced and becomes synced with a snapshot batch (one that
// begins with ALL_BLOCKS_CLEARED; further frames of it have the same seq). An incremental
// batch applies only when its seq is the next one; an older one is ignored, a skipped seq is
// a gap: the index is unsynced again and apply() says kGap (the caller asks the worker for a
// snapshot with KvEventsResync). Load reports carry the worker's last sent seq: when the index
// stays behind it for maxLag, the index is stale. current() is synced and not stale; the
// router routes a worker on this index only while it is current, on the predicted one
// (router/prefix_index.h) otherwise.
//
// Not thread-safe: the router loop's strand owns it (router/router_loop.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "common/base/clock.h"
#include "common/proto/pdserve.pb.h"

namespace pd::router {

class KvEventIndex {
 public:
  KvEventIndex(int blockSize, std::chrono::milliseconds maxLag)
      : blockSize_(blockSize > 0 ? blockSize : 16), maxLag_(maxLag) {}

  enum class Applied { kApplied, kIgnored, kGap };

  // The worker publishes events: tracked from now on, unsynced until its first snapshot
  // (which it sends when it registers, so takeResyncDue waits maxLag for it first).
  void addWorker(const std::string& worker);
  // The worker left: nothing is known of it.
  void forget(const std::string& worker) { workers_.erase(worker); }
  bool tracks(const std::string& worker) const { return workers_.count(worker) != 0; }

  // Applies a batch from `worker` (untracked: kIgnored).
  Applied apply(const std::string& worker, const proto::KvEventBatch& batch);
  // A load report said the worker had sent batches up to `seq`.
  void noteReportedSeq(const std::string& worker, uint64_t seq, SteadyTime now);
  bool current(const std::string& worker, SteadyTime now) const;
  // Whether the caller should ask `worker` for a snapshot now: tracked, not current, and no
  // request made in the last maxLag (a lost request is made again). Records the request.
  bool takeResyncDue(const std::string& worker, SteadyTime now);

  // Tokens of the longest run of leading blocks the worker holds in any tier (0 when
  // untracked): what routing counts as cached, a lower tier's block being promoted (copied)
  // instead of recomputed (docs/kv_cache.md, "Routing").
  int64_t cachedTokens(const std::string& worker, std::span<const uint64_t> hashes) const;
  // The same counting only blocks in the KV region itself.
  int64_t regionCachedTokens(const std::string& worker, std::span<const uint64_t> hashes) const;
  // Of cachedTokens()'s run, the tokens of blocks only the disk tier holds (neither the
  // region nor the host tier; a tier this router does not know counts as disk): what a
  // promotion would read from disk (router/pull_cost.h).
  int64_t diskOnlyTokens(const std::string& worker, std::span<const uint64_t> hashes) const;
  size_t blocks(const std::string& worker) const;  // names held in any tier
  size_t tierBlocks(const std::string& worker, int tier) const;
  uint64_t appliedSeq(const std::string& worker) const;

 private:
  struct WorkerState {
    std::unordered_map<uint64_t, uint8_t> blocks;  // name -> bit per tier holding it
    bool synced = false;
    uint64_t seq = 0;                       // last batch applied
    uint64_t reportedSeq = 0;               // the worker's, from its last load report
    std::optional<SteadyTime> behindSince;  // reportedSeq > seq since then
    std::optional<SteadyTime> resyncAskedAt;
  };
  static uint8_t tierBit(int tier);
  void applyEvents(WorkerState& w, const proto::KvEventBatch& batch);
  void caughtUp(WorkerState& w);

  int blockSize_;
  std::chrono::milliseconds maxLag_;
  std::unordered_map<std::string, WorkerState> workers_;
};

}  // namespace pd::router
