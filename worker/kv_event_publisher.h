// KvEventPublisher: the worker side of KV events (docs/kv_events.md). It turns the prefix
// cache's block events (engine::KvCacheManager::takeEvents) into KvEventBatch frames for the
// routers that take them (Hello.kv_events), so a router can index this worker exactly.
//
// Ordering: every batch gets the next sequence number of this process (1, 2, ...) and goes
// out on each router connection in that order (frames on one connection are never
// reordered). A router that (re)connects, or that saw a sequence number skipped and asks for
// it (KvEventsResync), gets a snapshot: ALL_BLOCKS_CLEARED then every named block, carrying
// the sequence number of the last batch it covers; the router drops older batches.
//
// Threads: the loop thread only (it owns the KV cache manager), except seq(), any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/metrics/metrics.h"
#include "common/proto/pdserve.pb.h"
#include "engine/kv_cache_manager.h"
#include "worker/router_links.h"

namespace pd::worker {

// `events` cut into runs that one wire event can carry: consecutive events of one kind and
// one tier that continue each other (stored: each block's parent the block before it; removed: any).
// ALL_BLOCKS_CLEARED is always a run of its own.
std::vector<std::span<const engine::KvBlockEvent>> kvEventRuns(std::span<const engine::KvBlockEvent> events);

// The proto form of `events`: one KvEvent per run.
void appendKvEvents(std::span<const engine::KvBlockEvent> events, proto::KvEventBatch* batch);

class KvEventPublisher {
 public:
  struct Sink {
    std::function<void(const proto::Envelope&)> broadcast;  // to every router that takes events
    std::function<void(RouterId, proto::Envelope)> sendTo;  // to one router
    // Optional: every flushed batch's events as the cache recorded them (token ids included),
    // with their creation time: the ZeroMQ publisher (worker/zmq_kv_publisher.h).
    std::function<void(std::span<const engine::KvBlockEvent>, uint64_t createdUnixUs)> tap;
  };
  // Turns the manager's event recording on. maxEventsPerFrame bounds one frame of a
  // snapshot (a large cache is sent as several frames with one seq).
  KvEventPublisher(engine::KvCacheManager& kv, Sink sink, metrics::Registry& registry, size_t maxEventsPerFrame = 8192);

  // Sends what the cache recorded since the last flush as the next batch (nothing when
  // nothing changed). The loop calls it once per iteration.
  void flush();
  // Sends `router` a snapshot of the cache (flushing first, so it covers everything).
  void snapshotTo(RouterId router);
  // The sequence number of the last batch sent (0: none yet).
  uint64_t seq() const { return seq_.load(); }

 private:
  engine::KvCacheManager& kv_;
  Sink sink_;
  size_t maxEventsPerFrame_;
  metrics::Counter batches_, snapshots_;
  std::atomic<uint64_t> seq_{0};
};

}  // namespace pd::worker
