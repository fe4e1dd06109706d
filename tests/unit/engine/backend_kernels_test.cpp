// The CPU kernels against plain scalar double-precision versions of the same math.
#include <cmath>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "pd/kernels/activation.h"
#include "pd/kernels/attention.h"
#include "pd/kernels/kv_cache.h"
#include "pd/kernels/norm.h"
#include "pd/kernels/rope.h"

namespace kc = pd::kernels::cpu;

namespace {

std::vector<float> randomVec(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("rmsNorm and swiGlu match scalar math") {
  const int rows = 3, dim = 67;  // odd size exercises the scalar tail
  auto x = randomVec(rows * dim, 1), w = randomVec(dim, 2);
  std::vector<float> out(rows * dim);
  kc::rmsNorm(x.data(), dim, w.data(), out.data(), dim, rows, dim, 1e-5f);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int i = 0; i < dim; ++i) CHECK(out[r * dim + i] == Approx(x[r * dim + i] * inv * w[i]).epsilon(1e-6));
  }
  const int ffn = 45;
  auto gu = randomVec(rows * 2 * ffn, 3, 4.0f);
  std::vector<float> act(rows * ffn);
  kc::swiGlu(gu.data(), act.data(), rows, ffn);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < ffn; ++i) {
      const double g = gu[r * 2 * ffn + i], u = gu[r * 2 * ffn + ffn + i];
      CHECK(act[r * ffn + i] == Approx(g / (1 + std::exp(-g)) * u).epsilon(1e-5).margin(1e-7));
    }
}

TEST_CASE("llama3 rope frequencies follow the published rule in all three bands") {
  const int hd = 128;
  std::vector<float> plain(hd / 2), scaled(hd / 2);
  kc::ropeInvFreq(plain.data(), hd, 500000.0, nullptr);
  kc::RopeLlama3Scaling s;  // factor 8, low 1, high 4, original 8192
  kc::ropeInvFreq(scaled.data(), hd, 500000.0, &s);
  int kept = 0, divided = 0, blended = 0;
  for (int i = 0; i < hd / 2; ++i) {
    const double f = 1.0 / std::pow(500000.0, 2.0 * i / hd);
    CHECK(plain[i] == Approx(f).epsilon(1e-6));
    const double wl = 2 * M_PI / f;
    double expect;
    if (wl < 8192.0 / 4) {
      expect = f;
      ++kept;
    } else if (wl > 8192.0 / 1) {
      expect = f / 8;
      ++divided;
    } else {
      const double sm = (8192.0 / wl - 1) / (4 - 1);
      expect = (1 - sm) * f / 8 + sm * f;
      ++blended;
    }
    CHECK(scaled[i] == Approx(expect).epsilon(1e-6));
  }
  CHECK(kept > 0);
  CHECK(divided > 0);
  CHECK(blended > 0);
}

TEST_CASE("paged attention and the GEMM-tile softmax match naive causal GQA attention") {
  const int hd = GENERATE(24, 20);  // 20: the scalar tails of the 8-wide loops
  const int numHeads = 6, numKvHeads = 2, blockSize = 4, numBlocks = 12;
  const int startPos = 13, n = 9, ctx = startPos + n;
  const int qStride = numHeads * hd + 5;  // padded rows, as in the fused qkv buffer
  const size_t tokenElems = size_t(numKvHeads) * hd;
  std::vector<float> pool(size_t(numBlocks) * 2 * blockSize * tokenElems, 0.0f);
  const std::vector<int32_t> table = {7, 2, 11, 0, 5, 9};  // 24 positions
  auto k = randomVec(size_t(ctx) * tokenElems, 4), v = randomVec(size_t(ctx) * tokenElems, 5);
  std::vector<int32_t> slots(ctx);
  for (int p = 0; p < ctx; ++p) slots[p] = table[p / blockSize] * blockSize + p % blockSize;
  kc::kvCacheWrite(pool.data(), k.data(), v.data(), int(tokenElems), slots.data(), ctx, blockSize, numKvHeads, hd);
  auto q = randomVec(size_t(n) * qStride, 6, 2.0f);
  const float scale = 1.0f / std::sqrt(float(hd));

  // Naive reference in double.
  std::vector<double> ref(size_t(n) * numHeads * hd);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < numHeads; ++h) {
      const int g = h / (numHeads / numKvHeads);
      const int len = startPos + t + 1;
      std::vector<double> s(len);
      double mx = -1e300;
      for (int p = 0; p < len; ++p) {
        double d = 0;
        for (int i = 0; i < hd; ++i) d += double(q[t * qStride + h * hd + i]) * k[p * tokenElems + g * hd + i];
        s[p] = d * scale;
        mx = std::max(mx, s[p]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int i = 0; i < hd; ++i) {
        double o = 0;
        for (int p = 0; p < len; ++p) o += s[p] / sum * v[p * tokenElems + g * hd + i];
        ref[(t * numHeads + h) * hd + i] = o;
      }
    }

  std::vector<float> out(size_t(n) * numHeads * hd, -1.0f);
  kc::pagedAttention(q.data(), qStride, pool.data(), table.data(), n, startPos, blockSize, numHeads, numKvHeads, hd, 0,
                     numKvHeads, scale, out.data(), numHeads * hd);
  for (size_t i = 0; i < out.size(); ++i) CHECK(out[i] == Approx(ref[i]).margin(2e-6));

  // GEMM-tile path, with the GEMMs written out as loops: gather, scores, softmax, P*V.
  std::vector<float> kg(size_t(ctx) * hd), vg(size_t(ctx) * hd);
  for (int h = 0; h < numHeads; ++h) {
    const int g = h / (numHeads / numKvHeads);
    kc::kvGatherHead(pool.data(), table.data(), ctx, blockSize, numKvHeads, hd, g, kg.data(), vg.data());
    for (int p = 0; p < ctx; ++p)
      for (int i = 0; i < hd; ++i) REQUIRE(kg[p * hd + i] == k[p * tokenElems + g * hd + i]);
    std::vector<float> scores(size_t(n) * ctx);
    for (int t = 0; t < n; ++t)
      for (int p = 0; p < ctx; ++p) {
        float d = 0;
        for (int i = 0; i < hd; ++i) d += q[t * qStride + h * hd + i] * kg[p * hd + i];
        scores[t * ctx + p] = d;
      }
    kc::causalSoftmaxRows(scores.data(), ctx, n, ctx, startPos, scale);
    for (int t = 0; t < n; ++t) {
      for (int p = startPos + t + 1; p < ctx; ++p) CHECK(scores[t * ctx + p] == 0.0f);
      for (int i = 0; i < hd; ++i) {
        double o = 0;
        for (int p = 0; p < ctx; ++p) o += double(scores[t * ctx + p]) * vg[p * hd + i];
        CHECK(o == Approx(ref[(t * numHeads + h) * hd + i]).margin(2e-6));
      }
    }
  }
}

#include "pd/kernels/linear.h"

TEST_CASE("linearSkinny matches a scalar matmul for odd shapes and both betas") {
  for (int m : {1, 2, 3, 8}) {
    const int n = 11, k = 37, ldx = 40, ldy = 13;
    auto x = randomVec(size_t(m) * ldx, 7 + m), w = randomVec(size_t(n) * k, 8);
    auto y0 = randomVec(size_t(m) * ldy, 9);
    for (float beta : {0.0f, 1.0f}) {
      auto y = y0;
      // Two column ranges, as two threads would split them.
      kc::linearSkinny(x.data(), ldx, w.data(), y.data(), ldy, m, k, 0, 4, beta);
      kc::linearSkinny(x.data(), ldx, w.data(), y.data(), ldy, m, k, 4, n, beta);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double s = beta * y0[i * ldy + j];
          for (int p = 0; p < k; ++p) s += double(x[i * ldx + p]) * w[j * k + p];
          CHECK(y[i * ldy + j] == Approx(s).margin(1e-5));
        }
        for (int j = n; j < ldy; ++j) CHECK(y[i * ldy + j] == y0[i * ldy + j]);  // untouched
      }
    }
  }
}

// Batch-1 decode takes the eight-row path, batches of two or more the four-row one: a token's
// outputs must be bit-identical either way, or its greedy ids would depend on the batch.
TEST_CASE("linearSkinny gives one input row the same bits alone as beside another row") {
  const int n = 45, k = 75, ldx = 80;  // 8-row groups, a 4-row group, a scalar tail
  auto x = randomVec(size_t(2) * ldx, 21), w = randomVec(size_t(n) * k, 22);
  for (float beta : {0.0f, 1.0f}) {
    auto y1 = randomVec(size_t(n), 23), y2 = randomVec(size_t(2) * n, 24);
    std::copy(y1.begin(), y1.end(), y2.begin());
    const auto y0 = y1;
    kc::linearSkinny(x.data(), ldx, w.data(), y1.data(), n, 1, k, 0, 28, beta);
    kc::linearSkinny(x.data(), ldx, w.data(), y1.data(), n, 1, k, 28, n, beta);
    kc::linearSkinny(x.data(), ldx, w.data(), y2.data(), n, 2, k, 0, n, beta);
    for (int j = 0; j < n; ++j) {
      CHECK(y1[j] == y2[j]);
      double s = beta * y0[j];
      for (int p = 0; p < k; ++p) s += double(x[p]) * w[j * k + p];
      CHECK(y1[j] == Approx(s).margin(1e-5));
    }
  }
}

#include "pd/kernels/gemm.h"

// The experts' weights are stored in the rows8 layout: the decode GEMV and the prefill GEMM
// over it must give the row-major kernels' bits, or a mixture-of-experts model's greedy ids
// would change with the layout. Shapes with n % 8 rows past the last group and k % 8 tails.
TEST_CASE("rows8 layout: the GEMV and the GEMM give the row-major kernels' bits") {
  for (auto [n, k] : {std::pair{16, 32}, {44, 75}, {13, 8}, {24, 341}}) {
    auto w = randomVec(size_t(n) * k, 31 + n), x = randomVec(size_t(40) * k, 32 + k);
    std::vector<float> il(w.size(), 0.0f);
    kc::rows8Interleave(w.data(), n, k, il.data());
    // Every element lands in its own place: the layout is a permutation.
    std::vector<int> hit(w.size(), 0);
    for (int j = 0; j < n; ++j)
      for (int p = 0; p < k; ++p) {
        const size_t at = kc::rows8Index(n, k, j, p);
        REQUIRE(at < il.size());
        ++hit[at];
        CHECK(il[at] == w[size_t(j) * k + p]);
      }
    for (int h : hit) CHECK(h == 1);
    for (int m : {1, 2, 3}) {
      for (float beta : {0.0f, 1.0f}) {
        auto a = randomVec(size_t(m) * n, 33), b = a;
        kc::linearSkinny(x.data(), k, w.data(), a.data(), n, m, k, 0, n, beta);
        // Split as the backend does for rows8 (multiples of 8), plus a split inside a group.
        const int cut = n > 8 ? 8 : n;
        kc::linearSkinnyRows8(x.data(), k, il.data(), b.data(), n, m, n, k, 0, cut / 2, beta);
        kc::linearSkinnyRows8(x.data(), k, il.data(), b.data(), n, m, n, k, cut / 2, cut, beta);
        kc::linearSkinnyRows8(x.data(), k, il.data(), b.data(), n, m, n, k, cut, n, beta);
        CHECK(a == b);
      }
    }
    const auto kern = kc::gemmBestKernel();
    const int m = 40;
    std::vector<float> a(size_t(m) * n), b(size_t(m) * n);
    kc::GemmWorkspace ws;
    kc::gemm(kern, m, 0, n, k, x.data(), k, w.data(), k, kc::GemmB::kNK, 0.0f, a.data(), n, ws);
    kc::gemmRows8(kern, m, 0, n, n, k, x.data(), k, il.data(), 0.0f, b.data(), n, ws);
    CHECK(a == b);
  }
}
