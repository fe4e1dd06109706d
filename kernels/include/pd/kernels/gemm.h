// f32 GEMM for prefill: C = A * op(B) + beta * C with the project's own micro-kernels, so the
// speed of a prompt does not depend on whether a BLAS library recognises the CPU.
//
//   kc::GemmWorkspace ws;                               // one per thread, reused
//   const auto kern = kc::gemmBestKernel();             // from CPUID, once
//   kc::gemm(kern, m, 0, n, k, x, k, w, k, kc::GemmB::kNK, 0.0f, y, n, ws);   // y = x * w^T
//
// Kernels (docs/engine-cpu.md, "GEMM kernels"): each variant is compiled with a function-level
// target attribute (this file's translation unit itself assumes only baseline x86-64), and
// gemmBestKernel() picks the widest one CPUID and the OS (XSAVE state) allow:
//   kAvx512   14 x 32 register tile (28 zmm accumulators), needs avx512f
//   kAvx2      6 x 16 register tile (12 ymm accumulators), needs avx2 + fma
//   kGeneric   4 x 16 tile in plain C++ (whatever the baseline compiler vectorises)
// Blocking: B is packed per (KC x NC) block into NR-wide column panels (in the workspace), so
// the register tile streams one contiguous B panel against MR rows of A read in place (no A
// copy); packing costs O(k * n) against the product's O(m * n * k). A B used by several
// products (attention's keys and values across query tiles and heads) can be packed once with
// gemmPackB and multiplied with gemmPrepacked.
// Pure functions apart from the workspace; callers split [0, n) output columns across threads
// in multiples of gemmKernelInfo(kernel).nr (any split is correct, NR multiples avoid padding).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace pd::kernels::cpu {

enum class GemmKernel { kGeneric, kAvx2, kAvx512 };

struct GemmKernelInfo {
  const char* name;  // "avx512", "avx2", "generic"
  int mr, nr;        // register tile: rows of A x columns of C
};
GemmKernelInfo gemmKernelInfo(GemmKernel kernel);

// Whether this CPU (and OS) can run `kernel`; kGeneric always.
bool gemmKernelSupported(GemmKernel kernel);
// The fastest supported kernel (decided once from CPUID; no environment variable).
GemmKernel gemmBestKernel();

// How B is stored: kNK = [n][ldb] (row j holds output column j's k weights: a Hugging Face
// weight [out][in], or the keys of attention scores); kKN = [k][ldb] (attention's values).
enum class GemmB { kNK, kKN };

// Packing buffers of one thread; grown on first use, reused after. Not thread-safe.
class GemmWorkspace {
 public:
  GemmWorkspace();
  ~GemmWorkspace();
  GemmWorkspace(const GemmWorkspace&) = delete;
  GemmWorkspace& operator=(const GemmWorkspace&) = delete;
  GemmWorkspace(GemmWorkspace&&) noexcept;
  GemmWorkspace& operator=(GemmWorkspace&&) noexcept;

  float* a(size_t floats);  // 64-byte aligned, contents unspecified
  float* b(size_t floats);

 private:
  struct Buf;
  std::unique_ptr<Buf> a_, b_;
};

// Computes output columns [nBegin, nEnd) of C[m][ldc]:
//   C[i][j] = sum_p A[i][p] * B(p, j) + beta * C[i][j]     (beta 0 ignores C's old contents)
// with B(p, j) = b[j * ldb + p] for kNK and b[p * ldb + j] for kKN. A is [m][lda] (k used).
// `kernel` must be supported (gemmKernelSupported); m, k >= 0. Sums are in f32 with FMA in
// the SIMD kernels, in a different order than a naive loop (error bound: docs/engine-cpu.md).
void gemm(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const float* b, int ldb,
          GemmB layout, float beta, float* c, int ldc, GemmWorkspace& ws);

// gemm() with B a bf16 weight [n][ldb] (kNK layout; pd/kernels/linear_bf16.h): each block of
// B is widened to f32 while it is packed, so the product runs the f32 micro-kernel and gives
// exactly gemm()'s result on the widened weight (bit for bit).
void gemmBf16(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const uint16_t* b,
              int ldb, float beta, float* c, int ldc, GemmWorkspace& ws);

// gemm() with B an 8-bit block-quantized weight (pd/kernels/linear_q8.h): q [n][k] int8,
// scales [n][ceil(k / 32)]; dequantized while packing (q8Dequantize's values), so the result
// is gemm()'s on the dequantized weight, bit for bit.
void gemmQ8(GemmKernel kernel, int m, int nBegin, int nEnd, int k, const float* a, int lda, const int8_t* q,
            const float* scales, float beta, float* c, int ldc, GemmWorkspace& ws);

// gemm() with B an f32 weight [n][k] stored in the rows8 layout (pd/kernels/linear.h): each
// block of B is gathered row by row while it is packed, so the result is gemm()'s on the
// row-major weight, bit for bit.
void gemmRows8(GemmKernel kernel, int m, int nBegin, int nEnd, int n, int k, const float* a, int lda, const float* b,
               float beta, float* c, int ldc, GemmWorkspace& ws);

// B packed once for several products: ceil(n / NR) panels of k rows of NR floats (NR is the
// kernel's), zero-padded; dst holds gemmPackedBFloats(kernel, n, k) floats.
size_t gemmPackedBFloats(GemmKernel kernel, int n, int k);
void gemmPackB(GemmKernel kernel, int n, int k, const float* b, int ldb, GemmB layout, float* dst);
// C[m][ldc] (columns [0, n)) = A * B + beta * C with B from gemmPackB(kernel, nPacked,
// packedK, ...), n <= nPacked, k <= packedK: the product uses B's first n columns and first k
// rows (attention packs a sequence's keys once and multiplies growing prefixes of them). The
// same sums, in the same order, as gemm() on the unpacked B.
void gemmPrepacked(GemmKernel kernel, int m, int n, int k, const float* a, int lda, const float* packedB, int packedK,
                   float beta, float* c, int ldc);

// The hardware ceiling for compute-bound work: runs `iterations` rounds of independent FMA
// chains with `kernel`'s instructions on the calling thread and returns the floating-point
// operations done (2 per lane per FMA). Benchmarks time it on each of their threads.
double gemmFmaProbe(GemmKernel kernel, long iterations);

}  // namespace pd::kernels::cpu
