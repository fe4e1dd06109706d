// Linear layers for few rows ("skinny" GEMM): y = x * W^T (+ beta * y), W row-major
// [n][k] as stored in Hugging Face checkpoints.
//
// Decode steps multiply a handful of token rows by every weight matrix; there the work is
// streaming W from memory once, and general GEMM libraries lose time packing W (OpenBLAS
// 0.3.21 measured 5-15x slower than streaming at m <= 32 here). This kernel walks W once,
// four rows at a time, applying each row block to all m input rows while it is in L1.
// Large-m products (prefill) use the GEMM (pd/kernels/gemm.h) instead.
// Pure function; callers split [0, n) output columns across threads.
#pragma once

namespace pd::kernels::cpu {

// x: [m][ldx] (k used), w: [n][k], y: [m][ldy]; computes output columns [nBegin, nEnd):
// y[i][j] = sum_p x[i][p] * w[j][p] + beta * y[i][j]   (beta 0 ignores y's old contents)
void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                  float beta);

}  // namespace pd::kernels::cpu
