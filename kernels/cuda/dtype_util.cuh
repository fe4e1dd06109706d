// Device-side helpers shared by the .cu files: f32 <-> storage type conversion and a
// DType -> C++ type dispatch (one type, or every pair). Internal to kernels/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "pd/kernels/cuda/dtype.h"

namespace pd::kernels::cuda::detail {

__device__ __forceinline__ float toF32(float x) { return x; }
__device__ __forceinline__ float toF32(__half x) { return __half2float(x); }
__device__ __forceinline__ float toF32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float toF32(__nv_fp8_e4m3 x) { return float(x); }

template <typename T>
__device__ __forceinline__ T fromF32(float x);
template <>
__device__ __forceinline__ float fromF32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half fromF32<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromF32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Calls fn(T{}) with T the storage type of d (f32, f16, bf16; kFp8 is refused here).
template <typename Fn>
inline cudaError_t dispatchDtype(DType d, Fn&& fn) {
  switch (d) {
    case DType::kF32:
      return fn(float{});
    case DType::kF16:
      return fn(__half{});
    case DType::kBF16:
      return fn(__nv_bfloat16{});
    case DType::kFp8:  // a KV format only: kvCacheWrite and pagedAttention take it explicitly
      break;
  }
  return cudaErrorInvalidValue;
}

// Calls fn(A{}, B{}) for every pair of storage types A, B of f32, f16, bf16 (A outer, B inner,
// in that order), stopping at the first error, which it returns.
template <typename Fn>
inline cudaError_t forEachDtypePair(Fn&& fn) {
  for (DType a : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (DType b : {DType::kF32, DType::kF16, DType::kBF16}) {
      const cudaError_t e =
          dispatchDtype(a, [&](auto aTag) { return dispatchDtype(b, [&](auto bTag) { return fn(aTag, bTag); }); });
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

// Grid size for a grid-stride loop over n elements with `threads` per block.
inline unsigned gridFor(size_t n, int threads) {
  size_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535u * 16u) blocks = 65535u * 16u;  // grid-stride covers the rest
  return unsigned(blocks);
}

}  // namespace pd::kernels::cuda::detail
