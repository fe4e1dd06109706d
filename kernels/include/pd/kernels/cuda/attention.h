// Causal paged attention on the GPU (CUDA twin of pd/kernels/attention.h's pagedAttention),
// batched: one launch covers every sequence chunk of a forward step, decode tokens and
// prefill chunks alike, with grouped-query heads (GQA) and an online (streaming) softmax.
//
// Work split: a chunk's (query token, query head of one kv head) pairs are "rows"
// (row = token * group + headInGroup, group = numHeads / numKvHeads); a thread block takes
// kAttnRowsPerBlock consecutive rows of one chunk and one kv head, streams that kv head's K/V
// for positions [0, last row's position] through shared memory kAttnKvTile positions at a
// time, and scores every row against each tile. A decode token has `group` rows, so with
// group <= kAttnRowsPerBlock one block serves all query heads of a kv head and each KV byte
// is read from memory once per step. Rows past a chunk's numTokens*group are idle, so a
// padded chunk (numTokens = 0) costs one early return.
//
// Same numerics as the CPU twin: scores are q.k * scale in f32, causal mask key <= query
// position, online softmax in f32, output divided by the running sum.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "pd/kernels/cuda/dtype.h"

namespace pd::kernels::cuda {

inline constexpr int kAttnRowsPerBlock = 16;
inline constexpr int kAttnKvTile = 16;
inline constexpr int kAttnMaxHeadDim = 256;

// One sequence chunk of the step (device array, [numSeqs]).
struct AttnSeq {
  int32_t tokenStart;        // row of the chunk's first token in q / out
  int32_t numTokens;         // 0 = padding, skipped
  int32_t startPos;          // position of the first token in its sequence
  int32_t blockTableOffset;  // its block table starts at blockTables[blockTableOffset]
};

// One thread block's work (device array, [numWork]).
struct AttnWork {
  int32_t seq;       // index into seqs
  int32_t rowBegin;  // first row (token * group + headInGroup) of this block
};

// Appends the work items of a chunk of numTokens tokens (host helper).
inline void appendAttnWork(std::vector<AttnWork>& work, int seq, int numTokens, int group) {
  const int rows = numTokens * group;
  for (int r = 0; r < rows; r += kAttnRowsPerBlock) work.push_back({seq, r});
}
// Work items a chunk of numTokens tokens needs (at least one, so padding keeps grids fixed).
inline int attnWorkItems(int numTokens, int group) {
  const int rows = numTokens * group;
  return rows <= 0 ? 1 : (rows + kAttnRowsPerBlock - 1) / kAttnRowsPerBlock;
}

// Call once per device (current device) before pagedAttention, outside graph capture: lets
// the kernel use more than 48 KiB of shared memory (needed for head dims above ~240).
cudaError_t pagedAttentionInit();

// q: [numQRows][qStride] f32, head h of token row t at q[t*qStride + h*headDim];
// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim] in kvDtype (kFp8: each block's codes
// followed by its f32 scales [2][blockSize][numKvHeads], engine/kv_layout.h);
// blockTables: [sum of tables] int32, seq s uses blockTables[seqs[s].blockTableOffset ..];
// seqs: [numSeqs]; work: [numWork];
// out: [numQRows][outStride] in outDtype, head h of token row t at out[t*outStride+h*headDim].
// headDim <= kAttnMaxHeadDim; numHeads % numKvHeads == 0. scale is usually 1/sqrt(headDim).
// Block ids and table lengths must have been validated by the caller.
cudaError_t pagedAttention(const float* q, int qStride, const void* layerKv, DType kvDtype, const int32_t* blockTables,
                           const AttnSeq* seqs, const AttnWork* work, int numWork, int blockSize, int numHeads,
                           int numKvHeads, int headDim, float scale, void* out, DType outDtype, int outStride,
                           cudaStream_t stream);

}  // namespace pd::kernels::cuda
