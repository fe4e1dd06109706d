// KV tiers below the region (engine/kv_tiers.h): demotion, promotion and eviction per tier
// with every invariant checked after each operation; the disk tier across a restart, and
// its refusal of corrupt, truncated and foreign files.
#include "engine/kv_tiers.h"

#include <chrono>
#include <cstring>
#include <fstream>
#include <numeric>

#include <catch2/catch.hpp>

#include "tests/scratch_dir.h"

using namespace pd;
using namespace pd::engine;
namespace fs = std::filesystem;

namespace {

#define REQUIRE_OK(expr)      \
  do {                        \
    ::pd::Status s_ = (expr); \
    INFO(s_.toString());      \
    REQUIRE(s_.isOk());       \
  } while (0)

constexpr int kBs = 4;

KvLayout layout(int numBlocks, KvDtype dtype = KvDtype::kF32) {
  KvLayout l;
  l.numLayers = 3;
  l.numBlocks = numBlocks;
  l.blockSize = kBs;
  l.numKvHeads = 2;
  l.headDim = 8;
  l.dtype = dtype;
  return l;
}

// dtype: an 8-bit cache's blocks carry their scales inside; the tiers copy them all the same
// (docs/kv_cache.md, "Quantized KV cache"): every byte is checked, codes and scales.
std::unique_ptr<KvCacheManager> makeKv(int numBlocks, KvDtype dtype = KvDtype::kF32) {
  auto kv = KvCacheManager::create(layout(numBlocks, dtype));
  REQUIRE(kv.ok());
  auto m = std::move(kv).value();
  m->setEventRecording(true);
  return m;
}

// Fills every byte of the block, in every layer, from its tokens and the layer: promoted
// bytes that differ anywhere from what was demoted fail blockHolds.
float contentOf(std::span<const TokenId> toks, int layer, size_t i) {
  return float(std::accumulate(toks.begin(), toks.end(), 0) * 131 + layer * 7 + int(i % 97));
}
void writeBlock(KvCacheManager& kv, BlockId b, std::span<const TokenId> toks) {
  const auto& l = kv.layout();
  for (int layer = 0; layer < l.numLayers; ++layer) {
    auto* f = reinterpret_cast<float*>(static_cast<uint8_t*>(kv.data()) + l.blockOffset(layer, b));
    for (size_t i = 0; i < l.blockBytes() / sizeof(float); ++i) f[i] = contentOf(toks, layer, i);
  }
}
bool blockHolds(const KvCacheManager& kv, BlockId b, std::span<const TokenId> toks) {
  const auto& l = kv.layout();
  for (int layer = 0; layer < l.numLayers; ++layer) {
    auto* f = reinterpret_cast<const float*>(static_cast<const uint8_t*>(kv.data()) + l.blockOffset(layer, b));
    for (size_t i = 0; i < l.blockBytes() / sizeof(float); ++i)
      if (f[i] != contentOf(toks, layer, i)) return false;
  }
  return true;
}

std::vector<TokenId> prompt(int base, int blocks) {
  std::vector<TokenId> t(size_t(blocks * kBs + 1));
  for (size_t i = 0; i < t.size(); ++i) t[i] = base + int(i);
  return t;
}

// Computes `toks` as a request would: allocate, "compute" every full block, name them, free.
void computeAndFree(KvCacheManager& kv, SeqId seq, const std::vector<TokenId>& toks) {
  REQUIRE_OK(kv.allocate(seq, int(toks.size())));
  auto table = kv.blockTable(seq);
  for (size_t b = 0; b + 1 < table.size() || (b + 1) * kBs <= toks.size(); ++b) {
    if ((b + 1) * kBs > toks.size()) break;
    writeBlock(kv, table[b], std::span(toks).subspan(b * kBs, kBs));
  }
  REQUIRE_OK(kv.cacheComputedBlocks(seq, toks, int(toks.size())));
  REQUIRE_OK(kv.free(seq));
}

// Every block of the prompt's cached prefix holds what was computed for it.
int servedBlocks(const KvCacheManager& kv, const std::vector<TokenId>& toks) {
  PrefixMatch m = kv.findCachedPrefix(toks, int(toks.size()) - 1);
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    INFO("block " << i);
    REQUIRE(blockHolds(kv, m.blocks[i], std::span(toks).subspan(i * kBs, kBs)));
  }
  return int(m.blocks.size());
}

int count(const std::vector<KvBlockEvent>& ev, KvBlockEvent::Kind k, KvTier t) {
  return int(std::count_if(ev.begin(), ev.end(), [&](const KvBlockEvent& e) { return e.kind == k && e.tier == t; }));
}

std::string identity(const char* w = "1111") { return std::string("small/l3b4h2d8f32/w") + w; }

void waitWritten(KvTierStore& t, int blocks) {
  for (int i = 0; i < 500 && t.disk()->size() < blocks; ++i) {
    t.disk()->drain(std::chrono::milliseconds(100));
    t.poll();
  }
  REQUIRE(t.disk()->size() == blocks);
}

// An asynchronous copier over a host region, as the cuda one behaves (kv_block_copier.h):
// a copy out started now reads the region's block only when the test lets it complete (or a
// caller waits), so a block reused and overwritten while its copy is in flight would put the
// wrong bytes into the tiers -- which the byte checks then see.
class FakeAsyncCopier final : public KvBlockCopier {
 public:
  FakeAsyncCopier(KvCacheManager& kv, int slots)
      : kv_(kv), slots_(size_t(slots), std::vector<uint8_t>(kv.blockStrideBytes())) {
    for (int i = slots - 1; i >= 0; --i) free_.push_back(i);
  }
  size_t strideBytes() const override { return kv_.blockStrideBytes(); }
  Status copyOut(BlockId b, uint8_t* dst) override {
    ++syncOut;
    kv_.copyBlockOut(b, dst);
    return Status::ok();
  }
  Status copyIn(const uint8_t* src, BlockId b) override {
    kv_.copyBlockIn(src, b);
    return Status::ok();
  }
  bool asynchronous() const override { return true; }
  int numSlots() const override { return int(slots_.size()); }
  int freeSlots() const override { return int(free_.size()); }
  Result<int> startCopyOut(BlockId b) override {
    if (free_.empty()) return resourceExhausted("no slot");
    const int slot = free_.back();
    free_.pop_back();
    pending_.push_back({slot, b});
    return slot;
  }
  void completed(bool wait, std::vector<Done>* done) override {
    if (wait) {
      ++waits;
      allowed_ = pending_.size();
    }
    while (allowed_ > 0 && !pending_.empty()) {
      --allowed_;
      auto [slot, b] = pending_.front();
      pending_.erase(pending_.begin());
      kv_.copyBlockOut(b, slots_[size_t(slot)].data());
      done->push_back({slot, Status::ok()});
    }
  }
  const uint8_t* slotData(int slot) const override { return slots_[size_t(slot)].data(); }
  void releaseSlot(int slot) override { free_.push_back(slot); }

  // Lets the next n copies in flight complete (at the next completed()).
  void allow(size_t n) { allowed_ += n; }
  size_t inFlight() const { return pending_.size(); }
  int syncOut = 0, waits = 0;

 private:
  KvCacheManager& kv_;
  std::vector<std::vector<uint8_t>> slots_;
  std::vector<int> free_;
  std::vector<std::pair<int, BlockId>> pending_;
  size_t allowed_ = 0;
};

// A tier store over `kv` with `o`'s tiers whose copier is a FakeAsyncCopier of `slots` staging
// slots: the store owns the copier, the test drives it through `copier`.
struct AsyncTiers {
  AsyncTiers(KvCacheManager& kv, const KvTierOptions& o, int slots)
      : AsyncTiers(kv, o, std::make_unique<FakeAsyncCopier>(kv, slots)) {}
  AsyncTiers(KvCacheManager& kv, const KvTierOptions& o, std::unique_ptr<FakeAsyncCopier> owned) : copier(*owned) {
    auto made = KvTierStore::create(kv, o, identity(), std::move(owned));
    REQUIRE(made.ok());
    store = std::move(made).value();
  }
  FakeAsyncCopier& copier;
  std::unique_ptr<KvTierStore> store;
};

// A host tier of `blocks` blocks of `kv` that demotes `demoteAhead` blocks ahead of need.
KvTierOptions hostTier(const KvCacheManager& kv, int blocks, int demoteAhead) {
  KvTierOptions o;
  o.hostBytes = int64_t(kv.blockStrideBytes()) * blocks;
  o.demoteAheadBlocks = demoteAhead;
  return o;
}

// Writes garbage into every block of `seq` (a step reusing them).
void clobber(KvCacheManager& kv, SeqId seq) {
  const auto& l = kv.layout();
  for (BlockId b : kv.blockTable(seq)) {
    for (int layer = 0; layer < l.numLayers; ++layer) {
      std::memset(static_cast<uint8_t*>(kv.data()) + l.blockOffset(layer, b), 0xA5, l.blockBytes());
    }
  }
}

}  // namespace

TEST_CASE("kv tiers: an evicted named block demotes to host and promotes back byte for byte") {
  const KvDtype dtype = GENERATE(KvDtype::kF32, KvDtype::kBF16, KvDtype::kInt8);
  auto kv = makeKv(4, dtype);
  KvTierOptions o;
  o.hostBytes = int64_t(kv->blockStrideBytes()) * 8;
  auto tiers = KvTierStore::create(*kv, o, identity());
  REQUIRE(tiers.ok());
  KvTierStore& t = **tiers;

  const auto a = prompt(100, 2);  // 2 full blocks + 1 token
  computeAndFree(*kv, 1, a);
  REQUIRE_OK(t.checkInvariants());
  REQUIRE(servedBlocks(*kv, a) == 2);
  (void)kv->takeEvents();

  // A prompt that needs every block evicts a's two: they demote instead of vanishing.
  REQUIRE_OK(kv->allocate(2, 4 * kBs));
  REQUIRE_OK(t.checkInvariants());
  REQUIRE(servedBlocks(*kv, a) == 0);
  REQUIRE(t.host()->size() == 2);
  auto ev = kv->takeEvents();
  CHECK(count(ev, KvBlockEvent::Kind::kRemoved, KvTier::kRegion) == 2);
  CHECK(count(ev, KvBlockEvent::Kind::kStored, KvTier::kHost) == 2);
  CHECK(t.stats().demotionsToHost == 2);

  // No free block: nothing can be promoted, and nothing changes.
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 0);
  REQUIRE_OK(t.checkInvariants());
  REQUIRE_OK(kv->free(2));

  // Promotion copies them back into fresh region blocks, named and findable.
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 2);
  REQUIRE_OK(t.checkInvariants());
  REQUIRE(servedBlocks(*kv, a) == 2);
  ev = kv->takeEvents();
  CHECK(count(ev, KvBlockEvent::Kind::kStored, KvTier::kRegion) == 2);
  CHECK(kv->stats().promotedBlocks[int(KvTier::kHost)] == 2);
  // The first attach counts them as host hits; a second one as region hits.
  REQUIRE(kv->attachCachedPrefix(3, a, int(a.size()) - 1).value() == 2 * kBs);
  CHECK(kv->stats().hitBlocks[int(KvTier::kHost)] == 2);
  REQUIRE_OK(kv->free(3));
  REQUIRE(kv->attachCachedPrefix(4, a, int(a.size()) - 1).value() == 2 * kBs);
  CHECK(kv->stats().hitBlocks[int(KvTier::kRegion)] == 2);
  REQUIRE_OK(kv->free(4));
  REQUIRE_OK(t.checkInvariants());
  // Promoting again finds everything in the region: nothing to do.
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 0);

  // The snapshot names the host copies with their tier.
  auto snap = kv->snapshotEvents();
  CHECK(count(snap, KvBlockEvent::Kind::kStored, KvTier::kHost) == 2);
  CHECK(count(snap, KvBlockEvent::Kind::kStored, KvTier::kRegion) == 2);
}

TEST_CASE("kv tiers: the host tier evicts its least recently used block, promotion stops at a miss") {
  auto kv = makeKv(6);
  KvTierOptions o;
  o.hostBytes = int64_t(kv->blockStrideBytes()) * 2;  // two slots
  auto tiers = KvTierStore::create(*kv, o, identity());
  REQUIRE(tiers.ok());
  KvTierStore& t = **tiers;
  const auto a = prompt(100, 2), b = prompt(500, 2);
  computeAndFree(*kv, 1, a);
  computeAndFree(*kv, 2, b);  // the region now holds a and b (4 named blocks)
  (void)kv->takeEvents();
  // Every block: evicts all four (least recently freed first: a's tail, a's head, b's tail,
  // b's head); the host keeps the last two.
  REQUIRE_OK(kv->allocate(3, 6 * kBs));
  REQUIRE_OK(t.checkInvariants());
  CHECK(t.host()->size() == 2);
  CHECK(t.stats().hostEvictions == 2);
  auto ev = kv->takeEvents();
  CHECK(count(ev, KvBlockEvent::Kind::kRemoved, KvTier::kHost) == 2);
  CHECK(count(ev, KvBlockEvent::Kind::kRemoved, KvTier::kRegion) == 4);
  REQUIRE_OK(kv->free(3));
  CHECK(t.promote(b, int(b.size()) - 1, 8) == 2);
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 0);
  REQUIRE_OK(t.checkInvariants());
  REQUIRE(servedBlocks(*kv, b) == 2);
  // Evicted again, b's blocks find their host copies (no second copy), and maxNewBlocks
  // bounds a promotion.
  REQUIRE_OK(kv->allocate(4, 6 * kBs));
  REQUIRE_OK(t.checkInvariants());
  CHECK(t.stats().demotionsToHost == 4);
  REQUIRE_OK(kv->free(4));
  CHECK(t.promote(b, int(b.size()) - 1, 1) == 1);
  REQUIRE_OK(t.checkInvariants());
  CHECK(servedBlocks(*kv, b) == 1);
}

TEST_CASE("kv tiers: the disk tier survives a restart and refuses corrupt, truncated and foreign files") {
  const KvDtype dtype = GENERATE(KvDtype::kF32, KvDtype::kFp8);
  const fs::path dir = test::scratchDir() / (std::string("disk-") + kvDtypeName(dtype));
  const auto a = prompt(100, 3), b = prompt(700, 2);
  std::vector<uint64_t> aNames, bNames;
  for (uint64_t h : blockHashChain(a, kBs)) aNames.push_back(h);
  for (uint64_t h : blockHashChain(b, kBs)) bNames.push_back(h);
  KvTierOptions o;
  o.diskBytes = 1 << 20;
  o.diskPath = dir.string();
  {
    auto kv = makeKv(8, dtype);
    auto tiers = KvTierStore::create(*kv, o, identity());
    REQUIRE(tiers.ok());
    KvTierStore& t = **tiers;
    computeAndFree(*kv, 1, a);  // write-through: named blocks go to disk
    computeAndFree(*kv, 2, b);
    waitWritten(t, 5);
    REQUIRE_OK(t.checkInvariants());
    auto ev = kv->takeEvents();
    CHECK(count(ev, KvBlockEvent::Kind::kStored, KvTier::kDisk) == 5);
    CHECK(t.stats().diskWrites == 5);
  }
  // Another identity (same name and shape, other weights) writes the same prompt: its files
  // live in a directory of their own.
  {
    auto kv = makeKv(8, dtype);
    KvTierOptions other = o;
    auto tiers = KvTierStore::create(*kv, other, identity("2222"));
    REQUIRE(tiers.ok());
    CHECK((*tiers)->disk()->size() == 0);  // another identity's directory: empty
    computeAndFree(*kv, 1, a);
    waitWritten(**tiers, 3);
  }
  fs::path mine, theirs;
  {
    auto kv = makeKv(8, dtype);
    auto t1 = KvTierStore::create(*kv, o, identity());
    REQUIRE(t1.ok());
    mine = (*t1)->disk()->dir();
  }
  {
    auto kv = makeKv(8, dtype);
    auto t2 = KvTierStore::create(*kv, o, identity("2222"));
    REQUIRE(t2.ok());
    theirs = (*t2)->disk()->dir();
  }
  REQUIRE(mine != theirs);
  const auto fileName = [](uint64_t h) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%016llx.kvb", static_cast<unsigned long long>(h));
    return std::string(buf);
  };
  // b[0]: replaced by the other identity's file for a[0] renamed to b[0]'s name: foreign.
  fs::copy_file(theirs / fileName(aNames[0]), mine / fileName(bNames[0]), fs::copy_options::overwrite_existing);
  // b[1]: truncated.
  fs::resize_file(mine / fileName(bNames[1]), fs::file_size(mine / fileName(bNames[1])) - 100);
  // a[2]: one KV byte flipped (the header is intact: found at start, refused at load).
  {
    std::fstream f(mine / fileName(aNames[2]), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-10, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-10, std::ios::end);
    c = char(c ^ 0x40);
    f.write(&c, 1);
  }
  // A leftover of an interrupted write.
  { std::ofstream(mine / "0000000000000001.kvb.tmp") << "partial"; }

  auto kv = makeKv(8, dtype);
  auto tiers = KvTierStore::create(*kv, o, identity());
  REQUIRE(tiers.ok());
  KvTierStore& t = **tiers;
  REQUIRE_OK(t.checkInvariants());
  CHECK(t.disk()->size() == 3);  // a[0], a[1], a[2] (the flipped byte is not seen yet)
  CHECK(t.stats().diskFilesDropped[int(KvDiskTier::FileDrop::kForeign)] == 1);
  CHECK(t.stats().diskFilesDropped[int(KvDiskTier::FileDrop::kTruncated)] == 1);
  CHECK(!fs::exists(mine / fileName(bNames[0])));
  CHECK(!fs::exists(mine / fileName(bNames[1])));
  CHECK(!fs::exists(mine / "0000000000000001.kvb.tmp"));
  CHECK(fs::exists(theirs / fileName(aNames[0])));  // another identity's files are left alone
  // What it holds is announced in a snapshot with the disk tier.
  auto snap = kv->snapshotEvents();
  CHECK(count(snap, KvBlockEvent::Kind::kStored, KvTier::kDisk) == 3);

  // Promotion restores a[0] and a[1] byte for byte and stops at the corrupt a[2], which is
  // dropped (a removed event), never loaded.
  (void)kv->takeEvents();
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 2);
  REQUIRE_OK(t.checkInvariants());
  CHECK(servedBlocks(*kv, a) == 2);
  CHECK(t.stats().diskFilesDropped[int(KvDiskTier::FileDrop::kCorrupt)] == 1);
  CHECK(!fs::exists(mine / fileName(aNames[2])));
  auto ev = kv->takeEvents();
  CHECK(count(ev, KvBlockEvent::Kind::kRemoved, KvTier::kDisk) == 1);
  CHECK(count(ev, KvBlockEvent::Kind::kStored, KvTier::kRegion) == 2);
  CHECK(kv->stats().promotedBlocks[int(KvTier::kDisk)] == 2);
  // b is gone from every tier: nothing to promote.
  CHECK(t.promote(b, int(b.size()) - 1, 8) == 0);
}

TEST_CASE("kv tiers: the disk tier stays within its byte bound and drops what its queue cannot take") {
  const fs::path dir = test::scratchDir() / "bound";
  auto kv = makeKv(16);
  const auto a = prompt(100, 3), b = prompt(900, 3);
  const int64_t file = int64_t(
      KvDiskTier::encodeFile(identity(), 1, 2, std::vector<TokenId>(kBs), std::vector<uint8_t>(kv->blockStrideBytes()))
          .size());
  SECTION("byte bound: the oldest files go first") {
    KvTierOptions o;
    o.diskBytes = file * 4;
    o.diskPath = dir.string();
    auto tiers = KvTierStore::create(*kv, o, identity());
    REQUIRE(tiers.ok());
    KvTierStore& t = **tiers;
    computeAndFree(*kv, 1, a);
    waitWritten(t, 3);
    computeAndFree(*kv, 2, b);
    waitWritten(t, 4);
    REQUIRE_OK(t.checkInvariants());
    CHECK(t.disk()->bytes() <= o.diskBytes);
    CHECK(t.stats().diskEvictions == 2);
    auto ev = kv->takeEvents();
    CHECK(count(ev, KvBlockEvent::Kind::kRemoved, KvTier::kDisk) == 2);
    const auto names = blockHashChain(a, kBs);
    CHECK(!t.disk()->contains(names[0]));
    CHECK(!t.disk()->contains(names[1]));
    CHECK(t.disk()->contains(names[2]));
  }
  SECTION("a queue that cannot take a block drops it, counted") {
    auto d = KvDiskTier::open(dir.string(), identity(), int64_t(1) << 20, /*queueBytes=*/file - 1,
                              kv->blockStrideBytes(), kBs);
    REQUIRE(d.ok());
    std::vector<KvDiskTier::Change> changes;
    std::vector<uint8_t> bytes(kv->blockStrideBytes(), 7);
    const std::vector<TokenId> toks = {1, 2, 3, 4};
    CHECK(!(*d)->enqueue(hashBlockTokens(kRootBlockHash, toks), kRootBlockHash, toks, bytes, &changes));
    CHECK((*d)->writesDropped(KvDiskTier::WriteDrop::kQueueFull) == 1);
    CHECK(!(*d)->knows(hashBlockTokens(kRootBlockHash, toks)));
    REQUIRE_OK((*d)->checkInvariants());
  }
}

TEST_CASE("kv tiers: configuration errors name the problem") {
  auto kv = makeKv(4);
  KvTierOptions none;
  CHECK(KvTierStore::create(*kv, none, identity()).status().code() == StatusCode::kInvalidArgument);
  KvTierOptions tiny;
  tiny.hostBytes = 1;
  auto r = KvTierStore::create(*kv, tiny, identity());
  REQUIRE(!r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("fewer than 2 blocks"));
  KvTierOptions noPath;
  noPath.diskBytes = 1 << 20;
  CHECK(KvTierStore::create(*kv, noPath, identity()).status().code() == StatusCode::kInvalidArgument);
  auto accounting = KvCacheManager::create(layout(4), KvCacheManager::Backing::kAccountingOnly);
  REQUIRE(accounting.ok());
  KvTierOptions host;
  host.hostBytes = 1 << 20;
  CHECK(KvTierStore::create(**accounting, host, identity()).status().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("kv tiers: a copier made for the region is required and its block size checked") {
  auto kv = makeKv(4);
  KvTierOptions o;
  o.hostBytes = int64_t(kv->blockStrideBytes()) * 8;
  CHECK(KvTierStore::create(*kv, o, identity(), nullptr).status().code() == StatusCode::kInvalidArgument);
  // A copier whose block is not whole blocks of this region (another layout) is refused.
  auto other = makeKv(4, KvDtype::kBF16);
  auto r = KvTierStore::create(*kv, o, identity(), std::make_unique<HostKvBlockCopier>(*other));
  REQUIRE(!r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("not whole blocks"));
  // The host copier given explicitly is what create() without one uses: same demotion.
  auto t = KvTierStore::create(*kv, o, identity(), std::make_unique<HostKvBlockCopier>(*kv));
  REQUIRE(t.ok());
  CHECK_FALSE((*t)->copier().asynchronous());
  const auto a = prompt(100, 2);
  computeAndFree(*kv, 1, a);
  REQUIRE_OK(kv->allocate(2, 4 * kBs));
  CHECK((*t)->host()->size() == 2);
  (*t)->poll();  // a synchronous copier demotes nothing ahead
  REQUIRE_OK((*t)->checkInvariants());
  CHECK(kv->numHeldBlocks() == 0);
  REQUIRE_OK(kv->free(2));
  CHECK((*t)->promote(a, int(a.size()) - 1, 8) == 2);
  CHECK(servedBlocks(*kv, a) == 2);
}

TEST_CASE("kv tiers: an asynchronous copier demotes ahead, holding each block until its copy completed") {
  auto kv = makeKv(8);
  AsyncTiers tiers(*kv, hostTier(*kv, 16, 2), 4);
  KvTierStore& t = *tiers.store;
  const auto a = prompt(100, 2), b = prompt(500, 2);
  computeAndFree(*kv, 1, a);
  computeAndFree(*kv, 2, b);              // 4 named free blocks, 4 uncached free
  REQUIRE_OK(kv->allocate(10, 4 * kBs));  // takes the 4 uncached ones
  REQUIRE(kv->numFreeBlocks() - kv->numCachedFreeBlocks() == 0);
  (void)kv->takeEvents();

  // poll() demotes ahead: a's two blocks (least recently freed) leave the region, held.
  t.poll();
  REQUIRE_OK(t.checkInvariants());
  CHECK(kv->numHeldBlocks() == 2);
  CHECK(tiers.copier.inFlight() == 2);
  CHECK(t.stats().copiesInFlight == 2);
  CHECK(t.host()->size() == 0);  // not in the host tier before the copy completed
  CHECK(servedBlocks(*kv, a) == 0);
  auto ev = kv->takeEvents();
  CHECK(count(ev, KvBlockEvent::Kind::kRemoved, KvTier::kRegion) == 2);
  CHECK(count(ev, KvBlockEvent::Kind::kStored, KvTier::kHost) == 0);
  // Only b's blocks are free: a step reusing every free block never gets a held one. It
  // overwrites what it gets; a's copies still read a's bytes.
  REQUIRE(kv->numFreeBlocks() == 2);
  tiers.copier.allow(1);  // the first copy completes before the step...
  t.poll();
  REQUIRE_OK(t.checkInvariants());
  CHECK(kv->numHeldBlocks() == 1);
  CHECK(t.host()->size() == 1);
  // ...which now takes b's two blocks and the one released: uncached first, no eviction
  // waited for.
  REQUIRE_OK(kv->allocate(11, 1 * kBs));
  CHECK(tiers.copier.waits == 0);
  for (BlockId blk : kv->blockTable(11)) CHECK_FALSE(kv->isHeld(blk));
  clobber(*kv, 11);
  // Evicting b's blocks cannot wait for poll(): the copy in flight is waited for first, then
  // b's block copied synchronously (the fallback the demotion ahead avoids).
  REQUIRE_OK(kv->allocate(12, 2 * kBs));
  for (BlockId blk : kv->blockTable(12)) CHECK_FALSE(kv->isHeld(blk));
  clobber(*kv, 12);
  CHECK(tiers.copier.waits == 1);
  CHECK(tiers.copier.syncOut == 2);
  CHECK(t.stats().waitedEvictions == 2);
  REQUIRE_OK(t.checkInvariants());  // a's last block: released at the next poll
  CHECK(kv->numHeldBlocks() == 1);
  t.poll();
  REQUIRE_OK(t.checkInvariants());
  CHECK(kv->numHeldBlocks() == 0);
  CHECK(t.host()->size() == 4);
  CHECK(t.stats().demotionsToHost == 4);
  ev = kv->takeEvents();
  CHECK(count(ev, KvBlockEvent::Kind::kStored, KvTier::kHost) == 4);

  // Everything freed: promotion brings a and b back byte for byte, though their region
  // blocks were overwritten after the copies started.
  for (SeqId s : {10, 11, 12}) REQUIRE_OK(kv->free(s));
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 2);
  CHECK(t.promote(b, int(b.size()) - 1, 8) == 2);
  REQUIRE_OK(t.checkInvariants());
  CHECK(servedBlocks(*kv, a) == 2);
  CHECK(servedBlocks(*kv, b) == 2);
}

TEST_CASE("kv tiers: a promotion wanting a block whose demotion is in flight waits for it") {
  auto kv = makeKv(6);
  AsyncTiers tiers(*kv, hostTier(*kv, 8, 2), 4);
  KvTierStore& t = *tiers.store;
  const auto a = prompt(100, 2);
  computeAndFree(*kv, 1, a);             // 2 named, 4 uncached free
  REQUIRE_OK(kv->allocate(2, 4 * kBs));  // no uncached block left
  t.poll();                              // a's blocks held, copies in flight
  REQUIRE(kv->numHeldBlocks() == 2);
  REQUIRE_OK(kv->free(2));
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 2);  // not recomputed: waited for
  CHECK(tiers.copier.waits == 1);
  REQUIRE_OK(t.checkInvariants());
  CHECK(servedBlocks(*kv, a) == 2);
  t.poll();
  CHECK(kv->numHeldBlocks() == 0);
  REQUIRE_OK(t.checkInvariants());
}

TEST_CASE("kv tiers: an asynchronous copier writes through to disk from its staging slots") {
  const fs::path dir = test::scratchDir() / "async-disk";
  auto kv = makeKv(8);
  KvTierOptions o;
  o.diskBytes = int64_t(1) << 20;
  o.diskPath = dir.string();
  AsyncTiers tiers(*kv, o, 2);
  KvTierStore& t = *tiers.store;
  const auto a = prompt(100, 3);
  // Three blocks named at once, two slots: the third write-through is skipped...
  computeAndFree(*kv, 1, a);
  CHECK(tiers.copier.inFlight() == 2);
  REQUIRE_OK(t.checkInvariants());
  tiers.copier.allow(2);
  t.poll();
  waitWritten(t, 2);
  // ...and its eviction is its last chance: copied synchronously and written.
  REQUIRE_OK(kv->allocate(2, 8 * kBs));
  CHECK(tiers.copier.syncOut == 1);
  waitWritten(t, 3);
  REQUIRE_OK(t.checkInvariants());
  REQUIRE_OK(kv->free(2));
  CHECK(t.promote(a, int(a.size()) - 1, 8) == 3);
  CHECK(servedBlocks(*kv, a) == 3);
  REQUIRE_OK(t.checkInvariants());
}

TEST_CASE("kv tiers: the checksum sees one flipped bit anywhere") {
  std::vector<uint8_t> v(4099);
  for (size_t i = 0; i < v.size(); ++i) v[i] = uint8_t(i * 31);
  const uint64_t h = kvChecksum(v);
  for (size_t i : {size_t(0), size_t(17), size_t(4096), size_t(4098)}) {
    v[i] ^= 1;
    CHECK(kvChecksum(v) != h);
    v[i] ^= 1;
  }
  CHECK(kvChecksum(v) == h);
}
