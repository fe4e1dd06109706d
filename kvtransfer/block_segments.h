// Block pools and the transfer segments between two of them: the byte arithmetic that turns
// "blocks b0..bn of layers [a, b)" on one side into matching (local, remote) segment lists for
// TransferAgent::post. kvtransfer knows no model: a pool is just equally sized blocks laid
// out layer-major in one registered region (the worker layer describes its KV cache as one,
// worker/kv_pools.h).
//
// Pure functions over values; safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/base/mem_desc.h"
#include "common/base/status.h"

namespace pd::kvt {

// numLayers x numBlocks blocks of blockBytes each, block (l, b) at
// base + l * numBlocks * blockBytes + b * blockBytes; `base` is in the owner's address space.
struct BlockPool {
  uintptr_t base = 0;
  size_t blockBytes = 0;
  int numBlocks = 0;  // per layer
  int numLayers = 0;
  MemKind kind = MemKind::kHost;
  int device = 0;  // CUDA ordinal for kCuda

  size_t layerBytes() const { return blockBytes * size_t(numBlocks); }
  size_t totalBytes() const { return layerBytes() * size_t(numLayers); }
  size_t blockOffset(int layer, int block) const { return size_t(layer) * layerBytes() + size_t(block) * blockBytes; }
  MemDesc region() const { return MemDesc{base, totalBytes(), device, kind}; }
};

struct Segments {
  DescList local;
  DescList remote;
};

// The segments that copy srcBlocks[i] to dstBlocks[i] for every layer in [layerBegin,
// layerEnd): per layer, each run of block ids consecutive on both sides is one segment.
// kInvalidArgument naming the problem when the pools' block size or layer count differ, the
// layer range is empty or out of range, the lists differ in length, or an id is out of range.
Result<Segments> blockSegments(const BlockPool& src, std::span<const int> srcBlocks, const BlockPool& dst,
                               std::span<const int> dstBlocks, int layerBegin, int layerEnd);

}  // namespace pd::kvt
