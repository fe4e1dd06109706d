#include "pd/kernels/linear_q8.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

// The input rows quantized like the weights: xq [m][kp] int8 and xs [m][kp / 32] f32, kp a
// multiple of 64 columns, the padding zero (scale 0) so whole 64-byte steps may read it.
struct QuantizedRows {
  const int8_t* xq;
  const float* xs;
  int kp;
  const int8_t* row(int i) const { return xq + size_t(i) * kp; }
  const float* scales(int i) const { return xs + size_t(i) * (kp / kQ8Block); }
};

// One block of 32 (or fewer, at the row's end) values: scale = max |x| / 127, q = round(x / scale).
void quantizeBlock(const float* x, int len, int8_t* q, float* scale) {
  if (len == kQ8Block) {
    __m256 v[4];
    const __m256 absMask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(x + 8 * c);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[c], absMask));
    }
    const float amax = detail::hmax(mx);
    const float s = amax / 127.0f;
    *scale = s;
    if (s == 0.0f) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
      return;
    }
    const __m256 sv = _mm256_set1_ps(s);
    __m256i i32[4];
    for (int c = 0; c < 4; ++c)  // x / s (IEEE division, as the scalar path), rounded to nearest even
      i32[c] =
          _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[c], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // |x / s| <= 127 by construction, so the saturating packs are exact; they interleave the
    // 128-bit lanes, which the final permute undoes.
    const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return;
  }
  float amax = 0.0f;
  for (int p = 0; p < len; ++p) amax = std::fmax(amax, std::fabs(x[p]));
  const float s = amax / 127.0f;
  *scale = s;
  for (int p = 0; p < kQ8Block; ++p)
    q[p] = p < len && s > 0.0f ? int8_t(std::fmax(-127.0f, std::fmin(127.0f, std::nearbyint(x[p] / s)))) : 0;
}

QuantizedRows quantizeRows(const float* x, int ldx, int m, int k) {
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  const int kp = (k + 63) / 64 * 64, nbp = kp / kQ8Block;
  if (xq.size() < size_t(m) * kp) xq.resize(size_t(m) * kp);
  if (xs.size() < size_t(m) * nbp) xs.resize(size_t(m) * nbp);
  for (int i = 0; i < m; ++i)
    for (int b = 0; b < nbp; ++b) {
      const int p0 = b * kQ8Block;
      quantizeBlock(x + size_t(i) * ldx + p0, std::max(0, std::min(kQ8Block, k - p0)), xq.data() + size_t(i) * kp + p0,
                    xs.data() + size_t(i) * nbp + b);
    }
  return {xq.data(), xs.data(), kp};
}

// What every kernel shares: the weights and the quantized input rows, and the reference dot
// product of one weight row and one input row (tail columns, and the generic kernel).
struct Q8Base {
  QuantizedRows x;
  const int8_t* q;
  const float* scales;
  int k, nb;

  const void* row(int j) const { return q + size_t(j) * k; }
  float one(int j, int i) const {
    const int8_t* wj = q + size_t(j) * k;
    const float* sj = scales + size_t(j) * nb;
    const int8_t* xi = x.row(i);
    const float* si = x.scales(i);
    float s = 0.0f;
    for (int b = 0; b < nb; ++b) {
      int32_t d = 0;
      for (int p = b * kQ8Block; p < std::min(k, (b + 1) * kQ8Block); ++p) d += int32_t(wj[p]) * xi[p];
      s += float(d) * (sj[b] * si[b]);
    }
    return s;
  }
};

// The rows a kernel's group meets: weight rows j.. and their scales, input rows i.. and theirs.
template <int kRowsW, int kRowsX>
struct Rows {
  const int8_t* w[kRowsW];
  const float* ws[kRowsW];
  const int8_t* x[kRowsX];
  const float* xs[kRowsX];
  Rows(const Q8Base& b, int j, int i) {
    for (int r = 0; r < kRowsW; ++r) {
      w[r] = b.q + size_t(j + r) * b.k;
      ws[r] = b.scales + size_t(j + r) * b.nb;
    }
    for (int t = 0; t < kRowsX; ++t) {
      x[t] = b.x.row(i + t);
      xs[t] = b.x.scales(i + t);
    }
  }
};

struct Q8RowsGeneric : Q8Base {
  template <int kRowsW, int kRowsX>
  void rows(int j, int i, const void*, float (&s)[kRowsW][kRowsX]) const {
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) s[r][t] = one(j + r, i + t);
  }
};

// kAvx2: one block of 32 columns per step and weight row: |x| (unsigned, once per step for
// all rows) times w with x's sign (vpsignb) in 16-bit pairs (vpmaddubsw: at most 2 * 127 * 127,
// no saturation), summed to 32 bits (vpmaddwd), converted and scaled by ws * xs. The row's partial last block in
// scalar code; the next group (kRowsW * 32 bytes per step) prefetched one line per two rows.
struct Q8RowsAvx2 : Q8Base {
  template <int kRowsW, int kRowsX>
  void rows(int j, int i, const void* next, float (&s)[kRowsW][kRowsX]) const {
    const Rows<kRowsW, kRowsX> g(*this, j, i);
    const int8_t* const* wr = g.w;
    const float* const* sr = g.ws;
    const int8_t* const* xr = g.x;
    const float* const* xsr = g.xs;
    __m256 a[kRowsW][kRowsX];
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) a[r][t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const char* ahead = static_cast<const char*>(next);
    int p = 0, b = 0;
    for (; p + kQ8Block <= k; p += kQ8Block, ++b) {
      if (ahead) {
        for (int line = 0; line < kRowsW / 2; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        ahead += kRowsW * 32;
      }
      __m256i xv[kRowsX], xu[kRowsX];
      __m256 xsv[kRowsX];
      for (int t = 0; t < kRowsX; ++t) {
        xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[t] + p));
        xu[t] = _mm256_abs_epi8(xv[t]);
        xsv[t] = _mm256_broadcast_ss(xsr[t] + b);
      }
      for (int r = 0; r < kRowsW; ++r) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + p));
        const __m256 wsv = _mm256_broadcast_ss(sr[r] + b);
        for (int t = 0; t < kRowsX; ++t) {
          const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(xu[t], _mm256_sign_epi8(w, xv[t])), ones);
          a[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(wsv, xsv[t]), a[r][t]);
        }
      }
    }
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) {
        float v = detail::hsum(a[r][t]);
        if (p < k) {
          int32_t d = 0;
          for (int c = p; c < k; ++c) d += int32_t(wr[r][c]) * xr[t][c];
          v += float(d) * (sr[r][b] * xsr[t][b]);
        }
        s[r][t] = v;
      }
  }
};

#define PD_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// kAvx512Vnni: two blocks (64 columns) per step and weight row: vpdpbusd of |x| and w with x's
// sign (w negated under the mask of x's sign bits; |x| and the mask once per step for all
// rows: two vector operations per row and step) gives 16 int32 partial sums, lanes 0-7 of
// the first block and 8-15 of the second; they are converted and scaled by each block's
// ws * xs (two scales spread over eight lanes each). The row's tail is loaded under a mask
// (x is zero-padded); the next group (kRowsW * 64 bytes per step) prefetched one line per row.
struct Q8RowsVnni : Q8Base {
  template <int kRowsW, int kRowsX>
  PD_VNNI_TARGET void rows(int j, int i, const void* next, float (&s)[kRowsW][kRowsX]) const {
    const Rows<kRowsW, kRowsX> g(*this, j, i);
    const int8_t* const* wr = g.w;
    const float* const* sr = g.ws;
    const int8_t* const* xr = g.x;
    const float* const* xsr = g.xs;
    __m512 a[kRowsW][kRowsX];
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) a[r][t] = _mm512_setzero_ps();
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i zero = _mm512_setzero_si512();
    const char* ahead = static_cast<const char*>(next);
    for (int p = 0, b = 0; p < k; p += 2 * kQ8Block, b += 2) {
      if (ahead) {
        for (int line = 0; line < kRowsW; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        ahead += kRowsW * 64;
      }
      const __mmask64 mask = k - p >= 64 ? ~__mmask64(0) : (__mmask64(1) << (k - p)) - 1;
      const __mmask8 scaleMask = nb - b >= 2 ? 3 : 1;
      __m512i xu[kRowsX];
      __mmask64 xneg[kRowsX];
      __m512 xsv[kRowsX];
      for (int t = 0; t < kRowsX; ++t) {
        const __m512i xv = _mm512_loadu_si512(xr[t] + p);
        xneg[t] = _mm512_movepi8_mask(xv);
        xu[t] = _mm512_abs_epi8(xv);
        xsv[t] = _mm512_permutexvar_ps(spread, _mm512_zextps128_ps512(_mm_maskz_loadu_ps(3, xsr[t] + b)));
      }
      for (int r = 0; r < kRowsW; ++r) {
        const __m512i w = _mm512_maskz_loadu_epi8(mask, wr[r] + p);
        const __m512 wsv =
            _mm512_permutexvar_ps(spread, _mm512_zextps128_ps512(_mm_maskz_loadu_ps(scaleMask, sr[r] + b)));
        for (int t = 0; t < kRowsX; ++t) {
          const __m512i sw = _mm512_mask_sub_epi8(w, xneg[t], zero, w);
          const __m512i d = _mm512_dpbusd_epi32(zero, xu[t], sw);
          a[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(wsv, xsv[t]), a[r][t]);
        }
      }
    }
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) s[r][t] = _mm512_reduce_add_ps(a[r][t]);
  }
};

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

const char* q8KernelName(Q8Kernel kernel) {
  switch (kernel) {
    case Q8Kernel::kAvx512Vnni:
      return "avx512vnni";
    case Q8Kernel::kAvx2:
      return "avx2";
    case Q8Kernel::kGeneric:
      break;
  }
  return "generic";
}

bool q8KernelSupported(Q8Kernel kernel) {
  __builtin_cpu_init();
  switch (kernel) {
    case Q8Kernel::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case Q8Kernel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Q8Kernel::kGeneric:
      break;
  }
  return true;
}

Q8Kernel q8BestKernel() {
  static const Q8Kernel best = q8KernelSupported(Q8Kernel::kAvx512Vnni) ? Q8Kernel::kAvx512Vnni
                               : q8KernelSupported(Q8Kernel::kAvx2)     ? Q8Kernel::kAvx2
                                                                        : Q8Kernel::kGeneric;
  return best;
}

void linearSkinnyQ8(Q8Kernel kernel, const float* x, int ldx, const int8_t* q, const float* scales, float* y, int ldy,
                    int m, int k, int nBegin, int nEnd, float beta) {
  if (m <= 0 || nBegin >= nEnd) return;
  const Q8Base base{quantizeRows(x, ldx, m, k), q, scales, k, q8BlocksPerRow(k)};
  switch (kernel) {
    case Q8Kernel::kAvx512Vnni:
      detail::streamLinear(Q8RowsVnni{base}, y, ldy, m, nBegin, nEnd, beta);
      return;
    case Q8Kernel::kAvx2:
      detail::streamLinear(Q8RowsAvx2{base}, y, ldy, m, nBegin, nEnd, beta);
      return;
    case Q8Kernel::kGeneric:
      detail::streamLinear(Q8RowsGeneric{base}, y, ldy, m, nBegin, nEnd, beta);
      return;
  }
}

}  // namespace pd::kernels::cpu
