// router::KvEventIndex: the exact prefix index fed by KV events (docs/kv_events.md): apply,
// removal, clear, snapshot frames, gap -> resync, stale -> fallback.
#include "router/kv_event_index.h"

#include <numeric>

#include <catch2/catch.hpp>

#include "common/base/hash.h"

using namespace pd;
using namespace pd::router;
using namespace std::chrono_literals;

namespace {

constexpr int kBs = 4;

std::vector<uint64_t> chain(int blocks, int32_t first = 0) {
  std::vector<int32_t> t(size_t(blocks * kBs));
  std::iota(t.begin(), t.end(), first);
  return blockHashChain(t, kBs);
}

proto::KvEventBatch batch(uint64_t seq, bool snapshot = false) {
  proto::KvEventBatch b;
  b.set_seq(seq);
  b.set_snapshot(snapshot);
  return b;
}

void stored(proto::KvEventBatch& b, std::span<const uint64_t> hashes, uint64_t parent = kRootBlockHash) {
  auto* e = b.add_events();
  e->set_kind(proto::KvEvent::BLOCK_STORED);
  e->set_parent_block_hash(parent);
  for (uint64_t h : hashes) e->add_block_hashes(h);
}

void removed(proto::KvEventBatch& b, std::span<const uint64_t> hashes) {
  auto* e = b.add_events();
  e->set_kind(proto::KvEvent::BLOCK_REMOVED);
  for (uint64_t h : hashes) e->add_block_hashes(h);
}

void tiered(proto::KvEventBatch& b, proto::KvEvent::Kind kind, std::span<const uint64_t> hashes,
            proto::KvEvent::Tier tier) {
  auto* e = b.add_events();
  e->set_kind(kind);
  e->set_tier(tier);
  for (uint64_t h : hashes) e->add_block_hashes(h);
}

void cleared(proto::KvEventBatch& b) { b.add_events()->set_kind(proto::KvEvent::ALL_BLOCKS_CLEARED); }

proto::KvEventBatch emptySnapshot(uint64_t seq) {
  auto b = batch(seq, true);
  cleared(b);
  return b;
}

}  // namespace

TEST_CASE("kv index: nothing is known of a worker before its snapshot") {
  KvEventIndex idx(kBs, 1000ms);
  const auto h = chain(3);
  auto b1 = batch(1);
  stored(b1, h);
  CHECK(idx.apply("w", b1) == KvEventIndex::Applied::kIgnored);  // not tracked at all
  idx.addWorker("w");
  CHECK_FALSE(idx.current("w", steadyNow()));
  CHECK(idx.apply("w", b1) == KvEventIndex::Applied::kIgnored);  // tracked, awaiting a snapshot
  CHECK(idx.cachedTokens("w", h) == 0);
  CHECK(idx.apply("w", emptySnapshot(1)) == KvEventIndex::Applied::kApplied);
  CHECK(idx.current("w", steadyNow()));
}

TEST_CASE("kv index: stored and removed blocks, the longest leading run counts") {
  KvEventIndex idx(kBs, 1000ms);
  idx.addWorker("w");
  REQUIRE(idx.apply("w", emptySnapshot(0)) == KvEventIndex::Applied::kApplied);
  const auto h = chain(4);
  auto b1 = batch(1);
  stored(b1, h);
  REQUIRE(idx.apply("w", b1) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 4 * kBs);
  CHECK(idx.blocks("w") == 4);
  auto b2 = batch(2);
  removed(b2, std::span(h).subspan(2, 1));  // block 2 evicted: blocks 0, 1 still lead
  REQUIRE(idx.apply("w", b2) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 2 * kBs);
  CHECK(idx.blocks("w") == 3);
  CHECK(idx.cachedTokens("other", h) == 0);
  // A different prompt sharing only block 0's tokens shares no name past it.
  CHECK(idx.cachedTokens("w", chain(4, 1)) == 0);
}

TEST_CASE("kv index: ALL_BLOCKS_CLEARED empties the worker's set") {
  KvEventIndex idx(kBs, 1000ms);
  idx.addWorker("w");
  const auto h = chain(2);
  auto s = emptySnapshot(5);
  stored(s, h);
  REQUIRE(idx.apply("w", s) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 2 * kBs);
  auto b = batch(6);
  cleared(b);
  REQUIRE(idx.apply("w", b) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 0);
  CHECK(idx.blocks("w") == 0);
}

TEST_CASE("kv index: a snapshot over several frames then older batches are ignored") {
  KvEventIndex idx(kBs, 1000ms);
  idx.addWorker("w");
  const auto h = chain(3);
  auto f1 = emptySnapshot(7);
  stored(f1, std::span(h).subspan(0, 2));
  auto f2 = batch(7, true);  // continuation frame: same seq, no clear
  stored(f2, std::span(h).subspan(2, 1), h[1]);
  REQUIRE(idx.apply("w", f1) == KvEventIndex::Applied::kApplied);
  REQUIRE(idx.apply("w", f2) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 3 * kBs);
  auto old = batch(7);  // already in the snapshot
  removed(old, h);
  CHECK(idx.apply("w", old) == KvEventIndex::Applied::kIgnored);
  CHECK(idx.cachedTokens("w", h) == 3 * kBs);
  // A continuation frame of another seq is stray.
  auto stray = batch(3, true);
  removed(stray, h);
  CHECK(idx.apply("w", stray) == KvEventIndex::Applied::kIgnored);
  CHECK(idx.appliedSeq("w") == 7);
}

TEST_CASE("kv index: a skipped seq is a gap, unsynced until a snapshot, resync asked once per lag") {
  KvEventIndex idx(kBs, 100ms);
  idx.addWorker("w");
  const SteadyTime t0 = steadyNow();
  REQUIRE(idx.apply("w", emptySnapshot(1)) == KvEventIndex::Applied::kApplied);
  const auto h = chain(2);
  auto b3 = batch(3);  // 2 never arrived
  stored(b3, h);
  CHECK(idx.apply("w", b3) == KvEventIndex::Applied::kGap);
  CHECK_FALSE(idx.current("w", t0));
  CHECK(idx.cachedTokens("w", h) == 0);  // nothing half-known is used
  CHECK(idx.takeResyncDue("w", t0 + 200ms));
  CHECK_FALSE(idx.takeResyncDue("w", t0 + 250ms));  // asked already
  CHECK(idx.takeResyncDue("w", t0 + 350ms));        // that one was lost: ask again
  auto b4 = batch(4);
  stored(b4, h);
  CHECK(idx.apply("w", b4) == KvEventIndex::Applied::kIgnored);  // still awaiting the snapshot
  auto s = emptySnapshot(4);
  stored(s, h);
  REQUIRE(idx.apply("w", s) == KvEventIndex::Applied::kApplied);
  CHECK(idx.current("w", t0 + 400ms));
  CHECK(idx.cachedTokens("w", h) == 2 * kBs);
  CHECK_FALSE(idx.takeResyncDue("w", t0 + 900ms));
  auto b5 = batch(5);
  REQUIRE(idx.apply("w", b5) == KvEventIndex::Applied::kApplied);
}

TEST_CASE("kv index: behind the worker's reported seq for max lag is stale and the caller falls back") {
  KvEventIndex idx(kBs, 100ms);
  idx.addWorker("w");
  REQUIRE(idx.apply("w", emptySnapshot(2)) == KvEventIndex::Applied::kApplied);
  const SteadyTime t0 = steadyNow();
  idx.noteReportedSeq("w", 2, t0);
  CHECK(idx.current("w", t0 + 10s));  // up to date: never stale, however quiet
  idx.noteReportedSeq("w", 3, t0);    // batch 3 sent, not here yet
  CHECK(idx.current("w", t0 + 50ms));
  CHECK_FALSE(idx.current("w", t0 + 100ms));
  CHECK(idx.takeResyncDue("w", t0 + 150ms));
  auto b3 = batch(3);
  REQUIRE(idx.apply("w", b3) == KvEventIndex::Applied::kApplied);
  CHECK(idx.current("w", t0 + 200ms));  // caught up
  idx.forget("w");
  CHECK_FALSE(idx.current("w", t0 + 200ms));
  CHECK_FALSE(idx.tracks("w"));
}

TEST_CASE("kv index: a block counts as cached while any tier holds it") {
  KvEventIndex idx(kBs, 1000ms);
  idx.addWorker("w");
  REQUIRE(idx.apply("w", emptySnapshot(1)) == KvEventIndex::Applied::kApplied);
  const auto h = chain(3);
  auto b2 = batch(2);
  stored(b2, h);  // the KV region (an old worker's events carry no tier: the region)
  tiered(b2, proto::KvEvent::BLOCK_STORED, h, proto::KvEvent::TIER_DISK);
  REQUIRE(idx.apply("w", b2) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 3 * kBs);
  CHECK(idx.regionCachedTokens("w", h) == 3 * kBs);
  // The region evicts the last two blocks; the host tier takes them.
  auto b3 = batch(3);
  removed(b3, std::span(h).subspan(1));
  tiered(b3, proto::KvEvent::BLOCK_STORED, std::span(h).subspan(1), proto::KvEvent::TIER_HOST);
  REQUIRE(idx.apply("w", b3) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 3 * kBs);  // promoted, not recomputed: counted as cached
  CHECK(idx.regionCachedTokens("w", h) == 1 * kBs);
  CHECK(idx.tierBlocks("w", proto::KvEvent::TIER_HOST) == 2);
  CHECK(idx.tierBlocks("w", proto::KvEvent::TIER_DISK) == 3);
  CHECK(idx.diskOnlyTokens("w", h) == 0);  // every block in the region or the host tier
  // The host tier drops block 2: only the disk holds it (a pull would read it from disk).
  auto hostDrop = batch(4);
  tiered(hostDrop, proto::KvEvent::BLOCK_REMOVED, std::span(h).subspan(2, 1), proto::KvEvent::TIER_HOST);
  REQUIRE(idx.apply("w", hostDrop) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 3 * kBs);
  CHECK(idx.diskOnlyTokens("w", h) == 1 * kBs);
  // The host drops block 1 and the disk too: the chain ends at block 0.
  auto b4 = batch(5);
  tiered(b4, proto::KvEvent::BLOCK_REMOVED, std::span(h).subspan(1, 1), proto::KvEvent::TIER_HOST);
  tiered(b4, proto::KvEvent::BLOCK_REMOVED, std::span(h).subspan(1, 1), proto::KvEvent::TIER_DISK);
  REQUIRE(idx.apply("w", b4) == KvEventIndex::Applied::kApplied);
  CHECK(idx.cachedTokens("w", h) == 1 * kBs);
  CHECK(idx.blocks("w") == 2);
  // A Removed of a tier that does not hold the block changes nothing.
  auto b5 = batch(6);
  tiered(b5, proto::KvEvent::BLOCK_REMOVED, std::span(h).subspan(2, 1), proto::KvEvent::TIER_REGION);
  REQUIRE(idx.apply("w", b5) == KvEventIndex::Applied::kApplied);
  CHECK(idx.blocks("w") == 2);
}
