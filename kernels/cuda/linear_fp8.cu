// FP8-weight linear kernels (pd/kernels/cuda/linear_fp8.h).
#include "kernels/cuda/dtype_util.cuh"
#include "kernels/cuda/reduce.cuh"
#include "pd/kernels/cuda/linear_fp8.h"

namespace pd::kernels::cuda {
namespace {

using detail::dispatchDtype;
using detail::fromF32;
using detail::gridFor;
using detail::toF32;
using detail::warpSum;

__device__ __forceinline__ float e4m3(uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = code;
  return float(v);
}

template <typename OutT>
__global__ void dequantKernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, int cols,
                              int colOffset, int blockCols, int scaleCols, size_t n, OutT* __restrict__ out) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / size_t(cols);
    const int c = int(i - r * size_t(cols));
    out[i] = fromF32<OutT>(e4m3(codes[i]) * scales[r * scaleCols + (colOffset + c) / blockCols]);
  }
}

constexpr int kWarpsPerBlock = 8;
constexpr int kVec = 16;  // codes per 16-byte load

// One warp per weight row: the row's codes are read once (16 bytes a lane per load when the
// layout allows) and multiplied into the n activation rows held in registers' accumulators.
template <typename XT, bool kVectorized>
__global__ void gemvKernel(const XT* __restrict__ x, int n, const uint8_t* __restrict__ codes,
                           const float* __restrict__ scales, int rows, int cols, int colOffset, int blockCols,
                           int scaleCols, float* __restrict__ y, float beta) {
  const int lane = threadIdx.x % 32;
  const int r = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const uint8_t* w = codes + size_t(r) * cols;
  const float* s = scales + size_t(r) * scaleCols;
  float acc[kFp8GemvMaxRows];
#pragma unroll
  for (int b = 0; b < kFp8GemvMaxRows; ++b) acc[b] = 0.0f;
  if constexpr (kVectorized) {
    // colOffset, cols and blockCols are multiples of 16: a load never straddles two blocks.
    for (int c0 = lane * kVec; c0 < cols; c0 += 32 * kVec) {
      const uint4 raw = *reinterpret_cast<const uint4*>(w + c0);
      const uint8_t* b8 = reinterpret_cast<const uint8_t*>(&raw);
      float wv[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) wv[k] = e4m3(b8[k]);
      const float sc = s[(colOffset + c0) / blockCols];
#pragma unroll
      for (int b = 0; b < kFp8GemvMaxRows; ++b) {
        if (b >= n) break;
        const XT* xr = x + size_t(b) * cols + c0;
        float part = 0.0f;
#pragma unroll
        for (int k = 0; k < kVec; ++k) part += wv[k] * toF32(xr[k]);
        acc[b] += part * sc;
      }
    }
  } else {
    for (int c = lane; c < cols; c += 32) {
      const float wv = e4m3(w[c]) * s[(colOffset + c) / blockCols];
#pragma unroll
      for (int b = 0; b < kFp8GemvMaxRows; ++b) {
        if (b >= n) break;
        acc[b] += wv * toF32(x[size_t(b) * cols + c]);
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kFp8GemvMaxRows; ++b) {
    if (b >= n) break;
    const float v = warpSum(acc[b]);
    if (lane == 0) {
      float* out = y + size_t(b) * rows + r;
      *out = beta == 0.0f ? v : v + beta * *out;  // beta 0 never reads y (it may hold NaN)
    }
  }
}

int scaleColsFor(int colOffset, int cols, int blockCols) { return (colOffset + cols + blockCols - 1) / blockCols; }

}  // namespace

cudaError_t fp8Dequantize(const uint8_t* codes, const float* scales, int rows, int cols, int colOffset, int blockCols,
                          void* out, DType outDtype, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || blockCols <= 0 || colOffset < 0 || colOffset >= blockCols) return cudaErrorInvalidValue;
  const size_t n = size_t(rows) * size_t(cols);
  if (n == 0) return cudaSuccess;
  const int scaleCols = scaleColsFor(colOffset, cols, blockCols);
  return dispatchDtype(outDtype, [&](auto tag) {
    using T = decltype(tag);
    dequantKernel<T><<<gridFor(n, 256), 256, 0, stream>>>(codes, scales, cols, colOffset, blockCols, scaleCols, n,
                                                          static_cast<T*>(out));
    return cudaGetLastError();
  });
}

cudaError_t fp8Gemv(const void* x, DType xDtype, int n, const uint8_t* codes, const float* scales, int rows, int cols,
                    int colOffset, int blockCols, float* y, float beta, cudaStream_t stream) {
  if (n < 1 || n > kFp8GemvMaxRows || rows < 0 || cols <= 0 || blockCols <= 0 || colOffset < 0 ||
      colOffset >= blockCols)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int scaleCols = scaleColsFor(colOffset, cols, blockCols);
  const bool vec = cols % kVec == 0 && colOffset % kVec == 0 && blockCols % kVec == 0 &&
                   reinterpret_cast<uintptr_t>(codes) % 16 == 0;
  const unsigned grid = unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return dispatchDtype(xDtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    if (vec)
      gemvKernel<T, true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(xt, n, codes, scales, rows, cols, colOffset,
                                                                    blockCols, scaleCols, y, beta);
    else
      gemvKernel<T, false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(xt, n, codes, scales, rows, cols, colOffset,
                                                                     blockCols, scaleCols, y, beta);
    return cudaGetLastError();
  });
}

}  // namespace pd::kernels::cuda
