// CUDA twins of the elementwise / row kernels (see pd/kernels/cuda/ops.h). Kept deliberately
// simple (grid-stride loops, one block per row for reductions): these ops are a few percent of
// a step next to the GEMMs and attention, and simple code is easy to check without a GPU.
#include <cmath>

#include "dtype_util.cuh"
#include "pd/kernels/cuda/ops.h"
#include "reduce.cuh"

namespace pd::kernels::cuda {

using detail::blockInvRms;
using detail::dispatchDtype;
using detail::fromF32;
using detail::gridFor;
using detail::toF32;
using detail::warpMax;
using detail::warpSum;

namespace {

constexpr int kThreads = 256;

// Launch: grid = numRows blocks, block = kThreads; one block reduces one row.
template <typename TOut>
__global__ void rmsNormKernel(const float* __restrict__ x, int xStride, const float* __restrict__ weight, TOut* out,
                              int outStride, int dim, float eps) {
  const float* row = x + size_t(blockIdx.x) * xStride;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += row[i] * row[i];
  const float invRms = blockInvRms<kThreads>(ss, dim, eps);
  TOut* o = out + size_t(blockIdx.x) * outStride;
  // Read all of the row before any write: out may alias x (f32, same stride); each element
  // is read and written by the same thread, so the in-place case is safe.
  for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = fromF32<TOut>(row[i] * invRms * weight[i]);
}

// Launch: grid = ceil(numTokens * numHeads / kHeadRowsPerBlock) blocks, block = 32 *
// kHeadRowsPerBlock threads; one warp normalises one (token, head) row of headDim values.
constexpr int kHeadRowsPerBlock = kThreads / 32;
__global__ void headRmsNormKernel(float* x, int rowStride, int numTokens, int numHeads, int headDim,
                                  const float* __restrict__ weight, float eps) {
  const size_t row = size_t(blockIdx.x) * kHeadRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= size_t(numTokens) * numHeads) return;  // warp-uniform
  const size_t t = row / numHeads, h = row % numHeads;
  float* v = x + t * rowStride + h * headDim;
  float ss = 0.0f;
  for (int i = lane; i < headDim; i += 32) ss += v[i] * v[i];
  const float invRms = rsqrtf(warpSum(ss) / float(headDim) + eps);
  // Each lane writes only the elements it read, after the whole warp's reduction.
  for (int i = lane; i < headDim; i += 32) v[i] = v[i] * invRms * weight[i];
}

// Launch: grid-stride over numTokens * halfDim.
__global__ void ropeCosSinKernel(const int32_t* __restrict__ positions, int numTokens,
                                 const float* __restrict__ invFreq, int halfDim, float* cosOut, float* sinOut) {
  const size_t n = size_t(numTokens) * halfDim;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int t = int(i / halfDim), k = int(i % halfDim);
    const double a = double(positions[t]) * double(invFreq[k]);
    double s, c;
    sincos(a, &s, &c);
    cosOut[i] = float(c);
    sinOut[i] = float(s);
  }
}

// Launch: grid-stride over numTokens * numHeads * (headDim/2) rotation pairs.
__global__ void applyRopeKernel(float* x, int rowStride, int numTokens, int numHeads, int headDim,
                                const float* __restrict__ cosT, const float* __restrict__ sinT) {
  const int half = headDim / 2;
  const size_t n = size_t(numTokens) * numHeads * half;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int k = int(i % half);
    const size_t th = i / half;
    const int h = int(th % numHeads), t = int(th / numHeads);
    float* p = x + size_t(t) * rowStride + size_t(h) * headDim;
    const float c = cosT[size_t(t) * half + k], s = sinT[size_t(t) * half + k];
    const float a = p[k], b = p[k + half];
    p[k] = a * c - b * s;
    p[k + half] = b * c + a * s;
  }
}

// Launch: grid-stride over numRows * ffn.
template <typename TOut>
__global__ void swiGluKernel(const float* __restrict__ gateUp, TOut* out, int numRows, int ffn) {
  const size_t n = size_t(numRows) * ffn;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / ffn, j = i % ffn;
    const float g = gateUp[r * 2 * ffn + j], u = gateUp[r * 2 * ffn + ffn + j];
    out[i] = fromF32<TOut>(g / (1.0f + expf(-g)) * u);
  }
}

// Launch: grid-stride over numTokens * dim.
template <typename T>
__global__ void embeddingGatherKernel(const T* __restrict__ table, const int32_t* __restrict__ ids, int numTokens,
                                      int dim, float* out) {
  const size_t n = size_t(numTokens) * dim;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / dim, d = i % dim;
    out[i] = toF32(table[size_t(ids[t]) * dim + d]);
  }
}

// Launch: grid-stride over numTokens * numKvHeads * headDim.
template <typename T>
__global__ void kvCacheWriteKernel(T* layerKv, const float* __restrict__ k, const float* __restrict__ v, int rowStride,
                                   const int32_t* __restrict__ slots, int numTokens, int blockSize, int tokenElems) {
  const size_t n = size_t(numTokens) * tokenElems;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int t = int(i / tokenElems), e = int(i % tokenElems);
    const int slot = slots[t];
    if (slot < 0) continue;
    const size_t block = size_t(slot / blockSize), off = size_t(slot % blockSize);
    const size_t kIdx = (block * 2 * blockSize + off) * tokenElems + e;
    const size_t vIdx = kIdx + size_t(blockSize) * tokenElems;
    layerKv[kIdx] = fromF32<T>(k[size_t(t) * rowStride + e]);
    layerKv[vIdx] = fromF32<T>(v[size_t(t) * rowStride + e]);
  }
}

// fp8 KV: one warp per (token, kv head, k|v) row: the row's max |x| by a warp reduction gives
// its scale (max / 448), then each lane encodes its values (nearest even, saturating: the CPU
// encoder's rounding, pd/kernels/kv_cache.h). An all-zero row gets scale 0 and zero codes.
// Launch: grid-stride over warps; blockBytes = the layout's (codes, then the f32 scales).
__global__ void kvCacheWriteFp8Kernel(uint8_t* layerKv, const float* __restrict__ k, const float* __restrict__ v,
                                      int rowStride, const int32_t* __restrict__ slots, int numTokens, int blockSize,
                                      int numKvHeads, int headDim, size_t blockBytes) {
  const int lane = threadIdx.x % 32;
  const size_t warps = size_t(gridDim.x) * blockDim.x / 32;
  const size_t rows = size_t(numTokens) * numKvHeads * 2;
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  for (size_t w = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32; w < rows; w += warps) {
    const int t = int(w / (2 * numKvHeads)), h = int(w / 2 % numKvHeads), isV = int(w % 2);
    const int slot = slots[t];
    if (slot < 0) continue;  // warp-uniform
    const float* x = (isV ? v : k) + size_t(t) * rowStride + size_t(h) * headDim;
    float amax = 0.0f;
    for (int d = lane; d < headDim; d += 32) amax = fmaxf(amax, fabsf(x[d]));
    amax = warpMax(amax);
    const bool zero = !(amax > 0.0f) || isinf(amax);
    const float inv = zero ? 0.0f : 448.0f / amax;
    const size_t block = size_t(slot / blockSize), off = size_t(slot % blockSize);
    uint8_t* base = layerKv + block * blockBytes;
    uint8_t* codes = base + (isV ? size_t(blockSize) * tokenElems : 0) + off * tokenElems + size_t(h) * headDim;
    for (int d = lane; d < headDim; d += 32)
      codes[d] = zero ? 0 : uint8_t(__nv_cvt_float_to_fp8(x[d] * inv, __NV_SATFINITE, __NV_E4M3));
    if (lane == 0) {
      float* scales = reinterpret_cast<float*>(base + 2 * size_t(blockSize) * tokenElems);
      scales[(isV ? size_t(blockSize) * numKvHeads : 0) + off * numKvHeads + h] = zero ? 0.0f : amax / 448.0f;
    }
  }
}

// Launch: grid-stride over n.
template <typename T>
__global__ void convertFromF32Kernel(const float* __restrict__ in, T* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = fromF32<T>(in[i]);
}

// Launch: grid-stride over n.
template <typename T>
__global__ void convertToF32Kernel(const T* __restrict__ in, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = toF32(in[i]);
}

// Launch: grid-stride over numRows * dim.
__global__ void gatherRowsKernel(const float* __restrict__ in, int inStride, const int32_t* __restrict__ rows,
                                 int numRows, int dim, float* out) {
  const size_t n = size_t(numRows) * dim;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / dim, d = i % dim;
    out[i] = in[size_t(rows[r]) * inStride + d];
  }
}

// Launch: grid-stride over numRows * dim. add = false sets, add = true accumulates.
__global__ void biasRowsKernel(float* y, const float* __restrict__ bias, int numRows, int dim, bool add) {
  const size_t n = size_t(numRows) * dim;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float b = bias[i % dim];
    y[i] = add ? y[i] + b : b;
  }
}

}  // namespace

cudaError_t rmsNorm(const float* x, int xStride, const float* weight, void* out, DType outDtype, int outStride,
                    int numRows, int dim, float eps, cudaStream_t stream) {
  if (numRows <= 0) return cudaSuccess;
  return dispatchDtype(outDtype, [&](auto tag) {
    using T = decltype(tag);
    rmsNormKernel<T><<<numRows, kThreads, 0, stream>>>(x, xStride, weight, static_cast<T*>(out), outStride, dim, eps);
    return cudaGetLastError();
  });
}

cudaError_t headRmsNorm(float* x, int rowStride, int numTokens, int numHeads, int headDim, const float* weight,
                        float eps, cudaStream_t stream) {
  const size_t rows = size_t(numTokens) * numHeads;
  if (rows == 0 || headDim <= 0) return cudaSuccess;
  const size_t blocks = (rows + kHeadRowsPerBlock - 1) / kHeadRowsPerBlock;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  headRmsNormKernel<<<unsigned(blocks), kThreads, 0, stream>>>(x, rowStride, numTokens, numHeads, headDim, weight, eps);
  return cudaGetLastError();
}

cudaError_t ropeCosSin(const int32_t* positions, int numTokens, const float* invFreq, int halfDim, float* cosOut,
                       float* sinOut, cudaStream_t stream) {
  const size_t n = size_t(numTokens) * halfDim;
  if (n == 0) return cudaSuccess;
  ropeCosSinKernel<<<gridFor(n, kThreads), kThreads, 0, stream>>>(positions, numTokens, invFreq, halfDim, cosOut,
                                                                  sinOut);
  return cudaGetLastError();
}

cudaError_t applyRope(float* x, int rowStride, int numTokens, int numHeads, int headDim, const float* cosT,
                      const float* sinT, cudaStream_t stream) {
  const size_t n = size_t(numTokens) * numHeads * (headDim / 2);
  if (n == 0) return cudaSuccess;
  applyRopeKernel<<<gridFor(n, kThreads), kThreads, 0, stream>>>(x, rowStride, numTokens, numHeads, headDim, cosT,
                                                                 sinT);
  return cudaGetLastError();
}

cudaError_t swiGlu(const float* gateUp, void* out, DType outDtype, int numRows, int ffn, cudaStream_t stream) {
  const size_t n = size_t(numRows) * ffn;
  if (n == 0) return cudaSuccess;
  return dispatchDtype(outDtype, [&](auto tag) {
    using T = decltype(tag);
    swiGluKernel<T><<<gridFor(n, kThreads), kThreads, 0, stream>>>(gateUp, static_cast<T*>(out), numRows, ffn);
    return cudaGetLastError();
  });
}

cudaError_t embeddingGather(const void* table, DType tableDtype, const int32_t* ids, int numTokens, int dim, float* out,
                            cudaStream_t stream) {
  const size_t n = size_t(numTokens) * dim;
  if (n == 0) return cudaSuccess;
  return dispatchDtype(tableDtype, [&](auto tag) {
    using T = decltype(tag);
    embeddingGatherKernel<T>
        <<<gridFor(n, kThreads), kThreads, 0, stream>>>(static_cast<const T*>(table), ids, numTokens, dim, out);
    return cudaGetLastError();
  });
}

cudaError_t kvCacheWrite(void* layerKv, DType kvDtype, const float* k, const float* v, int rowStride,
                         const int32_t* slots, int numTokens, int blockSize, int numKvHeads, int headDim,
                         cudaStream_t stream) {
  const int tokenElems = numKvHeads * headDim;
  const size_t n = size_t(numTokens) * tokenElems;
  if (n == 0) return cudaSuccess;
  if (kvDtype == DType::kFp8) {
    const size_t blockBytes = 2 * size_t(blockSize) * tokenElems + 2 * size_t(blockSize) * numKvHeads * sizeof(float);
    const size_t threads = size_t(numTokens) * numKvHeads * 2 * 32;  // a warp per row
    kvCacheWriteFp8Kernel<<<gridFor(threads, kThreads), kThreads, 0, stream>>>(
        static_cast<uint8_t*>(layerKv), k, v, rowStride, slots, numTokens, blockSize, numKvHeads, headDim, blockBytes);
    return cudaGetLastError();
  }
  return dispatchDtype(kvDtype, [&](auto tag) {
    using T = decltype(tag);
    kvCacheWriteKernel<T><<<gridFor(n, kThreads), kThreads, 0, stream>>>(static_cast<T*>(layerKv), k, v, rowStride,
                                                                         slots, numTokens, blockSize, tokenElems);
    return cudaGetLastError();
  });
}

cudaError_t convertFromF32(const float* in, void* out, DType outDtype, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatchDtype(outDtype, [&](auto tag) {
    using T = decltype(tag);
    convertFromF32Kernel<T><<<gridFor(n, kThreads), kThreads, 0, stream>>>(in, static_cast<T*>(out), n);
    return cudaGetLastError();
  });
}

cudaError_t convertToF32(const void* in, DType inDtype, float* out, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatchDtype(inDtype, [&](auto tag) {
    using T = decltype(tag);
    convertToF32Kernel<T><<<gridFor(n, kThreads), kThreads, 0, stream>>>(static_cast<const T*>(in), out, n);
    return cudaGetLastError();
  });
}

cudaError_t gatherRows(const float* in, int inStride, const int32_t* rows, int numRows, int dim, float* out,
                       cudaStream_t stream) {
  const size_t n = size_t(numRows) * dim;
  if (n == 0) return cudaSuccess;
  gatherRowsKernel<<<gridFor(n, kThreads), kThreads, 0, stream>>>(in, inStride, rows, numRows, dim, out);
  return cudaGetLastError();
}

cudaError_t broadcastRows(float* y, const float* bias, int numRows, int dim, cudaStream_t stream) {
  const size_t n = size_t(numRows) * dim;
  if (n == 0) return cudaSuccess;
  biasRowsKernel<<<gridFor(n, kThreads), kThreads, 0, stream>>>(y, bias, numRows, dim, false);
  return cudaGetLastError();
}

cudaError_t addRows(float* y, const float* bias, int numRows, int dim, cudaStream_t stream) {
  const size_t n = size_t(numRows) * dim;
  if (n == 0) return cudaSuccess;
  biasRowsKernel<<<gridFor(n, kThreads), kThreads, 0, stream>>>(y, bias, numRows, dim, true);
  return cudaGetLastError();
}

}  // namespace pd::kernels::cuda
