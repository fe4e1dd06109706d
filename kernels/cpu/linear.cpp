#include "pd/kernels/linear.h"

#include <type_traits>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

inline void store(float* y, float v, float beta) { *y = beta == 0.0f ? v : v + beta * *y; }

// kRowsW (4 or 8) weight rows against kRowsX (1 or 2) input rows: kRowsW * kRowsX
// accumulators, each W load reused kRowsX times. (Four rows against three input rows, 12
// accumulators, spills on 16 ymm registers and measured slower.)
// `next` (may be null) is the following group of kRowsW rows: its lines are prefetched one per
// 64 bytes consumed here. The hardware prefetchers pick each row up only after it starts;
// asking for the next rows early took batch-1 decode of the small model from ~260 to ~320
// tok/s on the same (noisy) Intel machine (docs/performance.md, "Engine: CPU backend").
template <int kRowsW, int kRowsX>
inline void blockRows(const float* const* xr, const float* w, const float* next, int k,
                      float* out[][2], float beta) {
  using namespace detail;
  const float* wr[kRowsW];
  for (int r = 0; r < kRowsW; ++r) wr[r] = w + size_t(r) * k;
  __m256 a[kRowsW][kRowsX];
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) a[r][i] = _mm256_setzero_ps();
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    if (next && (p & 15) == 0) {
      for (int r = 0; r < kRowsW; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + size_t(r) * k + p), _MM_HINT_T0);
    }
    __m256 v[kRowsW];
    for (int r = 0; r < kRowsW; ++r) v[r] = _mm256_loadu_ps(wr[r] + p);
    for (int i = 0; i < kRowsX; ++i) {
      const __m256 xv = _mm256_loadu_ps(xr[i] + p);
      for (int r = 0; r < kRowsW; ++r) a[r][i] = _mm256_fmadd_ps(v[r], xv, a[r][i]);
    }
  }
  for (int r = 0; r < kRowsW; ++r)
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
  // One input row (batch-1 decode): eight weight rows per pass, eight streams in flight; the
  // per-row arithmetic is block4's, so a token gets the same bits alone as in a batch. On the
  // AMD EPYC guest the software prefetch of the next eight rows cost CPU time (CPU-ms per
  // batch-1 step of the small model: 4 rows + prefetch 12.3, 8 rows + prefetch 10.5, 8 rows
  // without 9.5; docs/performance.md); on the Intel guest the prefetch was measured to help
  // the four-row kernel, so it stays on there.
  static const bool prefetchRows = !__builtin_cpu_is("amd");
  if (m == 1) {
    for (; j + 8 <= nEnd; j += 8) {
      const float* wj = w + size_t(j) * k;
      const float* next = prefetchRows && j + 16 <= nEnd ? wj + 8 * size_t(k) : nullptr;
      const float* xr[1] = {x};
      float* out[8][2];
      for (int c = 0; c < 8; ++c) out[c][0] = y + j + c;
      blockRows<8, 1>(xr, wj, next, k, out, beta);
    }
  }
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
      blockRows<4, r>(xr, wj, i == 0 ? next : nullptr, k, out, beta);
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
