// The GEMM micro-kernels (pd/kernels/gemm.h), each forced in turn, against a double-precision
// reference. A kernel this CPU cannot run is a ctest skip naming it.
//
// Bound: a float dot product of length k summed in any order with exact-then-rounded FMAs
// and adds is within gamma(k) * sum_p |a_p * b_p| of the exact value, gamma(k) = k*u / (1 - k*u),
// u = 2^-24 (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1). The beta * C
// term adds two more roundings: each entry is checked against gamma(k + 2) * (sum_p |a_p b_p| +
// |beta * c_old|), which any wrong index, lost tail or stale accumulator exceeds by orders of
// magnitude.
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/cpu_backend.h"
#include "engine/kv_layout.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"
#include "pd/kernels/gemm.h"
#include "tests/test_skip.h"

namespace kc = pd::kernels::cpu;

namespace {

std::vector<float> randomVec(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

kc::GemmKernel kernelNamed(const std::string& name) {
  for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric})
    if (name == kc::gemmKernelInfo(k).name) return k;
  FAIL("no kernel named " << name);
  return kc::GemmKernel::kGeneric;
}

kc::GemmKernel requireKernel(const std::string& name) {
  const kc::GemmKernel k = kernelNamed(name);
  if (!kc::gemmKernelSupported(k)) pd::test::skipTest("this CPU cannot run the " + name + " GEMM kernel");
  return k;
}

struct Shape {
  int m, n, k;
};

// One product with leading dimensions wider than the matrices, computed in two column ranges
// split at `split` (not a panel multiple), checked entry by entry against the bound above.
void checkShape(kc::GemmKernel kern, kc::GemmWorkspace& ws, Shape s, kc::GemmB layout, float beta, uint64_t seed) {
  const int lda = s.k + 3, ldc = s.n + 5;
  const int ldb = layout == kc::GemmB::kNK ? s.k + 1 : s.n + 2;
  const size_t bRows = layout == kc::GemmB::kNK ? size_t(s.n) : size_t(s.k);
  auto a = randomVec(size_t(s.m) * lda, seed);
  auto b = randomVec(std::max<size_t>(1, bRows * ldb), seed + 1);
  auto c0 = randomVec(size_t(s.m) * ldc, seed + 2);
  if (beta == 0.0f)  // beta 0 must not read C: NaNs there would leak into the result
    for (auto& x : c0) x = std::numeric_limits<float>::quiet_NaN();
  auto c = c0;
  const int split = std::max(0, std::min(s.n, s.n / 2 + 1));
  kc::gemm(kern, s.m, 0, split, s.k, a.data(), lda, b.data(), ldb, layout, beta, c.data(), ldc, ws);
  kc::gemm(kern, s.m, split, s.n, s.k, a.data(), lda, b.data(), ldb, layout, beta, c.data(), ldc, ws);
  const double u = std::ldexp(1.0, -24), kk = s.k + 2;
  const double gamma = kk * u / (1 - kk * u);
  int bad = 0;
  double worst = 0;
  for (int i = 0; i < s.m; ++i) {
    for (int j = 0; j < s.n; ++j) {
      double exact = 0, mag = 0;
      for (int p = 0; p < s.k; ++p) {
        const double bv = layout == kc::GemmB::kNK ? b[size_t(j) * ldb + p] : b[size_t(p) * ldb + j];
        exact += double(a[size_t(i) * lda + p]) * bv;
        mag += std::fabs(double(a[size_t(i) * lda + p]) * bv);
      }
      if (beta != 0.0f) {
        exact += double(beta) * c0[size_t(i) * ldc + j];
        mag += std::fabs(double(beta) * c0[size_t(i) * ldc + j]);
      }
      const double got = c[size_t(i) * ldc + j];
      const double err = std::fabs(got - exact), bound = gamma * mag + 1e-30;
      worst = std::max(worst, err / bound);
      if (!(err <= bound)) ++bad;  // NaN counts as bad
    }
    // Columns past n (inside ldc) are never written.
    for (int j = s.n; j < ldc; ++j)
      if (!(std::isnan(c0[size_t(i) * ldc + j]) && std::isnan(c[size_t(i) * ldc + j])) &&
          c[size_t(i) * ldc + j] != c0[size_t(i) * ldc + j])
        ++bad;
  }
  INFO(kc::gemmKernelInfo(kern).name << " m " << s.m << " n " << s.n << " k " << s.k << " layout "
                                     << (layout == kc::GemmB::kNK ? "NK" : "KN") << " beta " << beta
                                     << ": worst error / bound " << worst);
  CHECK(bad == 0);
}

void checkKernel(kc::GemmKernel kern) {
  kc::GemmWorkspace ws;  // one workspace for every shape: reuse after growth is part of the test
  const kc::GemmKernelInfo info = kc::gemmKernelInfo(kern);
  // Shapes around the kernel's own tile: 1 row, tails in M (< MR, > MC), N (< NR, > NC) and
  // K (1, odd, past one KC block of 512), and the prefill shapes' column counts.
  const std::vector<Shape> shapes = {
      {1, 1, 1},
      {1, 33, 7},
      {info.mr - 1, info.nr + 1, 5},
      {info.mr + 1, 2 * info.nr - 1, 64},
      {13, 31, 513},
      {29, 65, 1030},
      {200, 300, 37},
      {3, 17 * info.nr + 3, 9},
      {37, 96, 64},
  };
  uint64_t seed = 100;
  for (const Shape& s : shapes)
    for (kc::GemmB layout : {kc::GemmB::kNK, kc::GemmB::kKN})
      for (float beta : {0.0f, 1.0f, 0.5f}) checkShape(kern, ws, s, layout, beta, seed += 3);
}

// gemmPrepacked on B packed wider (more columns) and deeper (more rows) than the product uses,
// from a buffer that is not 64-byte aligned: the same bits as gemm() on the plain B.
void checkPrepacked(kc::GemmKernel kern) {
  kc::GemmWorkspace ws;
  for (kc::GemmB layout : {kc::GemmB::kNK, kc::GemmB::kKN}) {
    for (Shape s : {Shape{1, 1, 1}, Shape{20, 70, 600}, Shape{130, 64, 37}, Shape{5, 33, 1100}}) {
      const int nPacked = s.n + 5, kPacked = s.k + 7;
      const int ldb = layout == kc::GemmB::kNK ? kPacked : nPacked;
      auto a = randomVec(size_t(s.m) * s.k, 7);
      auto b = randomVec(size_t(layout == kc::GemmB::kNK ? nPacked : kPacked) * ldb, 8);
      std::vector<float> packed(kc::gemmPackedBFloats(kern, nPacked, kPacked) + 1);
      kc::gemmPackB(kern, nPacked, kPacked, b.data(), ldb, layout, packed.data() + 1);
      std::vector<float> want(size_t(s.m) * s.n, 1.0f), got = want;
      kc::gemm(kern, s.m, 0, s.n, s.k, a.data(), s.k, b.data(), ldb, layout, 0.5f, want.data(), s.n, ws);
      kc::gemmPrepacked(kern, s.m, s.n, s.k, a.data(), s.k, packed.data() + 1, kPacked, 0.5f, got.data(), s.n);
      INFO(kc::gemmKernelInfo(kern).name << " m " << s.m << " n " << s.n << " k " << s.k);
      CHECK(got == want);
    }
  }
}

}  // namespace

TEST_CASE("gemmPrepacked gives gemm's bits on every supported kernel") {
  for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric})
    if (kc::gemmKernelSupported(k)) checkPrepacked(k);
}

TEST_CASE("gemm avx512 kernel matches a double reference on odd shapes") { checkKernel(requireKernel("avx512")); }
TEST_CASE("gemm avx2 kernel matches a double reference on odd shapes") { checkKernel(requireKernel("avx2")); }
TEST_CASE("gemm generic kernel matches a double reference on odd shapes") { checkKernel(requireKernel("generic")); }

TEST_CASE("gemm with k = 0 scales C by beta and m = 0 or an empty range writes nothing") {
  kc::GemmWorkspace ws;
  std::vector<float> c = {1, 2, 3, 4, 5, 6};
  kc::gemm(kc::gemmBestKernel(), 2, 0, 3, 0, nullptr, 1, nullptr, 1, kc::GemmB::kNK, 0.5f, c.data(), 3, ws);
  CHECK(c == std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3});
  kc::gemm(kc::gemmBestKernel(), 0, 0, 3, 4, nullptr, 4, nullptr, 4, kc::GemmB::kNK, 0.0f, c.data(), 3, ws);
  kc::gemm(kc::gemmBestKernel(), 2, 2, 2, 4, nullptr, 4, nullptr, 4, kc::GemmB::kNK, 0.0f, c.data(), 3, ws);
  CHECK(c == std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3});
}

TEST_CASE("gemmBestKernel is the widest kernel the CPU supports") {
  const kc::GemmKernel best = kc::gemmBestKernel();
  CHECK(kc::gemmKernelSupported(best));
  CHECK(kc::gemmKernelSupported(kc::GemmKernel::kGeneric));
  if (kc::gemmKernelSupported(kc::GemmKernel::kAvx512))
    CHECK(best == kc::GemmKernel::kAvx512);
  else if (kc::gemmKernelSupported(kc::GemmKernel::kAvx2))
    CHECK(best == kc::GemmKernel::kAvx2);
  else
    CHECK(best == kc::GemmKernel::kGeneric);
  for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric})
    if (kc::gemmKernelSupported(k)) CHECK(kc::gemmFmaProbe(k, 1000) > 0);
}

TEST_CASE("createCpuBackend refuses an unknown GEMM kernel name and one the CPU lacks") {
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/gemm_kernel_refusal";
  pd::engine::MakeModelOptions o;
  o.preset = "tiny";
  REQUIRE(pd::engine::makeModel(o, dir).toString() == "OK");
  auto model = pd::engine::loadModel(dir);
  REQUIRE(model.ok());
  const auto layout = pd::engine::kvLayoutFor((*model)->config, 4, 16);
  std::vector<float> kv(layout.totalBytes() / sizeof(float));
  pd::engine::CpuBackendOptions opt;
  opt.gemmKernel = "sse9";
  auto r = pd::engine::createCpuBackend(*model, layout, kv.data(), opt);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().toString().find("unknown gemmKernel \"sse9\"") != std::string::npos);
  for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric}) {
    opt.gemmKernel = kc::gemmKernelInfo(k).name;
    auto b = pd::engine::createCpuBackend(*model, layout, kv.data(), opt);
    INFO(opt.gemmKernel);
    CHECK(b.ok() == kc::gemmKernelSupported(k));
    if (!b.ok()) CHECK(b.status().toString().find("needs instructions this CPU lacks") != std::string::npos);
  }
}
