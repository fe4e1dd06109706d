// Multi-head latent attention on the GPU (DeepseekV3ForCausalLM), the absorbed form: the CUDA
// twins of what engine/cpu_mla.h computes, split into the three steps that are not GEMMs.
//
// Latent KV (engine/kv_layout.h, `latent`): per layer and token one vector of
// L = kvLoraRank + ropeDim values [c_kv | k_pe], so a slot's vector sits at element
// slot * L of the layer (block * blockSize + offset = slot) and there is no separate V.
//
// RoPE of the decoupled part is DeepSeek's interleaved one: adjacent pairs (x[2i], x[2i+1])
// rotated by (cos, sin)[i] * mscale, the tables from ropeCosSin (ops.h) over the YaRN inverse
// frequencies; mscale is YaRN's magnitude factor (1 without YaRN).
//
// Attention (mlaAttention): every (token, head) pair of a chunk is a "row" (row = token *
// numHeads + head), all of a token's rows attend to the same latent keys (an MQA over one
// latent head). A thread block takes kAttnRowsPerBlock consecutive rows of one chunk -- the
// work items of pd/kernels/cuda/attention.h with group = numHeads -- streams the chunk's latent
// vectors for positions [0, its last row's position] through shared memory kMlaKvTile at a time
// and keeps an online softmax per row: score = qLat . latent * scale (all L values: the
// absorbed q_nope against c_kv plus q_pe against k_pe), output = sum p * c_kv (the first
// kvLoraRank values). Causal: key position <= the row's token position.
//
// Conventions as ops.h: device pointers, enqueue only (graph-capture safe), cudaGetLastError()
// after the launch; invalid sizes -> cudaErrorInvalidValue. The latent cache may be f32, f16 or
// bf16 (kFp8 is refused: cudaErrorInvalidValue).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pd/kernels/cuda/attention.h"
#include "pd/kernels/cuda/dtype.h"

namespace pd::kernels::cuda {

// DeepSeek-V3 / Kimi K2: kv_lora_rank 512, qk_rope_head_dim 64 (a 576-value latent).
inline constexpr int kMlaMaxKvLoraRank = 512;
inline constexpr int kMlaMaxRopeDim = 64;
inline constexpr int kMlaKvTile = 16;

// Whether the kernels take these shapes (kvLoraRank <= kMlaMaxKvLoraRank, ropeDim even and
// <= kMlaMaxRopeDim, both > 0).
inline bool mlaShapeSupported(int kvLoraRank, int ropeDim) {
  return kvLoraRank > 0 && kvLoraRank <= kMlaMaxKvLoraRank && ropeDim > 0 && ropeDim <= kMlaMaxRopeDim &&
         ropeDim % 2 == 0;
}

// Call once per device (current device) before mlaAttention, outside graph capture: lets the
// kernel use the shared memory of a 576-value latent (above 48 KiB).
cudaError_t mlaAttentionInit();

// Writes each token's latent into the paged cache:
//   c_kv = rmsNorm(kva[t][0, R)) * normWeight  (eps), k_pe = rope(kva[t][R, R + ropeDim)).
// kva: [numTokens][kvaStride] f32 (kv_a_proj_with_mqa's output), normWeight: [R] f32,
// cosT, sinT: [numTokens][ropeDim / 2], slots: [numTokens] (negative: skip the token),
// layerKv: [slots][R + ropeDim] in kvDtype.
cudaError_t mlaKvWrite(const float* kva, int kvaStride, const float* normWeight, float eps, int kvLoraRank, int ropeDim,
                       const float* cosT, const float* sinT, float mscale, const int32_t* slots, int numTokens,
                       void* layerKv, DType kvDtype, cudaStream_t stream);

// Splits the queries for the absorption: q: [numTokens][qStride] f32, head h at
// q[t*qStride + h*(nopeDim + ropeDim)] as [q_nope | q_pe].
//   qNope[t][h][0, nopeDim) = q_nope in qNopeDtype (the absorption GEMM's input);
//   qLat[t][h][R + i] = rope(q_pe)[i] (f32, R = kvLoraRank; qLat: [numTokens][numHeads][R + ropeDim],
//   its first R values per head are left for the absorption GEMM to fill).
cudaError_t mlaQSplit(const float* q, int qStride, int numTokens, int numHeads, int nopeDim, int ropeDim,
                      const float* cosT, const float* sinT, float mscale, void* qNope, DType qNopeDtype, float* qLat,
                      int kvLoraRank, cudaStream_t stream);

// qLat: [numQRows][numHeads][R + ropeDim] f32 (token row t of chunk s is seqs[s].tokenStart + t);
// layerKv: the latent cache in kvDtype; blockTables / seqs / work as pagedAttention's, the work
// items built with group = numHeads; out: [numQRows][numHeads][R] in outDtype.
// scale: the softmax scale (ModelConfig::softmaxScale(), YaRN's mscale^2 included).
cudaError_t mlaAttention(const float* qLat, const void* layerKv, DType kvDtype, const int32_t* blockTables,
                         const AttnSeq* seqs, const AttnWork* work, int numWork, int blockSize, int numHeads,
                         int kvLoraRank, int ropeDim, float scale, void* out, DType outDtype, cudaStream_t stream);

}  // namespace pd::kernels::cuda
