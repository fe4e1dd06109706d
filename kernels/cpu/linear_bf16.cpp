#include "pd/kernels/linear_bf16.h"

#include <immintrin.h>

#include <vector>

#include "kernels/cpu/linear_stream.h"

namespace pd::kernels::cpu {
namespace {

// kAvx2: each weight widened from bf16 to f32 with a shift, then the f32 kernel's FMAs.
struct Bf16 {
  static __m256 vec(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static float one(uint16_t w) { return bf16ToF32(w); }
};

#define PD_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// kAvx512Bf16: the input rows rounded to bf16 once per call (xb, each row padded with zeros
// to kp, a multiple of 32 columns); one 64-byte line per weight row per step, the row's tail
// loaded under a mask, one vdpbf16ps per weight row and input row.
struct Bf16RowsAvx512 {
  const uint16_t* xb;
  int kp;
  const uint16_t* w;
  int k;

  const void* row(int j) const { return w + size_t(j) * k; }
  float one(int j, int i) const {
    const uint16_t* xi = xb + size_t(i) * kp;
    const uint16_t* wj = w + size_t(j) * k;
    float s = 0.0f;
    for (int p = 0; p < k; ++p) s += bf16ToF32(xi[p]) * bf16ToF32(wj[p]);
    return s;
  }

  template <int kRowsW, int kRowsX>
  PD_BF16_TARGET void rows(int j, int i, const void* next, float (&s)[kRowsW][kRowsX]) const {
    const uint16_t* wr[kRowsW];
    const uint16_t* xr[kRowsX];
    for (int r = 0; r < kRowsW; ++r) wr[r] = w + size_t(j + r) * k;
    for (int t = 0; t < kRowsX; ++t) xr[t] = xb + size_t(i + t) * kp;
    __m512 a[kRowsW][kRowsX];
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) a[r][t] = _mm512_setzero_ps();
    const char* ahead = static_cast<const char*>(next);
    for (int p = 0; p < k; p += 32) {
      if (ahead) {  // the next group (kRowsW * k * 2 bytes, contiguous): kRowsW lines per step
        for (int line = 0; line < kRowsW; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        ahead += kRowsW * 64;
      }
      const __mmask32 mask = k - p >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - p)) - 1;
      __m512bh v[kRowsW];
      for (int r = 0; r < kRowsW; ++r) v[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[r] + p);
      for (int t = 0; t < kRowsX; ++t) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[t] + p);
        for (int r = 0; r < kRowsW; ++r) a[r][t] = _mm512_dpbf16_ps(a[r][t], v[r], xv);
      }
    }
    for (int r = 0; r < kRowsW; ++r)
      for (int t = 0; t < kRowsX; ++t) s[r][t] = _mm512_reduce_add_ps(a[r][t]);
  }
};

PD_BF16_TARGET void roundRowsBf16(const float* x, int ldx, int m, int k, int kp, uint16_t* dst) {
  for (int i = 0; i < m; ++i) {
    const float* src = x + size_t(i) * ldx;
    uint16_t* d = dst + size_t(i) * kp;
    int p = 0;
    for (; p + 32 <= k; p += 32) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + p + 16), _mm512_loadu_ps(src + p));
      _mm512_storeu_si512(d + p, (__m512i)b);
    }
    for (; p < k; ++p) d[p] = f32ToBf16(src[p]);
    for (; p < kp; ++p) d[p] = 0;
  }
}

}  // namespace

const char* bf16KernelName(Bf16Kernel kernel) { return kernel == Bf16Kernel::kAvx512Bf16 ? "avx512bf16" : "avx2"; }

bool bf16KernelSupported(Bf16Kernel kernel) {
  __builtin_cpu_init();
  if (kernel == Bf16Kernel::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

Bf16Kernel bf16BestKernel() {
  static const Bf16Kernel best =
      bf16KernelSupported(Bf16Kernel::kAvx512Bf16) ? Bf16Kernel::kAvx512Bf16 : Bf16Kernel::kAvx2;
  return best;
}

void f32ToBf16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32ToBf16(src[i]);
}

void linearSkinnyBf16(Bf16Kernel kernel, const float* x, int ldx, const uint16_t* w, float* y, int ldy, int m, int k,
                      int nBegin, int nEnd, float beta) {
  if (m <= 0 || nBegin >= nEnd) return;
  if (kernel == Bf16Kernel::kAvx512Bf16) {
    thread_local std::vector<uint16_t> xb;
    const int kp = (k + 31) / 32 * 32;
    if (xb.size() < size_t(m) * kp) xb.resize(size_t(m) * kp);
    roundRowsBf16(x, ldx, m, k, kp, xb.data());
    detail::streamLinear(Bf16RowsAvx512{xb.data(), kp, w, k}, y, ldy, m, nBegin, nEnd, beta);
  } else {
    detail::streamLinear(detail::WideningRows<uint16_t, Bf16>{x, ldx, w, k}, y, ldy, m, nBegin, nEnd, beta);
  }
}

}  // namespace pd::kernels::cpu
