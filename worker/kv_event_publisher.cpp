#include "worker/kv_event_publisher.h"

#include <algorithm>
#include <chrono>

namespace pd::worker {
namespace {

proto::KvEvent::Kind toProtoKind(engine::KvBlockEvent::Kind k) {
  switch (k) {
    case engine::KvBlockEvent::Kind::kStored: return proto::KvEvent::BLOCK_STORED;
    case engine::KvBlockEvent::Kind::kRemoved: return proto::KvEvent::BLOCK_REMOVED;
    case engine::KvBlockEvent::Kind::kAllCleared: return proto::KvEvent::ALL_BLOCKS_CLEARED;
  }
  return proto::KvEvent::KIND_UNSPECIFIED;
}

uint64_t unixUsNow() {
  return uint64_t(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

}  // namespace

void appendKvEvents(std::span<const engine::KvBlockEvent> events, proto::KvEventBatch* batch) {
  proto::KvEvent* last = nullptr;
  for (const auto& e : events) {
    const auto kind = toProtoKind(e.kind);
    const bool merge = last && last->kind() == kind &&
                       ((kind == proto::KvEvent::BLOCK_STORED && last->block_hashes_size() > 0 &&
                         last->block_hashes(last->block_hashes_size() - 1) == e.parentHash) ||
                        kind == proto::KvEvent::BLOCK_REMOVED);
    if (!merge) {
      last = batch->add_events();
      last->set_kind(kind);
      if (kind == proto::KvEvent::BLOCK_STORED) last->set_parent_block_hash(e.parentHash);
    }
    if (kind != proto::KvEvent::ALL_BLOCKS_CLEARED) last->add_block_hashes(e.hash);
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
