// Quantized weights (CpuBackendOptions::weightFormat "bf16", pd/kernels/linear_bf16.h, and
// "q8_0", pd/kernels/linear_q8.h): rounding / quantization round trips, the decode kernels
// (each bf16 and q8_0 kernel forced in turn) against a double reference within the headers' bounds,
// the prefill GEMM's packing of each format against the f32 GEMM, and the model-level
// agreement with f32 (greedy tokens and max logit error; docs/engine-cpu.md, "Quantized
// weights").
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "pd/kernels/gemm.h"
#include "pd/kernels/linear_bf16.h"
#include "pd/kernels/linear_q8.h"
#include "tests/test_skip.h"
#include "tests/unit/engine/model_test_util.h"

namespace kc = pd::kernels::cpu;
using namespace pd::engine;
using namespace pd::engine::test;

namespace {

std::vector<float> normals(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

kc::Bf16Kernel requireBf16Kernel(const std::string& name) {
  const kc::Bf16Kernel k = name == "avx2" ? kc::Bf16Kernel::kAvx2 : kc::Bf16Kernel::kAvx512Bf16;
  REQUIRE(name == kc::bf16KernelName(k));
  if (!kc::bf16KernelSupported(k)) pd::test::skipTest("this CPU cannot run the " + name + " bf16 kernel");
  return k;
}

kc::Q8Kernel requireQ8Kernel(const std::string& name) {
  for (kc::Q8Kernel k : {kc::Q8Kernel::kAvx512Vnni, kc::Q8Kernel::kAvx2, kc::Q8Kernel::kGeneric})
    if (name == kc::q8KernelName(k)) {
      if (!kc::q8KernelSupported(k)) pd::test::skipTest("this CPU cannot run the " + name + " q8_0 kernel");
      return k;
    }
  FAIL("no q8_0 kernel named " << name);
  return kc::Q8Kernel::kGeneric;
}

void checkSkinny(kc::Bf16Kernel kern, int m, int n, int k, float beta, uint64_t seed) {
  const int ldx = k + 3, ldy = n + 2;
  const auto x = normals(size_t(m) * ldx, seed);
  const auto wf = normals(size_t(n) * k, seed + 1);
  std::vector<uint16_t> w(wf.size());
  kc::f32ToBf16(wf.data(), w.data(), w.size());
  auto y0 = normals(size_t(m) * ldy, seed + 2);
  if (beta == 0.0f)
    for (auto& v : y0) v = std::numeric_limits<float>::quiet_NaN();
  auto y = y0;
  const int split = n / 2 + 1 < n ? n / 2 + 1 : n;  // two column ranges, not multiples of 4
  kc::linearSkinnyBf16(kern, x.data(), ldx, w.data(), y.data(), ldy, m, k, 0, split, beta);
  kc::linearSkinnyBf16(kern, x.data(), ldx, w.data(), y.data(), ldy, m, k, split, n, beta);
  const double u = std::ldexp(1.0, -24), kk = k + 2;
  const double gamma = kk * u / (1 - kk * u);
  const double rel = kern == kc::Bf16Kernel::kAvx2 ? gamma : std::ldexp(1.0, -8) + 2 * gamma;
  int bad = 0;
  double worst = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double exact = 0, mag = 0;
      for (int p = 0; p < k; ++p) {
        const double t = double(x[size_t(i) * ldx + p]) * kc::bf16ToF32(w[size_t(j) * k + p]);
        exact += t;
        mag += std::fabs(t);
      }
      const double old = y0[size_t(i) * ldy + j];
      if (beta != 0.0f) {
        exact += beta * old;
        mag += std::fabs(beta * old);
      }
      const double err = std::fabs(double(y[size_t(i) * ldy + j]) - exact);
      const double bound = rel * mag + 1e-30;
      worst = std::max(worst, err / bound);
      if (!(err <= bound)) ++bad;
    }
  INFO(kc::bf16KernelName(kern) << " m=" << m << " n=" << n << " k=" << k << " beta=" << beta
                                << " worst err/bound=" << worst);
  CHECK(bad == 0);
}

void checkSkinnyShapes(kc::Bf16Kernel kern) {
  uint64_t seed = 10;
  for (int m : {1, 2, 3, 7, 32})
    for (int k : {1, 31, 33, 64, 100, 515})
      for (float beta : {0.0f, 1.0f}) checkSkinny(kern, m, 37, k, beta, seed++);
}

}  // namespace

TEST_CASE("bf16 rounding: nearest even, within 2^-8 relative, specials kept") {
  // Every bf16 value widens and rounds back to itself (NaNs stay NaN).
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = kc::bf16ToF32(uint16_t(b));
    if (std::isnan(f))
      CHECK(std::isnan(kc::bf16ToF32(kc::f32ToBf16(f))));
    else
      CHECK(kc::f32ToBf16(f) == b);
  }
  // Ties go to the even mantissa: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
  CHECK(kc::bf16ToF32(kc::f32ToBf16(1.0f + std::ldexp(1.0f, -8))) == 1.0f);
  CHECK(kc::bf16ToF32(kc::f32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8))) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(std::isinf(kc::bf16ToF32(kc::f32ToBf16(std::numeric_limits<float>::infinity()))));
  CHECK(std::isnan(kc::bf16ToF32(kc::f32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // Round trip of random normal values: relative error <= 2^-8 (bf16's unit roundoff: 8
  // significant bits).
  const auto v = normals(100000, 3);
  std::vector<uint16_t> b(v.size());
  kc::f32ToBf16(v.data(), b.data(), v.size());
  double worst = 0;
  for (size_t i = 0; i < v.size(); ++i)
    worst = std::max(worst, std::fabs(double(kc::bf16ToF32(b[i])) - v[i]) / std::fabs(double(v[i])));
  CHECK(worst <= std::ldexp(1.0, -8));
  CHECK(worst > std::ldexp(1.0, -9));  // the rounding is to bf16, not something finer
}

TEST_CASE("bf16 decode kernel avx2 against a double reference") { checkSkinnyShapes(requireBf16Kernel("avx2")); }

TEST_CASE("bf16 decode kernel avx512bf16 against a double reference") {
  checkSkinnyShapes(requireBf16Kernel("avx512bf16"));
}

TEST_CASE("the GEMM on bf16 weights equals the f32 GEMM on the widened weights, bit for bit") {
  for (kc::GemmKernel g : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric}) {
    if (!kc::gemmKernelSupported(g)) continue;  // each supported kernel; the f32 tests skip by name
    for (int k : {5, 64, 700}) {
      const int m = 45, n = 77;
      const auto a = normals(size_t(m) * k, 1);
      const auto wf = normals(size_t(n) * k, 2);
      std::vector<uint16_t> w(wf.size());
      kc::f32ToBf16(wf.data(), w.data(), w.size());
      std::vector<float> wide(w.size());
      for (size_t i = 0; i < w.size(); ++i) wide[i] = kc::bf16ToF32(w[i]);
      std::vector<float> c1(size_t(m) * n, 0.5f), c2 = c1;
      kc::GemmWorkspace ws;
      kc::gemmBf16(g, m, 0, n, k, a.data(), k, w.data(), k, 1.0f, c1.data(), n, ws);
      kc::gemm(g, m, 0, n, k, a.data(), k, wide.data(), k, kc::GemmB::kNK, 1.0f, c2.data(), n, ws);
      INFO(kc::gemmKernelInfo(g).name << " k=" << k);
      CHECK(c1 == c2);
    }
  }
}

TEST_CASE("unknown weight formats and bf16 kernels are refused by name") {
  auto m = loadModel(makeTestModel("llama_tiny", {}));
  REQUIRE(m.status().toString() == "OK");
  TestKv kv((*m)->config, 8);
  CpuBackendOptions o;
  o.weightFormat = "int4";
  auto b = createCpuBackend(*m, kv.layout, kv.data.data(), o);
  CHECK(b.status().toString().find("unknown weightFormat \"int4\" (f32|bf16|q8_0)") != std::string::npos);
  o.weightFormat = "bf16";
  o.bf16Kernel = "sse";
  b = createCpuBackend(*m, kv.layout, kv.data.data(), o);
  CHECK(b.status().toString().find("unknown bf16Kernel \"sse\"") != std::string::npos);
  o.bf16Kernel = "";
  o.weightFormat = "q8_0";
  o.q8Kernel = "sse";
  b = createCpuBackend(*m, kv.layout, kv.data.data(), o);
  CHECK(b.status().toString().find("unknown q8Kernel \"sse\" (avx512vnni|avx2|generic)") != std::string::npos);
}

// Model level: four fixed prompts, prefill + 16 greedy steps with f32 and with bf16 weights.
// Agreement: the share of generated tokens equal at the same position. Logit error: max |bf16
// - f32| / max |f32| over the rows both computed from the same tokens (prefill and decode up to
// the first divergence). Measured values are printed; the bounds are in the docs.
void checkAgreement(const std::string& format, const std::string& preset, double minAgreement, double maxLogitErr,
                    const std::string& bf16Kernel = "") {
  MakeModelOptions mo;
  mo.preset = preset;
  auto model = loadModel(makeTestModel("llama_" + preset, mo));
  REQUIRE(model.status().toString() == "OK");
  int same = 0, total = 0;
  double worst = 0;
  for (uint64_t seed : {11, 12, 13, 14}) {
    const auto prompt = testPrompt(24, seed);
    TestKv kv1((*model)->config, 8), kv2((*model)->config, 8);
    auto f32 = makeBackend(*model, kv1);
    CpuBackendOptions o;
    o.weightFormat = format;
    (format == "q8_0" ? o.q8Kernel : o.bf16Kernel) = bf16Kernel;  // the forced decode kernel, if any
    auto bf16 = makeBackend(*model, kv2, o);
    std::vector<int32_t> g1, g2;
    const auto r1 = runGreedy(*f32, kv1, prompt, 0, 16, &g1);
    const auto r2 = runGreedy(*bf16, kv2, prompt, 0, 16, &g2);
    size_t diverge = 0;
    while (diverge < g1.size() && g1[diverge] == g2[diverge]) ++diverge;
    for (size_t i = 0; i < g1.size(); ++i) same += g1[i] == g2[i];
    total += int(g1.size());
    for (size_t i = 0; i <= diverge && i < r1.size(); ++i) worst = std::max(worst, relError(r2[i], r1[i]));
  }
  const double agreement = double(same) / total;
  std::printf("%s weights (%s), %s preset: greedy agreement %d/%d = %.3f, max logit error %.2e\n", format.c_str(),
              bf16Kernel.empty() ? "best kernel" : bf16Kernel.c_str(), preset.c_str(), same, total, agreement, worst);
  CHECK(agreement >= minAgreement);
  CHECK(worst <= maxLogitErr);
  CHECK(worst > 0);  // the weights really were rounded
}

TEST_CASE("bf16 weights agree with f32 on the tiny preset") { checkAgreement("bf16", "tiny", 0.75, 2e-2); }
TEST_CASE("bf16 weights agree with f32 on the small preset") { checkAgreement("bf16", "small", 0.9, 2e-2); }
TEST_CASE("bf16 weights agree with f32 with the avx2 bf16 kernel forced") {
  requireBf16Kernel("avx2");
  checkAgreement("bf16", "tiny", 0.75, 2e-2, "avx2");
  checkAgreement("bf16", "small", 0.9, 2e-2, "avx2");
}
TEST_CASE("bf16 weights agree with f32 with the avx512bf16 kernel forced") {
  requireBf16Kernel("avx512bf16");
  checkAgreement("bf16", "tiny", 0.75, 2e-2, "avx512bf16");
  checkAgreement("bf16", "small", 0.9, 2e-2, "avx512bf16");
}
TEST_CASE("q8_0 weights agree with f32 on the tiny preset") { checkAgreement("q8_0", "tiny", 0.75, 3e-2); }
TEST_CASE("q8_0 weights agree with f32 on the small preset") { checkAgreement("q8_0", "small", 0.6, 6e-2); }
TEST_CASE("q8_0 weights agree with f32 with the avx2 q8_0 kernel forced") {
  requireQ8Kernel("avx2");
  checkAgreement("q8_0", "tiny", 0.75, 3e-2, "avx2");
}
TEST_CASE("q8_0 weights agree with f32 with the generic q8_0 kernel forced") {
  requireQ8Kernel("generic");
  checkAgreement("q8_0", "tiny", 0.75, 3e-2, "generic");
}

TEST_CASE("q8_0 quantization: error <= block max / 254, zero blocks, tail blocks") {
  for (int k : {1, 31, 32, 33, 100, 512}) {
    const int n = 5;
    auto w = normals(size_t(n) * k, 40 + k);
    for (int p = 0; p < std::min(k, 32); ++p) w[p] = 0.0f;  // row 0's first block all zero
    std::vector<int8_t> q(w.size());
    std::vector<float> sc(size_t(n) * kc::q8BlocksPerRow(k)), back(w.size());
    kc::q8Quantize(w.data(), n, k, q.data(), sc.data());
    kc::q8Dequantize(q.data(), sc.data(), n, k, back.data());
    double worstRatio = 0;
    for (int j = 0; j < n; ++j)
      for (int p = 0; p < k; ++p) {
        const int b = p / 32;
        double amax = 0;
        for (int t = b * 32; t < std::min(k, b * 32 + 32); ++t)
          amax = std::max(amax, std::fabs(double(w[size_t(j) * k + t])));
        const double err = std::fabs(double(back[size_t(j) * k + p]) - w[size_t(j) * k + p]);
        const double bound = amax / 254 * (1 + 1e-6) + 1e-30;
        INFO("k=" << k << " row " << j << " col " << p);
        REQUIRE(err <= bound);
        if (amax > 0) worstRatio = std::max(worstRatio, err / (amax / 254));
        CHECK(std::abs(int(q[size_t(j) * k + p])) <= 127);
      }
    CHECK(sc[0] == 0.0f);
    if (k >= 100) CHECK(worstRatio > 0.5);  // the step really is max / 127
  }
}

namespace {

// The kernel against a double reference over the dequantized weights and the f32 input, within
// the header's bound: the input's rounding to int8 blocks (xs_b / 2 per column, times the
// block's sum |w^|) plus f32 arithmetic, gamma(k + 4) * (S + that rounding term). Shapes:
// m 1..32 (the 8-row, 4x2 and 4x1 groups), k with partial blocks and partial 64-column steps,
// two column ranges that are not multiples of 4, beta 0 (NaNs in y) and 1.
void checkQ8Kernel(kc::Q8Kernel kern) {
  uint64_t seed = 70;
  double worstShare = 0;
  for (int m : {1, 2, 3, 7, 32})
    for (int k : {1, 31, 33, 64, 100, 515})
      for (float beta : {0.0f, 1.0f}) {
        const int n = 37, ldx = k + 3, ldy = n + 2;
        const auto x = normals(size_t(m) * ldx, seed);
        const auto wf = normals(size_t(n) * k, seed + 1);
        std::vector<int8_t> q(wf.size());
        std::vector<float> sc(size_t(n) * kc::q8BlocksPerRow(k)), w(wf.size());
        kc::q8Quantize(wf.data(), n, k, q.data(), sc.data());
        kc::q8Dequantize(q.data(), sc.data(), n, k, w.data());
        auto y0 = normals(size_t(m) * ldy, seed + 2);
        if (beta == 0.0f)
          for (auto& v : y0) v = std::numeric_limits<float>::quiet_NaN();
        auto y = y0;
        kc::linearSkinnyQ8(kern, x.data(), ldx, q.data(), sc.data(), y.data(), ldy, m, k, 0, 19, beta);
        kc::linearSkinnyQ8(kern, x.data(), ldx, q.data(), sc.data(), y.data(), ldy, m, k, 19, n, beta);
        const double u = std::ldexp(1.0, -24), kk = k + 4, gamma = kk * u / (1 - kk * u);
        int bad = 0;
        for (int i = 0; i < m; ++i)
          for (int j = 0; j < n; ++j) {
            double exact = 0, mag = 0, rounding = 0;
            for (int b = 0; b * 32 < k; ++b) {
              double xmax = 0, wsum = 0;
              for (int p = b * 32; p < std::min(k, b * 32 + 32); ++p) {
                const double t = double(x[size_t(i) * ldx + p]) * w[size_t(j) * k + p];
                exact += t;
                mag += std::fabs(t);
                xmax = std::max(xmax, std::fabs(double(x[size_t(i) * ldx + p])));
                wsum += std::fabs(double(w[size_t(j) * k + p]));
              }
              rounding += xmax / 127 / 2 * wsum;
            }
            if (beta != 0.0f) {
              exact += double(y0[size_t(i) * ldy + j]);
              mag += std::fabs(double(y0[size_t(i) * ldy + j]));
            }
            const double err = std::fabs(double(y[size_t(i) * ldy + j]) - exact);
            const double bound = rounding * (1 + std::ldexp(1.0, -20)) + gamma * (mag + rounding) + 1e-30;
            worstShare = std::max(worstShare, err / bound);
            if (!(err <= bound)) ++bad;
          }
        INFO(kc::q8KernelName(kern) << " m=" << m << " k=" << k << " beta=" << beta);
        CHECK(bad == 0);
        ++seed;
      }
  // The input really is rounded to int8 blocks (an f32 kernel would sit far below the bound).
  CHECK(worstShare > 0.05);
}

}  // namespace

TEST_CASE("q8_0 decode kernel generic against a double reference") { checkQ8Kernel(requireQ8Kernel("generic")); }
TEST_CASE("q8_0 decode kernel avx2 against a double reference") { checkQ8Kernel(requireQ8Kernel("avx2")); }
TEST_CASE("q8_0 decode kernel avx512vnni against a double reference") { checkQ8Kernel(requireQ8Kernel("avx512vnni")); }

TEST_CASE("q8_0 decode kernels agree with the generic one on a decode-sized row") {
  // One token against 64 rows of k = 512: every kernel computes the same exact integer block
  // sums, so they differ only by f32 summation order.
  const int n = 64, k = 512;
  const auto x = normals(k, 5);
  const auto wf = normals(size_t(n) * k, 6);
  std::vector<int8_t> q(wf.size());
  std::vector<float> sc(size_t(n) * kc::q8BlocksPerRow(k));
  kc::q8Quantize(wf.data(), n, k, q.data(), sc.data());
  std::vector<float> ref(n), y(n);
  kc::linearSkinnyQ8(kc::Q8Kernel::kGeneric, x.data(), k, q.data(), sc.data(), ref.data(), n, 1, k, 0, n, 0.0f);
  for (kc::Q8Kernel kern : {kc::Q8Kernel::kAvx2, kc::Q8Kernel::kAvx512Vnni}) {
    if (!kc::q8KernelSupported(kern)) continue;  // the shape tests above skip by name
    kc::linearSkinnyQ8(kern, x.data(), k, q.data(), sc.data(), y.data(), n, 1, k, 0, n, 0.0f);
    for (int j = 0; j < n; ++j) {
      INFO(kc::q8KernelName(kern) << " column " << j);
      CHECK(std::fabs(y[j] - ref[j]) <= 1e-5 * (1 + std::fabs(ref[j])));
    }
  }
}

TEST_CASE("the GEMM on q8_0 weights equals the f32 GEMM on the dequantized weights, bit for bit") {
  for (kc::GemmKernel g : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric}) {
    if (!kc::gemmKernelSupported(g)) continue;
    for (int k : {5, 64, 700}) {
      const int m = 45, n = 77;
      const auto a = normals(size_t(m) * k, 1);
      const auto wf = normals(size_t(n) * k, 2);
      std::vector<int8_t> q(wf.size());
      std::vector<float> sc(size_t(n) * kc::q8BlocksPerRow(k)), wide(wf.size());
      kc::q8Quantize(wf.data(), n, k, q.data(), sc.data());
      kc::q8Dequantize(q.data(), sc.data(), n, k, wide.data());
      std::vector<float> c1(size_t(m) * n, 0.5f), c2 = c1;
      kc::GemmWorkspace ws;
      kc::gemmQ8(g, m, 0, n, k, a.data(), k, q.data(), sc.data(), 1.0f, c1.data(), n, ws);
      kc::gemm(g, m, 0, n, k, a.data(), k, wide.data(), k, kc::GemmB::kNK, 1.0f, c2.data(), n, ws);
      INFO(kc::gemmKernelInfo(g).name << " k=" << k);
      CHECK(c1 == c2);
    }
  }
}

TEST_CASE("a model loaded as bf16 / q8_0 holds no f32 linear weights and computes what the f32 model converted does") {
  MakeModelOptions mo;
  mo.preset = "tiny";
  const std::string dir = makeTestModel("llama_tiny", mo);
  auto f32 = loadModel(dir);
  REQUIRE(f32.status().toString() == "OK");
  for (const std::string format : {"bf16", "q8_0"}) {
    INFO(format);
    auto compact = loadModel(dir, format);
    REQUIRE(compact.status().toString() == "OK");
    const ModelWeights& m = **compact;
    CHECK(m.weightFormat == format);
    size_t linear = 0;
    for (const LayerWeights& l : m.layers) {
      CHECK(l.qkv.empty());
      CHECK(l.o.empty());
      CHECK(l.gateUp.empty());
      CHECK(l.down.empty());
      CHECK(!l.qkvCompact.empty());
      CHECK(!l.downCompact.empty());
      linear += l.qkvCompact.bytes() + l.oCompact.bytes() + l.gateUpCompact.bytes() + l.downCompact.bytes();
    }
    // Resident bytes: the f32 model's less the linear weights' f32 bytes, plus their compact ones
    // (2 bytes a weight for bf16, 1 + 4/32 for q8_0).
    const size_t linearF32 = (*f32)->totalBytes() - m.f32Bytes();
    CHECK(m.totalBytes() == m.f32Bytes() + linear);
    CHECK(double(linear) / double(linearF32) == Approx(format == "bf16" ? 0.5 : 1.125 / 4).epsilon(0.05));
    // The same logits as a backend converting the f32 model itself (same rounding), bit for bit.
    const auto prompt = testPrompt(24, 11);
    TestKv kv1(m.config, 8), kv2(m.config, 8);
    CpuBackendOptions o;
    o.weightFormat = format;
    auto fromF32 = makeBackend(*f32, kv1, o);
    auto fromCompact = makeBackend(*compact, kv2, o);
    std::vector<int32_t> g1, g2;
    const auto r1 = runGreedy(*fromF32, kv1, prompt, 0, 4, &g1);
    const auto r2 = runGreedy(*fromCompact, kv2, prompt, 0, 4, &g2);
    CHECK(g1 == g2);
    CHECK(r1 == r2);
    // A backend asking for another format is refused by name (the f32 copies are gone).
    o.weightFormat = format == "bf16" ? "q8_0" : "f32";
    auto other = createCpuBackend(*compact, kv2.layout, kv2.data.data(), o);
    CHECK(other.status().toString().find("loaded with weight format " + format) != std::string::npos);
  }
  CHECK(loadModel(dir, "int4").status().toString().find("loadModel: unknown weightFormat \"int4\"") !=
        std::string::npos);
}

TEST_CASE("q8_0 weights on a mixture-of-experts model: loaded compact or converted, the same logits") {
  // Qwen3-MoE tiny: layer 0 dense (mlp_only_layers), the others routed experts (kept f32).
  MakeModelOptions mo;
  mo.preset = "tiny";
  mo.arch = "qwen3_moe";
  const std::string dir = makeTestModel("qwen3_moe_tiny", mo);
  auto f32 = loadModel(dir);
  auto compact = loadModel(dir, "q8_0");
  REQUIRE(f32.status().toString() == "OK");
  REQUIRE(compact.status().toString() == "OK");
  const auto prompt = testPrompt(24, 12);
  TestKv kv1((*f32)->config, 8), kv2((*f32)->config, 8);
  CpuBackendOptions o;
  o.weightFormat = "q8_0";
  auto fromF32 = makeBackend(*f32, kv1, o);
  auto fromCompact = makeBackend(*compact, kv2, o);
  std::vector<int32_t> g1, g2;
  const auto r1 = runGreedy(*fromF32, kv1, prompt, 0, 4, &g1);
  const auto r2 = runGreedy(*fromCompact, kv2, prompt, 0, 4, &g2);
  CHECK(g1 == g2);
  CHECK(r1 == r2);
}
