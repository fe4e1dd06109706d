// Paged KV cache writes and reads, f32 cache, one layer at a time.
//
// A layer's pool (engine/kv_layout.h) is [numBlocks][2 (k|v)][blockSize][numKvHeads]
// [headDim]. A token's slot is blockTable[pos / blockSize] * blockSize + pos % blockSize;
// callers compute slots and validate block ids. Pure functions; callers split work across
// threads on disjoint tokens / heads.
#pragma once

#include <cstdint>

namespace pd::kernels::cpu {

// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim] (written),
// k, v: [numTokens][rowStride] with numKvHeads*headDim floats each at row start,
// slots: [numTokens].
void kvCacheWrite(float* layerKv, const float* k, const float* v, int rowStride, const int32_t* slots, int numTokens,
                  int blockSize, int numKvHeads, int headDim);

// Copies one kv head's K and V for positions [0, numPositions) out of the paged pool into
// contiguous rows (the operand layout a GEMM wants).
// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim], blockTable: [ceil(numPositions /
// blockSize)], kOut, vOut: [numPositions][headDim] out.
void kvGatherHead(const float* layerKv, const int32_t* blockTable, int numPositions, int blockSize, int numKvHeads,
                  int headDim, int kvHead, float* kOut, float* vOut);

}  // namespace pd::kernels::cpu
