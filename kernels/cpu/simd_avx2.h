// Internal AVX2/FMA helpers for the CPU kernels (compiled with -march=x86-64-v3).
#pragma once

#include <immintrin.h>

namespace pd::kernels::cpu::detail {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_max_ps(lo, hi);
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for 8 floats; relative error about 2e-7 over [-87, 88]. Inputs below -87.3 return
// a tiny positive number rather than 0 (callers that need exact zeros mask explicitly).
inline __m256 exp8(__m256 x) {
  const __m256 kHi = _mm256_set1_ps(88.3762626647949f);
  const __m256 kLo = _mm256_set1_ps(-87.3365447504019f);
  x = _mm256_min_ps(_mm256_max_ps(x, kLo), kHi);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_cvtps_epi32(fx);
  e = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float dot(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Eight dot products of q against rows r[0..7] (n floats each), returned as one vector:
// the horizontal sums are folded together with hadd, one reduction for eight dots.
inline __m256 dot8(const float* q, const float* const* r, int n) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[j] + i), a[j]);
  }
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  if (i < n) {  // scalar tail (n not a multiple of 8)
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) {
      float t = 0;
      for (int p = i; p < n; ++p) t += q[p] * r[j][p];
      tail[j] = t;
    }
    sum = _mm256_add_ps(sum, _mm256_load_ps(tail));
  }
  return sum;
}

// y[i] = y[i] * c + p * x[i]
inline void scaleAddScaled(float* y, float c, float p, const float* x, int n) {
  const __m256 vc = _mm256_set1_ps(c), vp = _mm256_set1_ps(p);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), _mm256_mul_ps(vc, _mm256_loadu_ps(y + i))));
  for (; i < n; ++i) y[i] = y[i] * c + p * x[i];
}

// y[i] += p * x[i]
inline void axpy(float* y, float p, const float* x, int n) {
  const __m256 vp = _mm256_set1_ps(p);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += p * x[i];
}

}  // namespace pd::kernels::cpu::detail
