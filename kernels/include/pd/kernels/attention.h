// Causal paged attention with grouped-query heads (GQA) and an online (streaming) softmax.
//
// One call handles one sequence's chunk of numTokens query tokens whose first token sits at
// position startPos; query token t attends to positions [0, startPos + t] read from the paged
// KV pool (which must already hold them, including the chunk's own K/V). This direct form is
// what decode steps and short prefill chunks use; long prefill chunks are better served by
// GEMM-shaped tiles over kvGatherHead's output plus causalSoftmaxRows (see below).
// Pure functions; callers split work across threads by kv-head range and/or token range.
#pragma once

#include <cstdint>

#include "pd/kernels/kv_cache.h"

namespace pd::kernels::cpu {

// q: [numTokens][qStride], head h at q[t*qStride + h*headDim];
// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim];
// blockTable: [ceil((startPos + numTokens) / blockSize)];
// out: [numTokens][outStride], head h at out[t*outStride + h*headDim].
// Computes kv heads [kvHeadBegin, kvHeadEnd) and with them their numHeads/numKvHeads query
// heads each. scale is usually 1/sqrt(headDim).
void pagedAttention(const float* q, int qStride, const float* layerKv, const int32_t* blockTable, int numTokens,
                    int startPos, int blockSize, int numHeads, int numKvHeads, int headDim, int kvHeadBegin,
                    int kvHeadEnd, float scale, float* out, int outStride);

// The same over a pool in any format (PagedKv, pd/kernels/kv_cache.h): each tile of K and V
// rows is dequantized once to f32 and shared by the group's query heads; the arithmetic after
// that is the f32 kernel's.
void pagedAttention(const float* q, int qStride, const PagedKv& kv, const int32_t* blockTable, int numTokens,
                    int startPos, int numHeads, int kvHeadBegin, int kvHeadEnd, float scale, float* out, int outStride);

// Attention of `rows` query rows that all see the same keys [0, numKeys) of one sequence's
// latent cache (multi-head latent attention's decode: one token's heads, an MQA over the
// latent; engine/cpu_mla.h). The cache holds one row of latentStride floats per position,
// blockSize positions per block of blockStride floats, block b of the sequence at
// layerKv + blockTable[b] * blockStride. Scores are q[r] . row[p] over scoreDim values (the
// whole latent: c_kv then k_pe), times scale, softmaxed per row (causalSoftmaxRows); out[r] =
// sum_p p[r][p] * row[p][0, valueDim) (c_kv). Reads the rows in place (no gather or packing).
// q: [rows][ldq]; scores: [rows][numKeys] scratch; out: [rows][ldo].
void latentAttention(const float* q, int ldq, int rows, const float* layerKv, const int32_t* blockTable, int blockSize,
                     size_t blockStride, int latentStride, int scoreDim, int valueDim, int numKeys, float scale,
                     float* scores, float* out, int ldo);

// In-place causal softmax over score rows produced by a QK^T GEMM tile.
// scores: [numRows][ldScores]; row r belongs to the query at absolute position
// firstQueryPos + r and keeps columns [0, firstQueryPos + r] (column = key position); columns
// beyond are set to 0 (so a following P*V GEMM over numCols columns is exact).
// Scores are multiplied by scale before the softmax. numCols >= firstQueryPos + numRows.
void causalSoftmaxRows(float* scores, int ldScores, int numRows, int numCols, int firstQueryPos, float scale);

}  // namespace pd::kernels::cpu
