// Every CUDA kernel against its CPU twin (pd/kernels/*.h) on random inputs (never zeros),
// outputs NaN-poisoned before each run, relative error thresholds per dtype: f32 < 1e-5,
// bf16 / f16 < 1e-2 (16-bit inputs are rounded the same way on the CPU side first).
// Every case skips with a message when no CUDA device is present.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "pd/kernels/activation.h"
#include "pd/kernels/attention.h"
#include "pd/kernels/cuda/attention.h"
#include "pd/kernels/cuda/linear_fp8.h"
#include "pd/kernels/cuda/mla.h"
#include "pd/kernels/cuda/moe.h"
#include "pd/kernels/cuda/ops.h"
#include "pd/kernels/embedding.h"
#include "pd/kernels/kv_cache.h"
#include "pd/kernels/norm.h"
#include "pd/kernels/rope.h"

namespace cpu = pd::kernels::cpu;
namespace kcu = pd::kernels::cuda;
using kcu::DType;
using namespace pd::kernels::cuda::test;

namespace {
const DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
}

TEST_CASE("cuda rmsNorm matches the CPU twin", "[cuda][kernels]") {
  if (!haveGpu()) return;
  const int rows = 7, dim = 200, stride = 211;
  const auto x = randomVec(size_t(rows) * stride, 1, -3, 3);
  const auto w = randomVec(dim, 2, 0.5f, 1.5f);
  std::vector<float> want(size_t(rows) * dim);
  cpu::rmsNorm(x.data(), stride, w.data(), want.data(), dim, rows, dim, 1e-5f);
  auto dx = upload(x);
  auto dw = upload(w);
  for (DType dt : kDtypes) {
    DYNAMIC_SECTION("out " << kcu::dtypeName(dt)) {
      DevBuf out(size_t(rows) * dim * kcu::dtypeBytes(dt));
      PD_CUDA_CHECK(
          kcu::rmsNorm(dx->as<float>(), stride, dw->as<float>(), out.as(), dt, dim, rows, dim, 1e-5f, nullptr));
      CHECK(relError(downloadAs(out.as(), dt, want.size()), want) < tolerance(dt));
    }
  }
}

// Qwen3's q_norm / k_norm: each head of each token row normalised in place; the CPU backend
// runs cpu::rmsNorm over a token's heads (engine/cpu_backend.cpp), which is the twin here.
// Row stride wider than the heads, so the values past them must stay untouched.
TEST_CASE("cuda headRmsNorm matches rmsNorm over each token's heads", "[cuda][kernels]") {
  if (!haveGpu()) return;
  for (int headDim : {16, 64, 128, 200}) {
    DYNAMIC_SECTION("headDim " << headDim) {
      const int tokens = 13, heads = 6, stride = heads * headDim + 40;  // 40: other heads / padding
      const auto x = randomVec(size_t(tokens) * stride, 21, -3, 3);
      const auto w = randomVec(headDim, 22, 0.5f, 1.5f);
      auto want = x;
      for (int t = 0; t < tokens; ++t) {
        float* row = want.data() + size_t(t) * stride;
        cpu::rmsNorm(row, headDim, w.data(), row, headDim, heads, headDim, 1e-6f);
      }
      auto dx = upload(x);
      auto dw = upload(w);
      PD_CUDA_CHECK(kcu::headRmsNorm(dx->as<float>(), stride, tokens, heads, headDim, dw->as<float>(), 1e-6f, nullptr));
      const auto got = download<float>(dx->as(), x.size());
      CHECK(relError(got, want) < 1e-5);
      for (int t = 0; t < tokens; ++t)  // the 40 values after the heads are not touched
        for (int i = heads * headDim; i < stride; ++i)
          REQUIRE(got[size_t(t) * stride + i] == x[size_t(t) * stride + i]);
    }
  }
}

// The mixture-of-experts gather and combine against the loops of engine/cpu_moe.cpp: rows
// routed to experts gathered by index (a copy: exact in every dtype), and each token's
// weighted expert outputs added in slot order.
TEST_CASE("cuda moeGatherRows and moeCombine match the CPU loops", "[cuda][kernels][moe]") {
  if (!haveGpu()) return;
  const int tokens = 9, k = 3, dim = 96, R = tokens * k;
  std::mt19937 rng(31);
  std::vector<int32_t> src(R);
  for (int32_t& r : src) r = int32_t(rng() % tokens);
  const auto xn = randomVec(size_t(tokens) * dim, 32);
  for (DType dt : kDtypes) {
    DYNAMIC_SECTION("gather " << kcu::dtypeName(dt)) {
      const auto rounded = roundedTo(xn, dt);
      std::vector<float> want(size_t(R) * dim);
      for (int r = 0; r < R; ++r)
        std::copy_n(rounded.begin() + size_t(src[r]) * dim, dim, want.begin() + size_t(r) * dim);
      auto din = uploadAs(xn, dt);
      auto drows = upload(src);
      DevBuf out(size_t(R) * dim * kcu::dtypeBytes(dt));
      PD_CUDA_CHECK(kcu::moeGatherRows(din->as(), dt, drows->as<int32_t>(), R, dim, out.as(), nullptr));
      CHECK(downloadAs(out.as(), dt, want.size()) == want);
    }
  }
  SECTION("combine") {
    // Each token's k slots: distinct rows of y (a permutation), weights in (0, 1).
    std::vector<int32_t> perm(R);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const auto weights = randomVec(R, 33, 0.05f, 1.0f);
    const auto y = randomVec(size_t(R) * dim, 34, -2, 2);
    const auto x = randomVec(size_t(tokens) * dim, 35, -2, 2);
    auto want = x;
    for (int t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j)
        for (int d = 0; d < dim; ++d)
          want[size_t(t) * dim + d] += weights[size_t(t) * k + j] * y[size_t(perm[size_t(t) * k + j]) * dim + d];
    auto dx = upload(x);
    auto dy = upload(y);
    auto dperm = upload(perm);
    auto dw = upload(weights);
    PD_CUDA_CHECK(kcu::moeCombine(dx->as<float>(), dy->as<float>(), dperm->as<int32_t>(), dw->as<float>(), tokens, k,
                                  dim, nullptr));
    CHECK(relError(download<float>(dx->as(), x.size()), want) < 1e-6);
  }
}

TEST_CASE("cuda RoPE (cos/sin tables and rotation, llama3 scaling) matches the CPU twin", "[cuda][kernels]") {
  if (!haveGpu()) return;
  for (int headDim : {64, 128}) {
    for (bool llama3 : {false, true}) {
      DYNAMIC_SECTION("headDim " << headDim << (llama3 ? " llama3" : "")) {
        const int half = headDim / 2, tokens = 9, heads = 5, stride = heads * headDim + 7;
        std::vector<float> invFreq(half);
        cpu::RopeLlama3Scaling s;
        cpu::ropeInvFreq(invFreq.data(), headDim, 500000.0, llama3 ? &s : nullptr);
        std::vector<int32_t> pos(tokens);
        std::mt19937 rng(3);
        for (int32_t& p : pos) p = int32_t(rng() % 131072);
        std::vector<float> cw(size_t(tokens) * half), sw(cw.size());
        cpu::ropeCosSin(pos.data(), tokens, invFreq.data(), half, cw.data(), sw.data());
        auto x = randomVec(size_t(tokens) * stride, 4);
        auto want = x;
        cpu::applyRope(want.data(), stride, tokens, heads, headDim, cw.data(), sw.data());

        auto dpos = upload(pos);
        auto dinv = upload(invFreq);
        DevBuf dc(cw.size() * 4), ds(sw.size() * 4);
        PD_CUDA_CHECK(kcu::ropeCosSin(dpos->as<int32_t>(), tokens, dinv->as<float>(), half, dc.as<float>(),
                                      ds.as<float>(), nullptr));
        CHECK(relError(download<float>(dc.as(), cw.size()), cw) < 1e-5);
        CHECK(relError(download<float>(ds.as(), sw.size()), sw) < 1e-5);
        auto dx = upload(x);
        PD_CUDA_CHECK(
            kcu::applyRope(dx->as<float>(), stride, tokens, heads, headDim, dc.as<float>(), ds.as<float>(), nullptr));
        CHECK(relError(download<float>(dx->as(), x.size()), want) < 1e-5);
      }
    }
  }
}

TEST_CASE("cuda swiGlu matches the CPU twin", "[cuda][kernels]") {
  if (!haveGpu()) return;
  const int rows = 5, ffn = 300;
  const auto gu = randomVec(size_t(rows) * 2 * ffn, 5, -4, 4);
  std::vector<float> want(size_t(rows) * ffn);
  cpu::swiGlu(gu.data(), want.data(), rows, ffn);
  auto dgu = upload(gu);
  for (DType dt : kDtypes) {
    DYNAMIC_SECTION("out " << kcu::dtypeName(dt)) {
      DevBuf out(want.size() * kcu::dtypeBytes(dt));
      PD_CUDA_CHECK(kcu::swiGlu(dgu->as<float>(), out.as(), dt, rows, ffn, nullptr));
      CHECK(relError(downloadAs(out.as(), dt, want.size()), want) < tolerance(dt));
    }
  }
}

TEST_CASE("cuda embeddingGather matches the CPU twin", "[cuda][kernels]") {
  if (!haveGpu()) return;
  const int vocab = 301, dim = 96, tokens = 11;
  std::vector<int32_t> ids(tokens);
  for (int i = 0; i < tokens; ++i) ids[i] = (i * 97 + 13) % vocab;
  auto dids = upload(ids);
  for (DType dt : kDtypes) {
    DYNAMIC_SECTION("table " << kcu::dtypeName(dt)) {
      const auto table = roundedTo(randomVec(size_t(vocab) * dim, 6), dt);
      std::vector<float> want(size_t(tokens) * dim);
      cpu::embeddingGather(table.data(), ids.data(), tokens, dim, want.data());
      auto dt16 = uploadAs(table, dt);
      DevBuf out(want.size() * 4);
      PD_CUDA_CHECK(kcu::embeddingGather(dt16->as(), dt, dids->as<int32_t>(), tokens, dim, out.as<float>(), nullptr));
      // The table holds exactly representable values: the gather is exact.
      CHECK(relError(download<float>(out.as(), want.size()), want) == 0.0);
    }
  }
}

TEST_CASE("cuda kvCacheWrite matches the CPU twin and skips negative slots", "[cuda][kernels]") {
  if (!haveGpu()) return;
  const int numBlocks = 6, blockSize = 8, kvHeads = 3, headDim = 32, tokens = 13;
  const int rowStride = 4 * kvHeads * headDim + 5;
  const size_t poolElems = size_t(numBlocks) * 2 * blockSize * kvHeads * headDim;
  std::vector<int32_t> slots(tokens);
  std::vector<int32_t> perm(numBlocks * blockSize);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  for (int t = 0; t < tokens; ++t) slots[t] = perm[t];
  auto rowsIn = randomVec(size_t(tokens) * rowStride, 8);
  const float* k = rowsIn.data() + 1;
  const float* v = rowsIn.data() + 1 + kvHeads * headDim;
  for (DType dt : kDtypes) {
    DYNAMIC_SECTION("cache " << kcu::dtypeName(dt)) {
      const auto rows = roundedTo(rowsIn, dt);
      const auto pool0 = roundedTo(randomVec(poolElems, 9), dt);  // a non-NaN "old" cache
      auto want = pool0;
      std::vector<int32_t> cpuSlots = slots;
      cpu::kvCacheWrite(want.data(), rows.data() + 1, rows.data() + 1 + kvHeads * headDim, rowStride, cpuSlots.data(),
                        tokens - 1, blockSize, kvHeads, headDim);
      // The last token's slot is -1 on the GPU: it must not be written.
      std::vector<int32_t> gpuSlots = slots;
      gpuSlots[tokens - 1] = -1;
      auto dpool = uploadAs(pool0, dt);
      auto drows = upload(rows);
      auto dslots = upload(gpuSlots);
      PD_CUDA_CHECK(kcu::kvCacheWrite(dpool->as(), dt, drows->as<float>() + 1,
                                      drows->as<float>() + 1 + kvHeads * headDim, rowStride, dslots->as<int32_t>(),
                                      tokens, blockSize, kvHeads, headDim, nullptr));
      CHECK(relError(downloadAs(dpool->as(), dt, poolElems), want) == 0.0);
    }
  }
  (void)k;
  (void)v;
}

TEST_CASE("cuda glue ops: conversions, gatherRows, broadcastRows, addRows", "[cuda][kernels]") {
  if (!haveGpu()) return;
  const int rows = 6, dim = 70, stride = 75;
  const auto x = randomVec(size_t(rows) * stride, 10);
  const auto bias = randomVec(dim, 11);
  const std::vector<int32_t> pick{5, 0, 3};
  auto dx = upload(x);
  auto db = upload(bias);
  auto dpick = upload(pick);
  DevBuf g(size_t(pick.size()) * dim * 4);
  PD_CUDA_CHECK(
      kcu::gatherRows(dx->as<float>(), stride, dpick->as<int32_t>(), int(pick.size()), dim, g.as<float>(), nullptr));
  std::vector<float> want(pick.size() * dim);
  for (size_t r = 0; r < pick.size(); ++r)
    for (int d = 0; d < dim; ++d) want[r * dim + d] = x[size_t(pick[r]) * stride + d];
  CHECK(relError(download<float>(g.as(), want.size()), want) == 0.0);

  DevBuf y(size_t(rows) * dim * 4);
  PD_CUDA_CHECK(kcu::broadcastRows(y.as<float>(), db->as<float>(), rows, dim, nullptr));
  PD_CUDA_CHECK(kcu::addRows(y.as<float>(), db->as<float>(), rows, dim, nullptr));
  std::vector<float> twice(size_t(rows) * dim);
  for (size_t i = 0; i < twice.size(); ++i) twice[i] = 2 * bias[i % dim];
  CHECK(relError(download<float>(y.as(), twice.size()), twice) == 0.0);

  for (DType dt : kDtypes) {
    const auto r = roundedTo(x, dt);
    auto d16 = uploadAs(x, dt);
    CHECK(relError(downloadAs(d16->as(), dt, x.size()), r) == 0.0);
  }
}

// Paged attention: a ragged batch of decode tokens and prefill chunks in one launch, each
// chunk compared with the CPU twin over all kv heads.
namespace {

struct Chunk {
  int startPos;
  int numTokens;
};

void checkAttention(int blockSize, int numHeads, int numKvHeads, int headDim, DType kvDt, DType outDt,
                    const std::vector<Chunk>& chunks, uint64_t seed) {
  const int group = numHeads / numKvHeads;
  const int qDim = numHeads * headDim, qStride = qDim + 3, outStride = qDim + 1;
  int totalTokens = 0, blocksNeeded = 0;
  for (const Chunk& c : chunks) {
    totalTokens += c.numTokens;
    blocksNeeded += (c.startPos + c.numTokens + blockSize - 1) / blockSize;
  }
  const int numBlocks = blocksNeeded + 3;
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  const size_t poolElems = size_t(numBlocks) * 2 * blockSize * tokenElems;
  const auto pool = roundedTo(randomVec(poolElems, seed, -2, 2), kvDt);
  const auto q = randomVec(size_t(totalTokens) * qStride, seed + 1, -2, 2);

  std::vector<int32_t> perm(numBlocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed + 2));
  std::vector<int32_t> tables;
  std::vector<kcu::AttnSeq> seqs;
  std::vector<kcu::AttnWork> work;
  int t = 0, next = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int need = (chunks[c].startPos + chunks[c].numTokens + blockSize - 1) / blockSize;
    seqs.push_back({t, chunks[c].numTokens, chunks[c].startPos, int32_t(tables.size())});
    for (int b = 0; b < need; ++b) tables.push_back(perm[next++]);
    kcu::appendAttnWork(work, int(c), chunks[c].numTokens, group);
    t += chunks[c].numTokens;
  }
  const float scale = 1.0f / std::sqrt(float(headDim));
  std::vector<float> want(size_t(totalTokens) * outStride, 0.0f);
  for (size_t c = 0; c < chunks.size(); ++c) {
    cpu::pagedAttention(q.data() + size_t(seqs[c].tokenStart) * qStride, qStride, pool.data(),
                        tables.data() + seqs[c].blockTableOffset, chunks[c].numTokens, chunks[c].startPos, blockSize,
                        numHeads, numKvHeads, headDim, 0, numKvHeads, scale,
                        want.data() + size_t(seqs[c].tokenStart) * outStride, outStride);
  }
  auto dpool = uploadAs(pool, kvDt);
  auto dq = upload(q);
  auto dtab = upload(tables);
  auto dseqs = upload(seqs);
  auto dwork = upload(work);
  DevBuf out(want.size() * kcu::dtypeBytes(outDt));
  PD_CUDA_CHECK(kcu::pagedAttentionInit());
  PD_CUDA_CHECK(kcu::pagedAttention(dq->as<float>(), qStride, dpool->as(), kvDt, dtab->as<int32_t>(),
                                    dseqs->as<kcu::AttnSeq>(), dwork->as<kcu::AttnWork>(), int(work.size()), blockSize,
                                    numHeads, numKvHeads, headDim, scale, out.as(), outDt, outStride, nullptr));
  auto got = downloadAs(out.as(), outDt, want.size());
  // The one padding column per row is never written: keep it out of the comparison.
  std::vector<float> g, w;
  for (int r = 0; r < totalTokens; ++r)
    for (int d = 0; d < qDim; ++d) {
      g.push_back(got[size_t(r) * outStride + d]);
      w.push_back(want[size_t(r) * outStride + d]);
    }
  const double err = relError(g, w);
  INFO("blockSize " << blockSize << " heads " << numHeads << "/" << numKvHeads << " headDim " << headDim << " kv "
                    << kcu::dtypeName(kvDt) << " out " << kcu::dtypeName(outDt) << " rel error " << err);
  CHECK(err < (outDt == DType::kF32 ? 1e-5 : 1e-2));
}

}  // namespace

TEST_CASE(
    "cuda paged attention matches the CPU twin across block sizes, heads, GQA ratios "
    "and ragged batches",
    "[cuda][kernels][attention]") {
  if (!haveGpu()) return;
  // Decode tokens at assorted positions, a fresh prefill, a mid-sequence chunk, a chunk
  // ending exactly on a block boundary.
  const std::vector<Chunk> ragged{{0, 1}, {37, 1}, {200, 1}, {0, 45}, {20, 17}, {15, 1}, {48, 16}};
  struct Shape {
    int heads, kvHeads, headDim;
  };
  const Shape shapes[] = {{4, 4, 64},    // MHA
                          {8, 2, 128},   // GQA 4
                          {32, 4, 128},  // GQA 8
                          {16, 1, 64},   // MQA, group 16 (one block per kv head)
                          {64, 2, 64},   // group 32: several blocks per decode token
                          {4, 2, 16},    // the tiny model's head dim
                          {2, 1, 256},   // the largest head dim
                          {2, 1, 6}};    // not a multiple of a 16-byte load: scalar path
  uint64_t seed = 100;
  for (int blockSize : {1, 8, 16, 32}) {
    for (const Shape& s : shapes) {
      checkAttention(blockSize, s.heads, s.kvHeads, s.headDim, DType::kF32, DType::kF32, ragged, seed++);
    }
  }
  for (DType kv : kDtypes) {
    for (DType out : kDtypes) {
      checkAttention(16, 8, 2, 128, kv, out, ragged, seed++);
      checkAttention(8, 4, 2, 6, kv, out, ragged, seed++);
    }
  }
}

namespace {
// float8_e4m3fn as its definition says (codes 0x7f / 0xff, NaN, are not generated).
float e4m3Ref(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const float v = e == 0 ? std::ldexp(float(m) / 8.0f, -6) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (c & 0x80) ? -v : v;
}
}  // namespace

// FP8 weights (pd/kernels/cuda/linear_fp8.h): the dequantized matrix against the layout's
// definition (exact in f32 and bf16: one f32 product, rounded once), and fp8Gemv against a double-precision
// product (f32 sums: 1e-5), on the 16-byte path (columns and offset multiples of 16) and the
// scalar one, with a column offset into the first block, 1..8 rows, beta 0 (y never read:
// it holds NaN) and 1.
TEST_CASE("cuda fp8Dequantize and fp8Gemv match the FP8 block layout's definition", "[cuda][kernels][fp8]") {
  if (!haveGpu()) return;
  struct Case {
    int rows, cols, colOffset, blockCols;
  };
  for (const Case& k : {Case{37, 256, 0, 128}, Case{40, 688, 48, 128}, Case{9, 100, 5, 128}, Case{5, 64, 16, 32}}) {
    const int scaleCols = (k.colOffset + k.cols + k.blockCols - 1) / k.blockCols;
    std::mt19937_64 rng(uint64_t(k.rows * 7919 + k.cols));
    std::vector<uint8_t> codes(size_t(k.rows) * k.cols);
    for (auto& c : codes) {
      do c = uint8_t(rng());
      while ((c & 0x7f) == 0x7f);
    }
    const std::vector<float> scales = randomVec(size_t(k.rows) * scaleCols, 3, 1e-4f, 1e-2f);
    std::vector<float> w(codes.size());
    for (int r = 0; r < k.rows; ++r)
      for (int c = 0; c < k.cols; ++c)
        w[size_t(r) * k.cols + c] =
            e4m3Ref(codes[size_t(r) * k.cols + c]) * scales[size_t(r) * scaleCols + (k.colOffset + c) / k.blockCols];
    auto codesDev = upload(codes);
    auto scalesDev = upload(scales);
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      DYNAMIC_SECTION(k.rows << "x" << k.cols << " offset " << k.colOffset << " blocks of " << k.blockCols << " "
                             << dtypeName(dt)) {
        DevBuf out(w.size() * dtypeBytes(dt));
        PD_CUDA_CHECK(kcu::fp8Dequantize(codesDev->as<uint8_t>(), scalesDev->as<float>(), k.rows, k.cols, k.colOffset,
                                         k.blockCols, out.as(), dt, nullptr));
        // f16: the smallest products fall below its normal range, where the host rounding
        // (11 significant bits) is not the format's, so it is held to f16's relative step.
        if (dt == DType::kF16)
          CHECK(relError(downloadAs(out.as(), dt, w.size()), w) < 1e-3);
        else
          CHECK(downloadAs(out.as(), dt, w.size()) == roundedTo(w, dt));

        for (int n : {1, 3, 8}) {
          const std::vector<float> x = roundedTo(randomVec(size_t(n) * k.cols, uint64_t(n)), dt);
          const std::vector<float> y0 = randomVec(size_t(n) * k.rows, 9);
          auto xDev = uploadAs(x, dt);
          for (float beta : {0.0f, 1.0f}) {
            INFO(n << " rows, beta " << beta);
            auto yDev = beta == 0.0f ? std::make_unique<DevBuf>(y0.size() * 4) : upload(y0);  // NaN when unread
            PD_CUDA_CHECK(kcu::fp8Gemv(xDev->as(), dt, n, codesDev->as<uint8_t>(), scalesDev->as<float>(), k.rows,
                                       k.cols, k.colOffset, k.blockCols, yDev->as<float>(), beta, nullptr));
            std::vector<float> want(y0.size());
            for (int b = 0; b < n; ++b)
              for (int r = 0; r < k.rows; ++r) {
                double acc = 0;
                for (int c = 0; c < k.cols; ++c)
                  acc += double(w[size_t(r) * k.cols + c]) * double(x[size_t(b) * k.cols + c]);
                want[size_t(b) * k.rows + r] = float(acc + beta * y0[size_t(b) * k.rows + r]);
              }
            const double err = relError(download<float>(yDev->as(), want.size()), want);
            INFO("rel error " << err);
            CHECK(err < 1e-5);
          }
        }
      }
    }
  }
  // More rows than the accumulators hold are refused at the call.
  DevBuf any(1024);
  CHECK(kcu::fp8Gemv(any.as(), DType::kBF16, kcu::kFp8GemvMaxRows + 1, any.as<uint8_t>(), any.as<float>(), 1, 16, 0,
                     128, any.as<float>(), 0.0f, nullptr) == cudaErrorInvalidValue);
}

// Multi-head latent attention (pd/kernels/cuda/mla.h) against plain host loops that restate
// engine/cpu_mla.cpp's definitions: the latent write (RMSNorm of c_kv, interleaved RoPE of k_pe
// with the magnitude factor), the query split, and the absorbed attention over a ragged batch
// of decode tokens and prefill chunks after cached prefixes -- up to DeepSeek-V3's 576-value
// latent and 128 heads.
namespace {

// x[2i], x[2i+1] rotated by (c, s) * mscale, as cpu_mla.cpp's ropeInterleaved.
void ropePairs(float* x, const float* c, const float* s, int half, float mscale) {
  for (int i = 0; i < half; ++i) {
    const float cc = c[i] * mscale, ss = s[i] * mscale, a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cc - b * ss;
    x[2 * i + 1] = b * cc + a * ss;
  }
}

void checkMla(int R, int P, int H, int nope, int blockSize, DType kvDt, DType outDt, const std::vector<Chunk>& chunks,
              uint64_t seed) {
  const int L = R + P, half = P / 2;
  int T = 0, blocksNeeded = 0;
  for (const Chunk& c : chunks) {
    T += c.numTokens;
    blocksNeeded += (c.startPos + c.numTokens + blockSize - 1) / blockSize;
  }
  const int numBlocks = blocksNeeded + 2;
  std::vector<int32_t> perm(numBlocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed + 2));
  std::vector<int32_t> tables, slots, pos;
  std::vector<kcu::AttnSeq> seqs;
  std::vector<kcu::AttnWork> work;
  int t = 0, next = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int need = (chunks[c].startPos + chunks[c].numTokens + blockSize - 1) / blockSize;
    seqs.push_back({t, chunks[c].numTokens, chunks[c].startPos, int32_t(tables.size())});
    for (int b = 0; b < need; ++b) tables.push_back(perm[next++]);
    kcu::appendAttnWork(work, int(c), chunks[c].numTokens, H);
    for (int i = 0; i < chunks[c].numTokens; ++i) {
      const int p = chunks[c].startPos + i;
      pos.push_back(p);
      slots.push_back(tables[seqs[c].blockTableOffset + p / blockSize] * blockSize + p % blockSize);
    }
    t += chunks[c].numTokens;
  }
  // The cached prefix: random latents (rounded to the KV dtype); the step's tokens overwrite
  // their slots through mlaKvWrite.
  auto pool = roundedTo(randomVec(size_t(numBlocks) * blockSize * L, seed, -2, 2), kvDt);
  const int kvaStride = L + 5, qh = nope + P, qStride = H * qh + 3;
  const auto kva = randomVec(size_t(T) * kvaStride, seed + 3, -2, 2);
  const auto normW = randomVec(size_t(R), seed + 4, 0.5f, 1.5f);
  const auto q = randomVec(size_t(T) * qStride, seed + 5, -1, 1);
  std::vector<float> invFreq(half);
  for (int i = 0; i < half; ++i) invFreq[i] = float(1.0 / std::pow(10000.0, double(2 * i) / P));
  std::vector<float> cosT(size_t(T) * half), sinT(size_t(T) * half);
  cpu::ropeCosSin(pos.data(), T, invFreq.data(), half, cosT.data(), sinT.data());
  const float mscale = 1.1f, eps = 1e-6f, scale = 0.3f / std::sqrt(float(qh));

  // Host: latent write, q split (the absorbed part filled with random values standing in for
  // the GEMM's), attention.
  for (int i = 0; i < T; ++i) {
    std::vector<float> v(kva.begin() + ptrdiff_t(i) * kvaStride, kva.begin() + ptrdiff_t(i) * kvaStride + L);
    cpu::rmsNorm(v.data(), R, normW.data(), v.data(), R, 1, R, eps);
    ropePairs(v.data() + R, cosT.data() + size_t(i) * half, sinT.data() + size_t(i) * half, half, mscale);
    for (int d = 0; d < L; ++d) pool[size_t(slots[i]) * L + d] = roundTo(v[d], kvDt);
  }
  std::vector<float> qNopeWant(size_t(T) * H * nope), qLat = randomVec(size_t(T) * H * L, seed + 6, -1, 1);
  for (int i = 0; i < T; ++i)
    for (int h = 0; h < H; ++h) {
      const float* src = q.data() + size_t(i) * qStride + size_t(h) * qh;
      for (int d = 0; d < nope; ++d) qNopeWant[(size_t(i) * H + h) * nope + d] = roundTo(src[d], outDt);
      float* pe = qLat.data() + (size_t(i) * H + h) * L + R;
      std::copy(src + nope, src + qh, pe);
      ropePairs(pe, cosT.data() + size_t(i) * half, sinT.data() + size_t(i) * half, half, mscale);
    }
  std::vector<float> want(size_t(T) * H * R);
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int i = 0; i < chunks[c].numTokens; ++i) {
      const int row = seqs[c].tokenStart + i, p = chunks[c].startPos + i;
      const int32_t* tab = tables.data() + seqs[c].blockTableOffset;
      for (int h = 0; h < H; ++h) {
        const float* qr = qLat.data() + (size_t(row) * H + h) * L;
        std::vector<double> sc(p + 1);
        double mx = -1e300, sum = 0;
        for (int k = 0; k <= p; ++k) {
          const float* key = pool.data() + (size_t(tab[k / blockSize]) * blockSize + k % blockSize) * L;
          double dot = 0;
          for (int d = 0; d < L; ++d) dot += double(qr[d]) * key[d];
          sc[k] = dot * scale;
          mx = std::max(mx, sc[k]);
        }
        for (int k = 0; k <= p; ++k) sum += (sc[k] = std::exp(sc[k] - mx));
        for (int d = 0; d < R; ++d) {
          double o = 0;
          for (int k = 0; k <= p; ++k)
            o += sc[k] * pool[(size_t(tab[k / blockSize]) * blockSize + k % blockSize) * L + d];
          want[(size_t(row) * H + h) * R + d] = float(o / sum);
        }
      }
    }

  // Device: the prefix pool with the step's slots poisoned, then the three kernels.
  auto devPool = roundedTo(randomVec(size_t(numBlocks) * blockSize * L, seed, -2, 2), kvDt);
  for (int32_t sl : slots)
    for (int d = 0; d < L; ++d) devPool[size_t(sl) * L + d] = NAN;
  auto dpool = uploadAs(devPool, kvDt);
  auto dkva = upload(kva);
  auto dnorm = upload(normW);
  auto dq = upload(q);
  auto dcos = upload(cosT);
  auto dsin = upload(sinT);
  auto dslots = upload(slots);
  auto dtab = upload(tables);
  auto dseqs = upload(seqs);
  auto dwork = upload(work);
  auto dqLat = upload(qLat);  // its absorbed parts are what the GEMM would write
  PD_CUDA_CHECK(kcu::mlaKvWrite(dkva->as<float>(), kvaStride, dnorm->as<float>(), eps, R, P, dcos->as<float>(),
                                dsin->as<float>(), mscale, dslots->as<int32_t>(), T, dpool->as(), kvDt, nullptr));
  DevBuf qNope(qNopeWant.size() * kcu::dtypeBytes(outDt));
  // Poison the rope part: mlaQSplit must write it.
  for (int i = 0; i < T * H; ++i)
    PD_CUDA_CHECK(cudaMemset(dqLat->as<float>() + size_t(i) * L + R, 0xff, sizeof(float) * P));
  PD_CUDA_CHECK(kcu::mlaQSplit(dq->as<float>(), qStride, T, H, nope, P, dcos->as<float>(), dsin->as<float>(), mscale,
                               qNope.as(), outDt, dqLat->as<float>(), R, nullptr));
  DevBuf out(want.size() * kcu::dtypeBytes(outDt));
  PD_CUDA_CHECK(kcu::mlaAttentionInit());
  PD_CUDA_CHECK(kcu::mlaAttention(dqLat->as<float>(), dpool->as(), kvDt, dtab->as<int32_t>(), dseqs->as<kcu::AttnSeq>(),
                                  dwork->as<kcu::AttnWork>(), int(work.size()), blockSize, H, R, P, scale, out.as(),
                                  outDt, nullptr));
  const double tol = kvDt == DType::kF32 && outDt == DType::kF32 ? 1e-5 : 1e-2;
  INFO("R " << R << " P " << P << " heads " << H << " blockSize " << blockSize << " kv " << kcu::dtypeName(kvDt)
            << " out " << kcu::dtypeName(outDt));
  // The latent cache: the step's slots as the host wrote them (one 16-bit rounding apart at
  // most), every other byte untouched.
  CHECK(relError(downloadAs(dpool->as(), kvDt, pool.size()), pool) < (kvDt == DType::kF32 ? 1e-5 : 1e-2));
  CHECK(relError(download<float>(dqLat->as(), qLat.size()), qLat) < 1e-5);
  CHECK(relError(downloadAs(qNope.as(), outDt, qNopeWant.size()), qNopeWant) == 0.0);
  const double err = relError(downloadAs(out.as(), outDt, want.size()), want);
  INFO("attention rel error " << err);
  CHECK(err < tol);
}

}  // namespace

TEST_CASE("cuda MLA latent write, query split and absorbed attention match the host definitions",
          "[cuda][kernels][mla]") {
  if (!haveGpu()) return;
  // Decode tokens, a fresh prefill, prefill chunks after cached prefixes (one ending on a block
  // boundary), and a padding chunk (numTokens 0).
  const std::vector<Chunk> ragged{{0, 1}, {37, 1}, {130, 1}, {0, 21}, {20, 17}, {0, 0}, {48, 16}};
  struct Shape {
    int R, P, heads, nope;
  };
  const Shape shapes[] = {{32, 8, 4, 16},      // the tiny made model
                          {128, 32, 8, 64},    // the small made model
                          {512, 64, 16, 128},  // DeepSeek-V3's latent (576 values)
                          {40, 6, 3, 8}};      // rows of a block span several tokens; scalar loads
  uint64_t seed = 900;
  for (const Shape& s : shapes)
    for (int blockSize : {1, 16})
      for (DType kv : kDtypes) checkMla(s.R, s.P, s.heads, s.nope, blockSize, kv, DType::kBF16, ragged, seed++);
  // f32 throughout (tight), and DeepSeek-V3's 128 heads on decode tokens (8 blocks per token).
  checkMla(32, 8, 4, 16, 16, DType::kF32, DType::kF32, ragged, seed++);
  checkMla(512, 64, 128, 128, 16, DType::kBF16, DType::kF32, {{0, 1}, {100, 1}, {7, 2}}, seed++);
}
