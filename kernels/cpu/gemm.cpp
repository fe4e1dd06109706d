// The GEMM driver, its packing routines and the register-tile micro-kernels.
//
// This file is compiled for baseline x86-64 (kernels/CMakeLists.txt overrides the library's
// -march): only functions carrying a target attribute use AVX2/AVX-512, and they run only
// after gemmKernelSupported() said yes, so the same binary runs on any x86-64 CPU.
#include "pd/kernels/gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "pd/kernels/linear.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PD_GEMM_X86 1
#else
#define PD_GEMM_X86 0
#endif

namespace pd::kernels::cpu {

// ---- Workspace ------------------------------------------------------------------------------

struct GemmWorkspace::Buf {
  float* p = nullptr;
  size_t cap = 0;  // floats
  ~Buf() { std::free(p); }
  float* get(size_t floats) {
    if (floats > cap) {
      std::free(p);
      // Rounded up to a cache line; aligned_alloc wants a multiple of the alignment.
      const size_t bytes = ((std::max<size_t>(floats, 16) * sizeof(float)) + 63) & ~size_t(63);
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (!p) std::abort();  // out of memory for a few hundred KiB: nothing sensible to do
      cap = bytes / sizeof(float);
    }
    return p;
  }
};

GemmWorkspace::GemmWorkspace() : a_(std::make_unique<Buf>()), b_(std::make_unique<Buf>()) {}
GemmWorkspace::~GemmWorkspace() = default;
GemmWorkspace::GemmWorkspace(GemmWorkspace&&) noexcept = default;
GemmWorkspace& GemmWorkspace::operator=(GemmWorkspace&&) noexcept = default;
float* GemmWorkspace::a(size_t floats) { return a_->get(floats); }
float* GemmWorkspace::b(size_t floats) { return b_->get(floats); }

namespace {

// Cache blocking. A KC-deep panel pair is what the register tile streams: the B panel
// (KC x NR: 64 KiB at NR 32) is reused across every MR-row panel of the MC block; the packed A
// block (MC x KC, <= 336 KiB) and B block (KC x NC, 512 KiB at NR 32) stay in L2. KC 512
// measured 5-8% faster than 256 on the AMD EPYC (Zen 4) guest: fewer passes over C, and L2
// feeds the tile's 2 B loads per 28 FMAs easily (docs/engine-cpu.md, "GEMM kernels").
constexpr int kKc = 512;
constexpr int kNcPanels = 8;  // NC = 8 panels of NR columns

// a: row-major A at (row, k offset) with row stride lda, read in place (rows past mr are not
// read: their accumulators repeat row mr - 1 and are not stored); b: a packed panel, kc rows of
// NR floats.
using MicroFn = void (*)(int kc, const float* a, int lda, const float* b, float* c, int ldc, int mr, int nr,
                         float beta);

// Stores a finished tile: c = acc + beta * c (beta 0: c = acc, c never read).
inline void storeTile(const float* acc, int accLd, float* c, int ldc, int mr, int nr, float beta) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float& d = c[size_t(i) * ldc + j];
      d = beta == 0.0f ? acc[i * accLd + j] : acc[i * accLd + j] + beta * d;
    }
}

// ---- Portable kernel (4 x 16) ----------------------------------------------------------------

void microGeneric(int kc, const float* a, int lda, const float* b, float* c, int ldc, int mr, int nr, float beta) {
  constexpr int MR = 4, NR = 16;
  const float* ar[MR];
  for (int i = 0; i < MR; ++i) ar[i] = a + size_t(std::min(i, mr - 1)) * lda;
  float acc[MR][NR] = {};
  for (int p = 0; p < kc; ++p, b += NR)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += ar[i][p] * b[j];
  storeTile(&acc[0][0], NR, c, ldc, mr, nr, beta);
}

#if PD_GEMM_X86

// ---- AVX2 + FMA kernel (6 x 16: 12 ymm accumulators, 2 for B, 1 broadcast) ------------------

__attribute__((target("avx2,fma"))) void microAvx2(int kc, const float* a, int lda, const float* b, float* c, int ldc,
                                                   int mr, int nr, float beta) {
  constexpr int MR = 6;
  const float* ar[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) ar[i] = a + size_t(std::min(i, mr - 1)) * lda;
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
  for (int p = 0; p < kc; ++p, b += 16) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(ar[i] + p);
      c0[i] = _mm256_fmadd_ps(av, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(av, b1, c1[i]);
    }
  }
  if (mr == MR && nr == 16) {
    const __m256 bv = _mm256_set1_ps(beta);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      float* ci = c + size_t(i) * ldc;
      if (beta == 0.0f) {
        _mm256_storeu_ps(ci, c0[i]);
        _mm256_storeu_ps(ci + 8, c1[i]);
      } else {
        _mm256_storeu_ps(ci, _mm256_fmadd_ps(bv, _mm256_loadu_ps(ci), c0[i]));
        _mm256_storeu_ps(ci + 8, _mm256_fmadd_ps(bv, _mm256_loadu_ps(ci + 8), c1[i]));
      }
    }
    return;
  }
  alignas(32) float acc[MR][16];
#pragma GCC unroll 6  // every index a constant, or GCC keeps c0/c1 in memory in the main loop
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(acc[i], c0[i]);
    _mm256_store_ps(acc[i] + 8, c1[i]);
  }
  storeTile(&acc[0][0], 16, c, ldc, mr, nr, beta);
}

// ---- AVX-512 kernel (14 x 32: 28 zmm accumulators, 2 for B, 1 broadcast) ----------------------

__attribute__((target("avx512f"))) void microAvx512(int kc, const float* a, int lda, const float* b, float* c, int ldc,
                                                    int mr, int nr, float beta) {
  constexpr int MR = 14;
  const float* ar[MR];
#pragma GCC unroll 14
  for (int i = 0; i < MR; ++i) ar[i] = a + size_t(std::min(i, mr - 1)) * lda;
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 14
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int p = 0; p < kc; ++p, b += 32) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
#pragma GCC unroll 14
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(ar[i][p]);
      c0[i] = _mm512_fmadd_ps(av, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(av, b1, c1[i]);
    }
  }
  // Column masks cover a partial tile; rows past mr are not stored.
  const __mmask16 m0 = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1);
  const __mmask16 m1 = nr >= 32 ? __mmask16(0xFFFF) : nr > 16 ? __mmask16((1u << (nr - 16)) - 1) : __mmask16(0);
  const __m512 bv = _mm512_set1_ps(beta);
#pragma GCC unroll 14
  for (int i = 0; i < MR; ++i) {
    if (i >= mr) break;
    float* ci = c + size_t(i) * ldc;
    if (beta == 0.0f) {
      _mm512_mask_storeu_ps(ci, m0, c0[i]);
      _mm512_mask_storeu_ps(ci + 16, m1, c1[i]);
    } else {
      _mm512_mask_storeu_ps(ci, m0, _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(m0, ci), c0[i]));
      _mm512_mask_storeu_ps(ci + 16, m1, _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(m1, ci + 16), c1[i]));
    }
  }
}

// ---- FMA probes: 12 independent chains, enough to cover a 4-cycle latency at 2 per cycle ----

__attribute__((target("avx512f"))) double probeAvx512(long iterations) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
  const __m512 mul = _mm512_set1_ps(0.999999f), add = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], mul, add);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);  // (not _mm512_reduce_add_ps: GCC 12 warns inside its header)
  volatile float sink = out[0];
  (void)sink;
  return double(iterations) * 12 * 16 * 2;
}

__attribute__((target("avx2,fma"))) double probeAvx2(long iterations) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i) * 1e-3f);
  const __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], mul, add);
  }
  alignas(32) float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_store_ps(out, s);
  volatile float sink = out[0];
  (void)sink;
  return double(iterations) * 12 * 8 * 2;
}

#endif  // PD_GEMM_X86

// Baseline: SSE2 multiply + add (no FMA instruction); counted as 2 flops per lane as well.
double probeGeneric(long iterations) {
  float acc[12][4];
  for (int i = 0; i < 12; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = float(i * 4 + j) * 1e-3f;
  for (long it = 0; it < iterations; ++it)
    for (int i = 0; i < 12; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = acc[i][j] * 0.999999f + 1e-7f;
  float s = 0;
  for (int i = 0; i < 12; ++i)
    for (int j = 0; j < 4; ++j) s += acc[i][j];
  volatile float sink = s;
  (void)sink;
  return double(iterations) * 12 * 4 * 2;
}

struct Kernel {
  GemmKernelInfo info;
  int mc;  // rows of A per packed block: a multiple of mr
  MicroFn micro;
};

Kernel kernelFor(GemmKernel k) {
  switch (k) {
#if PD_GEMM_X86
    case GemmKernel::kAvx512:
      return {{"avx512", 14, 32}, 14 * 12, microAvx512};
    case GemmKernel::kAvx2:
      return {{"avx2", 6, 16}, 6 * 24, microAvx2};
#endif
    default:
      return {{"generic", 4, 16}, 4 * 32, microGeneric};
  }
}

// B block [pc, pc + kc) x [jc, jc + nc) into ceil(nc / NR) panels of kc rows of NR floats,
// zero-padded past nc.
#if PD_GEMM_X86
// Rows [0, 8) x columns [0, kc) of src (row stride ldb) into dst[p * nr + i]: 8 x 8 transposes
// in registers. Packing a weight one float at a time cost a quarter of a 128-token prefill.
__attribute__((target("avx2"))) void transpose8Rows(const float* src, int ldb, int kc, float* dst, int nr) {
  int p = 0;
  for (; p + 8 <= kc; p += 8) {
    __m256 r[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + size_t(i) * ldb + p);
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    float* d = dst + size_t(p) * nr;
    _mm256_storeu_ps(d + 0 * size_t(nr), _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(d + 1 * size_t(nr), _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(d + 2 * size_t(nr), _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(d + 3 * size_t(nr), _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(d + 4 * size_t(nr), _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(d + 5 * size_t(nr), _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(d + 6 * size_t(nr), _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(d + 7 * size_t(nr), _mm256_permute2f128_ps(s3, s7, 0x31));
  }
  for (; p < kc; ++p)
    for (int i = 0; i < 8; ++i) dst[size_t(p) * nr + i] = src[size_t(i) * ldb + p];
}

bool haveAvx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  return yes;
}
#endif

void packB(int nr, const float* b, int ldb, GemmB layout, int jc, int nc, int pc, int kc, float* dst) {
  for (int j0 = 0; j0 < nc; j0 += nr, dst += size_t(kc) * nr) {
    const int cols = std::min(nr, nc - j0);
    if (layout == GemmB::kKN) {
      for (int p = 0; p < kc; ++p) {
        const float* src = b + size_t(pc + p) * ldb + jc + j0;
        float* d = dst + size_t(p) * nr;
        std::memcpy(d, src, sizeof(float) * cols);
        for (int r = cols; r < nr; ++r) d[r] = 0.0f;
      }
    } else {
      int r = 0;
#if PD_GEMM_X86
      if (haveAvx2())
        for (; r + 8 <= cols; r += 8) transpose8Rows(b + size_t(jc + j0 + r) * ldb + pc, ldb, kc, dst + r, nr);
#endif
      for (; r < cols; ++r) {
        const float* src = b + size_t(jc + j0 + r) * ldb + pc;
        for (int p = 0; p < kc; ++p) dst[size_t(p) * nr + r] = src[p];
      }
      for (int r = cols; r < nr; ++r)
        for (int p = 0; p < kc; ++p) dst[size_t(p) * nr + r] = 0.0f;
    }
  }
}

// A weight held in a compact form (bf16, or int8 with per-32-column scales), [n][ldb], kNK; or
// an f32 weight in the rows8 layout (pd/kernels/linear.h), [rows8N][ldb] logically.
struct CompactB {
  const uint16_t* bf16 = nullptr;
  const int8_t* q8 = nullptr;
  const float* q8Scales = nullptr;  // [n][ceil(ldb / 32)]
  const float* rows8 = nullptr;
  int rows8N = 0;
  // Row j, columns [pc, pc + kc) widened to f32 into d.
  void row(int j, int ldb, int pc, int kc, float* d) const {
    if (rows8) {
      // Runs of 8 columns are contiguous in the layout, and so is a row's tail.
      const int k8 = ldb / 8 * 8;
      for (int p = pc; p < pc + kc;) {
        const int end = p < k8 ? std::min(pc + kc, (p / 8 + 1) * 8) : pc + kc;
        std::memcpy(d + (p - pc), rows8 + rows8Index(rows8N, ldb, j, p), sizeof(float) * (end - p));
        p = end;
      }
    } else if (bf16) {
      const uint16_t* src = bf16 + size_t(j) * ldb + pc;
      for (int p = 0; p < kc; ++p) {
        const uint32_t u = uint32_t(src[p]) << 16;
        std::memcpy(d + p, &u, 4);
      }
    } else {
      const int8_t* src = q8 + size_t(j) * ldb + pc;
      const float* sc = q8Scales + size_t(j) * ((ldb + 31) / 32);
      for (int p = 0; p < kc; ++p) d[p] = float(src[p]) * sc[(pc + p) / 32];
    }
  }
};

// packB for a compact weight: each strip of 8 rows is widened to f32 into a buffer that stays
// in L1, then transposed into the panels as packB does, so such a weight costs the GEMM about
// what an f32 one does.
void packBCompact(int nr, const CompactB& cb, int ldb, int jc, int nc, int pc, int kc, float* dst) {
  alignas(64) float strip[8 * kKc];
  for (int j0 = 0; j0 < nc; j0 += nr, dst += size_t(kc) * nr) {
    const int cols = std::min(nr, nc - j0);
    int r = 0;
#if PD_GEMM_X86
    if (haveAvx2())
      for (; r + 8 <= cols; r += 8) {
        for (int q = 0; q < 8; ++q) cb.row(jc + j0 + r + q, ldb, pc, kc, strip + size_t(q) * kc);
        transpose8Rows(strip, kc, kc, dst + r, nr);
      }
#endif
    for (; r < cols; ++r) {
      cb.row(jc + j0 + r, ldb, pc, kc, strip);
      for (int p = 0; p < kc; ++p) dst[size_t(p) * nr + r] = strip[p];
    }
    for (int r = cols; r < nr; ++r)
      for (int p = 0; p < kc; ++p) dst[size_t(p) * nr + r] = 0.0f;
  }
}

}  // namespace

GemmKernelInfo gemmKernelInfo(GemmKernel kernel) { return kernelFor(kernel).info; }

bool gemmKernelSupported(GemmKernel kernel) {
#if PD_GEMM_X86
  __builtin_cpu_init();
  switch (kernel) {
    case GemmKernel::kAvx512:
      return __builtin_cpu_supports("avx512f");  // libgcc also checks the OS saves zmm state
    case GemmKernel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmKernel::kGeneric:
      return true;
  }
  return false;
#else
  return kernel == GemmKernel::kGeneric;
#endif
}

GemmKernel gemmBestKernel() {
  static const GemmKernel best = [] {
    for (GemmKernel k : {GemmKernel::kAvx512, GemmKernel::kAvx2})
      if (gemmKernelSupported(k)) return k;
    return GemmKernel::kGeneric;
  }();
  return best;
}

namespace {

// The blocked loops. B comes from `prepacked` (gemmPackB's layout with packedK >= k rows per
// panel, nBegin a multiple of NR) or, when that is null, is packed here one (KC x NC) block at
// a time.
// compact (when not null) replaces b: a bf16 or int8 weight in the kNK layout, widened while
// packing.
void runBlocked(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const float* b, int ldb,
                GemmB layout, const float* prepacked, int packedK, float beta, float* c, int ldc, GemmWorkspace& ws,
                const CompactB* compact = nullptr) {
  if (m <= 0 || nBegin >= nEnd) return;
  if (k <= 0) {  // an empty sum: C = beta * C
    for (int i = 0; i < m; ++i)
      for (int j = nBegin; j < nEnd; ++j) {
        float& d = c[size_t(i) * ldc + j];
        d = beta == 0.0f ? 0.0f : beta * d;
      }
    return;
  }
  const Kernel kern = kernelFor(kernel);
  const int mr = kern.info.mr, nr = kern.info.nr;
  const int ncMax = kNcPanels * nr;
  const int kcMax = std::min(kKc, k);
  float* pb = nullptr;
  if (!prepacked) pb = ws.b(size_t(kcMax) * std::min(ncMax, (nEnd - nBegin + nr - 1) / nr * nr));
  for (int jc = nBegin; jc < nEnd; jc += ncMax) {
    const int nc = std::min(ncMax, nEnd - jc);
    for (int pc = 0; pc < k; pc += kcMax) {
      const int kc = std::min(kcMax, k - pc);
      const float* panels;
      size_t panelStride;  // floats from one NR-column panel to the next
      if (prepacked) {
        panelStride = size_t(packedK) * nr;
        panels = prepacked + size_t(jc / nr) * panelStride + size_t(pc) * nr;
      } else {
        if (compact)
          packBCompact(nr, *compact, ldb, jc, nc, pc, kc, pb);
        else
          packB(nr, b, ldb, layout, jc, nc, pc, kc, pb);
        panelStride = size_t(kc) * nr;
        panels = pb;
      }
      const float betaBlock = pc == 0 ? beta : 1.0f;  // later K blocks accumulate
      // MC rows of A (read in place) stay in L2 while every panel of the block passes over them.
      for (int ic = 0; ic < m; ic += kern.mc) {
        const int mc = std::min(kern.mc, m - ic);
        for (int jr = 0; jr < nc; jr += nr)
          for (int ir = 0; ir < mc; ir += mr)
            kern.micro(kc, a + size_t(ic + ir) * lda + pc, lda, panels + size_t(jr / nr) * panelStride,
                       c + size_t(ic + ir) * ldc + jc + jr, ldc, std::min(mr, mc - ir), std::min(nr, nc - jr),
                       betaBlock);
      }
    }
  }
}

}  // namespace

void gemm(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const float* b, int ldb,
          GemmB layout, float beta, float* c, int ldc, GemmWorkspace& ws) {
  runBlocked(kernel, m, nBegin, nEnd, k, a, lda, b, ldb, layout, nullptr, 0, beta, c, ldc, ws);
}

void gemmBf16(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const uint16_t* b,
              int ldb, float beta, float* c, int ldc, GemmWorkspace& ws) {
  CompactB cb;
  cb.bf16 = b;
  runBlocked(kernel, m, nBegin, nEnd, k, a, lda, nullptr, ldb, GemmB::kNK, nullptr, 0, beta, c, ldc, ws, &cb);
}

void gemmQ8(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const int8_t* q,
            const float* scales, float beta, float* c, int ldc, GemmWorkspace& ws) {
  CompactB cb;
  cb.q8 = q;
  cb.q8Scales = scales;
  runBlocked(kernel, m, nBegin, nEnd, k, a, lda, nullptr, k, GemmB::kNK, nullptr, 0, beta, c, ldc, ws, &cb);
}

void gemmRows8(GemmKernel kernel, int m, int nBegin, int nEnd, int n, int k, const float* a, int lda, const float* b,
               float beta, float* c, int ldc, GemmWorkspace& ws) {
  CompactB cb;
  cb.rows8 = b;
  cb.rows8N = n;
  runBlocked(kernel, m, nBegin, nEnd, k, a, lda, nullptr, k, GemmB::kNK, nullptr, 0, beta, c, ldc, ws, &cb);
}

size_t gemmPackedBFloats(GemmKernel kernel, int n, int k) {
  const int nr = kernelFor(kernel).info.nr;
  return size_t((std::max(n, 0) + nr - 1) / nr) * nr * size_t(std::max(k, 0));
}

void gemmPackB(GemmKernel kernel, int n, int k, const float* b, int ldb, GemmB layout, float* dst) {
  if (n <= 0 || k <= 0) return;
  packB(kernelFor(kernel).info.nr, b, ldb, layout, 0, n, 0, k, dst);
}

void gemmPrepacked(GemmKernel kernel, int m, int n, int k, const float* a, int lda, const float* packedB, int packedK,
                   float beta, float* c, int ldc) {
  GemmWorkspace unused;  // allocates nothing: B is already packed and A is read in place
  runBlocked(kernel, m, 0, n, k, a, lda, nullptr, 0, GemmB::kNK, packedB, packedK, beta, c, ldc, unused);
}

double gemmFmaProbe(GemmKernel kernel, long iterations) {
  switch (kernel) {
#if PD_GEMM_X86
    case GemmKernel::kAvx512:
      return probeAvx512(iterations);
    case GemmKernel::kAvx2:
      return probeAvx2(iterations);
#endif
    default:
      return probeGeneric(iterations);
  }
}

}  // namespace pd::kernels::cpu
