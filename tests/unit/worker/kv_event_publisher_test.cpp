// worker::KvEventPublisher against a real KvCacheManager and a recording sink: batches in seq
// order, chains merged, snapshots cut into frames with the seq of the last batch.
#include "worker/kv_event_publisher.h"

#include <numeric>

#include <catch2/catch.hpp>

#include "tests/unit/worker/small_kv.h"

using namespace pd;
using namespace pd::worker;

namespace {

struct Sent {
  std::vector<proto::Envelope> all;
  std::vector<std::pair<RouterId, proto::Envelope>> to;
};

}  // namespace

TEST_CASE("kv event publisher: one batch per flush, chains merged, snapshots framed with the last seq") {
  auto kv = pd::test::smallAccountingKv(8, 2);
  metrics::Registry reg;
  Sent sent;
  KvEventPublisher pub(
      *kv,
      KvEventPublisher::Sink{[&](const proto::Envelope& e) { sent.all.push_back(e); },
                             [&](RouterId r, proto::Envelope e) { sent.to.emplace_back(r, std::move(e)); },
                             /*tap=*/{}},
      reg, /*maxEventsPerFrame=*/2);
  pub.flush();
  CHECK(sent.all.empty());  // nothing changed: no batch, no seq
  CHECK(pub.seq() == 0);

  std::vector<int32_t> a(6);
  std::iota(a.begin(), a.end(), 1);
  REQUIRE(kv->allocate(1, 6).isOk());
  REQUIRE(kv->cacheComputedBlocks(1, a, 6).isOk());
  pub.flush();
  REQUIRE(sent.all.size() == 1);
  const auto& b1 = sent.all[0].kv_events();
  CHECK(b1.seq() == 1);
  CHECK_FALSE(b1.snapshot());
  CHECK(b1.created_unix_us() > 0);
  REQUIRE(b1.events_size() == 1);  // three chained blocks: one event
  CHECK(b1.events(0).kind() == proto::KvEvent::BLOCK_STORED);
  CHECK(b1.events(0).parent_block_hash() == kRootBlockHash);
  const auto names = blockHashChain(a, 2);
  REQUIRE(b1.events(0).block_hashes_size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(b1.events(0).block_hashes(i) == names[size_t(i)]);

  // Evictions: free a, then take the whole pool.
  REQUIRE(kv->free(1).isOk());
  REQUIRE(kv->allocate(2, 16).isOk());
  pub.flush();
  REQUIRE(sent.all.size() == 2);
  const auto& b2 = sent.all[1].kv_events();
  CHECK(b2.seq() == 2);
  REQUIRE(b2.events_size() == 1);
  CHECK(b2.events(0).kind() == proto::KvEvent::BLOCK_REMOVED);
  CHECK(b2.events(0).block_hashes_size() == 3);

  // A snapshot of 3 named blocks (+ the clear) in frames of 2 events, all with seq 2.
  REQUIRE(kv->free(2).isOk());
  REQUIRE(kv->allocate(3, 6).isOk());
  REQUIRE(kv->cacheComputedBlocks(3, a, 6).isOk());
  pub.snapshotTo(7);
  REQUIRE(sent.all.size() == 3);  // flushed first: the snapshot covers batch 3
  CHECK(sent.all[2].kv_events().seq() == 3);
  REQUIRE(sent.to.size() == 2);
  for (const auto& [router, env] : sent.to) {
    CHECK(router == 7);
    CHECK(env.kv_events().snapshot());
    CHECK(env.kv_events().seq() == 3);
  }
  CHECK(sent.to[0].second.kv_events().events(0).kind() == proto::KvEvent::ALL_BLOCKS_CLEARED);
  int stored = 0;
  for (const auto& [router, env] : sent.to)
    for (const auto& e : env.kv_events().events())
      if (e.kind() == proto::KvEvent::BLOCK_STORED) stored += e.block_hashes_size();
  CHECK(stored == 3);
  CHECK(pub.seq() == 3);
}

TEST_CASE("kv event publisher: each tier's events go out as runs of their own, with the tier") {
  using engine::KvBlockEvent;
  using engine::KvTier;
  std::vector<KvBlockEvent> ev = {
      {KvBlockEvent::Kind::kStored, 1, kRootBlockHash, {}, KvTier::kRegion},
      {KvBlockEvent::Kind::kStored, 2, 1, {}, KvTier::kRegion},
      {KvBlockEvent::Kind::kStored, 3, 2, {}, KvTier::kDisk},  // continues the chain, another tier
      {KvBlockEvent::Kind::kRemoved, 1, kRootBlockHash, {}, KvTier::kRegion},
      {KvBlockEvent::Kind::kRemoved, 2, 1, {}, KvTier::kHost},
      {KvBlockEvent::Kind::kRemoved, 3, 2, {}, KvTier::kHost},
  };
  CHECK(kvEventRuns(ev).size() == 4);
  proto::KvEventBatch b;
  appendKvEvents(ev, &b);
  REQUIRE(b.events_size() == 4);
  CHECK(b.events(0).tier() == proto::KvEvent::TIER_REGION);
  CHECK(b.events(0).block_hashes_size() == 2);
  CHECK(b.events(1).tier() == proto::KvEvent::TIER_DISK);
  CHECK(b.events(1).parent_block_hash() == 2);
  CHECK(b.events(2).tier() == proto::KvEvent::TIER_REGION);
  CHECK(b.events(3).tier() == proto::KvEvent::TIER_HOST);
  CHECK(b.events(3).block_hashes_size() == 2);
}
