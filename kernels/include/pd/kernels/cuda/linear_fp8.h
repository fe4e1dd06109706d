// FP8 block-scaled weights used from device memory (W8A16): the weight stays e4m3 codes with
// row-expanded f32 block scales (engine/fp8_blocks.h, "the device layout"), and
//   w[r][c] = e4m3(codes[r][c]) * scales[r][(colOffset + c) / blockCols]
//   scaleCols = (colOffset + cols + blockCols - 1) / blockCols   (scales' row length)
// Two ways to multiply with it, the backend picks by row count:
//   fp8Dequantize  writes the weight in a 16-bit (or f32) dtype into a scratch buffer that a
//                  cuBLAS GEMM then reads (prefill: the GEMM is compute-bound, the extra pass
//                  over the weight is 3 bytes a weight against 2*n FLOPs);
//   fp8Gemv        y = x * W^T for few rows, reading the codes directly (decode: the step is
//                  bound by weight bytes, and the codes are half of bf16's).
// Contract as ops.h: device pointers, enqueue only (graph-capture safe), cudaGetLastError()
// after the launch. Thread-safety: any host thread, any stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pd/kernels/cuda/dtype.h"

namespace pd::kernels::cuda {

// out: [rows][cols] in outDtype (f32, f16, bf16): e4m3(code) * scale in f32, rounded once.
cudaError_t fp8Dequantize(const uint8_t* codes, const float* scales, int rows, int cols, int colOffset, int blockCols,
                          void* out, DType outDtype, cudaStream_t stream);

// The most rows fp8Gemv takes (its accumulators live in registers).
constexpr int kFp8GemvMaxRows = 8;

// y[n][rows] (f32, row stride `rows`) = x[n][cols] (xDtype) * W^T + beta * y, n in
// [1, kFp8GemvMaxRows] (cudaErrorInvalidValue otherwise). Products and sums in f32.
cudaError_t fp8Gemv(const void* x, DType xDtype, int n, const uint8_t* codes, const float* scales, int rows, int cols,
                    int colOffset, int blockCols, float* y, float beta, cudaStream_t stream);

}  // namespace pd::kernels::cuda
