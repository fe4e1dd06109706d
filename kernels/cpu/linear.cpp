#include "pd/kernels/linear.h"

#include <algorithm>

#include "kernels/cpu/linear_stream.h"

namespace pd::kernels::cpu {
namespace {

struct F32 {
  static __m256 vec(const float* p) { return _mm256_loadu_ps(p); }
  static float one(float w) { return w; }
};

// Output columns [g*8 + c0, g*8 + c1) of one whole group of 8 rows in the rows8 layout, for
// input row xi: WideningRows<float>::rows' sums in its order (an accumulator per row over the
// 8-column steps, hsum, then the row's tail in scalar code).
void rows8Group(const float* xi, const float* gw, int k, float* yi, int c0, int c1, float beta) {
  const int k8 = k / 8 * 8;
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  const float* p = gw;
  for (int q = 0; q < k8; q += 8, p += 64) {
    const __m256 xv = _mm256_loadu_ps(xi + q);
    for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p + r * 8), xv, a[r]);
  }
  const float* tail = gw + size_t(k8) * 8;
  for (int r = c0; r < c1; ++r) {
    float v = detail::hsum(a[r]);
    for (int q = k8; q < k; ++q) v += F32::one(tail[r * (k - k8) + (q - k8)]) * xi[q];
    detail::storeOut(yi + r, v, beta);
  }
}

}  // namespace

void linearSkinnyRows8(const float* x, int ldx, const float* w, float* y, int ldy, int m, int n, int k, int nBegin,
                       int nEnd, float beta) {
  if (m <= 0 || nBegin >= nEnd) return;
  const int n8 = n / 8 * 8;
  // Whole groups: the group (8 * k floats, in L1 or L2) is read once from memory and again
  // from cache for each further input row.
  for (int g = nBegin / 8; g * 8 < std::min(nEnd, n8); ++g) {
    const int c0 = std::max(nBegin - g * 8, 0), c1 = std::min(nEnd - g * 8, 8);
    for (int i = 0; i < m; ++i)
      rows8Group(x + size_t(i) * ldx, w + size_t(g) * 8 * k, k, y + size_t(i) * ldy + g * 8, c0, c1, beta);
  }
  // The rows past the last whole group are row-major.
  if (nEnd > n8)
    linearSkinny(x, ldx, w + size_t(n8) * k, y + n8, ldy, m, k, std::max(nBegin, n8) - n8, nEnd - n8, beta);
}

void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                  float beta) {
  detail::streamLinear(detail::WideningRows<float, F32>{x, ldx, w, k}, y, ldy, m, nBegin, nEnd, beta);
}

}  // namespace pd::kernels::cpu
