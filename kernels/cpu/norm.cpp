#include "pd/kernels/norm.h"

#include <immintrin.h>

#include <cmath>

namespace pd::kernels::cpu {

void rmsNorm(const float* x, int xStride, const float* weight, float* out, int outStride, int numRows, int dim,
             float eps) {
  for (int r = 0; r < numRows; ++r) {
    const float* xr = x + size_t(r) * xStride;
    float* o = out + size_t(r) * outStride;
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= dim; i += 8) {
      __m256 v = _mm256_loadu_ps(xr + i);
      __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      acc0 = _mm256_fmadd_pd(lo, lo, acc0);
      acc1 = _mm256_fmadd_pd(hi, hi, acc1);
    }
    alignas(32) double parts[4];
    _mm256_store_pd(parts, _mm256_add_pd(acc0, acc1));
    double ss = parts[0] + parts[1] + parts[2] + parts[3];
    for (; i < dim; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / dim + double(eps)));
    const __m256 vinv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= dim; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), _mm256_loadu_ps(weight + i)));
    for (; i < dim; ++i) o[i] = xr[i] * inv * weight[i];
  }
}

}  // namespace pd::kernels::cpu
