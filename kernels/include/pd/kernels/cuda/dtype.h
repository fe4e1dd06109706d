// Element types of the CUDA kernels' tensors (pd::kernels::cuda).
//
// The CUDA backend keeps the residual stream, GEMM outputs, RoPE and softmax in f32 and stores
// weights, GEMM inputs and (optionally) the KV cache in a 16-bit type; every kernel that
// touches a 16-bit tensor takes its DType and converts on load/store, accumulating in f32.
// The numeric values match engine::KvDtype (kv_layout.h) so the two convert by value.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pd::kernels::cuda {

// kFp8 (OCP e4m3fn) is a KV cache format only (kvCacheWrite, pagedAttention): 1-byte codes with
// an f32 scale per token and kv head stored after the block's codes (engine/kv_layout.h).
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kFp8 = 4 };

inline size_t dtypeBytes(DType d) { return d == DType::kF32 ? 4 : d == DType::kFp8 ? 1 : 2; }
inline const char* dtypeName(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kF16 ? "f16" : d == DType::kBF16 ? "bf16" : "fp8";
}

}  // namespace pd::kernels::cuda
