// CUDA twins of the CPU kernels in pd/kernels/{norm,rope,activation,embedding,kv_cache}.h,
// plus the few glue ops the CUDA backend needs (dtype conversion, row gather, bias rows).
//
// Every function has the CPU twin's signature plus, where a tensor may be 16-bit, its DType,
// and a trailing cudaStream_t. All pointers are DEVICE pointers unless said otherwise. The
// functions only enqueue work on `stream` (no allocation, no synchronisation, safe inside
// CUDA graph capture) and return cudaGetLastError() after the launch, so a bad launch
// configuration is reported at the call. Inputs 16-bit, math f32.
// Thread-safety: any host thread, any stream; outputs must not be written concurrently.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "pd/kernels/cuda/dtype.h"

namespace pd::kernels::cuda {

// RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight.
// x: [numRows][dim] f32 (row stride xStride), weight: [dim] f32,
// out: [numRows][dim] in outDtype (row stride outStride elements). out may alias x only when
// outDtype is f32 and the strides are equal.
cudaError_t rmsNorm(const float* x, int xStride, const float* weight, void* out, DType outDtype, int outStride,
                    int numRows, int dim, float eps, cudaStream_t stream);

// Per-head RMSNorm in place (Qwen3's q_norm / k_norm): for every token t < numTokens and head
// h < numHeads, the headDim values at x[t*rowStride + h*headDim] become
// v / sqrt(mean(v^2) + eps) * weight. x: f32, weight: [headDim] f32. The CPU twin is rmsNorm
// over each token's heads (pd/kernels/norm.h), as the CPU backend runs it.
cudaError_t headRmsNorm(float* x, int rowStride, int numTokens, int numHeads, int headDim, const float* weight,
                        float eps, cudaStream_t stream);

// positions: [numTokens], invFreq: [halfDim] (from the CPU ropeInvFreq),
// cosOut, sinOut: [numTokens][halfDim]. Angles are formed in double, as on the CPU.
cudaError_t ropeCosSin(const int32_t* positions, int numTokens, const float* invFreq, int halfDim, float* cosOut,
                       float* sinOut, cudaStream_t stream);

// x: [numTokens][rowStride] f32, numHeads heads of headDim at x[t*rowStride] (in place),
// cosT, sinT: [numTokens][headDim/2]. Hugging Face rotate_half convention.
cudaError_t applyRope(float* x, int rowStride, int numTokens, int numHeads, int headDim, const float* cosT,
                      const float* sinT, cudaStream_t stream);

// gateUp: [numRows][2*ffn] f32 (gate | up), out: [numRows][ffn] in outDtype.
cudaError_t swiGlu(const float* gateUp, void* out, DType outDtype, int numRows, int ffn, cudaStream_t stream);

// table: [vocab][dim] in tableDtype, ids: [numTokens] (validated by the caller),
// out: [numTokens][dim] f32.
cudaError_t embeddingGather(const void* table, DType tableDtype, const int32_t* ids, int numTokens, int dim, float* out,
                            cudaStream_t stream);

// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim] in kvDtype (written; kFp8: each
// block's codes followed by its f32 scales [2][blockSize][numKvHeads], one per row of headDim,
// scale = max |x| / 448, engine/kv_layout.h),
// k, v: [numTokens][rowStride] f32 with numKvHeads*headDim values at each row's start,
// slots: [numTokens]; a negative slot skips its token (padding rows of a captured graph).
cudaError_t kvCacheWrite(void* layerKv, DType kvDtype, const float* k, const float* v, int rowStride,
                         const int32_t* slots, int numTokens, int blockSize, int numKvHeads, int headDim,
                         cudaStream_t stream);

// in: [n] f32, out: [n] in outDtype (round to nearest even).
cudaError_t convertFromF32(const float* in, void* out, DType outDtype, size_t n, cudaStream_t stream);

// in: [n] in inDtype, out: [n] f32 (tests read 16-bit tensors back with it).
cudaError_t convertToF32(const void* in, DType inDtype, float* out, size_t n, cudaStream_t stream);

// in: [*][inStride] f32, rows: [numRows] row indices, out: [numRows][dim] f32.
cudaError_t gatherRows(const float* in, int inStride, const int32_t* rows, int numRows, int dim, float* out,
                       cudaStream_t stream);

// y: [numRows][dim] f32, every row set to bias: [dim] (a GEMM with beta = 1 then adds it).
cudaError_t broadcastRows(float* y, const float* bias, int numRows, int dim, cudaStream_t stream);

// y: [numRows][dim] f32, y[r] += bias: [dim].
cudaError_t addRows(float* y, const float* bias, int numRows, int dim, cudaStream_t stream);

}  // namespace pd::kernels::cuda
