// The KV tiers' block copier for the cuda backend's KV regions (engine/kv_block_copier.h,
// docs/kv_cache.md "Tiers on cuda"): one region in device memory per tensor-parallel rank,
// each laid out as the rank's KvLayout (CudaBackend::kvRegions(), rankKvLayout()).
//
//   copy out, asynchronous  per rank one cudaMemcpy2DAsync (every layer's slice of the block,
//                           layer pitch to block pitch) device -> a pinned staging slot, on
//                           a copy stream of the copier's own (non-blocking: it never waits
//                           for, nor holds up, the backend's compute stream), then an event
//                           per rank; completed() queries the events (cudaEventQuery, no
//                           wait) or, with `wait`, synchronizes on them.
//   copy out, synchronous   the same copy into the caller's memory, then the copy stream is
//                           synchronized (ordered after the asynchronous copies in flight).
//   copy in                 host -> device on the copy stream, synchronized before it returns.
//                           Synchronous on purpose: the promoted block is named (attachable,
//                           readable by a KV transfer) when KvTierStore::promote returns, and
//                           the source bytes (a host-tier slot, the one scratch block) are
//                           reused right after; one block is a few MiB, tens of microseconds
//                           over PCIe. The backend's next forward is issued after this
//                           returned, so it reads the bytes without any event.
//
// Ordering with the backend: a block is copied out only once it is named (its KV final: the
// forward that wrote it has returned, CudaBackend::forward() returns with every rank idle)
// and, for a demotion, while the manager holds it (evictAndHold: nothing writes it). A copy
// in writes a fresh block no step reads until promote() returned.
//
// Memory: slots * strideBytes of pinned host memory (cudaHostAlloc, portable: every rank's
// device copies into it), one non-blocking stream per rank, one event per slot per rank.
// Threads: one thread calls it (the worker loop), as for every copier; it sets each rank's
// device around its calls and restores the caller's current device before returning.
// Errors: regions empty, not device memory, or shorter than the layout -> kInvalidArgument;
// a build without CUDA -> kUnimplemented; CUDA failures -> kInternal naming the call.
#pragma once

#include <memory>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "engine/kv_block_copier.h"
#include "engine/kv_layout.h"

namespace pd::engine {

struct CudaKvCopierOptions {
  // Pinned staging for asynchronous copies out: this many bytes, in whole blocks, at least 2
  // and at most 64 slots.
  size_t stagingBytes = size_t(64) << 20;
};

// `regions`: one per rank, in rank order, each rankLayout.totalBytes() long, kind kCuda.
Result<std::unique_ptr<KvBlockCopier>> createCudaKvBlockCopier(const KvLayout& rankLayout,
                                                               const std::vector<MemDesc>& regions,
                                                               const CudaKvCopierOptions& options = {});

}  // namespace pd::engine
