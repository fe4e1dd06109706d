// KvCacheManager (docs/design.md §3, §4): the paged KV cache of one worker.
//
// It owns one contiguous, page-aligned region of ordinary anonymous memory laid out as
// KvLayout says (all layers; per layer a pool of blocks), and the bookkeeping over it:
//   - a pool of `numBlocks` blocks of `blockSize` tokens with a free list;
//   - per-sequence block tables: allocate for N tokens, extend as the sequence grows, free;
//   - reference counts, so one block can be held by several sequences (forks and shared
//     prompt prefixes);
//   - prefix hashes: once the KV of a full block has been computed, the block is named by a
//     hash of its token ids chained with the previous block's hash. A new prompt can attach
//     the cached full blocks of its longest cached prefix instead of recomputing them. A
//     freed block with a hash stays reusable until it is evicted (least recently freed
//     first) to satisfy a fresh allocation.
//
// Allocation is all or nothing: an operation that needs more blocks than are free fails with
// kResourceExhausted and changes nothing. checkInvariants() verifies every piece of the
// bookkeeping and names the first violation; tests call it after every operation.
//
// Threads: NOT thread-safe. One worker loop thread owns the manager (docs/design.md §3); other
// threads post work to that loop. The region's bytes are written by the backend and read by
// kvtransfer while the owning loop keeps the blocks referenced.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/base/hash.h"
#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "engine/kv_layout.h"

namespace pd::engine {

using SeqId = uint64_t;
using BlockId = int32_t;
using TokenId = int32_t;

// Where a named block's KV lives (docs/kv_cache.md): the KV region this manager keeps the
// books of, or a lower tier below it (engine/kv_tiers.h). vLLM's KV events call it `medium`.
enum class KvTier : uint8_t { kRegion = 0, kHost = 1, kDisk = 2 };
inline constexpr int kNumKvTiers = 3;
// "region", "host", "disk": the metric label.
const char* kvTierName(KvTier t);

// Result of a prefix-cache lookup.
struct PrefixMatch {
  int numTokens = 0;            // leading tokens whose KV is cached (a multiple of blockSize)
  std::vector<BlockId> blocks;  // the cached blocks, in order
  int numFreeBlocks = 0;        // how many of `blocks` sit in the free pool now (attaching
                                // them takes them out of it)
};

// A change of the prefix cache's named blocks (docs/kv_events.md): what a router's exact index
// and vLLM-style KV-event consumers track. Stored: a block became findable by `hash` (its
// predecessor `parentHash`, kRootBlockHash for block 0, holding `tokens`); Removed: the block
// named `hash` was evicted; AllCleared: forget everything (only ever the head of a snapshot).
// `tier` says which tier gained or lost the block: a block may be held by several tiers at
// once (the region and a copy on disk), and each tier announces its own changes.
struct KvBlockEvent {
  enum class Kind { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  uint64_t hash = 0;
  uint64_t parentHash = 0;
  std::vector<int32_t> tokens;  // kStored only
  KvTier tier = KvTier::kRegion;
};

// The tiers below the KV region, as the manager sees them (implemented by engine/kv_tiers.h).
// The manager calls them on its owner's thread, synchronously; they must not call back into
// the manager except recordEvent().
class KvLowerTiers {
 public:
  virtual ~KvLowerTiers() = default;
  // Block `b` just got its name: its KV is computed and final (write-through tiers copy it).
  virtual void onNamed(BlockId b, uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens) = 0;
  // The named free block `b` is being evicted for reuse: its bytes stay intact until this
  // returns (a tier that keeps it copies it now: a demotion).
  virtual void onEvict(BlockId b, uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens) = 0;
  // Appends a Stored event (with its tier) for every block the lower tiers hold: a snapshot.
  virtual void appendSnapshot(std::vector<KvBlockEvent>* out) const = 0;
};

struct KvCacheStats {
  uint64_t prefixQueries = 0;      // attachCachedPrefix calls
  uint64_t prefixQueryTokens = 0;  // tokens looked up
  uint64_t prefixHitTokens = 0;    // tokens served from cached blocks
  uint64_t evictions = 0;          // cached free blocks reused for fresh allocations
  // Blocks attached from the cache by where they came from: the region itself, or a lower
  // tier that promoted them (counted once, at the first attach after the promotion).
  uint64_t hitBlocks[kNumKvTiers] = {};
  uint64_t promotedBlocks[kNumKvTiers] = {};  // restored into the region, by source tier
};

class KvCacheManager {
 public:
  enum class Backing {
    kAllocate,        // map the region (the normal case)
    kAccountingOnly,  // no memory: block bookkeeping only (simulators, sizing); data() == null
  };

  // Validates the layout (every dimension positive, size representable) and maps the
  // region, resident before it returns (every page faulted in: no step pays for them later).
  // Errors: kInvalidArgument for a bad layout, kResourceExhausted when mmap fails or the
  // host cannot back the region with memory.
  static Result<std::unique_ptr<KvCacheManager>> create(const KvLayout& layout, Backing backing = Backing::kAllocate);
  // Bookkeeping over a region someone else owns and outlives this manager: the CUDA
  // backend's KV cache in device memory (kind kCuda). region() returns it as given; the
  // manager never reads or writes its bytes (fork() of a partial block, which copies on the
  // host, is refused unless the region is host memory). Errors: as create(), and
  // kInvalidArgument when the region is shorter than layout.totalBytes().
  static Result<std::unique_ptr<KvCacheManager>> createOver(const KvLayout& layout, const MemDesc& region);
  ~KvCacheManager();
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  // ---- The region ----------------------------------------------------------------------
  const KvLayout& layout() const { return layout_; }
  // The region's base; host-addressable only when region().kind is kHost.
  void* data() const { return base_; }
  // The whole region as one descriptor (what kvtransfer registers). Its length is
  // layout().totalBytes(); a mapping of our own is rounded up to whole pages.
  MemDesc region() const;

  // ---- Pool state ----------------------------------------------------------------------
  int blockSize() const { return layout_.blockSize; }
  int numTotalBlocks() const { return layout_.numBlocks; }
  // Free blocks, counting cached ones that may be evicted.
  int numFreeBlocks() const { return int(freeUncached_.size() + lru_.size()); }
  // Free blocks that still hold a reusable cached prefix.
  int numCachedFreeBlocks() const { return int(lru_.size()); }
  // Fraction of blocks referenced by some sequence, in [0, 1].
  double usage() const;
  int blocksFor(int numTokens) const;
  int refCount(BlockId block) const;  // 0 for free or out-of-range blocks
  const KvCacheStats& stats() const { return stats_; }

  // ---- Sequences -----------------------------------------------------------------------
  bool hasSequence(SeqId seq) const { return seqs_.count(seq) != 0; }
  int numSequences() const { return int(seqs_.size()); }
  // The sequence's block table (empty for an unknown sequence). Invalidated by any
  // mutating call.
  std::span<const BlockId> blockTable(SeqId seq) const;
  // Token slots allocated to the sequence; -1 for an unknown sequence.
  int numTokens(SeqId seq) const;
  // Blocks that must be taken from the pool for `seq` (new or existing) to hold
  // `newNumTokens` tokens; 0 when it already does.
  int blocksNeeded(SeqId seq, int newNumTokens) const;

  // Creates a sequence with blocks for `numTokens` tokens (0 is allowed). Errors:
  // kAlreadyExists, kInvalidArgument (negative), kResourceExhausted (nothing allocated).
  Status allocate(SeqId seq, int numTokens);
  // Disaggregation: the decode worker takes every block a prompt of `numTokens` needs up
  // front, before asking a prefill worker to push KV into them. Same contract as allocate().
  Status reserve(SeqId seq, int numTokens);
  // Grows `seq` to hold `newNumTokens` tokens (no-op when it already does; never shrinks).
  // Errors: kNotFound, kInvalidArgument, kResourceExhausted (nothing allocated).
  Status extend(SeqId seq, int newNumTokens);
  // Releases the sequence's blocks (ref counts drop; blocks nobody holds return to the pool,
  // hashed ones as reusable cache). Errors: kNotFound.
  Status free(SeqId seq);
  // `child` shares every full block of `parent`; a partially filled last block is copied
  // into a fresh block (in every layer) so both can append without clobbering each other.
  // Errors: kNotFound, kAlreadyExists, kResourceExhausted (nothing changed).
  Status fork(SeqId parent, SeqId child);
  // Moves `from`'s blocks, unchanged (no copy, ref counts as they are), to the new sequence
  // `to`: the owner changes, the blocks stay out of the free pool until free(to). KV fencing
  // uses it to keep blocks a remote writer may still fill after their request ended.
  // Errors: kNotFound (from), kAlreadyExists (to); nothing changed then.
  Status rename(SeqId from, SeqId to);

  // ---- Prefix cache --------------------------------------------------------------------
  // The longest chain of cached full blocks matching the start of `tokens`, covering at
  // most `maxTokens` tokens (callers pass tokens.size() - 1 so that at least one token is
  // computed and yields logits). Read-only.
  PrefixMatch findCachedPrefix(std::span<const TokenId> tokens, int maxTokens) const;
  // Creates `seq` holding the cached blocks of findCachedPrefix(tokens, maxTokens) and
  // returns the number of tokens they cover. Never allocates fresh blocks, so it cannot
  // fail for lack of memory. Errors: kAlreadyExists, kInvalidArgument.
  Result<int> attachCachedPrefix(SeqId seq, std::span<const TokenId> tokens, int maxTokens);
  // Declares that the KV of the first `numComputed` of `tokens` (the sequence's tokens so
  // far) is now in the cache, so every full block among them becomes findable by hash.
  // Only then may another sequence share them. Errors: kNotFound, kInvalidArgument
  // (numComputed beyond tokens or beyond the sequence's allocated slots).
  Status cacheComputedBlocks(SeqId seq, std::span<const TokenId> tokens, int numComputed);
  // Named blocks the region holds now (referenced or cached free).
  int numNamedBlocks() const { return int(byHash_.size()); }

  // ---- Lower tiers (docs/kv_cache.md) ---------------------------------------------------------
  // Not owned; must outlive the manager or be reset to null first. Null: none (the default).
  void setLowerTiers(KvLowerTiers* tiers) { tiers_ = tiers; }
  // Where promote() finds a block below the region: `has` says whether a lower tier holds
  // the block `hash` (cheap, no I/O) and from which tier; `fill` copies its KV into the
  // region's block `dst` and returns false when it cannot (a corrupt file: the block stays
  // unnamed and promotion stops there).
  struct PromoteSource {
    std::function<std::optional<KvTier>(uint64_t hash, std::span<const TokenId> tokens)> has;
    std::function<bool(uint64_t hash, KvTier from, BlockId dst)> fill;
  };
  // Extends the cached prefix of `tokens` (up to maxTokens, as findCachedPrefix) with blocks
  // a lower tier holds: each next block is copied into a fresh region block, named, and left
  // as a cached free block, so the scheduler's findCachedPrefix finds it and the request
  // attaches it instead of computing it. At most maxNewBlocks are promoted. A fresh block may
  // evict (and so demote) a cached block, never one of this prompt's prefix (pinned while
  // promoting). Returns the blocks promoted. Never fails: a block that cannot be had ends it.
  int promote(std::span<const TokenId> tokens, int maxTokens, int maxNewBlocks, const PromoteSource& source);
  // Eviction ahead of need, for lower tiers whose copies complete later (the cuda backend's,
  // docs/kv_cache.md "Tiers on cuda"): evicts the least recently freed cached block as a
  // fresh allocation would (its name dropped, a Removed event) but without calling the lower
  // tiers, and holds it: the block is neither free nor in any sequence, so nothing reuses
  // (writes) it, until releaseHeld(). The caller copies it meanwhile. nullopt when no cached
  // free block exists.
  struct HeldBlock {
    BlockId block = -1;
    uint64_t hash = 0, parentHash = 0;
    std::vector<TokenId> tokens;
  };
  std::optional<HeldBlock> evictAndHold();
  // Returns a held block to the free pool (uncached). A block not held: no-op, false.
  bool releaseHeld(BlockId b);
  int numHeldBlocks() const { return numHeld_; }
  bool isHeld(BlockId b) const { return b >= 0 && b < layout_.numBlocks && meta_[size_t(b)].held; }
  // Appends an event to the stream takeEvents() returns (a lower tier's change), in order
  // with the region's own; dropped when recording is off.
  void recordEvent(KvBlockEvent e) {
    if (recordEvents_) pushEvent(std::move(e));
  }
  // Every layer's bytes of block `b`, concatenated layer by layer into `dst`
  // (layout().numLayers * layout().blockBytes() bytes), and back. Host regions only: the
  // caller checks region().kind (the CUDA region's blocks are copied by the backend).
  void copyBlockOut(BlockId b, uint8_t* dst) const;
  void copyBlockIn(const uint8_t* src, BlockId b);
  size_t blockStrideBytes() const { return size_t(layout_.numLayers) * layout_.blockBytes(); }

  // ---- KV events (docs/kv_events.md) ---------------------------------------------------------
  // Off by default. While on, every block that gets a name (cacheComputedBlocks) and every
  // named block evicted appends an event, in the order they happen; takeEvents() hands them
  // over and empties the buffer. Turning it off drops what is pending.
  void setEventRecording(bool on);
  bool eventRecording() const { return recordEvents_; }
  std::vector<KvBlockEvent> takeEvents();
  // Unix time (microseconds) of the oldest event takeEvents() would return; 0 when none.
  uint64_t oldestPendingEventUnixUs() const { return oldestPendingUs_; }
  // The whole named state as events: AllCleared, then one Stored per named block, every
  // block after the block its parentHash names when that one is named too; then what the
  // lower tiers hold (KvLowerTiers::appendSnapshot). Read-only.
  std::vector<KvBlockEvent> snapshotEvents() const;

  // ---- Transfer descriptors ------------------------------------------------------------
  // Per layer in [layerBegin, layerEnd), the block table as coalesced byte ranges of this
  // region: consecutive block ids in one layer form one segment. Layer-major order.
  Result<DescList> layerSegments(SeqId seq, int layerBegin, int layerEnd) const;
  Result<DescList> layerSegments(std::span<const BlockId> blocks, int layerBegin, int layerEnd) const;

  // Verifies the bookkeeping: every block is either free (exactly once, in the right free
  // list) or referenced; ref counts equal the number of tables holding the block; no block
  // appears twice in one table; table lengths match token counts; the hash index and the
  // blocks agree; a held block is unnamed, unreferenced and not free. Returns kInternal naming the first violation.
  Status checkInvariants() const;

 private:
  friend class KvCacheManagerTestPeer;  // tests corrupt state to prove checkInvariants() bites

  struct SeqTable {
    std::vector<BlockId> blocks;
    int numTokens = 0;
    int numHashed = 0;      // leading full blocks whose hash has been computed
    uint64_t lastHash = 0;  // chain value after numHashed blocks
  };
  struct BlockMeta {
    int32_t ref = 0;
    bool hashed = false;  // registered in byHash_
    bool inLru = false;   // free and cached
    uint64_t hash = 0;
    uint64_t parentHash = 0;
    KvTier promotedFrom = KvTier::kRegion;  // a lower tier until its first attach
    bool held = false;                      // evictAndHold() until releaseHeld()
  };

  KvCacheManager(const KvLayout& layout, void* base, size_t mappedBytes);
  static Status validateLayout(const KvLayout& layout);
  Status checkLayer(int layerBegin, int layerEnd) const;
  BlockId takeFreeBlock();  // precondition: a free block exists
  void releaseBlock(BlockId b);
  void acquireCached(BlockId b);
  bool blockMatches(BlockId b, uint64_t parentHash, std::span<const TokenId> tokens) const;
  Status grow(SeqTable& t, int newNumTokens);
  void pushEvent(KvBlockEvent e);

  KvLayout layout_;
  void* base_ = nullptr;
  size_t mappedBytes_ = 0;  // > 0: base_ is our own mapping (munmap'd by the destructor)
  MemKind kind_ = MemKind::kHost;
  int device_ = 0;
  std::vector<BlockMeta> meta_;
  std::vector<TokenId> blockTokens_;   // numBlocks * blockSize: tokens of hashed blocks
  std::vector<BlockId> freeUncached_;  // stack; lowest ids on top at start
  std::list<BlockId> lru_;             // free cached blocks, least recently freed first
  std::vector<std::list<BlockId>::iterator> lruPos_;
  std::unordered_map<uint64_t, BlockId> byHash_;
  std::unordered_map<SeqId, SeqTable> seqs_;
  KvCacheStats stats_;
  bool recordEvents_ = false;
  std::vector<KvBlockEvent> events_;
  uint64_t oldestPendingUs_ = 0;
  KvLowerTiers* tiers_ = nullptr;
  int numHeld_ = 0;
};

// layerSegments over any region with this layout (for instance a peer's region, whose
// base address came in a KvTarget). Errors: kInvalidArgument for a block id or layer out of
// range.
Result<DescList> layerSegmentsAt(const KvLayout& layout, const MemDesc& region, std::span<const BlockId> blocks,
                                 int layerBegin, int layerEnd);

// Source and destination segments for copying the blocks `localBlocks[i]` of a local region
// into `remoteBlocks[i]` of a remote region with the same layout: runs are cut wherever
// either side's ids stop being consecutive, so local[i] and remote[i] always have the same
// length (the pairing a Transport::post expects).
struct SegmentPairs {
  DescList local;
  DescList remote;
};
Result<SegmentPairs> pairedLayerSegments(const KvLayout& layout, const MemDesc& localRegion,
                                         std::span<const BlockId> localBlocks, const MemDesc& remoteRegion,
                                         std::span<const BlockId> remoteBlocks, int layerBegin, int layerEnd);

// The chained block hash of the prefix cache: one definition in common/base/hash.h, shared
// with the router's indexes.
using ::pd::hashBlockTokens;
using ::pd::kRootBlockHash;

}  // namespace pd::engine
