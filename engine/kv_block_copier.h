// How the KV tiers (engine/kv_tiers.h, docs/kv_cache.md "Tiers on cuda") move one named
// block's KV between the KV region and host memory. The tier store never touches region
// memory itself: it asks its copier.
//
//   HostKvBlockCopier   the region is host memory (the cpu backend): a memcpy per layer,
//                       synchronous (copyOut / copyIn); no asynchronous copies.
//   CudaKvBlockCopier   the region is device memory, one region per tensor-parallel rank
//                       (engine/cuda_kv_copier.h): copies out also asynchronously, into
//                       pinned staging slots the copier owns, on its own copy streams.
//
// A block in host memory is `strideBytes()` long: every rank's share (rank 0 first), each
// the block's bytes in every layer, layer by layer (KvCacheManager::copyBlockOut's order for
// one rank). The disk tier stores exactly these bytes, so its files are only valid for the
// same layout and rank count (the identity names both).
//
// Threads: one thread (the worker loop that owns the KV cache manager) calls a copier.
// Errors: a failed copy returns kInternal naming the call (CUDA's error included); the
// store then drops that block (it is recomputed when asked for again).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/base/status.h"
#include "engine/kv_cache_manager.h"

namespace pd::engine {

class KvBlockCopier {
 public:
  virtual ~KvBlockCopier() = default;
  // Bytes of one block in host memory (all ranks, all layers).
  virtual size_t strideBytes() const = 0;

  // ---- Synchronous copies: the bytes are where they go when the call returns --------------
  // Region block `b` -> dst (strideBytes; any host memory). Any copy out started earlier
  // is ordered before it.
  virtual Status copyOut(BlockId b, uint8_t* dst) = 0;
  // src (strideBytes) -> region block `b`: when it returns, the next forward step and a KV
  // transfer reading the block see the bytes.
  virtual Status copyIn(const uint8_t* src, BlockId b) = 0;

  // ---- Asynchronous copies out (asynchronous() only) ----------------------------------------
  // True: startCopyOut works and the tier store demotes ahead of need (kv_tiers.h).
  virtual bool asynchronous() const = 0;
  // Staging slots: each holds one block's copy from start until releaseSlot().
  virtual int numSlots() const = 0;
  virtual int freeSlots() const = 0;
  // Starts copying region block `b` into a free slot and returns the slot. The block must
  // not be written until the copy completed (completed() reported it). Precondition:
  // freeSlots() > 0 (else kResourceExhausted).
  virtual Result<int> startCopyOut(BlockId b) = 0;
  struct Done {
    int slot = -1;
    Status status;  // not ok: the slot's bytes are not the block's
  };
  // Appends the slots whose copies completed since the last call, in start order; with
  // `wait`, first waits until every copy started so far completed (for an eviction that
  // cannot be put off, and shutdown). Non-blocking without `wait`.
  virtual void completed(bool wait, std::vector<Done>* done) = 0;
  // A completed slot's bytes (strideBytes), valid until releaseSlot(slot).
  virtual const uint8_t* slotData(int slot) const = 0;
  virtual void releaseSlot(int slot) = 0;
};

// The region is host memory the manager addresses (KvCacheManager::copyBlockOut/In). The
// manager must outlive the copier.
class HostKvBlockCopier final : public KvBlockCopier {
 public:
  explicit HostKvBlockCopier(KvCacheManager& kv) : kv_(kv) {}
  size_t strideBytes() const override { return kv_.blockStrideBytes(); }
  Status copyOut(BlockId b, uint8_t* dst) override;
  Status copyIn(const uint8_t* src, BlockId b) override;
  bool asynchronous() const override { return false; }
  int numSlots() const override { return 0; }
  int freeSlots() const override { return 0; }
  Result<int> startCopyOut(BlockId b) override;
  void completed(bool, std::vector<Done>*) override {}
  const uint8_t* slotData(int) const override { return nullptr; }
  void releaseSlot(int) override {}

 private:
  KvCacheManager& kv_;
};

}  // namespace pd::engine
