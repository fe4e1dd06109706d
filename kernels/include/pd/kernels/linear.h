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

#include <cstddef>
#include <cstring>

namespace pd::kernels::cpu {

// x: [m][ldx] (k used), w: [n][k], y: [m][ldy]; computes output columns [nBegin, nEnd):
// y[i][j] = sum_p x[i][p] * w[j][p] + beta * y[i][j]   (beta 0 ignores y's old contents)
void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                  float beta);

// The "rows8" layout of an f32 weight [n][k], for weights a batch-1 decode streams (the
// mixture-of-experts' experts): each group of 8 rows stores 8 columns of each of its rows in
// turn ([k/8][8 rows][8 columns], 256 bytes a step), then each row's last k % 8 columns; rows
// past the last whole group (n % 8) follow row-major. The same n * k floats. The GEMV then reads
// one sequential stream instead of eight concurrent rows, which the hardware prefetchers follow
// better: on the experts' shapes, one thread of the AMD EPYC guest, 0.76-0.86 of a plain
// sequential read row-major against 0.99-1.00 interleaved (docs/performance.md, "Engine: CPU
// backend, mixture of experts").
inline size_t rows8Index(int n, int k, int j, int p) {
  const int n8 = n / 8 * 8, k8 = k / 8 * 8;
  if (j >= n8) return size_t(n8) * k + size_t(j - n8) * k + p;
  const size_t group = size_t(j / 8) * 8 * k;
  const int r = j % 8;
  if (p < k8) return group + size_t(p / 8) * 64 + r * 8 + p % 8;
  return group + size_t(k8) * 8 + size_t(r) * (k - k8) + (p - k8);
}
// out[rows8Index(n, k, j, p)] = w[j * k + p]; out must not overlap w.
inline void rows8Interleave(const float* w, int n, int k, float* out) {
  for (int j = 0; j < n; ++j)
    for (int p = 0; p < k; p += 8) {
      const int len = k - p < 8 ? k - p : 8;
      std::memcpy(out + rows8Index(n, k, j, p), w + size_t(j) * k + p, sizeof(float) * len);
    }
}

// The inverse: out[j * k + p] = w[rows8Index(n, k, j, p)]; out must not overlap w.
inline void rows8Deinterleave(const float* w, int n, int k, float* out) {
  for (int j = 0; j < n; ++j)
    for (int p = 0; p < k; p += 8) {
      const int len = k - p < 8 ? k - p : 8;
      std::memcpy(out + size_t(j) * k + p, w + rows8Index(n, k, j, p), sizeof(float) * len);
    }
}

// linearSkinny() over a weight in the rows8 layout ([n][k] logically): the same sums in the
// same order for every output column of a whole group of 8 rows, so it gives linearSkinny()'s
// bits wherever that one runs its vector groups (column ranges starting at multiples of 4, n a
// multiple of 4). Splits in multiples of 8 read each group once.
void linearSkinnyRows8(const float* x, int ldx, const float* w, float* y, int ldy, int m, int n, int k, int nBegin,
                       int nEnd, float beta);

}  // namespace pd::kernels::cpu
