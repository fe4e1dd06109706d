#include "worker/kv_event_publisher.h"

#include <algorithm>
#include <chrono>

namespace pd::worker {
namespace {

proto::KvEvent::Kind toProtoKind(engine::KvBlockEvent::Kind k) {
  switch (k) {
    case engine::KvBlockEvent::Kind::kStored:
      return proto::KvEvent::BLOCK_STORED;
    case engine::KvBlockEvent::Kind::kRemoved:
      return proto::KvEvent::BLOCK_REMOVED;
    case engine::KvBlockEvent::Kind::kAllCleared:
      return proto::KvEvent::ALL_BLOCKS_CLEARED;
  }
  return proto::KvEvent::KIND_UNSPECIFIED;
}

uint64_t unixUsNow() {
  return uint64_t(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

}  // namespace

std::vector<std::span<const engine::KvBlockEvent>> kvEventRuns(std::span<const engine::KvBlockEvent> events) {
  using Kind = engine::KvBlockEvent::Kind;
  std::vector<std::span<const engine::KvBlockEvent>> runs;
  size_t begin = 0;
  for (size_t i = 1; i <= events.size(); ++i) {
    const bool continues = i < events.size() && events[i].kind == events[i - 1].kind &&
                           events[i].tier == events[i - 1].tier &&
                           (events[i].kind == Kind::kRemoved ||
                            (events[i].kind == Kind::kStored && events[i].parentHash == events[i - 1].hash));
    if (!continues) {
      runs.push_back(events.subspan(begin, i - begin));
      begin = i;
    }
  }
  return runs;
}

void appendKvEvents(std::span<const engine::KvBlockEvent> events, proto::KvEventBatch* batch) {
  for (const auto run : kvEventRuns(events)) {
    proto::KvEvent* e = batch->add_events();
    e->set_kind(toProtoKind(run.front().kind));
    if (run.front().kind == engine::KvBlockEvent::Kind::kAllCleared) continue;
    if (run.front().tier != engine::KvTier::kRegion) e->set_tier(proto::KvEvent::Tier(int(run.front().tier)));
    if (run.front().kind == engine::KvBlockEvent::Kind::kStored) e->set_parent_block_hash(run.front().parentHash);
    for (const auto& b : run) e->add_block_hashes(b.hash);
  }
}

KvEventPublisher::KvEventPublisher(engine::KvCacheManager& kv, Sink sink, metrics::Registry& registry,
                                   size_t maxEventsPerFrame)
    : kv_(kv),
      sink_(std::move(sink)),
      maxEventsPerFrame_(std::max<size_t>(1, maxEventsPerFrame)),
      batches_(registry.counter("pdserve_kv_event_batches_total", "KV event batches this worker sent",
                                {{"kind", "incremental"}})),
      snapshots_(registry.counter("pdserve_kv_event_batches_total", "KV event batches this worker sent",
                                  {{"kind", "snapshot"}})) {
  kv_.setEventRecording(true);
}

void KvEventPublisher::flush() {
  const uint64_t createdUs = kv_.oldestPendingEventUnixUs();
  std::vector<engine::KvBlockEvent> events = kv_.takeEvents();
  if (events.empty()) return;
  proto::Envelope env;
  auto* b = env.mutable_kv_events();
  b->set_seq(seq_.load() + 1);
  b->set_created_unix_us(createdUs);
  appendKvEvents(events, b);
  // The seq advances whether or not a router is up to hear it: a router that missed it
  // resynchronises from a snapshot.
  seq_.store(b->seq());
  sink_.broadcast(env);
  batches_.inc();
  if (sink_.tap) sink_.tap(events, createdUs);
}

void KvEventPublisher::snapshotTo(RouterId router) {
  flush();
  const std::vector<engine::KvBlockEvent> all = kv_.snapshotEvents();
  const uint64_t now = unixUsNow();
  for (size_t at = 0; at < all.size(); at += maxEventsPerFrame_) {
    proto::Envelope env;
    auto* b = env.mutable_kv_events();
    b->set_seq(seq_.load());
    b->set_created_unix_us(now);
    b->set_snapshot(true);
    const size_t n = std::min(maxEventsPerFrame_, all.size() - at);
    appendKvEvents(std::span(all).subspan(at, n), b);
    sink_.sendTo(router, std::move(env));
  }
  snapshots_.inc();
}

}  // namespace pd::worker
