// Multi-head latent attention kernels (see pd/kernels/cuda/mla.h).
//
// mlaAttention per block: kWarps warps, each owning kRowsPerWarp of the block's
// kAttnRowsPerBlock query rows (registers: the rows' running max and sum, and the output
// accumulator, kvLoraRank / 32 values per lane and row). Shared memory: the block's query rows
// pre-scaled [rows][L] and one tile of latent vectors [kMlaKvTile][L + 1] (odd row stride, so
// lanes scoring different keys read different banks): 73.8 KiB at L = 576. Lane j scores key j
// of a tile for a row, the warp updates the row's online softmax, then every lane accumulates
// p_key * c_kv[key][d] for its d = lane + 32 i (online_softmax.cuh, shared with attention.cu).
#include <cmath>

#include "dtype_util.cuh"
#include "online_softmax.cuh"
#include "pd/kernels/cuda/mla.h"
#include "reduce.cuh"

namespace pd::kernels::cuda {

using detail::blockInvRms;
using detail::dispatchDtype;
using detail::forEachDtypePair;
using detail::fromF32;
using detail::gridFor;
using detail::toF32;
using detail::WarpRowsSoftmax;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = kAttnRowsPerBlock / kWarps;
constexpr int kMaxRPerLane = kMlaMaxKvLoraRank / 32;
static_assert(kRowsPerWarp * kWarps == kAttnRowsPerBlock);
static_assert(kMlaKvTile <= 32, "one lane scores one key of a tile");
static_assert(kMlaMaxKvLoraRank % 32 == 0);

size_t mlaSharedBytes(int latentDim) {
  return sizeof(float) * (size_t(kAttnRowsPerBlock) * latentDim +  // q rows (pre-scaled)
                          size_t(kMlaKvTile) * (latentDim + 1));   // latent tile, padded rows
}

// Launch: grid = numTokens blocks, block = kThreads; one block per token.
template <typename KvT>
__global__ void mlaKvWriteKernel(const float* __restrict__ kva, int kvaStride, const float* __restrict__ normWeight,
                                 float eps, int R, int ropeDim, const float* __restrict__ cosT,
                                 const float* __restrict__ sinT, float mscale, const int32_t* __restrict__ slots,
                                 KvT* layerKv) {
  const int t = blockIdx.x;
  const int slot = slots[t];
  if (slot < 0) return;  // uniform over the block
  const float* x = kva + size_t(t) * kvaStride;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < R; i += blockDim.x) ss += x[i] * x[i];
  const float invRms = blockInvRms<kThreads>(ss, R, eps);
  const int L = R + ropeDim, half = ropeDim / 2;
  KvT* dst = layerKv + size_t(slot) * L;
  for (int i = threadIdx.x; i < R; i += blockDim.x) dst[i] = fromF32<KvT>(x[i] * invRms * normWeight[i]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float c = cosT[size_t(t) * half + i] * mscale, s = sinT[size_t(t) * half + i] * mscale;
    const float a = x[R + 2 * i], b = x[R + 2 * i + 1];
    dst[R + 2 * i] = fromF32<KvT>(a * c - b * s);
    dst[R + 2 * i + 1] = fromF32<KvT>(b * c + a * s);
  }
}

// Launch: grid-stride over numTokens * numHeads * (nopeDim + ropeDim / 2) items: an item below
// nopeDim copies one q_nope value, one above rotates one q_pe pair.
template <typename QT>
__global__ void mlaQSplitKernel(const float* __restrict__ q, int qStride, int numTokens, int numHeads, int nopeDim,
                                int ropeDim, const float* __restrict__ cosT, const float* __restrict__ sinT,
                                float mscale, QT* qNope, float* qLat, int R) {
  const int half = ropeDim / 2, per = nopeDim + half, qh = nopeDim + ropeDim, L = R + ropeDim;
  const size_t n = size_t(numTokens) * numHeads * per;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int k = int(i % per);
    const size_t th = i / per;  // token * numHeads + head
    const int h = int(th % numHeads), t = int(th / numHeads);
    const float* src = q + size_t(t) * qStride + size_t(h) * qh;
    if (k < nopeDim) {
      qNope[th * nopeDim + k] = fromF32<QT>(src[k]);
    } else {
      const int j = k - nopeDim;
      const float c = cosT[size_t(t) * half + j] * mscale, s = sinT[size_t(t) * half + j] * mscale;
      const float a = src[nopeDim + 2 * j], b = src[nopeDim + 2 * j + 1];
      float* dst = qLat + th * L + R;
      dst[2 * j] = a * c - b * s;
      dst[2 * j + 1] = b * c + a * s;
    }
  }
}

// Launch: grid = numWork blocks, block = kWarps * 32 threads, dynamic shared memory =
// mlaSharedBytes(R + ropeDim).
template <typename KvT, typename OutT>
__global__ void __launch_bounds__(kWarps * 32)
    mlaAttentionKernel(const float* __restrict__ qLat, const KvT* __restrict__ layerKv,
                       const int32_t* __restrict__ blockTables, const AttnSeq* __restrict__ seqs,
                       const AttnWork* __restrict__ work, int blockSize, int numHeads, int R, int L, float scale,
                       OutT* __restrict__ out) {
  const AttnWork w = work[blockIdx.x];
  const AttnSeq s = seqs[w.seq];
  const int totalRows = s.numTokens * numHeads;
  // Uniform over the block, so returning before __syncthreads is safe.
  if (w.rowBegin >= totalRows) return;
  const int rowsHere = min(kAttnRowsPerBlock, totalRows - w.rowBegin);
  const int lastToken = (w.rowBegin + rowsHere - 1) / numHeads;
  const int ctx = s.startPos + lastToken + 1;  // keys [0, ctx) are visible to some row here

  extern __shared__ float smem[];
  float* qs = smem;                        // [kAttnRowsPerBlock][L]
  float* ks = qs + kAttnRowsPerBlock * L;  // [kMlaKvTile][L + 1]
  const int kStride = L + 1;
  // The block's rows are consecutive (token, head) pairs: one contiguous run of qLat.
  const size_t firstRow = size_t(s.tokenStart) * numHeads + w.rowBegin;
  const float* qSrc = qLat + firstRow * L;
  for (int i = threadIdx.x; i < rowsHere * L; i += blockDim.x) qs[i] = qSrc[i] * scale;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WarpRowsSoftmax<kWarps, kRowsPerWarp, kMaxRPerLane> rows;
  rows.init(warp, rowsHere, w.rowBegin, numHeads, s.startPos);

  const int32_t* table = blockTables + s.blockTableOffset;
  constexpr int kVec = int(16 / sizeof(KvT));  // elements per 16-byte load
  for (int kv0 = 0; kv0 < ctx; kv0 += kMlaKvTile) {
    const int n = min(kMlaKvTile, ctx - kv0);
    __syncthreads();  // the previous tile is consumed (and, the first time, q is loaded)
    if (L % kVec == 0) {
      // 16-byte loads: every vector starts at slot * L elements, a multiple of kVec, of a
      // cudaMalloc'd (256-byte aligned) pool whose layer size is a multiple of 16 bytes.
      const int vecPerRow = L / kVec;
      for (int i = threadIdx.x; i < n * vecPerRow; i += blockDim.x) {
        const int p = i / vecPerRow, d0 = (i % vecPerRow) * kVec;
        const int pos = kv0 + p;
        const size_t slot = size_t(table[pos / blockSize]) * blockSize + pos % blockSize;
        const uint4 raw = *reinterpret_cast<const uint4*>(layerKv + slot * L + d0);
        const KvT* e = reinterpret_cast<const KvT*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec; ++k) ks[p * kStride + d0 + k] = toF32(e[k]);
      }
    } else {
      for (int i = threadIdx.x; i < n * L; i += blockDim.x) {
        const int p = i / L, d = i % L;
        const int pos = kv0 + p;
        const size_t slot = size_t(table[pos / blockSize]) * blockSize + pos % blockSize;
        ks[p * kStride + d] = toF32(layerKv[slot * L + d]);
      }
    }
    __syncthreads();
    // The values are the keys' c_kv: the first R values of each latent.
    rows.addTile(kv0, n, warp, lane, qs, L, ks, kStride, ks, kStride, R);
  }

  rows.template store<OutT>(warp, lane, R, [&](int r) { return out + (firstRow + r) * R; });
}

template <typename KvT, typename OutT>
cudaError_t allowLargeShared() {
  return cudaFuncSetAttribute(mlaAttentionKernel<KvT, OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(mlaSharedBytes(kMlaMaxKvLoraRank + kMlaMaxRopeDim)));
}

}  // namespace

cudaError_t mlaAttentionInit() {
  return forEachDtypePair([](auto kvTag, auto oTag) { return allowLargeShared<decltype(kvTag), decltype(oTag)>(); });
}

cudaError_t mlaKvWrite(const float* kva, int kvaStride, const float* normWeight, float eps, int kvLoraRank, int ropeDim,
                       const float* cosT, const float* sinT, float mscale, const int32_t* slots, int numTokens,
                       void* layerKv, DType kvDtype, cudaStream_t stream) {
  if (numTokens <= 0) return cudaSuccess;
  if (!mlaShapeSupported(kvLoraRank, ropeDim) || kvaStride < kvLoraRank + ropeDim) return cudaErrorInvalidValue;
  return dispatchDtype(kvDtype, [&](auto tag) {
    using T = decltype(tag);
    mlaKvWriteKernel<T><<<numTokens, kThreads, 0, stream>>>(kva, kvaStride, normWeight, eps, kvLoraRank, ropeDim, cosT,
                                                            sinT, mscale, slots, static_cast<T*>(layerKv));
    return cudaGetLastError();
  });
}

cudaError_t mlaQSplit(const float* q, int qStride, int numTokens, int numHeads, int nopeDim, int ropeDim,
                      const float* cosT, const float* sinT, float mscale, void* qNope, DType qNopeDtype, float* qLat,
                      int kvLoraRank, cudaStream_t stream) {
  const size_t n = size_t(numTokens) * numHeads * (nopeDim + ropeDim / 2);
  if (n == 0) return cudaSuccess;
  if (!mlaShapeSupported(kvLoraRank, ropeDim) || nopeDim < 0 || qStride < numHeads * (nopeDim + ropeDim))
    return cudaErrorInvalidValue;
  return dispatchDtype(qNopeDtype, [&](auto tag) {
    using T = decltype(tag);
    mlaQSplitKernel<T><<<gridFor(n, kThreads), kThreads, 0, stream>>>(q, qStride, numTokens, numHeads, nopeDim, ropeDim,
                                                                      cosT, sinT, mscale, static_cast<T*>(qNope), qLat,
                                                                      kvLoraRank);
    return cudaGetLastError();
  });
}

cudaError_t mlaAttention(const float* qLat, const void* layerKv, DType kvDtype, const int32_t* blockTables,
                         const AttnSeq* seqs, const AttnWork* work, int numWork, int blockSize, int numHeads,
                         int kvLoraRank, int ropeDim, float scale, void* out, DType outDtype, cudaStream_t stream) {
  if (numWork <= 0) return cudaSuccess;
  if (!mlaShapeSupported(kvLoraRank, ropeDim) || numHeads <= 0 || blockSize <= 0) return cudaErrorInvalidValue;
  const int L = kvLoraRank + ropeDim;
  return dispatchDtype(kvDtype, [&](auto kvTag) {
    using KvT = decltype(kvTag);
    return dispatchDtype(outDtype, [&](auto outTag) {
      using OutT = decltype(outTag);
      mlaAttentionKernel<KvT, OutT><<<unsigned(numWork), kWarps * 32, mlaSharedBytes(L), stream>>>(
          qLat, static_cast<const KvT*>(layerKv), blockTables, seqs, work, blockSize, numHeads, kvLoraRank, L, scale,
          static_cast<OutT*>(out));
      return cudaGetLastError();
    });
  });
}

}  // namespace pd::kernels::cuda
