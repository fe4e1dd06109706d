#include "pd/kernels/linear.h"

#include <type_traits>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

inline void store(float* y, float v, float beta) { *y = beta == 0.0f ? v : v + beta * *y; }

// Four weight rows against up to two input rows: 8 accumulators, each W load reused kRowsX
// times. (Three input rows, 12 accumulators, spills on 16 ymm registers and measured slower.)
// `next` (may be null) is the following group of four rows: its lines are prefetched one per
// 64 bytes consumed here. The hardware prefetchers pick each row up only after it starts;
// asking for the next rows early took batch-1 decode of the small model from ~260 to ~320
// tok/s on the same (noisy) machine (docs/performance.md, "Engine: CPU backend").
template <int kRowsX>
inline void block4(const float* const* xr, const float* w, const float* next, int k,
                   float* out[4][2], float beta) {
  using namespace detail;
  const float* w0 = w;
  const float* w1 = w + k;
  const float* w2 = w + 2 * size_t(k);
  const float* w3 = w + 3 * size_t(k);
  __m256 a[4][kRowsX];
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < kRowsX; ++i) a[r][i] = _mm256_setzero_ps();
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    if (next && (p & 15) == 0) {
      for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + size_t(r) * k + p), _MM_HINT_T0);
    }
    const __m256 v0 = _mm256_loadu_ps(w0 + p), v1 = _mm256_loadu_ps(w1 + p);
    const __m256 v2 = _mm256_loadu_ps(w2 + p), v3 = _mm256_loadu_ps(w3 + p);
    for (int i = 0; i < kRowsX; ++i) {
      const __m256 xv = _mm256_loadu_ps(xr[i] + p);
      a[0][i] = _mm256_fmadd_ps(v0, xv, a[0][i]);
      a[1][i] = _mm256_fmadd_ps(v1, xv, a[1][i]);
      a[2][i] = _mm256_fmadd_ps(v2, xv, a[2][i]);
      a[3][i] = _mm256_fmadd_ps(v3, xv, a[3][i]);
    }
  }
  const float* wr[4] = {w0, w1, w2, w3};
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < kRowsX; ++i) {
      float s = hsum(a[r][i]);
      for (int q = p; q < k; ++q) s += wr[r][q] * xr[i][q];
      store(out[r][i], s, beta);
    }
}

}  // namespace

void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k,
                  int nBegin, int nEnd, float beta) {
  int j = nBegin;
  for (; j + 4 <= nEnd; j += 4) {
    const float* wj = w + size_t(j) * k;
    const float* next = j + 8 <= nEnd ? wj + 4 * size_t(k) : nullptr;
    int i = 0;
    auto rows = [&](auto kRows) {
      constexpr int r = decltype(kRows)::value;
      const float* xr[r];
      float* out[4][2];
      for (int q = 0; q < r; ++q) {
        xr[q] = x + size_t(i + q) * ldx;
        for (int c = 0; c < 4; ++c) out[c][q] = y + size_t(i + q) * ldy + j + c;
      }
      block4<r>(xr, wj, i == 0 ? next : nullptr, k, out, beta);
      i += r;
    };
    while (i + 2 <= m) rows(std::integral_constant<int, 2>{});
    if (i < m) rows(std::integral_constant<int, 1>{});
  }
  for (; j < nEnd; ++j)
    for (int i = 0; i < m; ++i)
      store(y + size_t(i) * ldy + j, detail::dot(x + size_t(i) * ldx, w + size_t(j) * k, k), beta);
}

}  // namespace pd::kernels::cpu
