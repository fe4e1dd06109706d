#include "pd/kernels/linear_q8.h"

#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

inline void store(float* y, float v, float beta) { *y = beta == 0.0f ? v : v + beta * *y; }

// 8 int8 weights from column p of a row, dequantized with their block's scale.
inline __m256 deq8(const int8_t* q, const float* scales, int p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + p)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(scales[p / kQ8Block]));
}

// kRowsW weight rows against kRowsX input rows (the f32 streaming kernel's structure), the next
// group's int8 rows prefetched front to back.
template <int kRowsW, int kRowsX>
inline void blockRows(const float* const* xr, const int8_t* q, const float* scales, int k, const int8_t* next,
                      float* out[][2], float beta) {
  using namespace detail;
  const int nb = q8BlocksPerRow(k);
  const int8_t* qr[kRowsW];
  const float* sr[kRowsW];
  for (int r = 0; r < kRowsW; ++r) {
    qr[r] = q + size_t(r) * k;
    sr[r] = scales + size_t(r) * nb;
  }
  __m256 a[kRowsW][kRowsX];
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) a[r][i] = _mm256_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(next);
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    if (ahead && (p & 63) == 0) {  // kRowsW * 64 bytes of the next group per 64 columns
      for (int line = 0; line < kRowsW; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
      ahead += kRowsW * 64;
    }
    __m256 v[kRowsW];
    for (int r = 0; r < kRowsW; ++r) v[r] = deq8(qr[r], sr[r], p);
    for (int i = 0; i < kRowsX; ++i) {
      const __m256 xv = _mm256_loadu_ps(xr[i] + p);
      for (int r = 0; r < kRowsW; ++r) a[r][i] = _mm256_fmadd_ps(v[r], xv, a[r][i]);
    }
  }
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) {
      float s = hsum(a[r][i]);
      for (int t = p; t < k; ++t) s += float(qr[r][t]) * sr[r][t / kQ8Block] * xr[i][t];
      store(out[r][i], s, beta);
    }
}

}  // namespace

void q8Quantize(const float* w, int n, int k, int8_t* q, float* scales) {
  const int nb = q8BlocksPerRow(k);
  for (int j = 0; j < n; ++j)
    for (int b = 0; b < nb; ++b) {
      const int p0 = b * kQ8Block, p1 = p0 + kQ8Block < k ? p0 + kQ8Block : k;
      const float* src = w + size_t(j) * k;
      float amax = 0.0f;
      for (int p = p0; p < p1; ++p) amax = std::fmax(amax, std::fabs(src[p]));
      const float scale = amax / 127.0f;
      scales[size_t(j) * nb + b] = scale;
      for (int p = p0; p < p1; ++p) {
        const float r = scale > 0.0f ? std::nearbyint(src[p] / scale) : 0.0f;
        q[size_t(j) * k + p] = int8_t(std::fmax(-127.0f, std::fmin(127.0f, r)));
      }
    }
}

void q8Dequantize(const int8_t* q, const float* scales, int n, int k, float* out) {
  const int nb = q8BlocksPerRow(k);
  for (int j = 0; j < n; ++j)
    for (int p = 0; p < k; ++p)
      out[size_t(j) * k + p] = float(q[size_t(j) * k + p]) * scales[size_t(j) * nb + p / kQ8Block];
}

void linearSkinnyQ8(const float* x, int ldx, const int8_t* q, const float* scales, float* y, int ldy, int m, int k,
                    int nBegin, int nEnd, float beta) {
  if (m <= 0 || nBegin >= nEnd) return;
  const int nb = q8BlocksPerRow(k);
  int j = nBegin;
  if (m == 1) {
    for (; j + 8 <= nEnd; j += 8) {
      const float* xr[1] = {x};
      float* out[8][2];
      for (int c = 0; c < 8; ++c) out[c][0] = y + j + c;
      blockRows<8, 1>(xr, q + size_t(j) * k, scales + size_t(j) * nb, k,
                      j + 16 <= nEnd ? q + size_t(j + 8) * k : nullptr, out, beta);
    }
  }
  for (; j + 4 <= nEnd; j += 4) {
    int i = 0;
    auto rows = [&](auto kRows) {
      constexpr int r = decltype(kRows)::value;
      const float* xr[r];
      float* out[4][2];
      for (int t = 0; t < r; ++t) {
        xr[t] = x + size_t(i + t) * ldx;
        for (int c = 0; c < 4; ++c) out[c][t] = y + size_t(i + t) * ldy + j + c;
      }
      blockRows<4, r>(xr, q + size_t(j) * k, scales + size_t(j) * nb, k,
                      i == 0 && j + 8 <= nEnd ? q + size_t(j + 4) * k : nullptr, out, beta);
      i += r;
    };
    while (i + 2 <= m) rows(std::integral_constant<int, 2>{});
    if (i < m) rows(std::integral_constant<int, 1>{});
  }
  for (; j < nEnd; ++j)
    for (int i = 0; i < m; ++i) {
      const float* xi = x + size_t(i) * ldx;
      float s = 0.0f;
      for (int p = 0; p < k; ++p) s += xi[p] * (float(q[size_t(j) * k + p]) * scales[size_t(j) * nb + p / kQ8Block]);
      store(y + size_t(i) * ldy + j, s, beta);
    }
}

}  // namespace pd::kernels::cpu
