#include "pd/kernels/linear.h"

#include <type_traits>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

inline void store(float* y, float v, float beta) { *y = beta == 0.0f ? v : v + beta * *y; }

// kRowsW (4 or 8) weight rows against kRowsX (1 or 2) input rows: kRowsW * kRowsX
// accumulators, each W load reused kRowsX times. (Four rows against three input rows, 12
// accumulators, spills on 16 ymm registers and measured slower.)
// `next` (may be null) is the following group of kRowsW rows, contiguous after these: it is
// prefetched front to back, kRowsW * 32 bytes for every 8 columns consumed here, so the whole
// group is requested by the time it starts. The hardware prefetchers follow each of the
// kRowsW rows as a stream of its own, each only after it starts (2 KiB rows for k = 512):
// asking for the next group early, in address order, took batch-1 decode of the small model
// from 279 to 322 tok/s on the AMD EPYC guest, where requests in row order (one line per row
// per 16 columns) had cost CPU time (docs/performance.md, "Engine: CPU backend").
template <int kRowsW, int kRowsX>
inline void blockRows(const float* const* xr, const float* w, const float* next, int k, float* out[][2], float beta) {
  using namespace detail;
  const float* wr[kRowsW];
  for (int r = 0; r < kRowsW; ++r) wr[r] = w + size_t(r) * k;
  __m256 a[kRowsW][kRowsX];
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) a[r][i] = _mm256_setzero_ps();
  int p = 0;
  const char* ahead = reinterpret_cast<const char*>(next);
  for (; p + 8 <= k; p += 8) {
    if (ahead) {
      for (int line = 0; line < kRowsW / 2; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
      ahead += kRowsW * 32;
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

void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                  float beta) {
  int j = nBegin;
  // One input row (batch-1 decode): eight weight rows per pass; the per-row arithmetic is
  // block4's, so a token gets the same bits alone as in a batch.
  if (m == 1) {
    for (; j + 8 <= nEnd; j += 8) {
      const float* wj = w + size_t(j) * k;
      const float* next = j + 16 <= nEnd ? wj + 8 * size_t(k) : nullptr;
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
