// Warp and block reductions shared by the .cu files. Internal to kernels/cuda.
//
// Contract: every helper is a collective. The warp helpers must be called by all 32 lanes of a
// full warp (mask 0xffffffff) and return the result in every lane; blockInvRms must be called by
// every thread of the block (it holds __syncthreads). The order of the additions is part of the
// contract: a butterfly over lane offsets 16, 8, 4, 2, 1, then (blockInvRms) warp 0's sum plus
// warp 1's and so on, so the kernels that share these give the bit-exact results they gave
// with their own copies.
#pragma once

namespace pd::kernels::cuda::detail {

// The sum of v over the warp.
__device__ __forceinline__ float warpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The maximum of v over the warp (fmaxf: a NaN lane loses to a number).
__device__ __forceinline__ float warpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// RMSNorm's scale for one row reduced by a whole block of kThreads threads (a multiple of 32,
// blockDim.x == kThreads): each thread passes its partial sum of squares `ss`; every thread gets
// rsqrt(sum / n + eps). Safe to call again in the same kernel: each write to the shared scratch
// follows a barrier that every reader of the previous call's values has passed.
template <int kThreads>
__device__ __forceinline__ float blockInvRms(float ss, int n, float eps) {
  static_assert(kThreads % 32 == 0);
  ss = warpSum(ss);
  __shared__ float warpSums[kThreads / 32];
  __shared__ float invRms;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warpSums[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) total += warpSums[w];
    invRms = rsqrtf(total / float(n) + eps);
  }
  __syncthreads();
  return invRms;
}

}  // namespace pd::kernels::cuda::detail
