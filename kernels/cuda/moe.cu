// The mixture-of-experts gather / combine ops (see pd/kernels/cuda/moe.h). Grid-stride loops:
// memory-bound row copies next to the experts' GEMMs.
#include "dtype_util.cuh"
#include "pd/kernels/cuda/moe.h"

namespace pd::kernels::cuda {

using detail::dispatchDtype;
using detail::gridFor;

namespace {

constexpr int kThreads = 256;

// Launch: grid-stride over numRows * dim.
template <typename T>
__global__ void moeGatherRowsKernel(const T* __restrict__ in, const int32_t* __restrict__ rows, int numRows, int dim,
                                    T* __restrict__ out) {
  const size_t n = size_t(numRows) * dim;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / dim, d = i % dim;
    out[i] = in[size_t(rows[r]) * dim + d];
  }
}

// Launch: grid-stride over numTokens * dim.
__global__ void moeCombineKernel(float* x, const float* __restrict__ y, const int32_t* __restrict__ slotRows,
                                 const float* __restrict__ weights, int numTokens, int k, int dim) {
  const size_t n = size_t(numTokens) * dim;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / dim, d = i % dim;
    float acc = x[i];
    for (int j = 0; j < k; ++j) {
      const size_t s = t * k + j;
      acc += weights[s] * y[size_t(slotRows[s]) * dim + d];
    }
    x[i] = acc;
  }
}

}  // namespace

cudaError_t moeGatherRows(const void* in, DType dtype, const int32_t* rows, int numRows, int dim, void* out,
                          cudaStream_t stream) {
  const size_t n = size_t(numRows) * dim;
  if (n == 0) return cudaSuccess;
  return dispatchDtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    moeGatherRowsKernel<T><<<gridFor(n, kThreads), kThreads, 0, stream>>>(static_cast<const T*>(in), rows, numRows, dim,
                                                                          static_cast<T*>(out));
    return cudaGetLastError();
  });
}

cudaError_t moeCombine(float* x, const float* y, const int32_t* slotRows, const float* weights, int numTokens, int k,
                       int dim, cudaStream_t stream) {
  const size_t n = size_t(numTokens) * dim;
  if (n == 0 || k <= 0) return cudaSuccess;
  moeCombineKernel<<<gridFor(n, kThreads), kThreads, 0, stream>>>(x, y, slotRows, weights, numTokens, k, dim);
  return cudaGetLastError();
}

}  // namespace pd::kernels::cuda
