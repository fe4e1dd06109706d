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

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline size_t dtypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }
inline const char* dtypeName(DType d) { return d == DType::kF32 ? "f32" : d == DType::kF16 ? "f16" : "bf16"; }

}  // namespace pd::kernels::cuda
