// The causal online softmax of the paged attention kernels (attention.cu: per kv head;
// mla.cu: over the latent), for the query rows one warp owns. Internal to kernels/cuda.
//
// Contract: a block holds kWarps * kRows query rows; warp w owns block rows w + kWarps * j
// (j < kRows). Per row the registers hold the running max m, the running sum l and the lane's
// slice of the output accumulator: dims d = lane + 32 i (i < kPerLane), so the output dimension
// must be at most 32 * kPerLane. The kernel stages each tile of keys and values in shared memory
// as f32 (and the block's pre-scaled query rows once), then calls addTile with the whole warp
// (warp-collective: shuffles with the full mask); store writes acc / l. The operation order
// (the fmaf chains, expf, the reductions of reduce.cuh) is fixed here so that both kernels
// compute what they computed with their own copies of this code.
#pragma once

#include <cmath>

#include "dtype_util.cuh"
#include "reduce.cuh"

namespace pd::kernels::cuda::detail {

template <int kWarps, int kRows, int kPerLane>
struct WarpRowsSoftmax {
  float m[kRows], l[kRows], acc[kRows][kPerLane];
  int qpos[kRows];  // row j's query position (the last key it sees); -1: the block has no such row

  // Block row r < rowsHere is the query of token (rowBegin + r) / group of a sequence whose
  // first token here is at position startPos (group: query rows per token and kv head).
  __device__ __forceinline__ void init(int warp, int rowsHere, int rowBegin, int group, int startPos) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      m[j] = -INFINITY;
      l[j] = 0.0f;
      const int r = warp + kWarps * j;
      qpos[j] = r < rowsHere ? startPos + (rowBegin + r) / group : -1;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[j][i] = 0.0f;
    }
  }

  // Folds the tile of keys kv0 .. kv0 + n - 1 (n <= 32) into every row that sees one of them.
  // Lane k scores key kv0 + k (visible to row j while kv0 + k <= qpos[j]): the dot of block row
  // r's query, qs + r * qkDim, with ks + k * kStride over qkDim values. The key's value row is
  // vs + k * vStride, of which the first vDim values are accumulated.
  __device__ __forceinline__ void addTile(int kv0, int n, int warp, int lane, const float* qs, int qkDim,
                                          const float* ks, int kStride, const float* vs, int vStride, int vDim) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (qpos[j] < 0 || kv0 > qpos[j]) continue;  // warp-uniform: row absent or tile all masked
      const int r = warp + kWarps * j;
      const bool visible = lane < n && kv0 + lane <= qpos[j];
      float score = -INFINITY;
      if (visible) {
        const float* qr = qs + r * qkDim;
        const float* kr = ks + lane * kStride;
        float dot = 0.0f;
        for (int d = 0; d < qkDim; ++d) dot = fmaf(qr[d], kr[d], dot);
        score = dot;
      }
      const float tileMax = warpMax(score);  // finite: key kv0 <= qpos[j] is always visible
      const float mNew = fmaxf(m[j], tileMax);
      const float corr = expf(m[j] - mNew);  // m = -inf on the first tile gives 0
      const float p = visible ? expf(score - mNew) : 0.0f;
      l[j] = l[j] * corr + warpSum(p);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[j][i] *= corr;
      for (int key = 0; key < n; ++key) {
        const float pk = __shfl_sync(0xffffffffu, p, key);
        const float* vr = vs + key * vStride;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int d = lane + 32 * i;
          if (d < vDim) acc[j][i] = fmaf(pk, vr[d], acc[j][i]);
        }
      }
      m[j] = mNew;
    }
  }

  // Writes each present row's vDim outputs (acc / l, as OutT) to rowOut(r), r its block row.
  template <typename OutT, typename RowOut>
  __device__ __forceinline__ void store(int warp, int lane, int vDim, RowOut rowOut) const {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (qpos[j] < 0) continue;
      const float inv = 1.0f / l[j];
      OutT* o = rowOut(warp + kWarps * j);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < vDim) o[d] = fromF32<OutT>(acc[j][i] * inv);
      }
    }
  }
};

}  // namespace pd::kernels::cuda::detail
