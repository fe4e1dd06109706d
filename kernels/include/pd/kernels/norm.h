// RMSNorm (Llama/Qwen2 convention): out = x / sqrt(mean(x^2) + eps) * weight.
//
// CPU implementations live in namespace pd::kernels::cpu; a CUDA twin keeps the same
// signature in pd::kernels::cuda. Pure functions over raw pointers: no allocation, no
// threads, safe to call concurrently on disjoint outputs (callers split rows across threads).
#pragma once

namespace pd::kernels::cpu {

// x: [numRows][dim] (row stride xStride floats), weight: [dim],
// out: [numRows][dim] (row stride outStride floats). out may alias x.
// The sum of squares is accumulated in double so the result does not depend on how a
// caller batches rows.
void rmsNorm(const float* x, int xStride, const float* weight, float* out, int outStride, int numRows, int dim,
             float eps);

}  // namespace pd::kernels::cpu
