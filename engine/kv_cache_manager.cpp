#include "engine/kv_cache_manager.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "common/base/hash.h"

namespace pd::engine {
namespace {

std::string seqName(SeqId seq) { return "sequence " + std::to_string(seq); }

}  // namespace

const char* kvTierName(KvTier t) {
  switch (t) {
    case KvTier::kRegion:
      return "region";
    case KvTier::kHost:
      return "host";
    case KvTier::kDisk:
      return "disk";
  }
  return "unknown";
}

// ---- Construction -------------------------------------------------------------------------

Status KvCacheManager::validateLayout(const KvLayout& layout) {
  if (layout.numLayers <= 0 || layout.numBlocks <= 0 || layout.blockSize <= 0 || layout.numKvHeads <= 0 ||
      layout.headDim <= 0) {
    return invalidArgument("kv cache: layout " + layout.fingerprint() + " with " + std::to_string(layout.numBlocks) +
                           " blocks: every dimension (layers, blocks, block size, kv heads, "
                           "head dim) must be positive");
  }
  if (layout.numBlocks > std::numeric_limits<BlockId>::max() / 2 ||
      size_t(layout.numBlocks) * layout.blockSize > size_t(std::numeric_limits<int>::max())) {
    return invalidArgument("kv cache: " + std::to_string(layout.numBlocks) + " blocks of " +
                           std::to_string(layout.blockSize) + " tokens exceed the supported token count (2^31 - 1)");
  }
  // Overflow check of totalBytes(): layers * blocks * blockBytes must fit in size_t.
  const size_t blockBytes = layout.blockBytes();
  if (blockBytes == 0 ||
      size_t(layout.numBlocks) > std::numeric_limits<size_t>::max() / blockBytes / size_t(layout.numLayers)) {
    return invalidArgument("kv cache: layout " + layout.fingerprint() + " overflows size_t");
  }
  return Status::ok();
}

namespace {

// Faults the whole region in now, in the huge pages create() advised. Left to first touch,
// the first prompts after start paid for their blocks' pages inside their prefill steps: a
// 2 MiB huge page took ~2.3 ms to fault on this project's VM, and every third 384-token prompt
// crossed into fresh pages in each of its layers' K and V, 18% slower (238 against 202 ms,
// docs/performance.md). The engine peers touch their CPU KV cache at start too (vLLM zeroes it,
// llama.cpp clears its buffer). MADV_POPULATE_WRITE (Linux 5.14) reports a shortage as ENOMEM
// where a memset would be killed by the OOM killer; older kernels get the memset.
Status populate(void* base, size_t bytes, const KvLayout& layout) {
  if (::madvise(base, bytes, MADV_POPULATE_WRITE) == 0) return Status::ok();
  if (errno == EINVAL) {
    std::memset(base, 0, bytes);
    return Status::ok();
  }
  const int err = errno;
  munmap(base, bytes);
  return resourceExhausted("kv cache: cannot back " + std::to_string(bytes) + " bytes for layout " +
                           layout.fingerprint() + " with memory: " + std::strerror(err));
}

}  // namespace

Result<std::unique_ptr<KvCacheManager>> KvCacheManager::create(const KvLayout& layout, Backing backing) {
  PD_RETURN_IF_ERROR(validateLayout(layout));
  void* base = nullptr;
  size_t mapped = 0;
  if (backing == Backing::kAllocate) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    mapped = (layout.totalBytes() + page - 1) / page * page;
    // Transparent huge pages where the region spans one: a KV transfer between processes on
    // one node (cma) pins and copies the region page by page, and 2 MiB pages made it 1.85x
    // faster (7.9 -> 14.6 GB/s for 512 MiB, docs/performance.md). The mapping is over-sized
    // by one huge page and trimmed, so the region starts on a huge-page boundary.
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t extra = mapped >= kHuge ? kHuge : 0;
    void* raw = mmap(nullptr, mapped + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      return resourceExhausted("kv cache: cannot map " + std::to_string(mapped) + " bytes for layout " +
                               layout.fingerprint() + ": " + std::strerror(errno));
    }
    base = raw;
    if (extra > 0) {
      const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
      const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
      if (aligned > start) munmap(raw, aligned - start);
      if (const size_t tail = start + mapped + extra - (aligned + mapped); tail > 0) {
        munmap(reinterpret_cast<void*>(aligned + mapped), tail);
      }
      base = reinterpret_cast<void*>(aligned);
      ::madvise(base, mapped, MADV_HUGEPAGE);  // advice: without THP the region keeps 4 KiB pages
    }
    PD_RETURN_IF_ERROR(populate(base, mapped, layout));
  }
  return std::unique_ptr<KvCacheManager>(new KvCacheManager(layout, base, mapped));
}

Result<std::unique_ptr<KvCacheManager>> KvCacheManager::createOver(const KvLayout& layout, const MemDesc& region) {
  PD_RETURN_IF_ERROR(validateLayout(layout));
  if (region.addr == 0 || region.len < layout.totalBytes()) {
    return invalidArgument("kv cache: region " + toString(region) + " cannot hold layout " + layout.fingerprint() +
                           " (" + std::to_string(layout.totalBytes()) + " bytes)");
  }
  std::unique_ptr<KvCacheManager> m(new KvCacheManager(layout, reinterpret_cast<void*>(region.addr), 0));
  m->kind_ = region.kind;
  m->device_ = region.device;
  return m;
}

KvCacheManager::KvCacheManager(const KvLayout& layout, void* base, size_t mappedBytes)
    : layout_(layout),
      base_(base),
      mappedBytes_(mappedBytes),
      meta_(size_t(layout.numBlocks)),
      blockTokens_(size_t(layout.numBlocks) * layout.blockSize),
      lruPos_(size_t(layout.numBlocks)) {
  // Pop order 0, 1, 2, ...: a fresh cache hands out consecutive ids, so transfers of a new
  // sequence coalesce into few segments.
  freeUncached_.reserve(size_t(layout.numBlocks));
  for (BlockId b = layout.numBlocks - 1; b >= 0; --b) freeUncached_.push_back(b);
}

KvCacheManager::~KvCacheManager() {
  if (mappedBytes_ > 0) munmap(base_, mappedBytes_);
}

MemDesc KvCacheManager::region() const {
  MemDesc d;
  d.addr = reinterpret_cast<uintptr_t>(base_);
  d.len = layout_.totalBytes();
  d.kind = kind_;
  d.device = device_;
  return d;
}

// ---- Pool ---------------------------------------------------------------------------------

double KvCacheManager::usage() const { return 1.0 - double(numFreeBlocks()) / double(numTotalBlocks()); }

int KvCacheManager::blocksFor(int numTokens) const {
  return numTokens <= 0 ? 0 : (numTokens + layout_.blockSize - 1) / layout_.blockSize;
}

int KvCacheManager::refCount(BlockId block) const {
  return block >= 0 && block < layout_.numBlocks ? meta_[size_t(block)].ref : 0;
}

BlockId KvCacheManager::takeFreeBlock() {
  BlockId b;
  if (!freeUncached_.empty()) {
    b = freeUncached_.back();
    freeUncached_.pop_back();
  } else {
    // Evict the least recently freed cached block: its prefix is the least likely to be
    // asked for again.
    b = lru_.front();
    lru_.pop_front();
    BlockMeta& m = meta_[size_t(b)];
    m.inLru = false;
    // Demotion: a lower tier copies the block while its bytes are still intact.
    if (tiers_ != nullptr) {
      tiers_->onEvict(
          b, m.hash, m.parentHash,
          std::span<const TokenId>(&blockTokens_[size_t(b) * layout_.blockSize], size_t(layout_.blockSize)));
    }
    byHash_.erase(m.hash);
    m.hashed = false;
    m.promotedFrom = KvTier::kRegion;
    ++stats_.evictions;
    if (recordEvents_) pushEvent({KvBlockEvent::Kind::kRemoved, m.hash, m.parentHash, {}});
  }
  meta_[size_t(b)].ref = 1;
  return b;
}

void KvCacheManager::releaseBlock(BlockId b) {
  BlockMeta& m = meta_[size_t(b)];
  if (--m.ref > 0) return;
  if (m.hashed) {
    m.inLru = true;
    lruPos_[size_t(b)] = lru_.insert(lru_.end(), b);
  } else {
    freeUncached_.push_back(b);
  }
}

void KvCacheManager::acquireCached(BlockId b) {
  BlockMeta& m = meta_[size_t(b)];
  if (m.ref == 0 && m.inLru) {
    lru_.erase(lruPos_[size_t(b)]);
    m.inLru = false;
  }
  ++m.ref;
}

// ---- Sequences ----------------------------------------------------------------------------

std::span<const BlockId> KvCacheManager::blockTable(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return {};
  return it->second.blocks;
}

int KvCacheManager::numTokens(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? -1 : it->second.numTokens;
}

int KvCacheManager::blocksNeeded(SeqId seq, int newNumTokens) const {
  auto it = seqs_.find(seq);
  const int have = it == seqs_.end() ? 0 : int(it->second.blocks.size());
  return std::max(0, blocksFor(newNumTokens) - have);
}

Status KvCacheManager::grow(SeqTable& t, int newNumTokens) {
  const int need = blocksFor(newNumTokens) - int(t.blocks.size());
  if (need > numFreeBlocks()) {
    return resourceExhausted("kv cache: " + std::to_string(need) + " more blocks needed for " +
                             std::to_string(newNumTokens) + " tokens, " + std::to_string(numFreeBlocks()) + " of " +
                             std::to_string(numTotalBlocks()) + " free");
  }
  for (int i = 0; i < need; ++i) t.blocks.push_back(takeFreeBlock());
  t.numTokens = std::max(t.numTokens, newNumTokens);
  return Status::ok();
}

Status KvCacheManager::allocate(SeqId seq, int numTokens) {
  if (numTokens < 0) {
    return invalidArgument("kv cache: allocate " + seqName(seq) + ": negative token count " +
                           std::to_string(numTokens));
  }
  if (hasSequence(seq)) {
    return Status(StatusCode::kAlreadyExists, "kv cache: " + seqName(seq) + " already has blocks");
  }
  SeqTable t;
  t.lastHash = kRootBlockHash;
  Status st = grow(t, numTokens);
  if (!st.isOk()) return st.withContext("allocate " + seqName(seq));
  seqs_.emplace(seq, std::move(t));
  return Status::ok();
}

Status KvCacheManager::reserve(SeqId seq, int numTokens) {
  Status st = allocate(seq, numTokens);
  if (!st.isOk() && st.code() == StatusCode::kResourceExhausted) {
    return resourceExhausted("kv cache: cannot reserve " + std::to_string(numTokens) + " tokens (" +
                             std::to_string(blocksFor(numTokens)) + " blocks) for " + seqName(seq) + ": " +
                             std::to_string(numFreeBlocks()) + " of " + std::to_string(numTotalBlocks()) +
                             " blocks free");
  }
  return st;
}

Status KvCacheManager::extend(SeqId seq, int newNumTokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return notFound("kv cache: extend: unknown " + seqName(seq));
  if (newNumTokens < 0) {
    return invalidArgument("kv cache: extend " + seqName(seq) + ": negative token count");
  }
  Status st = grow(it->second, newNumTokens);
  return st.isOk() ? st : st.withContext("extend " + seqName(seq));
}

Status KvCacheManager::free(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return notFound("kv cache: free: unknown " + seqName(seq));
  // Tail first, so that a sequence's later blocks are evicted before its prefix blocks,
  // which other prompts are the most likely to share.
  const auto& blocks = it->second.blocks;
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) releaseBlock(*b);
  seqs_.erase(it);
  return Status::ok();
}

Status KvCacheManager::rename(SeqId from, SeqId to) {
  auto it = seqs_.find(from);
  if (it == seqs_.end()) return notFound("kv cache: rename: unknown " + seqName(from));
  if (hasSequence(to)) {
    return Status(StatusCode::kAlreadyExists,
                  "kv cache: rename " + seqName(from) + " -> " + seqName(to) + ": the target already has blocks");
  }
  SeqTable t = std::move(it->second);
  seqs_.erase(it);
  seqs_.emplace(to, std::move(t));
  return Status::ok();
}

Status KvCacheManager::fork(SeqId parent, SeqId child) {
  auto it = seqs_.find(parent);
  if (it == seqs_.end()) return notFound("kv cache: fork: unknown parent " + seqName(parent));
  if (hasSequence(child)) {
    return Status(StatusCode::kAlreadyExists, "kv cache: fork: child " + seqName(child) + " already has blocks");
  }
  const SeqTable& p = it->second;
  const bool partialTail = p.numTokens % layout_.blockSize != 0;
  if (partialTail && base_ != nullptr && kind_ != MemKind::kHost) {
    return failedPrecondition("kv cache: fork " + seqName(parent) + " -> " + seqName(child) +
                              ": copying a partial block of " + toString(region()) +
                              " memory is not supported (host regions only)");
  }
  if (partialTail && numFreeBlocks() == 0) {
    return resourceExhausted("kv cache: fork " + seqName(parent) + " -> " + seqName(child) +
                             ": no free block to copy the partial last block into");
  }
  SeqTable c = p;
  const size_t shared = p.blocks.size() - (partialTail ? 1 : 0);
  for (size_t i = 0; i < shared; ++i) ++meta_[size_t(p.blocks[i])].ref;
  if (partialTail) {
    const BlockId src = p.blocks.back();
    const BlockId dst = takeFreeBlock();
    c.blocks.back() = dst;
    if (base_ != nullptr) {
      auto* bytes = static_cast<uint8_t*>(base_);
      for (int l = 0; l < layout_.numLayers; ++l) {
        std::memcpy(bytes + layout_.blockOffset(l, dst), bytes + layout_.blockOffset(l, src), layout_.blockBytes());
      }
    }
  }
  seqs_.emplace(child, std::move(c));
  return Status::ok();
}

// ---- Prefix cache -------------------------------------------------------------------------

bool KvCacheManager::blockMatches(BlockId b, uint64_t parentHash, std::span<const TokenId> tokens) const {
  const BlockMeta& m = meta_[size_t(b)];
  if (!m.hashed || m.parentHash != parentHash) return false;
  // Compare the tokens too: a 64-bit collision must never serve another prompt's KV.
  const TokenId* stored = &blockTokens_[size_t(b) * layout_.blockSize];
  return std::equal(tokens.begin(), tokens.end(), stored);
}

PrefixMatch KvCacheManager::findCachedPrefix(std::span<const TokenId> tokens, int maxTokens) const {
  PrefixMatch match;
  const int bs = layout_.blockSize;
  const int limit = std::min<int>(maxTokens, int(tokens.size()));
  uint64_t parent = kRootBlockHash;
  for (int start = 0; start + bs <= limit; start += bs) {
    auto blockToks = tokens.subspan(size_t(start), size_t(bs));
    const uint64_t h = hashBlockTokens(parent, blockToks);
    auto it = byHash_.find(h);
    if (it == byHash_.end() || !blockMatches(it->second, parent, blockToks)) break;
    match.blocks.push_back(it->second);
    if (meta_[size_t(it->second)].ref == 0) ++match.numFreeBlocks;
    match.numTokens += bs;
    parent = h;
  }
  return match;
}

Result<int> KvCacheManager::attachCachedPrefix(SeqId seq, std::span<const TokenId> tokens, int maxTokens) {
  if (hasSequence(seq)) {
    return Status(StatusCode::kAlreadyExists, "kv cache: " + seqName(seq) + " already has blocks");
  }
  if (maxTokens < 0) {
    return invalidArgument("kv cache: attach prefix for " + seqName(seq) + ": negative token limit");
  }
  PrefixMatch match = findCachedPrefix(tokens, maxTokens);
  SeqTable t;
  t.lastHash = kRootBlockHash;
  for (BlockId b : match.blocks) {
    acquireCached(b);
    BlockMeta& m = meta_[size_t(b)];
    t.lastHash = m.hash;
    ++stats_.hitBlocks[size_t(m.promotedFrom)];
    m.promotedFrom = KvTier::kRegion;
  }
  t.blocks = std::move(match.blocks);
  t.numTokens = match.numTokens;
  t.numHashed = int(t.blocks.size());
  seqs_.emplace(seq, std::move(t));
  ++stats_.prefixQueries;
  stats_.prefixQueryTokens += tokens.size();
  stats_.prefixHitTokens += uint64_t(match.numTokens);
  return match.numTokens;
}

Status KvCacheManager::cacheComputedBlocks(SeqId seq, std::span<const TokenId> tokens, int numComputed) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return notFound("kv cache: cache blocks: unknown " + seqName(seq));
  SeqTable& t = it->second;
  if (numComputed < 0 || numComputed > int(tokens.size()) || numComputed > t.numTokens) {
    return invalidArgument("kv cache: cache blocks of " + seqName(seq) + ": " + std::to_string(numComputed) +
                           " computed tokens, but " + std::to_string(tokens.size()) + " tokens given and " +
                           std::to_string(t.numTokens) + " slots allocated");
  }
  const int bs = layout_.blockSize;
  const int fullBlocks = numComputed / bs;
  for (int i = t.numHashed; i < fullBlocks; ++i) {
    auto blockToks = tokens.subspan(size_t(i) * bs, size_t(bs));
    const uint64_t h = hashBlockTokens(t.lastHash, blockToks);
    const BlockId b = t.blocks[size_t(i)];
    BlockMeta& m = meta_[size_t(b)];
    // A block already named (attached from the cache) keeps its name. When another block
    // already holds the same content, keep that one as the cached copy and leave this one
    // unnamed: the index maps a hash to one block.
    if (!m.hashed && byHash_.find(h) == byHash_.end()) {
      m.hashed = true;
      m.hash = h;
      m.parentHash = t.lastHash;
      std::copy(blockToks.begin(), blockToks.end(), &blockTokens_[size_t(b) * bs]);
      byHash_.emplace(h, b);
      if (recordEvents_)
        pushEvent(
            {KvBlockEvent::Kind::kStored, h, t.lastHash, std::vector<int32_t>(blockToks.begin(), blockToks.end())});
      if (tiers_ != nullptr) tiers_->onNamed(b, h, t.lastHash, blockToks);
    }
    t.lastHash = h;
    t.numHashed = i + 1;
  }
  return Status::ok();
}

// ---- Lower tiers --------------------------------------------------------------------------

std::optional<KvCacheManager::HeldBlock> KvCacheManager::evictAndHold() {
  if (lru_.empty()) return std::nullopt;
  const BlockId b = lru_.front();
  lru_.pop_front();
  BlockMeta& m = meta_[size_t(b)];
  m.inLru = false;
  HeldBlock h;
  h.block = b;
  h.hash = m.hash;
  h.parentHash = m.parentHash;
  const TokenId* toks = &blockTokens_[size_t(b) * size_t(layout_.blockSize)];
  h.tokens.assign(toks, toks + layout_.blockSize);
  byHash_.erase(m.hash);
  m.hashed = false;
  m.promotedFrom = KvTier::kRegion;
  m.held = true;
  ++numHeld_;
  ++stats_.evictions;
  if (recordEvents_) pushEvent({KvBlockEvent::Kind::kRemoved, m.hash, m.parentHash, {}});
  return h;
}

bool KvCacheManager::releaseHeld(BlockId b) {
  if (!isHeld(b)) return false;
  meta_[size_t(b)].held = false;
  --numHeld_;
  freeUncached_.push_back(b);
  return true;
}

int KvCacheManager::promote(std::span<const TokenId> tokens, int maxTokens, int maxNewBlocks,
                            const PromoteSource& source) {
  if (maxNewBlocks <= 0 || !source.has || !source.fill) return 0;
  // Pin the prefix the region already holds, and each promoted block, so that no fresh
  // block taken below evicts a block of this very prompt.
  PrefixMatch match = findCachedPrefix(tokens, maxTokens);
  std::vector<BlockId> pinned = match.blocks;
  for (BlockId b : pinned) acquireCached(b);
  const int bs = layout_.blockSize;
  const int limit = std::min<int>(maxTokens, int(tokens.size()));
  uint64_t parent = pinned.empty() ? kRootBlockHash : meta_[size_t(pinned.back())].hash;
  int promoted = 0;
  for (int start = match.numTokens; start + bs <= limit && promoted < maxNewBlocks; start += bs) {
    auto blockToks = tokens.subspan(size_t(start), size_t(bs));
    const uint64_t h = hashBlockTokens(parent, blockToks);
    // The region may hold it under another chain position's block already (a collision of
    // names with other tokens): never name two blocks alike.
    if (byHash_.count(h) != 0) break;
    const std::optional<KvTier> from = source.has(h, blockToks);
    if (!from || *from == KvTier::kRegion || numFreeBlocks() == 0) break;
    const BlockId b = takeFreeBlock();
    if (!source.fill(h, *from, b)) {
      meta_[size_t(b)].ref = 0;
      freeUncached_.push_back(b);
      break;
    }
    BlockMeta& m = meta_[size_t(b)];
    m.hashed = true;
    m.hash = h;
    m.parentHash = parent;
    m.promotedFrom = *from;
    std::copy(blockToks.begin(), blockToks.end(), &blockTokens_[size_t(b) * bs]);
    byHash_.emplace(h, b);
    ++stats_.promotedBlocks[size_t(*from)];
    if (recordEvents_)
      pushEvent({KvBlockEvent::Kind::kStored, h, parent, std::vector<int32_t>(blockToks.begin(), blockToks.end())});
    pinned.push_back(b);
    parent = h;
    ++promoted;
  }
  // Tail first, as free() does: the prefix blocks are evicted last.
  for (auto it = pinned.rbegin(); it != pinned.rend(); ++it) releaseBlock(*it);
  return promoted;
}

void KvCacheManager::copyBlockOut(BlockId b, uint8_t* dst) const {
  const auto* bytes = static_cast<const uint8_t*>(base_);
  const size_t bb = layout_.blockBytes();
  for (int l = 0; l < layout_.numLayers; ++l) std::memcpy(dst + size_t(l) * bb, bytes + layout_.blockOffset(l, b), bb);
}

void KvCacheManager::copyBlockIn(const uint8_t* src, BlockId b) {
  auto* bytes = static_cast<uint8_t*>(base_);
  const size_t bb = layout_.blockBytes();
  for (int l = 0; l < layout_.numLayers; ++l) std::memcpy(bytes + layout_.blockOffset(l, b), src + size_t(l) * bb, bb);
}

// ---- KV events ----------------------------------------------------------------------------

void KvCacheManager::setEventRecording(bool on) {
  recordEvents_ = on;
  if (!on) {
    events_.clear();
    oldestPendingUs_ = 0;
  }
}

void KvCacheManager::pushEvent(KvBlockEvent e) {
  if (events_.empty()) {
    oldestPendingUs_ = uint64_t(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
  }
  events_.push_back(std::move(e));
}

std::vector<KvBlockEvent> KvCacheManager::takeEvents() {
  oldestPendingUs_ = 0;
  return std::exchange(events_, {});
}

std::vector<KvBlockEvent> KvCacheManager::snapshotEvents() const {
  std::vector<KvBlockEvent> out;
  out.push_back({KvBlockEvent::Kind::kAllCleared, 0, 0, {}});
  // Parents first: walk down from every block whose parent is not named (a root, or a
  // block whose predecessor was evicted before it).
  std::unordered_map<uint64_t, std::vector<BlockId>> children;
  std::vector<BlockId> todo;
  for (BlockId b = 0; b < layout_.numBlocks; ++b) {
    const BlockMeta& m = meta_[size_t(b)];
    if (!m.hashed) continue;
    if (byHash_.count(m.parentHash))
      children[m.parentHash].push_back(b);
    else
      todo.push_back(b);
  }
  const int bs = layout_.blockSize;
  while (!todo.empty()) {
    const BlockId b = todo.back();
    todo.pop_back();
    const BlockMeta& m = meta_[size_t(b)];
    const int32_t* toks = &blockTokens_[size_t(b) * size_t(bs)];
    out.push_back({KvBlockEvent::Kind::kStored, m.hash, m.parentHash, std::vector<int32_t>(toks, toks + bs)});
    if (auto c = children.find(m.hash); c != children.end())
      todo.insert(todo.end(), c->second.begin(), c->second.end());
  }
  if (tiers_ != nullptr) tiers_->appendSnapshot(&out);
  return out;
}

// ---- Descriptors --------------------------------------------------------------------------

Status KvCacheManager::checkLayer(int layerBegin, int layerEnd) const {
  if (layerBegin < 0 || layerEnd > layout_.numLayers || layerBegin > layerEnd) {
    return invalidArgument("kv cache: layer range [" + std::to_string(layerBegin) + ", " + std::to_string(layerEnd) +
                           ") is not within [0, " + std::to_string(layout_.numLayers) + ")");
  }
  return Status::ok();
}

Result<DescList> layerSegmentsAt(const KvLayout& layout, const MemDesc& region, std::span<const BlockId> blocks,
                                 int layerBegin, int layerEnd) {
  // Pairing a list with itself cuts runs exactly where its own ids stop being consecutive.
  PD_ASSIGN_OR_RETURN(SegmentPairs pairs,
                      pairedLayerSegments(layout, region, blocks, region, blocks, layerBegin, layerEnd));
  return std::move(pairs.local);
}

Result<SegmentPairs> pairedLayerSegments(const KvLayout& layout, const MemDesc& localRegion,
                                         std::span<const BlockId> localBlocks, const MemDesc& remoteRegion,
                                         std::span<const BlockId> remoteBlocks, int layerBegin, int layerEnd) {
  if (layerBegin < 0 || layerEnd > layout.numLayers || layerBegin > layerEnd) {
    return invalidArgument("kv segments: layer range [" + std::to_string(layerBegin) + ", " + std::to_string(layerEnd) +
                           ") is not within [0, " + std::to_string(layout.numLayers) + ")");
  }
  if (localBlocks.size() != remoteBlocks.size()) {
    return invalidArgument("kv segments: " + std::to_string(localBlocks.size()) + " local blocks but " +
                           std::to_string(remoteBlocks.size()) + " remote blocks");
  }
  for (size_t i = 0; i < localBlocks.size(); ++i) {
    for (BlockId b : {localBlocks[i], remoteBlocks[i]}) {
      if (b < 0 || b >= layout.numBlocks) {
        return invalidArgument("kv segments: block id " + std::to_string(b) + " is out of range [0, " +
                               std::to_string(layout.numBlocks) + ")");
      }
    }
  }
  SegmentPairs out;
  const size_t blockBytes = layout.blockBytes();
  auto makeDesc = [&](const MemDesc& region, int layer, BlockId first, size_t run) {
    MemDesc d;
    d.addr = region.addr + layout.blockOffset(layer, first);
    d.len = run * blockBytes;
    d.device = region.device;
    d.kind = region.kind;
    return d;
  };
  for (int layer = layerBegin; layer < layerEnd; ++layer) {
    size_t i = 0;
    while (i < localBlocks.size()) {
      size_t run = 1;
      while (i + run < localBlocks.size() && localBlocks[i + run] == localBlocks[i] + BlockId(run) &&
             remoteBlocks[i + run] == remoteBlocks[i] + BlockId(run)) {
        ++run;
      }
      out.local.push_back(makeDesc(localRegion, layer, localBlocks[i], run));
      out.remote.push_back(makeDesc(remoteRegion, layer, remoteBlocks[i], run));
      i += run;
    }
  }
  return out;
}

Result<DescList> KvCacheManager::layerSegments(std::span<const BlockId> blocks, int layerBegin, int layerEnd) const {
  PD_RETURN_IF_ERROR(checkLayer(layerBegin, layerEnd));
  return layerSegmentsAt(layout_, region(), blocks, layerBegin, layerEnd);
}

Result<DescList> KvCacheManager::layerSegments(SeqId seq, int layerBegin, int layerEnd) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return notFound("kv cache: layer segments: unknown " + seqName(seq));
  return layerSegments(it->second.blocks, layerBegin, layerEnd);
}

// ---- Invariants ---------------------------------------------------------------------------

Status KvCacheManager::checkInvariants() const {
  auto fail = [](const std::string& what) { return internalError("kv cache invariant violated: " + what); };
  const int n = layout_.numBlocks;
  const int bs = layout_.blockSize;
  std::vector<int32_t> holders(size_t(n), 0);
  for (const auto& [seq, t] : seqs_) {
    if (t.numTokens < 0) return fail(seqName(seq) + " has a negative token count");
    if (int(t.blocks.size()) != blocksFor(t.numTokens)) {
      return fail(seqName(seq) + " holds " + std::to_string(t.blocks.size()) + " blocks for " +
                  std::to_string(t.numTokens) + " tokens (expected " + std::to_string(blocksFor(t.numTokens)) + ")");
    }
    if (t.numHashed < 0 || t.numHashed > t.numTokens / bs) {
      return fail(seqName(seq) + " has " + std::to_string(t.numHashed) + " hashed blocks but only " +
                  std::to_string(t.numTokens / bs) + " full ones");
    }
    std::vector<BlockId> sorted = t.blocks;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (sorted[i] < 0 || sorted[i] >= n) {
        return fail(seqName(seq) + " holds out-of-range block " + std::to_string(sorted[i]));
      }
      if (i > 0 && sorted[i] == sorted[i - 1]) {
        return fail(seqName(seq) + " holds block " + std::to_string(sorted[i]) + " twice");
      }
      ++holders[size_t(sorted[i])];
    }
  }
  std::vector<uint8_t> inFree(size_t(n), 0);
  for (BlockId b : freeUncached_) {
    if (b < 0 || b >= n) return fail("free list holds out-of-range block " + std::to_string(b));
    if (inFree[size_t(b)]++) return fail("block " + std::to_string(b) + " is in the free lists twice");
    if (meta_[size_t(b)].hashed) {
      return fail("block " + std::to_string(b) + " is in the uncached free list but has a hash");
    }
  }
  for (BlockId b : lru_) {
    if (b < 0 || b >= n) return fail("cached free list holds out-of-range block " + std::to_string(b));
    if (inFree[size_t(b)]++) return fail("block " + std::to_string(b) + " is in the free lists twice");
    if (!meta_[size_t(b)].hashed || !meta_[size_t(b)].inLru) {
      return fail("block " + std::to_string(b) + " is in the cached free list without a hash or mark");
    }
    if (*lruPos_[size_t(b)] != b) return fail("block " + std::to_string(b) + " has a stale LRU position");
  }
  int held = 0;
  for (int b = 0; b < n; ++b) {
    const BlockMeta& m = meta_[size_t(b)];
    const std::string name = "block " + std::to_string(b);
    if (m.ref != holders[size_t(b)]) {
      return fail(name + " has ref count " + std::to_string(m.ref) + " but " + std::to_string(holders[size_t(b)]) +
                  " tables hold it");
    }
    if (m.held) {
      ++held;
      if (m.ref != 0 || inFree[size_t(b)] || m.hashed) return fail(name + " is held but referenced, free or named");
      continue;
    }
    if (m.ref == 0 && !inFree[size_t(b)]) return fail(name + " is neither free nor referenced");
    if (m.ref > 0 && inFree[size_t(b)]) return fail(name + " is referenced and also free");
    if (m.inLru && (m.ref != 0 || !m.hashed)) return fail(name + " is marked cached-free wrongly");
    if (!m.hashed && m.promotedFrom != KvTier::kRegion) return fail(name + " is unnamed but marked promoted");
    if (m.hashed) {
      auto it = byHash_.find(m.hash);
      if (it == byHash_.end() || it->second != b) {
        return fail(name + " has a hash the index does not map to it");
      }
    }
  }
  for (const auto& [h, b] : byHash_) {
    if (b < 0 || b >= n || !meta_[size_t(b)].hashed || meta_[size_t(b)].hash != h) {
      return fail("hash index entry for block " + std::to_string(b) + " is stale");
    }
  }
  if (held != numHeld_)
    return fail(std::to_string(held) + " blocks are held but the count says " + std::to_string(numHeld_));
  if (numFreeBlocks() + held + int(std::count_if(holders.begin(), holders.end(), [](int32_t h) { return h > 0; })) !=
      n) {
    return fail("free + held + referenced blocks do not add up to " + std::to_string(n));
  }
  return Status::ok();
}

}  // namespace pd::engine
