#include "pd/kernels/linear_bf16.h"

#include <immintrin.h>

#include <vector>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

inline void store(float* y, float v, float beta) { *y = beta == 0.0f ? v : v + beta * *y; }

inline __m256 widen8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// The f32 streaming kernel's loop (kernels/cpu/linear.cpp) with each weight widened from bf16:
// kRowsW weight rows against kRowsX input rows, the next group prefetched front to back.
template <int kRowsW, int kRowsX>
inline void blockRowsAvx2(const float* const* xr, const uint16_t* w, const uint16_t* next, int k, float* out[][2],
                          float beta) {
  using namespace detail;
  const uint16_t* wr[kRowsW];
  for (int r = 0; r < kRowsW; ++r) wr[r] = w + size_t(r) * k;
  __m256 a[kRowsW][kRowsX];
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) a[r][i] = _mm256_setzero_ps();
  int p = 0;
  const char* ahead = reinterpret_cast<const char*>(next);
  for (; p + 8 <= k; p += 8) {
    if (ahead) {  // kRowsW * 16 bytes of the next group per 8 columns (kRowsW is 4 or 8)
      for (int line = 0; line < kRowsW / 4; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
      ahead += kRowsW * 16;
    }
    __m256 v[kRowsW];
    for (int r = 0; r < kRowsW; ++r) v[r] = widen8(wr[r] + p);
    for (int i = 0; i < kRowsX; ++i) {
      const __m256 xv = _mm256_loadu_ps(xr[i] + p);
      for (int r = 0; r < kRowsW; ++r) a[r][i] = _mm256_fmadd_ps(v[r], xv, a[r][i]);
    }
  }
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) {
      float s = hsum(a[r][i]);
      for (int q = p; q < k; ++q) s += bf16ToF32(wr[r][q]) * xr[i][q];
      store(out[r][i], s, beta);
    }
}

void skinnyAvx2(const float* x, int ldx, const uint16_t* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                float beta) {
  int j = nBegin;
  if (m == 1) {
    for (; j + 8 <= nEnd; j += 8) {
      const uint16_t* wj = w + size_t(j) * k;
      const uint16_t* next = j + 16 <= nEnd ? wj + 8 * size_t(k) : nullptr;
      const float* xr[1] = {x};
      float* out[8][2];
      for (int c = 0; c < 8; ++c) out[c][0] = y + j + c;
      blockRowsAvx2<8, 1>(xr, wj, next, k, out, beta);
    }
  }
  for (; j + 4 <= nEnd; j += 4) {
    const uint16_t* wj = w + size_t(j) * k;
    const uint16_t* next = j + 8 <= nEnd ? wj + 4 * size_t(k) : nullptr;
    int i = 0;
    auto rows = [&](auto kRows) {
      constexpr int r = decltype(kRows)::value;
      const float* xr[r];
      float* out[4][2];
      for (int q = 0; q < r; ++q) {
        xr[q] = x + size_t(i + q) * ldx;
        for (int c = 0; c < 4; ++c) out[c][q] = y + size_t(i + q) * ldy + j + c;
      }
      blockRowsAvx2<4, r>(xr, wj, i == 0 ? next : nullptr, k, out, beta);
      i += r;
    };
    while (i + 2 <= m) rows(std::integral_constant<int, 2>{});
    if (i < m) rows(std::integral_constant<int, 1>{});
  }
  for (; j < nEnd; ++j)
    for (int i = 0; i < m; ++i) {
      const float* xi = x + size_t(i) * ldx;
      const uint16_t* wj = w + size_t(j) * k;
      float s = 0.0f;
      for (int p = 0; p < k; ++p) s += xi[p] * bf16ToF32(wj[p]);
      store(y + size_t(i) * ldy + j, s, beta);
    }
}

#define PD_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// kRowsW (4 or 8) weight rows against kRowsX rounded input rows (each padded with zeros to a
// multiple of 32 columns): one 64-byte line per weight row per step, the tail loaded under a
// mask. One input row gets 8 weight rows: 4 chains of vdpbf16ps do not cover its latency.
template <int kRowsW, int kRowsX>
PD_BF16_TARGET inline void blockRowsBf16(const uint16_t* const* xr, const uint16_t* w, const uint16_t* next, int k,
                                         float* out[][2], float beta) {
  const uint16_t* wr[kRowsW];
  for (int r = 0; r < kRowsW; ++r) wr[r] = w + size_t(r) * k;
  __m512 a[kRowsW][kRowsX];
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) a[r][i] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(next);
  for (int p = 0; p < k; p += 32) {
    if (ahead) {  // the next group (kRowsW * k * 2 bytes, contiguous): kRowsW lines per step
      for (int line = 0; line < kRowsW; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
      ahead += kRowsW * 64;
    }
    const __mmask32 mask = k - p >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - p)) - 1;
    __m512bh v[kRowsW];
    for (int r = 0; r < kRowsW; ++r) v[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[r] + p);
    for (int i = 0; i < kRowsX; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[i] + p);
      for (int r = 0; r < kRowsW; ++r) a[r][i] = _mm512_dpbf16_ps(a[r][i], v[r], xv);
    }
  }
  for (int r = 0; r < kRowsW; ++r)
    for (int i = 0; i < kRowsX; ++i) store(out[r][i], _mm512_reduce_add_ps(a[r][i]), beta);
}

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

PD_BF16_TARGET void skinnyAvx512Bf16(const float* x, int ldx, const uint16_t* w, float* y, int ldy, int m, int k,
                                     int nBegin, int nEnd, float beta) {
  thread_local std::vector<uint16_t> xb;
  const int kp = (k + 31) / 32 * 32;
  if (xb.size() < size_t(m) * kp) xb.resize(size_t(m) * kp);
  roundRowsBf16(x, ldx, m, k, kp, xb.data());
  int j = nBegin;
  if (m == 1) {
    for (; j + 8 <= nEnd; j += 8) {
      const uint16_t* wj = w + size_t(j) * k;
      const uint16_t* xr[1] = {xb.data()};
      float* out[8][2];
      for (int c = 0; c < 8; ++c) out[c][0] = y + j + c;
      blockRowsBf16<8, 1>(xr, wj, j + 16 <= nEnd ? wj + 8 * size_t(k) : nullptr, k, out, beta);
    }
  }
  for (; j + 4 <= nEnd; j += 4) {
    const uint16_t* wj = w + size_t(j) * k;
    const uint16_t* next = j + 8 <= nEnd ? wj + 4 * size_t(k) : nullptr;
    int i = 0;
    auto rows = [&](auto kRows) {
      constexpr int r = decltype(kRows)::value;
      const uint16_t* xr[r];
      float* out[4][2];
      for (int q = 0; q < r; ++q) {
        xr[q] = xb.data() + size_t(i + q) * kp;
        for (int c = 0; c < 4; ++c) out[c][q] = y + size_t(i + q) * ldy + j + c;
      }
      blockRowsBf16<4, r>(xr, wj, i == 0 ? next : nullptr, k, out, beta);
      i += r;
    };
    while (i + 2 <= m) rows(std::integral_constant<int, 2>{});
    if (i < m) rows(std::integral_constant<int, 1>{});
  }
  for (; j < nEnd; ++j)
    for (int i = 0; i < m; ++i) {
      const uint16_t* xi = xb.data() + size_t(i) * kp;
      const uint16_t* wj = w + size_t(j) * k;
      float s = 0.0f;
      for (int p = 0; p < k; ++p) s += bf16ToF32(xi[p]) * bf16ToF32(wj[p]);
      store(y + size_t(i) * ldy + j, s, beta);
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
  if (kernel == Bf16Kernel::kAvx512Bf16)
    skinnyAvx512Bf16(x, ldx, w, y, ldy, m, k, nBegin, nEnd, beta);
  else
    skinnyAvx2(x, ldx, w, y, ldy, m, k, nBegin, nEnd, beta);
}

}  // namespace pd::kernels::cpu
