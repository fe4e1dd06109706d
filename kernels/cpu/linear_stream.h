// The streaming skeleton shared by the decode-side linear kernels (f32, bf16, q8_0): how the
// output columns [nBegin, nEnd) are walked in groups of weight rows, which input rows each
// group meets, which group is prefetched while another computes, and the tail columns. Each
// weight format supplies only its dot kernel (kernels/cpu/linear*.cpp).
//
// A Kernel provides:
//   template <int kRowsW, int kRowsX>
//   void rows(int j, int i, const void* next, float (&s)[kRowsW][kRowsX]) const;
//       s[r][t] = dot(weight row j + r, input row i + t) for kRowsW in {4, 8}, kRowsX in {1, 2};
//       `next` (may be null) is the first byte of the following group of kRowsW weight rows,
//       contiguous after these: the kernel prefetches it front to back while it computes, so
//       the whole group is requested by the time it starts. (The hardware prefetchers follow
//       each weight row as a stream of its own and start late on each; asking for the next
//       group early, in address order, took batch-1 decode of the small model from 279 to 322
//       tok/s on the AMD EPYC guest; docs/engine-cpu.md, "The forward step".)
//   const void* row(int j) const;     the first byte of weight row j
//   float one(int j, int i) const;    dot(weight row j, input row i) for the tail columns
// Columns are written y[i][j] = s + beta * y[i][j] (beta 0 ignores y's old contents).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <type_traits>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu::detail {

inline void storeOut(float* y, float v, float beta) { *y = beta == 0.0f ? v : v + beta * *y; }

template <typename Kernel>
void streamLinear(const Kernel& kern, float* y, int ldy, int m, int nBegin, int nEnd, float beta) {
  if (m <= 0 || nBegin >= nEnd) return;
  int j = nBegin;
  // One input row (batch-1 decode): eight weight rows per pass (four chains of a dot product
  // do not cover its latency). The per-row arithmetic is the four-row group's, so a token gets
  // the same bits alone as in a batch.
  if (m == 1) {
    for (; j + 8 <= nEnd; j += 8) {
      float s[8][1];
      kern.template rows<8, 1>(j, 0, j + 16 <= nEnd ? kern.row(j + 8) : nullptr, s);
      for (int c = 0; c < 8; ++c) storeOut(y + j + c, s[c][0], beta);
    }
  }
  // Four weight rows against two input rows (eight accumulators, each weight load reused
  // twice). Four against three (12 accumulators) spills on 16 ymm registers and measured slower.
  for (; j + 4 <= nEnd; j += 4) {
    const void* next = j + 8 <= nEnd ? kern.row(j + 4) : nullptr;
    int i = 0;
    auto group = [&](auto kRows) {
      constexpr int r = decltype(kRows)::value;
      float s[4][r];
      kern.template rows<4, r>(j, i, i == 0 ? next : nullptr, s);
      for (int t = 0; t < r; ++t)
        for (int c = 0; c < 4; ++c) storeOut(y + size_t(i + t) * ldy + j + c, s[c][t], beta);
      i += r;
    };
    while (i + 2 <= m) group(std::integral_constant<int, 2>{});
    if (i < m) group(std::integral_constant<int, 1>{});
  }
  for (; j < nEnd; ++j)
    for (int i = 0; i < m; ++i) storeOut(y + size_t(i) * ldy + j, kern.one(j, i), beta);
}

// The AVX2 dot kernel for weights that widen to f32 (f32 itself, bf16 on CPUs without
// avx512_bf16): 8 columns per step, each weight widened once (Widen::vec: 8 weights -> __m256;
// Widen::one: a weight -> float) and used against kRowsX input rows, one FMA each; the row's
// last k % 8 columns in scalar code. The next group (kRowsW * 8 * sizeof(T) bytes per step)
// is prefetched a line at a time.
template <typename T, typename Widen>
struct WideningRows {
  const float* x;
  int ldx;
  const T* w;
  int k;

  const void* row(int j) const { return w + size_t(j) * k; }
  float one(int j, int i) const {
    const float* xi = x + size_t(i) * ldx;
    const T* wj = w + size_t(j) * k;
    float s = 0.0f;
    for (int p = 0; p < k; ++p) s += xi[p] * Widen::one(wj[p]);
    return s;
  }

  template <int kRowsW, int kRowsX>
  void rows(int j, int i, const void* next, float (&s)[kRowsW][kRowsX]) const {
    constexpr int kLinesPerStep = kRowsW * 8 * int(sizeof(T)) / 64;
    const T* wr[kRowsW];
    const float* xr[kRowsX];
    for (int r = 0; r < kRowsW; ++r) wr[r] = w + size_t(j + r) * k;
    for (int t = 0; t < kRowsX; ++t) xr[t] = x + size_t(i + t) * ldx;
    __m256 a[kRowsW][kRowsX];
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) a[r][t] = _mm256_setzero_ps();
    const char* ahead = static_cast<const char*>(next);
    int p = 0;
    for (; p + 8 <= k; p += 8) {
      if (ahead) {
        for (int line = 0; line < kLinesPerStep; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        ahead += kLinesPerStep * 64;
      }
      __m256 v[kRowsW];
      for (int r = 0; r < kRowsW; ++r) v[r] = Widen::vec(wr[r] + p);
      for (int t = 0; t < kRowsX; ++t) {
        const __m256 xv = _mm256_loadu_ps(xr[t] + p);
        for (int r = 0; r < kRowsW; ++r) a[r][t] = _mm256_fmadd_ps(v[r], xv, a[r][t]);
      }
    }
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) {
        float v = hsum(a[r][t]);
        for (int q = p; q < k; ++q) v += Widen::one(wr[r][q]) * xr[t][q];
        s[r][t] = v;
      }
  }
};

}  // namespace pd::kernels::cpu::detail
