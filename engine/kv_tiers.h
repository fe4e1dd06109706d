// KV tiers below a worker's KV region (docs/kv_cache.md): a host-memory block pool and a
// local-disk directory. A named block the region evicts is demoted (copied) to the host tier
// instead of vanishing; every named block is also written through to disk, off the worker
// loop, so it survives the host tier's own evictions and a worker restart. A prompt whose
// prefix misses the region but hits a lower tier gets those blocks promoted (copied back into
// fresh region blocks, KvCacheManager::promote) instead of recomputed.
//
//   KvHostTier   a fixed pool of block slots in one anonymous mapping; LRU eviction.
//   KvDiskTier   one file per block under <dir>/<identity key>/, each with a header naming the
//                model identity, the block name, its parent, its tokens and a checksum over
//                all of it and the KV bytes; bounded in bytes (oldest evicted first). Files
//                are written by one writer thread fed by a queue bounded in bytes: a block
//                that does not fit the queue is dropped and counted, never waited for.
//   KvTierStore  both, wired to one KvCacheManager (KvLowerTiers): demotes, writes through,
//                promotes, and records the tiers' KV events in the manager's event stream.
//                It moves bytes between the region and host memory through a KvBlockCopier
//                (engine/kv_block_copier.h): a memcpy for a host region, CUDA copies for the
//                cuda backend's device regions.
//
// Synchronous copier (host region): a block is demoted when the manager evicts it, written
// through when it is named, promoted by a copy -- all inside the call.
// Asynchronous copier (device region, docs/kv_cache.md "Tiers on cuda"): the store demotes
// ahead of need from poll(): while the region has fewer than demoteAheadBlocks free uncached
// blocks it evicts the least recently freed cached ones with KvCacheManager::evictAndHold()
// (the block stays held: nothing reuses it) and starts copying each into a staging slot.
// A later poll() sees the copy completed, puts the block into the host tier (Stored host
// event) and releases it to the free pool. A write-through copies the named block into a
// slot the same way (no slot free: skipped; the eviction is its last chance) and the disk
// tier writes the slot's bytes. An eviction the manager cannot put off (a step needs more
// blocks than were demoted ahead) first waits for the copies in flight and then copies the
// block synchronously: that is the only place the loop waits for a device-to-host copy.
// Promotion is a synchronous copy into the region block (KvBlockCopier::copyIn): the block
// is attachable, and readable by a KV transfer, as soon as promote() returns. A promotion
// that wants a block whose demotion is still in flight waits for the copies in flight.
//
// Block names are chained hashes of token ids (common/base/hash.h) and mean the same KV only
// for the same weights and KV layout: the disk tier is keyed by the worker's identity
// (`<model>/<layout>/w<weights fingerprint>`, worker/engine_setup.h) and refuses a file made
// under any other. A corrupt, truncated or foreign file is deleted and counted, never loaded.
//
// Threads: everything here belongs to the worker loop thread that owns the KV cache manager,
// except KvDiskTier's writer thread, which only writes and deletes files it is handed and
// reports back through a mutex-guarded list that poll() drains. The copier's copies run on
// the device's copy engines; only the loop thread calls the copier.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/base/status.h"
#include "engine/kv_block_copier.h"
#include "engine/kv_cache_manager.h"

namespace pd::engine {

// The lower tiers' sizes and where the disk tier lives; 0 bytes turns a tier off.
struct KvTierOptions {
  int64_t hostBytes = 0;
  int64_t diskBytes = 0;
  std::string diskPath;  // needed when diskBytes > 0
  int64_t diskWriteQueueBytes = int64_t{64} << 20;
  // Asynchronous copiers only: the free uncached region blocks poll() keeps by demoting
  // ahead of need; 0 = max(1, region blocks / 32).
  int demoteAheadBlocks = 0;
};

// A 64-bit checksum of `bytes` (four independent multiply-xorshift lanes, ~GB/s): detects a
// torn or bit-flipped file, not an adversary.
uint64_t kvChecksum(std::span<const uint8_t> bytes, uint64_t seed = 0);

// Counters of the lower tiers since start (the worker exports them, docs/metrics.md).
struct KvTierStats {
  int64_t hostBlocks = 0, hostCapacityBlocks = 0;
  int64_t diskBlocks = 0, diskBytes = 0;
  uint64_t demotionsToHost = 0;        // blocks copied region -> host on eviction
  uint64_t diskWrites = 0;             // blocks written to disk
  uint64_t hostEvictions = 0;          // host slots reused
  uint64_t diskEvictions = 0;          // files deleted to stay within the byte bound
  uint64_t diskWritesDropped[3] = {};  // [queue_full, disk_full, error]
  uint64_t diskFilesDropped[3] = {};   // [corrupt, truncated, foreign]
  uint64_t diskFilesLoaded = 0;        // files found valid at start
  // Asynchronous copiers: copies in flight now, and evictions that had to wait for a copy
  // (demotion ahead of need did not keep up) since start.
  int64_t copiesInFlight = 0;
  uint64_t waitedEvictions = 0;
  int64_t blockBytes = 0;  // one block in the lower tiers: every rank's share, every layer
};

class KvHostTier {
 public:
  // A pool of bytes / stride slots (none: kInvalidArgument naming the sizes; kResourceExhausted
  // when the mapping fails).
  static Result<std::unique_ptr<KvHostTier>> create(int64_t bytes, size_t strideBytes);
  ~KvHostTier();
  KvHostTier(const KvHostTier&) = delete;
  KvHostTier& operator=(const KvHostTier&) = delete;

  int capacity() const { return int(slots_.size()); }
  int size() const { return int(byHash_.size()); }
  size_t strideBytes() const { return stride_; }
  bool contains(uint64_t hash) const { return byHash_.count(hash) != 0; }
  // Whether `hash` is held with exactly these tokens (a 64-bit name collision never serves
  // another prompt's KV).
  bool matches(uint64_t hash, std::span<const TokenId> tokens) const;
  // Makes `hash`'s slot the most recently used (no-op when not held).
  void touch(uint64_t hash);
  // The bytes of `hash`'s slot (nullptr when not held).
  const uint8_t* data(uint64_t hash) const;
  struct Evicted {
    uint64_t hash = 0, parentHash = 0;
    std::vector<TokenId> tokens;
  };
  // A slot for `hash` (not held yet), evicting the least recently used one when full (what
  // it held comes back in `evicted`; its bytes are still in the returned slot until the
  // caller overwrites them, so they can be saved first); the caller fills the slot.
  uint8_t* insert(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens, std::optional<Evicted>* evicted);
  // Every held block as (hash, parentHash, tokens), for a snapshot.
  template <typename Fn>
  void forEach(Fn&& fn) const {
    for (const auto& [h, s] : byHash_) fn(h, slots_[size_t(s)].parentHash, slots_[size_t(s)].tokens);
  }
  // Every slot free or held exactly once, LRU and index agree. kInternal naming the first
  // violation.
  Status checkInvariants() const;

 private:
  struct Slot {
    bool used = false;
    uint64_t hash = 0, parentHash = 0;
    std::vector<TokenId> tokens;
    std::list<int>::iterator lruPos;
  };
  KvHostTier(uint8_t* base, size_t mapped, size_t stride, int n);
  uint8_t* base_;
  size_t mapped_, stride_;
  std::vector<Slot> slots_;
  std::vector<int> free_;
  std::list<int> lru_;  // used slots, least recently used first
  std::unordered_map<uint64_t, int> byHash_;
};

class KvDiskTier {
 public:
  enum class WriteDrop { kQueueFull = 0, kDiskFull = 1, kError = 2 };
  enum class FileDrop { kCorrupt = 0, kTruncated = 1, kForeign = 2 };

  // Opens (creating it when missing) <path>/<key of identity>/, deletes leftovers of
  // interrupted writes, and indexes the valid files, dropping corrupt, truncated and foreign
  // ones and, oldest first, what exceeds maxBytes. Starts the writer thread. Errors:
  // kInvalidArgument (empty path or identity, maxBytes <= 0), kUnavailable naming the
  // directory when it cannot be created or read.
  static Result<std::unique_ptr<KvDiskTier>> open(const std::string& path, std::string identity, int64_t maxBytes,
                                                  int64_t queueBytes, size_t strideBytes, int blockSize);
  ~KvDiskTier();  // stops the writer after the queued operations
  KvDiskTier(const KvDiskTier&) = delete;
  KvDiskTier& operator=(const KvDiskTier&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  int size() const { return int(index_.size()); }
  int64_t bytes() const { return committedBytes_; }
  // Held and written (a queued write does not count until poll() saw it done).
  bool contains(uint64_t hash) const { return index_.count(hash) != 0; }
  bool matches(uint64_t hash, std::span<const TokenId> tokens) const;
  // Held, written, or queued.
  bool knows(uint64_t hash) const { return contains(hash) || pending_.count(hash) != 0; }

  struct Change {
    bool stored = true;  // false: removed
    uint64_t hash = 0, parentHash = 0;
    std::vector<TokenId> tokens;
  };
  // Queues a write of `kv` (strideBytes) for the block; true when queued. Never blocks: a
  // queue without room drops it (counted). Blocks evicted to make room on disk come back in
  // `changes` (removed).
  bool enqueue(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens, std::span<const uint8_t> kv,
               std::vector<Change>* changes);
  // Takes the writer's results: written blocks become held (stored changes), failed writes
  // are counted. The loop calls it once per iteration.
  void poll(std::vector<Change>* changes);
  // Reads and verifies the block's file into `dst` (strideBytes). A file that fails any check
  // is deleted and forgotten (a removed change) and the call returns false.
  bool load(uint64_t hash, std::span<uint8_t> dst, std::vector<Change>* changes);
  // Waits (up to `timeout`) until every queued write is done; for tests and shutdown.
  bool drain(std::chrono::milliseconds timeout);
  template <typename Fn>
  void forEach(Fn&& fn) const {
    for (const auto& [h, e] : index_) fn(h, e.parentHash, e.tokens);
  }
  uint64_t writesDropped(WriteDrop why) const { return writesDropped_[int(why)]; }
  uint64_t filesDropped(FileDrop why) const { return filesDropped_[int(why)]; }
  uint64_t writes() const { return writes_; }
  uint64_t evictions() const { return evictions_; }
  uint64_t filesLoaded() const { return filesLoaded_; }
  // The file a block is kept in (tests corrupt it).
  std::filesystem::path fileFor(uint64_t hash) const;
  // Index, LRU and byte count agree. kInternal naming the first violation.
  Status checkInvariants() const;

  // The file format (exposed for tests): header, tokens, KV bytes.
  static std::string encodeFile(const std::string& identity, uint64_t hash, uint64_t parentHash,
                                std::span<const TokenId> tokens, std::span<const uint8_t> kv);

 private:
  struct Entry {
    uint64_t parentHash = 0;
    std::vector<TokenId> tokens;
    int64_t bytes = 0;
    std::list<uint64_t>::iterator lruPos;
  };
  struct Op {
    bool write = true;  // false: delete
    uint64_t hash = 0;
    std::filesystem::path path;
    std::string contents;
  };
  struct Done {
    uint64_t hash = 0;
    bool ok = false;
    bool noSpace = false;
    std::string error;
  };
  KvDiskTier() = default;
  void writerMain();
  void evictOldest(std::vector<Change>* changes);
  void forget(uint64_t hash, std::vector<Change>* changes);
  // Validates a file's bytes (header only unless `full`). Returns the reason it is refused.
  // `contents` is only modified during the call (the checksum field zeroed and restored).
  std::optional<FileDrop> check(std::string& contents, bool full, Entry* out, uint64_t* hash) const;
  int64_t fileBytes(int numTokens) const;

  std::filesystem::path dir_;
  std::string identity_;
  int64_t maxBytes_ = 0, queueBytes_ = 0;
  size_t stride_ = 0;
  int blockSize_ = 0;
  std::unordered_map<uint64_t, Entry> index_;
  std::list<uint64_t> lru_;                      // written blocks, oldest first
  std::unordered_map<uint64_t, Entry> pending_;  // queued writes
  int64_t committedBytes_ = 0, pendingBytes_ = 0;
  uint64_t writesDropped_[3] = {}, filesDropped_[3] = {};
  uint64_t writes_ = 0, evictions_ = 0, filesLoaded_ = 0;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_, idleCv_;
  std::deque<Op> queue_;
  int64_t queuedBytes_ = 0;
  bool busy_ = false, stop_ = false;
  std::vector<Done> done_;
  std::thread writer_;
};

class KvTierStore : public KvLowerTiers {
 public:
  // Tiers for `kv` (a host region, copied by a HostKvBlockCopier: kFailedPrecondition
  // otherwise, naming the region kind). Attaches itself to kv (setLowerTiers); detaches in
  // the destructor. Errors as KvHostTier::create and KvDiskTier::open, and kInvalidArgument
  // when both tiers are off.
  static Result<std::unique_ptr<KvTierStore>> create(KvCacheManager& kv, const KvTierOptions& options,
                                                     const std::string& identity);
  // Tiers for any region, its bytes moved by `copier` (owned; made for kv's region: the
  // cuda backend's is createCudaKvBlockCopier, engine/cuda_kv_copier.h). Errors as above,
  // kInvalidArgument for a null copier or one whose strideBytes is not a whole multiple of
  // kv.blockStrideBytes() (one block of every rank's region).
  static Result<std::unique_ptr<KvTierStore>> create(KvCacheManager& kv, const KvTierOptions& options,
                                                     const std::string& identity,
                                                     std::unique_ptr<KvBlockCopier> copier);
  // Waits for the copies in flight, returns held blocks to the manager, detaches.
  ~KvTierStore() override;

  // Promotes the lower tiers' blocks that continue the region's cached prefix of `tokens`
  // (KvCacheManager::promote); returns the blocks promoted.
  int promote(std::span<const TokenId> tokens, int maxTokens, int maxNewBlocks);
  // Drains the disk writer's results into KV events; with an asynchronous copier also takes
  // the completed copies (host tier, disk, held blocks released) and demotes ahead of need.
  // Once per loop iteration.
  void poll();
  KvTierStats stats() const;
  KvHostTier* host() { return host_.get(); }
  KvDiskTier* disk() { return disk_.get(); }
  KvBlockCopier& copier() { return *copier_; }
  // Waits (asynchronous copier) until every copy in flight completed and was taken as poll()
  // takes it; for tests and shutdown.
  void finishCopies();
  // The host tier, disk tier and manager invariants, and: every held block is one demotion in
  // flight; in-flight copies and free staging slots add up to the copier's slots.
  Status checkInvariants() const;

  void onNamed(BlockId b, uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens) override;
  void onEvict(BlockId b, uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens) override;
  void appendSnapshot(std::vector<KvBlockEvent>* out) const override;

 private:
  explicit KvTierStore(KvCacheManager& kv) : kv_(kv) {}
  void writeToDisk(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens, std::span<const uint8_t> kv);
  void record(const std::vector<KvDiskTier::Change>& changes);
  // Copies `bytes` into the host tier under `hash` (LRU insert, a slot's previous block
  // written to disk first when the disk lacks it), with its events.
  void demoteToHost(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens, const uint8_t* bytes);
  // Takes the copier's completed copies (all in flight with `wait`). Held blocks are released
  // to the manager unless `deferRelease` (inside a manager callback): then at the next poll.
  void takeCompletedCopies(bool wait, bool deferRelease);
  void demoteAhead();
  void releaseDeferred();

  // One asynchronous copy out: a demotion (the block is held by the manager) or a
  // write-through to disk (the block is named and final: nothing writes it).
  struct InFlight {
    int slot = -1;
    BlockId block = -1;
    bool demotion = false;
    uint64_t hash = 0, parentHash = 0;
    std::vector<TokenId> tokens;
  };

  KvCacheManager& kv_;
  std::unique_ptr<KvBlockCopier> copier_;
  std::unique_ptr<KvHostTier> host_;
  std::unique_ptr<KvDiskTier> disk_;
  std::vector<uint8_t> scratch_;  // one block, gathered from the region's layers
  uint64_t demotionsToHost_ = 0, hostEvictions_ = 0, waitedEvictions_ = 0;
  int demoteAhead_ = 0;
  std::vector<InFlight> inFlight_;        // in start order
  std::vector<BlockId> releaseDeferred_;  // demoted, still held: released at the next poll
};

}  // namespace pd::engine
