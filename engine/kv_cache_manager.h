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
#include <list>
#include <memory>
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
struct KvBlockEvent {
  enum class Kind { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  uint64_t hash = 0;
  uint64_t parentHash = 0;
  std::vector<int32_t> tokens;  // kStored only
};

struct KvCacheStats {
  uint64_t prefixQueries = 0;      // attachCachedPrefix calls
  uint64_t prefixQueryTokens = 0;  // tokens looked up
  uint64_t prefixHitTokens = 0;    // tokens served from cached blocks
  uint64_t evictions = 0;          // cached free blocks reused for fresh allocations
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
  // block after the block its parentHash names when that one is named too. Read-only.
  std::vector<KvBlockEvent> snapshotEvents() const;

  // ---- Transfer descriptors ------------------------------------------------------------
  // Per layer in [layerBegin, layerEnd), the block table as coalesced byte ranges of this
  // region: consecutive block ids in one layer form one segment. Layer-major order.
  Result<DescList> layerSegments(SeqId seq, int layerBegin, int layerEnd) const;
  Result<DescList> layerSegments(std::span<const BlockId> blocks, int layerBegin, int layerEnd) const;

  // Verifies the bookkeeping: every block is either free (exactly once, in the right free
  // list) or referenced; ref counts equal the number of tables holding the block; no block
  // appears twice in one table; table lengths match token counts; the hash index and the
  // blocks agree. Returns kInternal naming the first violation.
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
