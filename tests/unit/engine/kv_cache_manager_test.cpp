#include "engine/kv_cache_manager.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::engine;

namespace {

KvLayout smallLayout(int numBlocks, int blockSize = 4, int layers = 3) {
  KvLayout l;
  l.numLayers = layers;
  l.numBlocks = numBlocks;
  l.blockSize = blockSize;
  l.numKvHeads = 2;
  l.headDim = 8;
  l.dtype = KvDtype::kF32;
  return l;
}

std::unique_ptr<KvCacheManager> makeKv(const KvLayout& l) {
  auto kv = KvCacheManager::create(l);
  REQUIRE(kv.ok());
  return std::move(kv).value();
}

#define REQUIRE_OK(expr)      \
  do {                        \
    ::pd::Status s_ = (expr); \
    INFO(s_.toString());      \
    REQUIRE(s_.isOk());       \
  } while (0)

// Writes a block's "KV": every float of layer 0's K half holds the block's tokens, so a
// block served from the prefix cache can be checked to really hold that content.
void writeBlockContent(KvCacheManager& kv, BlockId b, std::span<const TokenId> toks) {
  auto* f = reinterpret_cast<float*>(static_cast<uint8_t*>(kv.data()) + kv.layout().blockOffset(0, b));
  for (size_t t = 0; t < toks.size(); ++t) f[kv.layout().kOffsetInBlock(int(t))] = float(toks[t]);
}
bool blockHolds(const KvCacheManager& kv, BlockId b, std::span<const TokenId> toks) {
  auto* f = reinterpret_cast<const float*>(static_cast<const uint8_t*>(kv.data()) + kv.layout().blockOffset(0, b));
  for (size_t t = 0; t < toks.size(); ++t) {
    if (f[kv.layout().kOffsetInBlock(int(t))] != float(toks[t])) return false;
  }
  return true;
}

// A new sequence for `tokens` as an admission makes it: the cached prefix (at least one token
// left to compute) attached, then extended to `numTokens`; all or nothing, like the scheduler
// applying one admission. Returns the cached tokens.
Result<int> attachAndExtend(KvCacheManager& kv, SeqId seq, std::span<const TokenId> tokens, int numTokens) {
  const int maxCached = std::max(0, std::min(numTokens, int(tokens.size()) - 1));
  PD_ASSIGN_OR_RETURN(int cached, kv.attachCachedPrefix(seq, tokens, maxCached));
  if (Status st = kv.extend(seq, numTokens); !st.isOk()) {
    (void)kv.free(seq);
    return st;
  }
  return cached;
}

}  // namespace

TEST_CASE("KvCacheManager validates the layout and maps a page-aligned region") {
  KvLayout bad = smallLayout(0);
  auto r = KvCacheManager::create(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message().find("must be positive") != std::string::npos);

  KvLayout l = smallLayout(10);
  auto kv = makeKv(l);
  MemDesc region = kv->region();
  CHECK(region.addr == reinterpret_cast<uintptr_t>(kv->data()));
  CHECK(region.len == l.totalBytes());
  CHECK(region.kind == MemKind::kHost);
  CHECK(region.addr % size_t(sysconf(_SC_PAGESIZE)) == 0);
  // Every byte is usable: touch the first and last.
  auto* bytes = static_cast<uint8_t*>(kv->data());
  bytes[0] = 1;
  bytes[region.len - 1] = 2;
  CHECK(bytes[region.len - 1] == 2);
  CHECK(kv->numTotalBlocks() == 10);
  CHECK(kv->numFreeBlocks() == 10);
  CHECK(kv->usage() == 0.0);
  REQUIRE_OK(kv->checkInvariants());

  auto acct = KvCacheManager::create(l, KvCacheManager::Backing::kAccountingOnly);
  REQUIRE(acct.ok());
  CHECK((*acct)->data() == nullptr);
  CHECK((*acct)->region().len == l.totalBytes());
}

TEST_CASE("the region is resident from create(): no prompt pays its pages' faults") {
  KvLayout l = smallLayout(1024, 16, 8);  // 8 MiB, four 2 MiB huge pages where THP is on
  auto kv = makeKv(l);
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t len = kv->region().len;
  std::vector<unsigned char> resident((len + page - 1) / page);
  REQUIRE(mincore(kv->data(), len, resident.data()) == 0);
  CHECK(std::count_if(resident.begin(), resident.end(), [](unsigned char c) { return c & 1; }) ==
        long(resident.size()));
}

TEST_CASE("allocate, extend and free keep counts and tables consistent") {
  auto kv = makeKv(smallLayout(10, 4));
  REQUIRE_OK(kv->allocate(1, 5));  // 2 blocks
  CHECK(kv->blockTable(1).size() == 2);
  CHECK(kv->numTokens(1) == 5);
  CHECK(kv->numFreeBlocks() == 8);
  CHECK(kv->usage() == Approx(0.2));
  // A fresh cache hands out consecutive ids.
  CHECK(kv->blockTable(1)[0] == 0);
  CHECK(kv->blockTable(1)[1] == 1);
  CHECK(kv->blocksNeeded(1, 8) == 0);
  CHECK(kv->blocksNeeded(1, 9) == 1);
  REQUIRE_OK(kv->extend(1, 8));
  CHECK(kv->blockTable(1).size() == 2);
  REQUIRE_OK(kv->extend(1, 9));
  CHECK(kv->blockTable(1).size() == 3);
  CHECK(kv->extend(2, 4).code() == StatusCode::kNotFound);
  CHECK(kv->allocate(1, 1).code() == StatusCode::kAlreadyExists);
  CHECK(kv->allocate(3, -1).code() == StatusCode::kInvalidArgument);
  REQUIRE_OK(kv->checkInvariants());
  REQUIRE_OK(kv->free(1));
  CHECK(kv->numFreeBlocks() == 10);
  CHECK(kv->free(1).code() == StatusCode::kNotFound);
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("a reservation that does not fit fails whole and leaves nothing allocated") {
  auto kv = makeKv(smallLayout(8, 16));
  REQUIRE_OK(kv->reserve(1, 16 * 5));
  const int freeBefore = kv->numFreeBlocks();
  REQUIRE(freeBefore == 3);
  Status s = kv->reserve(2, 16 * 3 + 1);  // 4 blocks
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(s.message().find("cannot reserve 49 tokens (4 blocks)") != std::string::npos);
  CHECK(kv->numFreeBlocks() == freeBefore);
  CHECK_FALSE(kv->hasSequence(2));
  // Extending past the pool also changes nothing.
  Status e = kv->extend(1, 16 * 9);
  CHECK(e.code() == StatusCode::kResourceExhausted);
  CHECK(kv->numTokens(1) == 80);
  CHECK(kv->blockTable(1).size() == 5);
  CHECK(kv->numFreeBlocks() == freeBefore);
  REQUIRE_OK(kv->checkInvariants());
  // Exactly what is left fits.
  REQUIRE_OK(kv->reserve(2, 16 * 3));
  CHECK(kv->numFreeBlocks() == 0);
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("prefix hashes let a new prompt share computed full blocks") {
  auto kv = makeKv(smallLayout(16, 4));
  std::vector<TokenId> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 full blocks + 2
  REQUIRE_OK(kv->allocate(1, int(a.size())));
  // Nothing is shareable until its KV has been computed.
  CHECK(kv->findCachedPrefix(a, 10).numTokens == 0);
  REQUIRE_OK(kv->cacheComputedBlocks(1, a, 10));
  REQUIRE_OK(kv->checkInvariants());

  std::vector<TokenId> b = {1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52};
  auto cached = attachAndExtend(*kv, 2, b, int(b.size()));
  REQUIRE(cached.ok());
  CHECK(*cached == 8);
  CHECK(kv->blockTable(2)[0] == kv->blockTable(1)[0]);
  CHECK(kv->blockTable(2)[1] == kv->blockTable(1)[1]);
  CHECK(kv->blockTable(2)[2] != kv->blockTable(1)[2]);
  CHECK(kv->refCount(kv->blockTable(1)[0]) == 2);
  CHECK(kv->refCount(kv->blockTable(1)[2]) == 1);
  REQUIRE_OK(kv->checkInvariants());

  // Same second block after a different first block: the chain does not match.
  std::vector<TokenId> c = {9, 9, 9, 9, 5, 6, 7, 8, 1};
  CHECK(kv->findCachedPrefix(c, 8).numTokens == 0);
  // A prompt that is exactly the cached blocks keeps its last token to compute.
  std::vector<TokenId> d = {1, 2, 3, 4, 5, 6, 7, 8};
  auto dc = attachAndExtend(*kv, 3, d, 8);
  REQUIRE(dc.ok());
  CHECK(*dc == 4);

  // Freed blocks stay cached and reusable...
  REQUIRE_OK(kv->free(1));
  REQUIRE_OK(kv->free(2));
  REQUIRE_OK(kv->free(3));
  CHECK(kv->numFreeBlocks() == 16);
  CHECK(kv->numCachedFreeBlocks() == 2);
  PrefixMatch m = kv->findCachedPrefix(a, 10);
  CHECK(m.numTokens == 8);
  CHECK(m.numFreeBlocks == 2);
  REQUIRE_OK(kv->checkInvariants());
  // ...until fresh allocations need them: the uncached free blocks go first.
  REQUIRE_OK(kv->allocate(10, 14 * 4));
  CHECK(kv->findCachedPrefix(a, 10).numTokens == 8);
  CHECK(kv->stats().evictions == 0);
  REQUIRE_OK(kv->allocate(11, 4));  // evicts the least recently freed cached block
  CHECK(kv->stats().evictions == 1);
  REQUIRE_OK(kv->checkInvariants());
  REQUIRE_OK(kv->allocate(12, 4));
  CHECK(kv->stats().evictions == 2);
  CHECK(kv->findCachedPrefix(a, 10).numTokens == 0);
  CHECK(kv->numFreeBlocks() == 0);
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("the prefix block freed last is evicted last") {
  auto kv = makeKv(smallLayout(6, 2));
  std::vector<TokenId> a = {1, 2, 3, 4, 5, 6};
  REQUIRE_OK(kv->allocate(1, 6));
  REQUIRE_OK(kv->cacheComputedBlocks(1, a, 6));
  REQUIRE_OK(kv->free(1));
  REQUIRE_OK(kv->allocate(2, 6));  // uses the 3 uncached blocks
  REQUIRE_OK(kv->allocate(3, 2));  // evicts one: the tail block {5,6}
  CHECK(kv->findCachedPrefix(a, 6).numTokens == 4);
  REQUIRE_OK(kv->allocate(4, 2));
  CHECK(kv->findCachedPrefix(a, 6).numTokens == 2);
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("KV events: stored blocks carry the shared hash chain, evictions say which, snapshots parents first") {
  auto kv = makeKv(smallLayout(6, 2));
  std::vector<TokenId> a = {1, 2, 3, 4, 5, 6};
  REQUIRE_OK(kv->allocate(1, 6));
  REQUIRE_OK(kv->cacheComputedBlocks(1, a, 6));
  CHECK(kv->takeEvents().empty());  // recording is off by default
  REQUIRE_OK(kv->free(1));
  kv->setEventRecording(true);
  std::vector<TokenId> b = {7, 8, 9, 10};
  REQUIRE_OK(kv->allocate(2, 4));
  CHECK(kv->oldestPendingEventUnixUs() == 0);
  REQUIRE_OK(kv->cacheComputedBlocks(2, b, 4));
  CHECK(kv->oldestPendingEventUnixUs() > 0);
  auto ev = kv->takeEvents();
  // The names the router computes for the same tokens (common/base/hash.h).
  const auto names = blockHashChain(b, 2);
  REQUIRE(ev.size() == 2);
  CHECK(ev[0].kind == KvBlockEvent::Kind::kStored);
  CHECK(ev[0].hash == names[0]);
  CHECK(ev[0].parentHash == kRootBlockHash);
  CHECK(ev[0].tokens == std::vector<int32_t>{7, 8});
  CHECK(ev[1].hash == names[1]);
  CHECK(ev[1].parentHash == names[0]);
  CHECK(kv->takeEvents().empty());
  CHECK(kv->oldestPendingEventUnixUs() == 0);
  // A shared prefix names nothing new.
  REQUIRE_OK(kv->allocate(3, 2));
  REQUIRE_OK(kv->cacheComputedBlocks(3, std::vector<TokenId>{7, 8}, 2));
  CHECK(kv->takeEvents().empty());
  // No uncached block is left: the next allocation evicts one of a's cached blocks, and says so.
  CHECK(kv->numCachedFreeBlocks() == 3);
  CHECK(kv->numFreeBlocks() == 3);
  REQUIRE_OK(kv->allocate(4, 2));
  ev = kv->takeEvents();
  const auto aNames = blockHashChain(a, 2);
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == KvBlockEvent::Kind::kRemoved);
  CHECK(std::count(aNames.begin(), aNames.end(), ev[0].hash) == 1);
  // The snapshot: cleared, then every named block, each after its named parent.
  auto snap = kv->snapshotEvents();
  REQUIRE(!snap.empty());
  CHECK(snap[0].kind == KvBlockEvent::Kind::kAllCleared);
  CHECK(snap.size() == 1 + 2 + 2);  // b's two blocks, a's two left
  std::vector<uint64_t> seen;
  for (size_t i = 1; i < snap.size(); ++i) {
    CHECK(snap[i].kind == KvBlockEvent::Kind::kStored);
    CHECK(snap[i].tokens.size() == 2);
    for (size_t j = 1; j < snap.size(); ++j)
      if (snap[j].hash == snap[i].parentHash) CHECK(std::count(seen.begin(), seen.end(), snap[j].hash) == 1);
    seen.push_back(snap[i].hash);
  }
  kv->setEventRecording(false);
  REQUIRE_OK(kv->free(2));
  REQUIRE_OK(kv->allocate(6, 2));
  CHECK(kv->takeEvents().empty());
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("generated tokens: a block is named when its last token's KV is computed, like a prompt block") {
  // The decode loop of one request (engine/engine.cpp): a prompt of 6 tokens (blocks of 4) is
  // computed, then each step appends the sampled token and computes its KV one step later.
  // Block i may be named only once all of its 4 tokens' KV is computed: never by the sampled
  // token whose KV is not yet written.
  auto kv = makeKv(smallLayout(8, 4));
  kv->setEventRecording(true);
  std::vector<TokenId> tokens = {1, 2, 3, 4, 5, 6};
  REQUIRE_OK(kv->allocate(1, 6));
  REQUIRE_OK(kv->cacheComputedBlocks(1, tokens, 6));
  std::vector<KvBlockEvent> stored = kv->takeEvents();
  CHECK(stored.size() == 1);
  int computed = 6;
  for (TokenId next = 100; next < 107; ++next) {
    tokens.push_back(next);  // sampled: in the sequence, its KV not computed
    REQUIRE_OK(kv->extend(1, int(tokens.size())));
    REQUIRE_OK(kv->cacheComputedBlocks(1, tokens, computed));
    for (auto& e : kv->takeEvents()) stored.push_back(std::move(e));
    CHECK(int(stored.size()) == computed / 4);
    REQUIRE_OK(kv->checkInvariants());
    ++computed;  // the next decode step computes it
  }
  // 13 tokens, 12 computed: three blocks named, holding the prompt and the answer's tokens, on
  // the same chain the router computes for the next turn's prompt.
  REQUIRE(stored.size() == 3);
  const auto names = blockHashChain(tokens, 4);
  for (size_t i = 0; i < stored.size(); ++i) {
    CHECK(stored[i].kind == KvBlockEvent::Kind::kStored);
    CHECK(stored[i].hash == names[i]);
    CHECK(stored[i].parentHash == (i == 0 ? kRootBlockHash : names[i - 1]));
    CHECK(stored[i].tokens == std::vector<int32_t>(tokens.begin() + 4 * long(i), tokens.begin() + 4 * long(i) + 4));
  }
  CHECK(stored[2].tokens == std::vector<int32_t>{102, 103, 104, 105});  // wholly generated
  REQUIRE_OK(kv->free(1));
  // The next turn: the whole history and a new message. The answer's named blocks are found;
  // the block of the last sampled token (its KV was never computed) is not.
  std::vector<TokenId> next = tokens;
  next.insert(next.end(), {50, 51, 52, 53, 54});
  auto cached = attachAndExtend(*kv, 2, next, int(next.size()));
  REQUIRE(cached.ok());
  CHECK(*cached == 12);
  CHECK(kv->takeEvents().empty());  // attaching names nothing new
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("fork shares full blocks and copies the partial tail in every layer") {
  KvLayout l = smallLayout(8, 4);
  auto kv = makeKv(l);
  REQUIRE_OK(kv->allocate(1, 6));
  const BlockId tail = kv->blockTable(1)[1];
  auto* bytes = static_cast<uint8_t*>(kv->data());
  for (int layer = 0; layer < l.numLayers; ++layer) {
    std::memset(bytes + l.blockOffset(layer, tail), 0x40 + layer, l.blockBytes());
  }
  REQUIRE_OK(kv->fork(1, 2));
  auto t1 = kv->blockTable(1);
  auto t2 = kv->blockTable(2);
  REQUIRE(t2.size() == 2);
  CHECK(t2[0] == t1[0]);
  CHECK(kv->refCount(t1[0]) == 2);
  CHECK(t2[1] != t1[1]);
  for (int layer = 0; layer < l.numLayers; ++layer) {
    CHECK(std::memcmp(bytes + l.blockOffset(layer, t2[1]), bytes + l.blockOffset(layer, tail), l.blockBytes()) == 0);
  }
  CHECK(kv->numTokens(2) == 6);
  REQUIRE_OK(kv->checkInvariants());
  CHECK(kv->fork(1, 2).code() == StatusCode::kAlreadyExists);
  CHECK(kv->fork(9, 3).code() == StatusCode::kNotFound);
  REQUIRE_OK(kv->free(1));
  CHECK(kv->refCount(t2[0]) == 1);
  REQUIRE_OK(kv->checkInvariants());
}

TEST_CASE("createOver keeps the books of a region it does not own, and never touches it") {
  const KvLayout l = smallLayout(8);
  // Device memory stands in as an address the manager must never dereference: a host
  // address of a buffer we poison and check afterwards.
  std::vector<uint8_t> bytes(l.totalBytes(), 0xA5);
  MemDesc region{reinterpret_cast<uintptr_t>(bytes.data()), l.totalBytes(), 3, MemKind::kCuda};

  MemDesc shortRegion = region;
  shortRegion.len -= 1;
  auto refused = KvCacheManager::createOver(l, shortRegion);
  REQUIRE(!refused.ok());
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(refused.status().message(), Catch::Contains("cannot hold layout"));

  auto made = KvCacheManager::createOver(l, region);
  REQUIRE(made.ok());
  auto& kv = *made;
  CHECK(kv->region().addr == region.addr);
  CHECK(kv->region().len == l.totalBytes());
  CHECK(kv->region().kind == MemKind::kCuda);
  CHECK(kv->region().device == 3);

  REQUIRE_OK(kv->allocate(1, 6));  // 1 full block + a partial one
  auto segs = kv->layerSegments(1, 0, 1);
  REQUIRE(segs.ok());
  REQUIRE(segs->size() == 1);
  CHECK((*segs)[0].addr == region.addr + l.blockOffset(0, kv->blockTable(1)[0]));
  CHECK((*segs)[0].kind == MemKind::kCuda);
  // Copying the partial tail would be a host memcpy on device memory: refused, nothing changed.
  Status f = kv->fork(1, 2);
  CHECK(f.code() == StatusCode::kFailedPrecondition);
  CHECK(!kv->hasSequence(2));
  REQUIRE_OK(kv->free(1));
  REQUIRE_OK(kv->checkInvariants());
  kv.reset();  // does not unmap what it does not own
  CHECK(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0xA5; }));
}

TEST_CASE("layerSegments coalesces consecutive block ids per layer") {
  KvLayout l = smallLayout(16, 4, 4);
  auto kv = makeKv(l);
  const uintptr_t base = kv->region().addr;
  REQUIRE_OK(kv->allocate(1, 12));  // blocks 0,1,2
  auto segs = kv->layerSegments(SeqId(1), 0, 4);
  REQUIRE(segs.ok());
  REQUIRE(segs->size() == 4);
  for (int layer = 0; layer < 4; ++layer) {
    CHECK((*segs)[size_t(layer)].addr == base + l.blockOffset(layer, 0));
    CHECK((*segs)[size_t(layer)].len == 3 * l.blockBytes());
  }

  std::vector<BlockId> blocks = {3, 4, 5, 9, 10, 2};
  auto s2 = kv->layerSegments(std::span<const BlockId>(blocks), 1, 3);
  REQUIRE(s2.ok());
  REQUIRE(s2->size() == 6);
  const std::vector<std::pair<BlockId, size_t>> runs = {{3, 3}, {9, 2}, {2, 1}};
  size_t k = 0;
  for (int layer = 1; layer < 3; ++layer) {
    for (auto [first, n] : runs) {
      CHECK((*s2)[k].addr == base + l.blockOffset(layer, first));
      CHECK((*s2)[k].len == n * l.blockBytes());
      CHECK(kv->region().contains((*s2)[k]));
      ++k;
    }
  }
  CHECK(totalBytes(*s2) == 2 * blocks.size() * l.blockBytes());

  auto badLayer = kv->layerSegments(std::span<const BlockId>(blocks), 2, 5);
  CHECK(badLayer.status().code() == StatusCode::kInvalidArgument);
  std::vector<BlockId> badBlock = {1, 16};
  auto bb = kv->layerSegments(std::span<const BlockId>(badBlock), 0, 1);
  CHECK(bb.status().code() == StatusCode::kInvalidArgument);
  CHECK(bb.status().message().find("block id 16") != std::string::npos);
  CHECK(kv->layerSegments(SeqId(7), 0, 1).status().code() == StatusCode::kNotFound);
}

TEST_CASE("paired segments cut runs where either side breaks") {
  KvLayout l = smallLayout(32, 4, 2);
  MemDesc local;
  local.addr = 0x100000;
  local.len = l.totalBytes();
  MemDesc remote;
  remote.addr = 0x900000;
  remote.len = l.totalBytes();
  std::vector<BlockId> lb = {0, 1, 2, 3};
  std::vector<BlockId> rb = {5, 6, 9, 10};
  auto p = pairedLayerSegments(l, local, lb, remote, rb, 0, 2);
  REQUIRE(p.ok());
  REQUIRE(p->local.size() == 4);
  REQUIRE(p->remote.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    CHECK(p->local[i].len == 2 * l.blockBytes());
    CHECK(p->remote[i].len == p->local[i].len);
  }
  CHECK(p->local[1].addr == local.addr + l.blockOffset(0, 2));
  CHECK(p->remote[1].addr == remote.addr + l.blockOffset(0, 9));
  CHECK(p->remote[2].addr == remote.addr + l.blockOffset(1, 5));
  std::vector<BlockId> shorter = {1};
  CHECK(pairedLayerSegments(l, local, lb, remote, shorter, 0, 1).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("random allocate/extend/reserve/share/free keeps every invariant") {
  KvLayout l = smallLayout(48, 4, 1);
  auto kv = makeKv(l);
  std::mt19937 rng(12345);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  // A few shared "system prompts" so prefix hits happen often.
  std::vector<std::vector<TokenId>> stems(4);
  for (auto& s : stems) {
    for (int i = 0; i < 12; ++i) s.push_back(pick(0, 30));
  }
  std::map<SeqId, std::vector<TokenId>> live;  // the tokens each live sequence holds
  SeqId next = 1;
  int hits = 0, exhausted = 0;
  auto randomTokens = [&](int n) {
    std::vector<TokenId> t = stems[size_t(pick(0, 3))];
    t.resize(size_t(std::min<int>(n, int(t.size()))));
    while (int(t.size()) < n) t.push_back(pick(0, 30));
    return t;
  };
  auto computeAll = [&](SeqId seq) {
    auto& toks = live[seq];
    auto table = kv->blockTable(seq);
    for (size_t b = 0; b < toks.size() / 4; ++b) {
      writeBlockContent(*kv, table[b], std::span<const TokenId>(toks).subspan(b * 4, 4));
    }
    REQUIRE_OK(kv->cacheComputedBlocks(seq, toks, int(toks.size())));
  };

  for (int op = 0; op < 4000; ++op) {
    const int kind = pick(0, 9);
    const int freeBefore = kv->numFreeBlocks();
    if (kind <= 2) {  // new sequence, plain or with prefix reuse
      const SeqId s = next++;
      auto toks = randomTokens(pick(1, 30));
      if (kind == 0) {
        Status st = pick(0, 1) ? kv->allocate(s, int(toks.size())) : kv->reserve(s, int(toks.size()));
        if (st.code() == StatusCode::kResourceExhausted) {
          ++exhausted;
          CHECK(kv->numFreeBlocks() == freeBefore);
          CHECK_FALSE(kv->hasSequence(s));
        } else {
          REQUIRE_OK(st);
          live[s] = toks;
        }
      } else {
        auto cached = attachAndExtend(*kv, s, toks, int(toks.size()));
        if (!cached.ok()) {
          REQUIRE(cached.status().code() == StatusCode::kResourceExhausted);
          ++exhausted;
          CHECK(kv->numFreeBlocks() == freeBefore);
          CHECK_FALSE(kv->hasSequence(s));
        } else {
          CHECK(*cached % 4 == 0);
          CHECK(*cached < int(toks.size()));
          if (*cached > 0) ++hits;
          // Shared blocks really hold the KV computed for these tokens.
          auto table = kv->blockTable(s);
          for (int b = 0; b < *cached / 4; ++b) {
            CHECK(blockHolds(*kv, table[size_t(b)], std::span<const TokenId>(toks).subspan(size_t(b) * 4, 4)));
          }
          live[s] = toks;
        }
      }
    } else if (!live.empty()) {
      auto it = live.begin();
      std::advance(it, pick(0, int(live.size()) - 1));
      const SeqId s = it->first;
      if (kind <= 4) {  // grow by a few tokens
        const int grow = pick(1, 9);
        Status st = kv->extend(s, int(it->second.size()) + grow);
        if (st.code() == StatusCode::kResourceExhausted) {
          CHECK(kv->numFreeBlocks() == freeBefore);
          CHECK(kv->numTokens(s) == int(it->second.size()));
        } else {
          REQUIRE_OK(st);
          for (int i = 0; i < grow; ++i) it->second.push_back(pick(0, 30));
        }
      } else if (kind == 5) {  // compute (registers hashes)
        computeAll(s);
      } else if (kind == 6) {  // fork
        const SeqId c = next++;
        Status st = kv->fork(s, c);
        if (st.isOk()) {
          live[c] = it->second;
        } else {
          REQUIRE(st.code() == StatusCode::kResourceExhausted);
          CHECK(kv->numFreeBlocks() == freeBefore);
        }
      } else {
        REQUIRE_OK(kv->free(s));
        live.erase(it);
      }
    }
    for (const auto& [seq, toks] : live) {
      REQUIRE(kv->numTokens(seq) == int(toks.size()));
    }
    Status inv = kv->checkInvariants();
    INFO("after op " << op);
    REQUIRE_OK(inv);
  }
  CHECK(hits > 50);
  CHECK(exhausted > 10);
  for (const auto& [seq, toks] : live) REQUIRE_OK(kv->free(seq));
  CHECK(kv->numFreeBlocks() == kv->numTotalBlocks());
  REQUIRE_OK(kv->checkInvariants());
}

namespace pd::engine {
// Reaches into the manager to break one rule at a time.
class KvCacheManagerTestPeer {
 public:
  static void bumpRef(KvCacheManager& kv, BlockId b) { ++kv.meta_[size_t(b)].ref; }
  static void pushFree(KvCacheManager& kv, BlockId b) { kv.freeUncached_.push_back(b); }
  static void dropFree(KvCacheManager& kv) { kv.freeUncached_.pop_back(); }
  static void setTokens(KvCacheManager& kv, SeqId s, int n) { kv.seqs_[s].numTokens = n; }
  static void duplicateBlock(KvCacheManager& kv, SeqId s) {
    auto& t = kv.seqs_[s];
    t.blocks.back() = t.blocks.front();
  }
  static void miscountHeld(KvCacheManager& kv) { ++kv.numHeld_; }
};
}  // namespace pd::engine

TEST_CASE("checkInvariants names the first broken rule") {
  using Peer = KvCacheManagerTestPeer;
  auto fresh = [] {
    auto kv = makeKv(smallLayout(8, 4));
    REQUIRE(kv->allocate(1, 8).isOk());  // blocks 0, 1
    REQUIRE(kv->checkInvariants().isOk());
    return kv;
  };
  auto expectViolation = [](const KvCacheManager& kv, const std::string& text) {
    Status s = kv.checkInvariants();
    INFO(s.toString());
    CHECK(s.code() == StatusCode::kInternal);
    CHECK(s.message().find(text) != std::string::npos);
  };
  {
    auto kv = fresh();
    Peer::bumpRef(*kv, 0);
    expectViolation(*kv, "block 0 has ref count 2 but 1 tables hold it");
  }
  {
    auto kv = fresh();
    Peer::pushFree(*kv, 1);
    expectViolation(*kv, "block 1 is referenced and also free");
  }
  {
    auto kv = fresh();
    Peer::pushFree(*kv, 7);  // 7 is already free
    expectViolation(*kv, "block 7 is in the free lists twice");
  }
  {
    auto kv = fresh();
    Peer::dropFree(*kv);  // block 2 leaks: neither free nor held
    expectViolation(*kv, "block 2 is neither free nor referenced");
  }
  {
    auto kv = fresh();
    Peer::setTokens(*kv, 1, 9);
    expectViolation(*kv, "sequence 1 holds 2 blocks for 9 tokens (expected 3)");
  }
  {
    auto kv = fresh();
    Peer::duplicateBlock(*kv, 1);
    expectViolation(*kv, "sequence 1 holds block 0 twice");
  }
  {
    auto kv = fresh();
    Peer::miscountHeld(*kv);
    expectViolation(*kv, "0 blocks are held but the count says 1");
  }
}

TEST_CASE("evictAndHold takes the oldest cached block out of every list until it is released") {
  auto kv = makeKv(smallLayout(4, 4));
  kv->setEventRecording(true);
  CHECK_FALSE(kv->evictAndHold().has_value());  // nothing cached
  const std::vector<TokenId> a = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  REQUIRE_OK(kv->allocate(1, int(a.size())));
  REQUIRE_OK(kv->cacheComputedBlocks(1, a, int(a.size())));
  const std::vector<BlockId> table(kv->blockTable(1).begin(), kv->blockTable(1).end());
  REQUIRE_OK(kv->free(1));
  (void)kv->takeEvents();
  REQUIRE(kv->numCachedFreeBlocks() == 2);
  // Freed tail first: the second block is the least recently freed.
  auto h = kv->evictAndHold();
  REQUIRE(h.has_value());
  CHECK(h->block == table[1]);
  CHECK(h->tokens == std::vector<TokenId>{5, 6, 7, 8});
  CHECK(h->parentHash == hashBlockTokens(kRootBlockHash, std::span(a).first(4)));
  CHECK(h->hash == hashBlockTokens(h->parentHash, std::span(a).subspan(4, 4)));
  CHECK(kv->isHeld(h->block));
  CHECK(kv->numHeldBlocks() == 1);
  CHECK(kv->numFreeBlocks() == 3);
  CHECK(kv->findCachedPrefix(a, 8).numTokens == 4);  // its name is gone
  auto ev = kv->takeEvents();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == KvBlockEvent::Kind::kRemoved);
  REQUIRE_OK(kv->checkInvariants());
  // Every free block taken: the held one is not among them.
  REQUIRE_OK(kv->allocate(2, 3 * 4));
  for (BlockId b : kv->blockTable(2)) CHECK(b != h->block);
  CHECK(kv->allocate(3, 1).code() == StatusCode::kResourceExhausted);
  REQUIRE_OK(kv->checkInvariants());
  CHECK(kv->releaseHeld(h->block));
  CHECK_FALSE(kv->releaseHeld(h->block));
  CHECK(kv->numHeldBlocks() == 0);
  REQUIRE_OK(kv->allocate(3, 1));
  CHECK(kv->blockTable(3)[0] == h->block);
  REQUIRE_OK(kv->checkInvariants());
}
