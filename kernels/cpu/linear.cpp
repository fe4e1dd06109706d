#include "pd/kernels/linear.h"

#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

// f32 weights: 8 columns per step, one FMA per weight row and input row; the next group
// (kRowsW * 32 bytes per step) prefetched one line per two rows.
struct F32Rows {
  const float* x;
  int ldx;
  const float* w;
  int k;

  const void* row(int j) const { return w + size_t(j) * k; }
  float one(int j, int i) const { return detail::dot(x + size_t(i) * ldx, w + size_t(j) * k, k); }

  template <int kRowsW, int kRowsX>
  void rows(int j, int i, const void* next, float (&s)[kRowsW][kRowsX]) const {
    using namespace detail;
    const float* wr[kRowsW];
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
        for (int line = 0; line < kRowsW / 2; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        ahead += kRowsW * 32;
      }
      __m256 v[kRowsW];
      for (int r = 0; r < kRowsW; ++r) v[r] = _mm256_loadu_ps(wr[r] + p);
      for (int t = 0; t < kRowsX; ++t) {
        const __m256 xv = _mm256_loadu_ps(xr[t] + p);
        for (int r = 0; r < kRowsW; ++r) a[r][t] = _mm256_fmadd_ps(v[r], xv, a[r][t]);
      }
    }
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) {
        float v = hsum(a[r][t]);
        for (int q = p; q < k; ++q) v += wr[r][q] * xr[t][q];
        s[r][t] = v;
      }
  }
};

}  // namespace

void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                  float beta) {
  detail::streamLinear(F32Rows{x, ldx, w, k}, y, ldy, m, nBegin, nEnd, beta);
}

}  // namespace pd::kernels::cpu
