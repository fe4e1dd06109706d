// Batched causal paged attention (see pd/kernels/cuda/attention.h for the work split).
//
// Per block: kWarps warps, each owning up to kRowsPerWarp query rows (its registers hold the
// rows' running max, running sum and output accumulator, headDim / 32 values per lane).
// For each tile of kAttnKvTile key positions the block converts K and V of its kv head into
// shared memory (K rows padded by one float so lanes reading different keys hit different
// banks); then lane j of a warp computes the score of key j for a row, the warp updates the
// row's online softmax, and every lane accumulates p_j * V[j] into its slice of the row
// (the per-row state and tile update: online_softmax.cuh, shared with mla.cu).
#include <cmath>
#include <type_traits>

#include "dtype_util.cuh"
#include "online_softmax.cuh"
#include "pd/kernels/cuda/attention.h"

namespace pd::kernels::cuda {

using detail::dispatchDtype;
using detail::forEachDtypePair;
using detail::toF32;
using detail::WarpRowsSoftmax;

namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = kAttnRowsPerBlock / kWarps;
constexpr int kMaxDimPerLane = kAttnMaxHeadDim / 32;
static_assert(kRowsPerWarp * kWarps == kAttnRowsPerBlock);
static_assert(kAttnKvTile <= 32, "one lane scores one key of a tile");

size_t attnSharedBytes(int headDim) {
  return sizeof(float) * (size_t(kAttnRowsPerBlock) * headDim +  // q rows (pre-scaled)
                          size_t(kAttnKvTile) * (headDim + 1) +  // K tile, padded rows
                          size_t(kAttnKvTile) * headDim);        // V tile
}

// Launch: grid = (numWork, numKvHeads), block = kWarps * 32 threads,
// dynamic shared memory = attnSharedBytes(headDim).
template <typename KvT, typename OutT>
__global__ void __launch_bounds__(kWarps * 32)
    pagedAttentionKernel(const float* __restrict__ q, int qStride, const KvT* __restrict__ layerKv,
                         const int32_t* __restrict__ blockTables, const AttnSeq* __restrict__ seqs,
                         const AttnWork* __restrict__ work, int blockSize, int numHeads, int numKvHeads, int headDim,
                         float scale, OutT* __restrict__ out, int outStride) {
  const AttnWork w = work[blockIdx.x];
  const AttnSeq s = seqs[w.seq];
  const int kvHead = blockIdx.y;
  const int group = numHeads / numKvHeads;
  const int totalRows = s.numTokens * group;
  // Uniform over the block, so returning before __syncthreads is safe.
  if (w.rowBegin >= totalRows) return;
  const int rowsHere = min(kAttnRowsPerBlock, totalRows - w.rowBegin);
  const int lastToken = (w.rowBegin + rowsHere - 1) / group;
  const int ctx = s.startPos + lastToken + 1;  // keys [0, ctx) are visible to some row here

  extern __shared__ float smem[];
  float* qs = smem;                              // [kAttnRowsPerBlock][headDim]
  float* ks = qs + kAttnRowsPerBlock * headDim;  // [kAttnKvTile][headDim + 1]
  float* vs = ks + kAttnKvTile * (headDim + 1);  // [kAttnKvTile][headDim]
  const int kStride = headDim + 1;

  for (int i = threadIdx.x; i < rowsHere * headDim; i += blockDim.x) {
    const int r = i / headDim, d = i % headDim;
    const int row = w.rowBegin + r;
    const int token = row / group, h = kvHead * group + row % group;
    qs[i] = q[size_t(s.tokenStart + token) * qStride + size_t(h) * headDim + d] * scale;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WarpRowsSoftmax<kWarps, kRowsPerWarp, kMaxDimPerLane> rows;
  rows.init(warp, rowsHere, w.rowBegin, group, s.startPos);

  const int32_t* table = blockTables + s.blockTableOffset;
  constexpr int kVec = int(16 / sizeof(KvT));  // elements per 16-byte load
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  for (int kv0 = 0; kv0 < ctx; kv0 += kAttnKvTile) {
    const int n = min(kAttnKvTile, ctx - kv0);
    __syncthreads();  // the previous tile is consumed (and, the first time, q is loaded)
    if constexpr (std::is_same_v<KvT, __nv_fp8_e4m3>) {
      // fp8 blocks: codes [k|v][token][kv head][head dim], then f32 scales [k|v][token][kv head]
      // (engine/kv_layout.h); a value is code * its row's scale.
      const uint8_t* pool = reinterpret_cast<const uint8_t*>(layerKv);
      const size_t codeBytes = 2 * size_t(blockSize) * tokenElems;
      const size_t blockBytes = codeBytes + 2 * size_t(blockSize) * numKvHeads * sizeof(float);
      for (int i = threadIdx.x; i < n * headDim; i += blockDim.x) {
        const int p = i / headDim, d = i % headDim;
        const int pos = kv0 + p;
        const uint8_t* base = pool + size_t(table[pos / blockSize]) * blockBytes;
        const size_t off = size_t(pos % blockSize);
        const size_t kIdx = off * tokenElems + size_t(kvHead) * headDim + d;
        const float* scales = reinterpret_cast<const float*>(base + codeBytes);
        const float kScale = scales[off * numKvHeads + kvHead];
        const float vScale = scales[(size_t(blockSize) + off) * numKvHeads + kvHead];
        __nv_fp8_e4m3 kc, vc;
        kc.__x = base[kIdx];
        vc.__x = base[kIdx + size_t(blockSize) * tokenElems];
        ks[p * kStride + d] = float(kc) * kScale;
        vs[p * headDim + d] = float(vc) * vScale;
      }
    } else if (headDim % kVec == 0) {
      // 16-byte loads (the memory-bound part of decode), K and V both in flight before use.
      // Aligned: cudaMalloc'd pool, and every row offset is a multiple of headDim.
      const int vecPerRow = headDim / kVec;
      for (int i = threadIdx.x; i < n * vecPerRow; i += blockDim.x) {
        const int p = i / vecPerRow, d0 = (i % vecPerRow) * kVec;
        const int pos = kv0 + p;
        const size_t block = size_t(table[pos / blockSize]);
        const size_t off = size_t(pos % blockSize);
        const size_t kIdx = (block * 2 * blockSize + off) * tokenElems + size_t(kvHead) * headDim + d0;
        const uint4 kRaw = *reinterpret_cast<const uint4*>(layerKv + kIdx);
        const uint4 vRaw = *reinterpret_cast<const uint4*>(layerKv + kIdx + size_t(blockSize) * tokenElems);
        const KvT* kE = reinterpret_cast<const KvT*>(&kRaw);
        const KvT* vE = reinterpret_cast<const KvT*>(&vRaw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          ks[p * kStride + d0 + e] = toF32(kE[e]);
          vs[p * headDim + d0 + e] = toF32(vE[e]);
        }
      }
    } else {
      for (int i = threadIdx.x; i < n * headDim; i += blockDim.x) {
        const int p = i / headDim, d = i % headDim;
        const int pos = kv0 + p;
        const size_t block = size_t(table[pos / blockSize]);
        const size_t off = size_t(pos % blockSize);
        const size_t kIdx = (block * 2 * blockSize + off) * tokenElems + size_t(kvHead) * headDim + d;
        ks[p * kStride + d] = toF32(layerKv[kIdx]);
        vs[p * headDim + d] = toF32(layerKv[kIdx + size_t(blockSize) * tokenElems]);
      }
    }
    __syncthreads();
    rows.addTile(kv0, n, warp, lane, qs, headDim, ks, kStride, vs, headDim, headDim);
  }

  rows.template store<OutT>(warp, lane, headDim, [&](int r) {
    const int row = w.rowBegin + r;
    const int token = row / group, h = kvHead * group + row % group;
    return out + size_t(s.tokenStart + token) * outStride + size_t(h) * headDim;
  });
}

template <typename KvT, typename OutT>
cudaError_t launchAttention(const float* q, int qStride, const void* layerKv, const int32_t* blockTables,
                            const AttnSeq* seqs, const AttnWork* work, int numWork, int blockSize, int numHeads,
                            int numKvHeads, int headDim, float scale, void* out, int outStride, cudaStream_t stream) {
  auto kernel = pagedAttentionKernel<KvT, OutT>;
  const dim3 grid{unsigned(numWork), unsigned(numKvHeads), 1u};
  kernel<<<grid, kWarps * 32, attnSharedBytes(headDim), stream>>>(
      q, qStride, static_cast<const KvT*>(layerKv), blockTables, seqs, work, blockSize, numHeads, numKvHeads, headDim,
      scale, static_cast<OutT*>(out), outStride);
  return cudaGetLastError();
}

template <typename KvT, typename OutT>
cudaError_t allowLargeShared() {
  return cudaFuncSetAttribute(pagedAttentionKernel<KvT, OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(attnSharedBytes(kAttnMaxHeadDim)));
}

}  // namespace

cudaError_t pagedAttentionInit() {
  // Above 48 KiB of dynamic shared memory (head dims over ~240) a kernel must opt in.
  for (DType o : {DType::kF32, DType::kF16, DType::kBF16}) {
    const cudaError_t e =
        dispatchDtype(o, [&](auto oTag) { return allowLargeShared<__nv_fp8_e4m3, decltype(oTag)>(); });
    if (e != cudaSuccess) return e;
  }
  return forEachDtypePair([](auto kvTag, auto oTag) { return allowLargeShared<decltype(kvTag), decltype(oTag)>(); });
}

cudaError_t pagedAttention(const float* q, int qStride, const void* layerKv, DType kvDtype, const int32_t* blockTables,
                           const AttnSeq* seqs, const AttnWork* work, int numWork, int blockSize, int numHeads,
                           int numKvHeads, int headDim, float scale, void* out, DType outDtype, int outStride,
                           cudaStream_t stream) {
  if (numWork <= 0) return cudaSuccess;
  if (headDim <= 0 || headDim > kAttnMaxHeadDim || numKvHeads <= 0 || numHeads % numKvHeads != 0 || blockSize <= 0)
    return cudaErrorInvalidValue;
  if (kvDtype == DType::kFp8) {
    return dispatchDtype(outDtype, [&](auto outTag) {
      return launchAttention<__nv_fp8_e4m3, decltype(outTag)>(q, qStride, layerKv, blockTables, seqs, work, numWork,
                                                              blockSize, numHeads, numKvHeads, headDim, scale, out,
                                                              outStride, stream);
    });
  }
  return dispatchDtype(kvDtype, [&](auto kvTag) {
    using KvT = decltype(kvTag);
    return dispatchDtype(outDtype, [&](auto outTag) {
      using OutT = decltype(outTag);
      return launchAttention<KvT, OutT>(q, qStride, layerKv, blockTables, seqs, work, numWork, blockSize, numHeads,
                                        numKvHeads, headDim, scale, out, outStride, stream);
    });
  });
}

}  // namespace pd::kernels::cuda
