// The device ops of a mixture-of-experts block (engine/cuda_moe.h) around its cuBLAS GEMMs:
// gathering the rows routed to each expert into one expert-grouped matrix, and adding every
// token's weighted expert outputs back into the residual stream.
//
// Conventions as pd/kernels/cuda/ops.h: DEVICE pointers, enqueue-only on `stream` (no
// allocation, no synchronisation), cudaGetLastError() after the launch; math in f32.
// CPU twins: the loops of engine/cpu_moe.cpp (tests/kernels/cuda_kernels_test.cpp compares).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pd/kernels/cuda/dtype.h"

namespace pd::kernels::cuda {

// out[r][0, dim) = in[rows[r]][0, dim) for r < numRows; in: [*][dim] and out: [numRows][dim],
// both in dtype (f32, f16, bf16). rows: [numRows] source row indices (validated by the caller).
cudaError_t moeGatherRows(const void* in, DType dtype, const int32_t* rows, int numRows, int dim, void* out,
                          cudaStream_t stream);

// For every token t < numTokens and d < dim, in slot order j = 0 .. k-1:
//   x[t][d] += weights[t*k + j] * y[slotRows[t*k + j]][d]
// x: [numTokens][dim] f32 (the residual stream), y: [*][dim] f32 (the experts' outputs),
// slotRows, weights: [numTokens][k]. One thread owns each x element and sums its slots in
// order: deterministic, no atomics (a token's k slots are distinct rows of y).
cudaError_t moeCombine(float* x, const float* y, const int32_t* slotRows, const float* weights, int numTokens, int k,
                       int dim, cudaStream_t stream);

}  // namespace pd::kernels::cuda
