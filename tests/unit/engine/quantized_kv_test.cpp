// The quantized KV cache (engine.kv_cache_dtype; docs/kv_cache.md, "Quantized KV cache"): the
// row quantizers' round trips within the bounds pd/kernels/kv_cache.h states, the layout's
// bytes and fingerprint, paged attention over a bf16 / int8 / fp8 pool against a double
// reference (on the dequantized K/V: the kernel itself adds only f32 rounding; on the f32 K/V:
// the quantization's effect, bounded), and the model-level greedy agreement with an f32 cache.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "pd/kernels/attention.h"
#include "pd/kernels/kv_cache.h"
#include "tests/unit/engine/model_test_util.h"

namespace kc = pd::kernels::cpu;
using namespace pd::engine;
using namespace pd::engine::test;

namespace {

std::vector<float> normals(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

const char* formatName(kc::KvFormat f) {
  return f == kc::KvFormat::kF32    ? "f32"
         : f == kc::KvFormat::kBf16 ? "bf16"
         : f == kc::KvFormat::kInt8 ? "int8"
                                    : "fp8";
}

// The per-element bound of pd/kernels/kv_cache.h for a row whose max |x| is amax, plus f32
// rounding of the scale arithmetic (a few ulps of amax).
double roundTripBound(kc::KvFormat f, double x, double amax) {
  const double slack = amax * 4e-7;
  switch (f) {
    case kc::KvFormat::kF32:
      return 0;
    case kc::KvFormat::kBf16:
      return std::fabs(x) * std::ldexp(1.0, -8);
    case kc::KvFormat::kInt8:
      return amax / 254 + slack;
    case kc::KvFormat::kFp8:
      return std::max(std::fabs(x) * std::ldexp(1.0, -4), amax / 448 * std::ldexp(1.0, -10)) + slack;
  }
  return 0;
}

}  // namespace

TEST_CASE("fp8 e4m3: every finite code reads back and encodes to itself; rounding and saturation") {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = kc::fp8E4m3ToFloat(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      CHECK(std::isnan(v));
      continue;
    }
    ++finite;
    const uint8_t back = kc::fp8E4m3FromFloat(v);
    INFO("code " << c << " value " << v);
    if (v == 0.0f)
      CHECK((back & 0x7f) == 0);
    else
      CHECK(back == uint8_t(c));
  }
  CHECK(finite == 254);
  // The vector dequantizer (8 at a time) against the scalar table, every finite code, in
  // every lane position and the scalar tail.
  std::vector<uint8_t> all;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7f) != 0x7f) all.push_back(uint8_t(c));
  std::vector<float> wide(all.size());
  kc::kvDequantizeRow(all.data(), 0.75f, int(all.size()), kc::KvFormat::kFp8, wide.data());
  for (size_t i = 0; i < all.size(); ++i) {
    INFO("code " << int(all[i]));
    CHECK(wide[i] == kc::fp8E4m3ToFloat(all[i]) * 0.75f);
  }
  CHECK(kc::fp8E4m3ToFloat(0x7e) == 448.0f);
  CHECK(kc::fp8E4m3ToFloat(0x01) == std::ldexp(1.0f, -9));  // the smallest subnormal
  CHECK(kc::fp8E4m3FromFloat(1e6f) == 0x7e);                // saturates, no infinity
  CHECK(kc::fp8E4m3FromFloat(-1e6f) == 0xfe);
  CHECK(kc::fp8E4m3FromFloat(1.0625f) == kc::fp8E4m3FromFloat(1.0f));   // tie to even (mantissa 0)
  CHECK(kc::fp8E4m3FromFloat(1.1875f) == kc::fp8E4m3FromFloat(1.25f));  // tie to even (mantissa 2)
  CHECK(kc::fp8E4m3ToFloat(kc::fp8E4m3FromFloat(1.07f)) == 1.125f);     // nearest
  CHECK(std::isnan(kc::fp8E4m3ToFloat(kc::fp8E4m3FromFloat(std::nanf("")))));
}

TEST_CASE("KV row quantizers: round trips within the stated bounds, zero rows, tails") {
  for (kc::KvFormat f : {kc::KvFormat::kF32, kc::KvFormat::kBf16, kc::KvFormat::kInt8, kc::KvFormat::kFp8}) {
    for (int n : {8, 13, 64, 128}) {
      for (float sigma : {1e-3f, 1.0f, 300.0f}) {
        auto x = normals(size_t(n), 100 + n, sigma);
        x[n / 2] *= 8;  // an outlier: the scale follows it, the small values lose precision
        std::vector<uint8_t> codes(size_t(n) * 4);
        float scale = -1;
        kc::kvQuantizeRow(x.data(), n, f, codes.data(), &scale);
        std::vector<float> back(n);
        kc::kvDequantizeRow(codes.data(), scale, n, f, back.data());
        double amax = 0;
        for (float v : x) amax = std::max(amax, double(std::fabs(v)));
        int bad = 0;
        double worst = 0;
        for (int i = 0; i < n; ++i) {
          const double err = std::fabs(double(back[i]) - x[i]);
          const double bound = roundTripBound(f, x[i], amax);
          worst = std::max(worst, err / std::max(bound, 1e-30));
          bad += !(err <= bound);
        }
        INFO(formatName(f) << " n=" << n << " sigma=" << sigma << " worst err/bound " << worst);
        CHECK(bad == 0);
        if (f == kc::KvFormat::kInt8 || f == kc::KvFormat::kFp8) CHECK(worst > 0.05);  // it really rounded
      }
    }
    std::vector<float> zeros(40, 0.0f), back(40, 1.0f);
    std::vector<uint8_t> codes(160, 0xff);
    float scale = -1;
    kc::kvQuantizeRow(zeros.data(), 40, f, codes.data(), &scale);
    kc::kvDequantizeRow(codes.data(), scale, 40, f, back.data());
    for (float v : back) CHECK(v == 0.0f);
  }
}

TEST_CASE("the KV layout's bytes and fingerprint name the dtype and its scales") {
  KvLayout l;
  l.numLayers = 2;
  l.numBlocks = 3;
  l.blockSize = 16;
  l.numKvHeads = 2;
  l.headDim = 64;
  const size_t elems = 2 * 16 * 2 * 64;
  l.dtype = KvDtype::kF32;
  CHECK(l.blockBytes() == elems * 4);
  CHECK(l.fingerprint() == "L2.B16.H2.D64.f32");
  l.dtype = KvDtype::kBF16;
  CHECK(l.blockBytes() == elems * 2);
  CHECK(l.fingerprint() == "L2.B16.H2.D64.bf16");
  l.dtype = KvDtype::kInt8;
  CHECK(l.blockBytes() == elems + 2 * 16 * 2 * 4);  // codes + an f32 scale per token, head, k|v
  CHECK(l.scalesOffsetInBlock() == elems);
  CHECK(l.fingerprint() == "L2.B16.H2.D64.int8-tks32");
  l.dtype = KvDtype::kFp8;
  CHECK(l.fingerprint() == "L2.B16.H2.D64.fp8-tks32");
  CHECK(l.totalBytes() == l.blockBytes() * 3 * 2);
  // The kernels' view of one block agrees with the layout's.
  kc::PagedKv p;
  p.format = kc::KvFormat::kFp8;
  p.blockSize = 16;
  p.numKvHeads = 2;
  p.headDim = 64;
  CHECK(p.blockBytes() == l.blockBytes());
  CHECK(p.dataBytes() == l.scalesOffsetInBlock());
}

TEST_CASE("paged attention over a bf16 / int8 / fp8 pool against the f32 reference") {
  const kc::KvFormat f = GENERATE(kc::KvFormat::kBf16, kc::KvFormat::kInt8, kc::KvFormat::kFp8);
  const int hd = GENERATE(64, 20);  // 20: the scalar tails of the 8-wide loops
  const int numHeads = 8, numKvHeads = 2, blockSize = 4, numBlocks = 24;
  const int startPos = 40, n = 5, ctx = startPos + n;  // ctx > 32: more than one key tile
  const int qStride = numHeads * hd + 3;
  const size_t tokenElems = size_t(numKvHeads) * hd;
  std::vector<int32_t> table(numBlocks);
  for (int b = 0; b < numBlocks; ++b) table[b] = (b * 7 + 3) % numBlocks;  // scattered block ids
  auto k = normals(size_t(ctx) * tokenElems, 4), v = normals(size_t(ctx) * tokenElems, 5);
  std::vector<int32_t> slots(ctx);
  for (int p = 0; p < ctx; ++p) slots[p] = table[p / blockSize] * blockSize + p % blockSize;
  kc::PagedKv kv;
  kv.format = f;
  kv.blockSize = blockSize;
  kv.numKvHeads = numKvHeads;
  kv.headDim = hd;
  std::vector<uint8_t> pool(kv.blockBytes() * numBlocks + 64, 0);
  kv.layer = pool.data();
  kc::kvCacheWrite(kv, k.data(), v.data(), int(tokenElems), slots.data(), ctx);
  // The pool's own values, read back (the gather must give exactly the row dequantizer's).
  std::vector<float> kq(k.size()), vq(v.size());
  for (int g = 0; g < numKvHeads; ++g) {
    std::vector<float> kg(size_t(ctx) * hd), vg(size_t(ctx) * hd);
    kc::kvGatherHead(kv, table.data(), ctx, g, kg.data(), vg.data());
    for (int p = 0; p < ctx; ++p)
      for (int i = 0; i < hd; ++i) {
        kq[p * tokenElems + g * hd + i] = kg[p * hd + i];
        vq[p * tokenElems + g * hd + i] = vg[p * hd + i];
      }
  }
  auto q = normals(size_t(n) * qStride, 6, 2.0f);
  const float scale = 1.0f / std::sqrt(float(hd));
  auto reference = [&](const std::vector<float>& K, const std::vector<float>& V) {
    std::vector<double> ref(size_t(n) * numHeads * hd);
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < numHeads; ++h) {
        const int g = h / (numHeads / numKvHeads), len = startPos + t + 1;
        std::vector<double> s(len);
        double mx = -1e300;
        for (int p = 0; p < len; ++p) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += double(q[t * qStride + h * hd + i]) * K[p * tokenElems + g * hd + i];
          mx = std::max(mx, s[p] = d * scale);
        }
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int i = 0; i < hd; ++i) {
          double o = 0;
          for (int p = 0; p < len; ++p) o += s[p] / sum * V[p * tokenElems + g * hd + i];
          ref[(t * numHeads + h) * hd + i] = o;
        }
      }
    return ref;
  };
  const auto refQ = reference(kq, vq), refF = reference(k, v);
  std::vector<float> out(size_t(n) * numHeads * hd, -1.0f);
  kc::pagedAttention(q.data(), qStride, kv, table.data(), n, startPos, numHeads, 0, numKvHeads, scale, out.data(),
                     numHeads * hd);
  double errQ = 0, errF = 0, mag = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    errQ = std::max(errQ, std::fabs(out[i] - refQ[i]));
    errF = std::max(errF, std::fabs(out[i] - refF[i]));
    mag = std::max(mag, std::fabs(refF[i]));
  }
  // Bounds: on the dequantized K/V the kernel is the f32 kernel (2e-6 as its own test); the
  // quantization's effect on attention outputs of unit-variance K/V: bf16 1%, fp8 8%, int8
  // 3% of the largest output (measured 0.3-0.7 of each here; printed).
  const double boundF = f == kc::KvFormat::kBf16 ? 0.01 : f == kc::KvFormat::kInt8 ? 0.03 : 0.08;
  std::printf("paged attention %s hd=%d: max error vs the dequantized reference %.2e, vs f32 %.2e (%.2e relative)\n",
              formatName(f), hd, errQ, errF, errF / mag);
  CHECK(errQ <= 2e-6);
  CHECK(errF / mag <= boundF);
  CHECK(errF > 0);  // the pool really was narrower
}

TEST_CASE("the cpu backend refuses an f16 KV cache by name") {
  MakeModelOptions mo;
  mo.preset = "tiny";
  auto m = loadModel(makeTestModel("llama_tiny", mo));
  REQUIRE(m.status().toString() == "OK");
  TestKv kv((*m)->config, 4, 16, 7, KvDtype::kF16);
  auto b = createCpuBackend(*m, kv.layout, kv.data.data(), {});
  CHECK(b.status().toString().find("KV dtype f16") != std::string::npos);
}

// Model level, as for quantized weights (quantized_weights_test.cpp): four fixed prompts of 24
// tokens, prefill (one chunk through the GEMM attention path, then in chunks of 5 through the
// paged kernel) + 16 greedy steps with an f32 KV cache and with `dtype`. Agreement: the share
// of generated tokens equal at the same position; logit error: max |q - f32| / max |f32| over
// the rows computed from the same tokens. Measured values printed; bounds in the docs.
void checkKvAgreement(KvDtype dtype, const std::string& preset, double minAgreement, double maxLogitErr) {
  MakeModelOptions mo;
  mo.preset = preset;
  auto model = loadModel(makeTestModel("llama_" + preset, mo));
  REQUIRE(model.status().toString() == "OK");
  int same = 0, total = 0;
  double worst = 0;
  for (int chunk : {0, 5}) {
    for (uint64_t seed : {11, 12, 13, 14}) {
      const auto prompt = testPrompt(24, seed);
      TestKv kv1((*model)->config, 8), kv2((*model)->config, 8, 16, 7, dtype);
      CpuBackendOptions o;
      o.gemmAttentionMinTokens = 8;  // chunk 0 (24 tokens) takes the gather + GEMM path
      auto f32 = makeBackend(*model, kv1, o);
      auto q = makeBackend(*model, kv2, o);
      std::vector<int32_t> g1, g2;
      const auto r1 = runGreedy(*f32, kv1, prompt, chunk, 16, &g1);
      const auto r2 = runGreedy(*q, kv2, prompt, chunk, 16, &g2);
      size_t diverge = 0;
      while (diverge < g1.size() && g1[diverge] == g2[diverge]) ++diverge;
      for (size_t i = 0; i < g1.size(); ++i) same += g1[i] == g2[i];
      total += int(g1.size());
      for (size_t i = 0; i <= diverge && i < r1.size(); ++i) worst = std::max(worst, relError(r2[i], r1[i]));
    }
  }
  const double agreement = double(same) / total;
  std::printf("%s KV cache, %s preset: greedy agreement %d/%d = %.3f, max logit error %.2e\n", kvDtypeName(dtype),
              preset.c_str(), same, total, agreement, worst);
  CHECK(agreement >= minAgreement);
  CHECK(worst <= maxLogitErr);
  CHECK(worst > 0);  // the cache really was narrower
}

TEST_CASE("a bf16 KV cache agrees with f32") {
  checkKvAgreement(KvDtype::kBF16, "tiny", 0.9, 1e-2);
  checkKvAgreement(KvDtype::kBF16, "small", 0.9, 1e-2);
}
TEST_CASE("an int8 KV cache agrees with f32") {
  checkKvAgreement(KvDtype::kInt8, "tiny", 0.75, 3e-2);
  checkKvAgreement(KvDtype::kInt8, "small", 0.75, 3e-2);
}
TEST_CASE("an fp8 KV cache agrees with f32") {
  checkKvAgreement(KvDtype::kFp8, "tiny", 0.6, 8e-2);
  checkKvAgreement(KvDtype::kFp8, "small", 0.6, 8e-2);
}
