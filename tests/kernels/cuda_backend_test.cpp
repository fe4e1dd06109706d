// The CUDA backend against the CPU backend on the tiny model made by make-model: the same
// prompt + greedy decode, logits compared step by step (f32 weights and KV: tight; bf16
// weights and KV: bf16 tolerance), CUDA-graph decode steps against eager ones, the
// layer-by-layer KV readiness callback, and batch validation; tensor parallelism against
// TP = 1 (logits, tokens, and each rank's KV region against the matching kv heads of the
// TP = 1 cache): ranks sharing one GPU (runs on any GPU machine), NCCL over two GPUs (skips
// with a message on fewer); weights streamed from bf16 checkpoints against host-uploaded ones;
// FP8 block-scaled checkpoints held as FP8 on the device against the CPU backend; Qwen3 (q/k
// norms) and the mixture-of-experts models (Qwen3-MoE, Mixtral, DeepseekV3's routed and shared
// experts) against the CPU backend, and streamed against uploaded; DeepseekV3's multi-head
// latent attention (a dense made model) against the CPU backend, its latent KV region
// included. Skips without a device.
#include "engine/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "engine/cpu_backend.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"
#include "gpu_test_util.h"

using namespace pd;
using namespace pd::engine;
using pd::kernels::cuda::test::haveGpu;
using pd::kernels::cuda::test::relError;

namespace {

// The directory PD_TEST_MODEL_DIR/name holding make-model's checkpoint for `o`, written once per
// build tree: made under a temporary name and renamed, so that test processes running at once
// never read half a model (the loser of a race drops its copy).
std::string madeModelDir(const std::string& name, const MakeModelOptions& o) {
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/" + name;
  if (!std::filesystem::exists(dir + "/config.json")) {
    std::filesystem::create_directories(PD_TEST_MODEL_DIR);
    const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
    REQUIRE(makeModel(o, tmp).toString() == "OK");
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);
    if (ec) std::filesystem::remove_all(tmp);
  }
  return dir;
}

std::shared_ptr<const ModelWeights> testModel(const std::string& preset, bool qkvBias) {
  MakeModelOptions o;
  o.preset = preset;
  o.seed = 11;
  o.qkvBias = qkvBias;
  auto m = loadModel(madeModelDir("cuda_" + preset + (qkvBias ? "_qwen2" : ""), o));
  REQUIRE(m.status().toString() == "OK");
  return m.value();
}
std::shared_ptr<const ModelWeights> tinyModel() { return testModel("tiny", false); }

// make-model's tiny preset of another architecture (qwen3, qwen3_moe, mixtral), the CPU
// tests' generation (seed 11), written once per build tree; dtype "f32" or "bf16".
std::string archModelDir(const std::string& arch, const std::string& dtype = "f32") {
  MakeModelOptions o;
  o.preset = "tiny";
  o.seed = 11;
  o.arch = arch;
  o.dtype = dtype;
  return madeModelDir("cuda_tiny_" + arch + "_" + dtype, o);
}
std::shared_ptr<const ModelWeights> archModel(const std::string& arch) {
  auto m = loadModel(archModelDir(arch));
  REQUIRE(m.status().toString() == "OK");
  return m.value();
}

// Two sequences: prompts of 40 and 23 tokens prefilled together (one chunk each, the second
// in two chunks of 16 + 7), then `steps` greedy decode steps batched together. Returns every
// logits row the run produced, in order.
std::vector<std::vector<float>> runTwoSeqs(Backend& b, int steps, std::vector<int32_t>* out,
                                           const std::function<void()>& afterDecodeStep = {}) {
  const int vocab = b.config().vocabSize, bs = b.kvLayout().blockSize;
  std::mt19937_64 rng(5);
  std::vector<int32_t> p0{kMadeBosId}, p1{kMadeBosId};
  while (p0.size() < 40) p0.push_back(int32_t(rng() % 256));
  while (p1.size() < 23) p1.push_back(int32_t(rng() % 256));
  const int maxLen = 40 + steps;
  const int blocksPerSeq = (maxLen + bs - 1) / bs;
  std::vector<int32_t> t0(blocksPerSeq), t1(blocksPerSeq);
  // Interleaved, reversed block ids so no code can assume contiguous tables.
  for (int i = 0; i < blocksPerSeq; ++i) {
    t0[i] = 2 * (blocksPerSeq - 1 - i);
    t1[i] = 2 * i + 1;
  }
  std::vector<std::vector<float>> rows;
  std::vector<float> logits(2 * size_t(vocab));
  auto argmax = [&](const float* r) { return int32_t(std::max_element(r, r + vocab) - r); };

  SeqChunk a{p0.data(), 40, 0, t0.data(), blocksPerSeq, true};
  SeqChunk c1{p1.data(), 16, 0, t1.data(), blocksPerSeq, false};
  SeqChunk pre[] = {a, c1};
  REQUIRE(b.forward(pre, logits.data()).toString() == "OK");
  rows.emplace_back(logits.begin(), logits.begin() + vocab);
  SeqChunk c2{p1.data() + 16, 7, 16, t1.data(), blocksPerSeq, true};
  REQUIRE(b.forward({&c2, 1}, logits.data()).toString() == "OK");
  rows.emplace_back(logits.begin(), logits.begin() + vocab);
  int32_t next0 = argmax(rows[0].data()), next1 = argmax(rows[1].data());
  int pos0 = 40, pos1 = 23;
  for (int s = 0; s < steps; ++s) {
    out->push_back(next0);
    out->push_back(next1);
    SeqChunk d[] = {{&next0, 1, pos0, t0.data(), blocksPerSeq, true}, {&next1, 1, pos1, t1.data(), blocksPerSeq, true}};
    REQUIRE(b.forward(d, logits.data()).toString() == "OK");
    if (afterDecodeStep) afterDecodeStep();
    rows.emplace_back(logits.begin(), logits.begin() + vocab);
    rows.emplace_back(logits.begin() + vocab, logits.end());
    next0 = argmax(rows[rows.size() - 2].data());
    next1 = argmax(rows.back().data());
    ++pos0;
    ++pos1;
  }
  return rows;
}

// runTwoSeqs on a CPU backend of `model` over a fresh (zeroed) cache of `layout`: its logits rows,
// its greedy ids in *tokens and, when kv is given, the cache it wrote in *kv (as f32 words).
std::vector<std::vector<float>> cpuTwoSeqs(std::shared_ptr<const ModelWeights> model, const KvLayout& layout, int steps,
                                           std::vector<int32_t>* tokens, std::vector<float>* kv = nullptr) {
  std::vector<float> own;
  std::vector<float>& cache = kv ? *kv : own;
  cache.assign((layout.totalBytes() + 3) / 4, 0.0f);  // an fp8 cache need not be whole f32 words
  auto cpu = createCpuBackend(std::move(model), layout, cache.data(), {});
  REQUIRE(cpu.status().toString() == "OK");
  return runTwoSeqs(**cpu, steps, tokens);
}

// Rows [0, rows) of got within relative error tol of want's, each checked on its own.
void checkRowsNear(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want, size_t rows,
                   double tol) {
  for (size_t r = 0; r < rows; ++r) {
    const double err = relError(got[r], want[r]);
    INFO("row " << r << " rel error " << err);
    CHECK(err < tol);
  }
}

// runTwoSeqs' rows against a reference run's for as long as the inputs agree: rows 0-1 are the
// prefill chunks (always compared); rows 2+2s and 3+2s are decode step s, fed tokens up to
// [2s+1], compared while those are the reference's. At least the prefill rows are compared.
void checkRowsWhileIdsAgree(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want,
                            const std::vector<int32_t>& tokens, const std::vector<int32_t>& wantTokens, double tol) {
  size_t compared = 0;
  for (size_t r = 0; r < got.size(); ++r) {
    if (r >= 2) {
      const size_t fed = 2 * ((r - 2) / 2) + 2;  // tokens fed up to and including step s
      if (!std::equal(tokens.begin(), tokens.begin() + long(fed), wantTokens.begin())) break;
    }
    const double err = relError(got[r], want[r]);
    INFO("row " << r << " rel error " << err);
    CHECK(err < tol);
    ++compared;
  }
  CHECK(compared >= 2);
}

// Two backends that must compute the same thing bit for bit: the same ids and logits rows.
void checkSameRuns(Backend& want, Backend& got, int steps) {
  std::vector<int32_t> a, b;
  const auto wantRows = runTwoSeqs(want, steps, &a);
  const auto gotRows = runTwoSeqs(got, steps, &b);
  CHECK(a == b);
  REQUIRE(wantRows.size() == gotRows.size());
  for (size_t i = 0; i < wantRows.size(); ++i) CHECK(wantRows[i] == gotRows[i]);
}

std::unique_ptr<CudaBackend> makeCuda(std::shared_ptr<const ModelWeights> m, KvDtype w, KvDtype kv, bool graphs,
                                      int numBlocks = 16) {
  CudaBackendOptions o;
  o.weightDtype = w;
  o.useCudaGraphs = graphs;
  const KvLayout layout = kvLayoutFor(m->config, numBlocks, 16, kv);
  auto b = createCudaBackend(std::move(m), layout, o);
  REQUIRE(b.status().toString() == "OK");
  return std::move(b).value();
}

// One 20-token prefill (block table {3, 9}) over KV regions first filled with NaN: the layer
// callback comes once per layer, in order, and when layer l's comes, block 3 of layer l
// (positions 0..15) of every region in `regions` (laid out as L) is written: all finite.
// Returns the prefill's logits row.
std::vector<float> forwardCheckingLayerReadiness(CudaBackend& gpu, const KvLayout& L,
                                                 const std::vector<MemDesc>& regions, const ModelConfig& c) {
  for (const MemDesc& d : regions) PD_CUDA_CHECK(cudaMemset(d.ptr(), 0xff, d.len));  // NaN everywhere
  std::vector<int32_t> prompt(20, 65), table{3, 9};
  SeqChunk chunk{prompt.data(), 20, 0, table.data(), 2, true};
  std::vector<float> logits(c.vocabSize);
  std::vector<int> seen;
  const Status st = gpu.forward({&chunk, 1}, logits.data(), [&](int layer) {
    seen.push_back(layer);
    for (const MemDesc& d : regions) {
      std::vector<float> blk(L.blockElems());
      const char* src = static_cast<const char*>(d.ptr()) + L.blockOffset(layer, 3);
      REQUIRE(cudaMemcpy(blk.data(), src, L.blockBytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(std::all_of(blk.begin(), blk.end(), [](float x) { return std::isfinite(x); }));
    }
  });
  REQUIRE(st.toString() == "OK");
  std::vector<int> all(c.numLayers);
  std::iota(all.begin(), all.end(), 0);
  CHECK(seen == all);
  return logits;
}

}  // namespace

TEST_CASE("cuda backend logits match the CPU backend on the tiny and small models", "[cuda][backend]") {
  if (!haveGpu()) return;
  struct Which {
    const char* preset;
    bool bias;
  };
  for (Which which : {Which{"tiny", false}, Which{"tiny", true}, Which{"small", false}}) {
    const bool bias = which.bias;
    auto model = testModel(which.preset, bias);
    std::vector<int32_t> cpuTokens;
    const auto want = cpuTwoSeqs(model, kvLayoutFor(model->config, 16, 16), 8, &cpuTokens);

    struct Variant {
      KvDtype w, kv;
      double tol;
    };
    // f32: cuBLAS SGEMM vs OpenBLAS and reordered sums only. bf16: weights and KV rounded to
    // 8 significant bits, activations into every GEMM too.
    for (Variant v : {Variant{KvDtype::kF32, KvDtype::kF32, 1e-4}, Variant{KvDtype::kBF16, KvDtype::kBF16, 5e-2},
                      Variant{KvDtype::kF16, KvDtype::kF16, 2e-2}}) {
      DYNAMIC_SECTION((bias ? "qwen2 " : "llama ") << "weights " << kvDtypeName(v.w) << " kv " << kvDtypeName(v.kv)) {
        auto gpu = makeCuda(model, v.w, v.kv, true);
        std::vector<int32_t> tokens;
        // In 16-bit a near-tie can flip a greedy token and with it every later row, so
        // there only the prefill rows (same inputs on both sides) are compared.
        const auto got = runTwoSeqs(*gpu, 8, &tokens);
        REQUIRE(got.size() == want.size());
        const size_t compareRows = v.w == KvDtype::kF32 ? got.size() : 2;
        if (v.w == KvDtype::kF32) CHECK(tokens == cpuTokens);
        checkRowsNear(got, want, compareRows, v.tol);
        CHECK(gpu->graphSteps() == 8);  // every batched decode step ran as a graph
      }
    }
  }
}

// Qwen3 (per-head q/k RMSNorm before RoPE) and the mixture-of-experts families (Qwen3-MoE:
// 16 experts, top 4, norm_topk_prob, dense layer 0; Mixtral: 8 experts, top 2; DeepseekV3:
// 16 experts in 4 groups, sigmoid scores with the correction bias, top 2 groups, top 4,
// routed_scaling_factor, 1 shared expert, dense layer 0, behind its latent attention) against
// the CPU backend on the same tiny checkpoints: two sequences prefilled together (one in two
// chunks), then 8 greedy decode steps batched. f32 weights: every row tight and the greedy ids
// identical. bf16: every row within the bf16 tolerance for as long as the greedy ids agree (a
// near-tie may flip one in 16-bit and with it every later row; the count is printed), the
// prefill rows always. MoE steps are never graphed (routing syncs per layer); in a batched
// decode step the two rows route to different experts (more than k experts get rows).
TEST_CASE("cuda backend runs Qwen3 and the mixture-of-experts models as the CPU backend does", "[cuda][backend][moe]") {
  if (!haveGpu()) return;
  for (const char* arch : {"qwen3", "qwen3_moe", "mixtral", "deepseek_v3"}) {
    auto model = archModel(arch);
    const ModelConfig& c = model->config;
    const std::string a = arch;
    REQUIRE(c.qkNorm == (a == "qwen3" || a == "qwen3_moe"));
    REQUIRE(c.isMoe() == (a != "qwen3"));
    if (a == "deepseek_v3") {  // sigmoid scores, correction bias, groups, scaling, shared experts
      REQUIRE(c.moe.sigmoidScoring);
      REQUIRE(c.moe.numGroups > 1);
      REQUIRE(c.moe.numSharedExperts > 0);
      REQUIRE(c.moe.routedScalingFactor != 1.0);
      REQUIRE_FALSE(model->layers.back().routerBias.empty());
    }
    std::vector<int32_t> cpuTokens;
    const auto want = cpuTwoSeqs(model, kvLayoutFor(c, 16, 16), 8, &cpuTokens);
    struct Variant {
      KvDtype w;
      double tol;
    };
    for (Variant v : {Variant{KvDtype::kF32, 1e-4}, Variant{KvDtype::kBF16, 5e-2}}) {
      DYNAMIC_SECTION(arch << " weights and kv " << kvDtypeName(v.w)) {
        auto gpu = makeCuda(model, v.w, v.w, true);
        std::vector<int32_t> tokens;
        int decodeSteps = 0, stepsWithSpread = 0;
        const auto got = runTwoSeqs(*gpu, 8, &tokens, [&] {
          ++decodeSteps;
          const std::vector<int> rows = gpu->moeExpertRows();
          if (!c.isMoe()) return;
          REQUIRE(int(rows.size()) == c.moe.numExperts);
          CHECK(std::accumulate(rows.begin(), rows.end(), 0) == 2 * c.moe.expertsPerToken);  // 2 rows x k
          const auto used = std::count_if(rows.begin(), rows.end(), [](int n) { return n > 0; });
          if (used > c.moe.expertsPerToken) ++stepsWithSpread;
        });
        REQUIRE(got.size() == want.size());
        CHECK(decodeSteps == 8);
        if (c.isMoe()) CHECK(stepsWithSpread > 0);
        // Rows 0, 1: the prefill; then two per decode step, whose inputs are the tokens so far.
        size_t agree = 2;
        while (agree < got.size() && tokens[agree - 2] == cpuTokens[agree - 2]) ++agree;
        if (v.w == KvDtype::kF32) {
          CHECK(tokens == cpuTokens);
          agree = got.size();
        }
        INFO(arch << ": " << agree << " of " << got.size() << " rows with the same inputs as the CPU's");
        checkRowsNear(got, want, agree, v.tol);
        CHECK(gpu->graphSteps() == (c.isMoe() ? 0 : 8));
      }
    }
  }
}

// A MoE checkpoint streamed to the device (describeModel: how a worker loads) holds the same
// bf16 experts, f32 router and f32 q/k norms as the host-uploaded one: the same logits, bit
// for bit. Tensor parallelism with experts is refused by name.
TEST_CASE("MoE and Qwen3 weights streamed from a bf16 checkpoint give the host-uploaded logits exactly",
          "[cuda][backend][stream][moe]") {
  if (!haveGpu()) return;
  for (const char* arch : {"qwen3", "qwen3_moe", "mixtral"}) {
    DYNAMIC_SECTION(arch) {
      const std::string dir = archModelDir(arch, "bf16");
      auto host = loadModel(dir);
      REQUIRE(host.status().toString() == "OK");
      auto described = describeModel(dir);
      REQUIRE(described.status().toString() == "OK");
      CudaBackendOptions o;
      o.weightStagingBytes = 1 << 20;
      const KvLayout layout = kvLayoutFor((*host)->config, 16, 16, KvDtype::kBF16);
      auto uploaded = createCudaBackend(*host, layout, o);
      REQUIRE(uploaded.status().toString() == "OK");
      auto streamed = createCudaBackend(*described, layout, o);
      REQUIRE(streamed.status().toString() == "OK");
      checkSameRuns(**uploaded, **streamed, 6);
      if ((*host)->config.isMoe()) {
        o.tensorParallelSize = 2;
        o.tpRanksShareDevice = true;
        auto tp = createCudaBackend(*host, layout, o);
        REQUIRE_FALSE(tp.ok());
        CHECK(tp.status().code() == StatusCode::kUnimplemented);
        CHECK(tp.status().message().find("expert parallelism") != std::string::npos);
      }
    }
  }
}

// fp8 KV (docs/kv_cache.md, "Quantized KV cache"): the GPU writes the same e4m3 codes and
// per-row scales as the CPU backend's fp8 cache (the same rounding) and reads them in its
// attention kernel. With f32 weights on both sides, the GPU's logits stay within the CPU fp8
// backend's of the same tokens (the prefill rows: a near-tie may flip a later greedy token), and
// within the fp8 bound of docs/kv_cache.md of the f32 cache's.
TEST_CASE("cuda backend: an fp8 KV cache matches the CPU backend's fp8 cache", "[cuda][backend]") {
  if (!haveGpu()) return;
  for (const char* preset : {"tiny", "small"}) {
    auto model = testModel(preset, false);
    const KvLayout f32Layout = kvLayoutFor(model->config, 16, 16);
    const KvLayout fp8Layout = kvLayoutFor(model->config, 16, 16, KvDtype::kFp8);
    std::vector<int32_t> t32, t8, tg;
    const auto want32 = cpuTwoSeqs(model, f32Layout, 8, &t32);
    const auto want8 = cpuTwoSeqs(model, fp8Layout, 8, &t8);
    auto gpu = makeCuda(model, KvDtype::kF32, KvDtype::kFp8, true);
    CHECK(gpu->kvLayout().fingerprint() == fp8Layout.fingerprint());
    const auto got = runTwoSeqs(*gpu, 8, &tg);
    REQUIRE(got.size() == want8.size());
    for (size_t r = 0; r < 2; ++r) {
      const double e8 = relError(got[r], want8[r]), e32 = relError(got[r], want32[r]);
      INFO(preset << " row " << r << " vs cpu fp8 " << e8 << ", vs cpu f32 " << e32);
      CHECK(e8 < 1e-2);
      CHECK(e32 < 8e-2);
    }
    CHECK(gpu->graphSteps() == 8);
  }
}

TEST_CASE("cuda backend: graph decode steps equal eager ones", "[cuda][backend]") {
  if (!haveGpu()) return;
  auto model = tinyModel();
  auto eager = makeCuda(model, KvDtype::kBF16, KvDtype::kBF16, false);
  auto graphed = makeCuda(model, KvDtype::kBF16, KvDtype::kBF16, true);
  std::vector<int32_t> te, tg;
  const auto a = runTwoSeqs(*eager, 6, &te);
  const auto b = runTwoSeqs(*graphed, 6, &tg);
  CHECK(eager->graphSteps() == 0);
  CHECK(graphed->graphSteps() == 6);
  CHECK(te == tg);
  for (size_t r = 0; r < a.size(); ++r) CHECK(relError(b[r], a[r]) < 1e-6);
}

TEST_CASE("cuda backend reports each layer's KV once it is in device memory", "[cuda][backend]") {
  if (!haveGpu()) return;
  auto model = tinyModel();
  auto gpu = makeCuda(model, KvDtype::kF32, KvDtype::kF32, true);
  const KvLayout& L = gpu->kvLayout();
  const MemDesc region = gpu->kvRegion();
  CHECK(region.kind == MemKind::kCuda);
  CHECK(region.len == L.totalBytes());
  // Block 3 of each layer: K and V of every token must be written by the layer's callback.
  forwardCheckingLayerReadiness(*gpu, L, {region}, model->config);
  CHECK(gpu->graphSteps() == 0);  // steps with a layer callback are never graphed
}

TEST_CASE("cuda backend rejects malformed batches with a clear error", "[cuda][backend]") {
  if (!haveGpu()) return;
  auto model = tinyModel();
  auto gpu = makeCuda(model, KvDtype::kBF16, KvDtype::kBF16, true);
  std::vector<float> logits(model->config.vocabSize);
  std::vector<int32_t> bad{5, 9999}, table{0};
  SeqChunk c{bad.data(), 2, 0, table.data(), 1, true};
  const Status st = gpu->forward({&c, 1}, logits.data());
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK(st.message().find("token id 9999") != std::string::npos);
  std::vector<int32_t> ok{5}, farTable{99};
  SeqChunk d{ok.data(), 1, 0, farTable.data(), 1, true};
  CHECK(gpu->forward({&d, 1}, logits.data()).message().find("block id 99") != std::string::npos);
}

namespace {

std::unique_ptr<CudaBackend> makeCudaTp(std::shared_ptr<const ModelWeights> m, KvDtype w, KvDtype kv, int tp,
                                        bool shareDevice) {
  CudaBackendOptions o;
  o.weightDtype = w;
  o.tensorParallelSize = tp;
  o.tpRanksShareDevice = shareDevice;
  const KvLayout layout = kvLayoutFor(m->config, 16, 16, kv);
  auto b = createCudaBackend(std::move(m), layout, o);
  REQUIRE(b.status().toString() == "OK");
  return std::move(b).value();
}

// Every rank's KV region against the TP = 1 region: rank r's block holds kv heads
// [r*kvPerRank, (r+1)*kvPerRank) of the same block id, token slot and K/V half. Returns the
// relative error over all of them (f32 KV).
double kvRegionsError(const CudaBackend& tp, const CudaBackend& one) {
  const KvLayout& full = one.kvLayout();
  const KvLayout& rank = tp.rankKvLayout();
  const std::vector<MemDesc> regions = tp.kvRegions();
  std::vector<float> want(full.totalBytes() / 4);
  REQUIRE(cudaMemcpy(want.data(), one.kvRegion().ptr(), full.totalBytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<float> got(want.size()), regrouped(want.size());
  const int perRank = rank.numKvHeads, hd = rank.headDim;
  for (size_t r = 0; r < regions.size(); ++r) {
    std::vector<float> mine(rank.totalBytes() / 4);
    REQUIRE(cudaMemcpy(mine.data(), regions[r].ptr(), rank.totalBytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
    // Index (layer, block, kv half, token, head, dim) in each layout.
    for (int l = 0; l < full.numLayers; ++l)
      for (int b = 0; b < full.numBlocks; ++b)
        for (int half = 0; half < 2; ++half)
          for (int t = 0; t < full.blockSize; ++t)
            for (int h = 0; h < perRank; ++h) {
              const size_t src = rank.blockOffset(l, b) / 4 + (half ? rank.vOffsetInBlock(t) : rank.kOffsetInBlock(t)) +
                                 size_t(h) * hd;
              const size_t dst = full.blockOffset(l, b) / 4 + (half ? full.vOffsetInBlock(t) : full.kOffsetInBlock(t)) +
                                 size_t(r * perRank + h) * hd;
              std::copy(mine.begin() + src, mine.begin() + src + hd, regrouped.begin() + dst);
            }
  }
  return relError(regrouped, want);
}

}  // namespace

TEST_CASE("cuda backend: tensor parallel ranks sharing one GPU match tensor parallel 1", "[cuda][backend][tp]") {
  if (!haveGpu()) return;
  struct Which {
    const char* preset;
    bool bias;
    int tp;
  };
  // tiny: 4 heads, 2 kv heads, ffn 172 -> 1 kv head per rank; small at TP 4: 2 heads, 1 kv
  // head, ffn 344 per rank. The Qwen2 variant slices the q|k|v bias and adds the o bias once.
  for (Which which : {Which{"tiny", false, 2}, Which{"tiny", true, 2}, Which{"small", false, 4}}) {
    auto model = testModel(which.preset, which.bias);
    for (KvDtype dt : {KvDtype::kF32, KvDtype::kBF16}) {
      DYNAMIC_SECTION(which.preset << (which.bias ? " qwen2" : " llama") << " tp " << which.tp << " "
                                   << kvDtypeName(dt)) {
        auto one = makeCuda(model, dt, dt, false);
        auto tp = makeCudaTp(model, dt, dt, which.tp, true);
        CHECK(tp->tensorParallelSize() == which.tp);
        const std::vector<MemDesc> regions = tp->kvRegions();
        REQUIRE(int(regions.size()) == which.tp);
        CHECK(tp->rankKvLayout().numKvHeads == model->config.numKvHeads / which.tp);
        for (const MemDesc& d : regions) {
          CHECK(d.kind == MemKind::kCuda);
          CHECK(d.device == 0);
          CHECK(d.len == tp->rankKvLayout().totalBytes());
        }
        CHECK(tp->kvRegion().addr == regions[0].addr);

        std::vector<int32_t> tokOne, tokTp;
        const auto want = runTwoSeqs(*one, 8, &tokOne);
        const auto got = runTwoSeqs(*tp, 8, &tokTp);
        REQUIRE(got.size() == want.size());
        // f32: the same math with the o_proj / down_proj sums split in rank partials; 16-bit:
        // a near-tie can flip a greedy token, so only the prefill rows are compared.
        const bool f32 = dt == KvDtype::kF32;
        const size_t compareRows = f32 ? got.size() : 2;
        if (f32) CHECK(tokTp == tokOne);
        checkRowsNear(got, want, compareRows, f32 ? 1e-4 : 2e-2);
        if (f32) CHECK(kvRegionsError(*tp, *one) < 1e-4);
        CHECK(tp->graphSteps() == 0);  // graphs are off at TP > 1
      }
    }
  }
}

TEST_CASE("cuda backend: tensor parallel layer readiness waits for every rank's KV", "[cuda][backend][tp]") {
  if (!haveGpu()) return;
  auto model = tinyModel();
  auto gpu = makeCudaTp(model, KvDtype::kF32, KvDtype::kF32, 2, true);
  const std::vector<float> logits =
      forwardCheckingLayerReadiness(*gpu, gpu->rankKvLayout(), gpu->kvRegions(), model->config);
  CHECK(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
}

TEST_CASE("cuda backend: tensor parallel 2 over NCCL on two GPUs matches tensor parallel 1", "[cuda][backend][tp]") {
  if (!haveGpu()) return;
  int count = 0;
  PD_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < 2) {
    // A skip even under PD_REQUIRE_GPU=1: that asks for a GPU, and the check machine has one;
    // the sharded math is covered by the shared-device case above.
    pd::test::skipTest("tensor_parallel_size 2 over NCCL needs 2 CUDA devices, found " + std::to_string(count));
  }
  auto model = tinyModel();
  auto one = makeCuda(model, KvDtype::kF32, KvDtype::kF32, false);
  auto tp = makeCudaTp(model, KvDtype::kF32, KvDtype::kF32, 2, false);
  const std::vector<MemDesc> regions = tp->kvRegions();
  REQUIRE(regions.size() == 2);
  CHECK(regions[0].device == 0);
  CHECK(regions[1].device == 1);
  std::vector<int32_t> tokOne, tokTp;
  const auto want = runTwoSeqs(*one, 8, &tokOne);
  const auto got = runTwoSeqs(*tp, 8, &tokTp);
  REQUIRE(got.size() == want.size());
  CHECK(tokTp == tokOne);
  checkRowsNear(got, want, got.size(), 1e-4);
  CHECK(kvRegionsError(*tp, *one) < 1e-4);
}

TEST_CASE("cuda backend: tensor parallel set-up errors name the numbers", "[cuda][backend][tp]") {
  if (!haveGpu()) return;
  int count = 0;
  PD_CUDA_CHECK(cudaGetDeviceCount(&count));
  auto model = tinyModel();
  const KvLayout layout = kvLayoutFor(model->config, 16, 16, KvDtype::kBF16);
  CudaBackendOptions o;
  o.device = count - 1;  // the last device: TP 2 from there needs one more than exist
  o.tensorParallelSize = 2;
  auto b = createCudaBackend(model, layout, o);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == StatusCode::kUnavailable);
  CHECK(b.status().message() == "createCudaBackend: tensor_parallel_size 2 on device " + std::to_string(count - 1) +
                                    " requires " + std::to_string(count + 1) + " GPUs (found " + std::to_string(count) +
                                    ")");
  o.device = 0;
  o.tensorParallelSize = 4;  // tiny has 2 kv heads
  auto c = createCudaBackend(model, layout, o);
  CHECK(c.status().code() == StatusCode::kInvalidArgument);
  CHECK(c.status().message().find("does not divide the model's 2 kv heads") != std::string::npos);
  o.tensorParallelSize = 2;
  o.tpRanksShareDevice = true;
  void* base = nullptr;
  PD_CUDA_CHECK(cudaMalloc(&base, layout.totalBytes()));
  o.kvDeviceBase = base;
  auto d = createCudaBackend(model, layout, o);
  cudaFree(base);
  CHECK(d.status().code() == StatusCode::kInvalidArgument);
  CHECK(d.status().message().find("kvDeviceBase is for tensor_parallel_size 1") != std::string::npos);
}

TEST_CASE("cuda backend forwardAndSample returns the tokens sample() picks from forward()'s logits",
          "[cuda][backend][sampling]") {
  if (!haveGpu()) return;
  auto model = tinyModel();
  const int vocab = model->config.vocabSize;
  auto gpu = makeCuda(model, KvDtype::kF32, KvDtype::kF32, true);
  std::mt19937_64 rng(17);
  std::vector<int32_t> p0(30), p1(12), t0{0, 1, 2}, t1{5, 4, 3};
  for (auto& x : p0) x = int32_t(rng() % 256);
  for (auto& x : p1) x = int32_t(rng() % 256);
  // Prefill both (2 logits rows), then decode steps of 1 token each (graph steps).
  std::vector<SeqChunk> steps[2] = {
      {{p0.data(), 30, 0, t0.data(), 3, true}, {p1.data(), 12, 0, t1.data(), 3, true}},
      {{p0.data() + 29, 1, 30, t0.data(), 3, true}, {p1.data() + 11, 1, 12, t1.data(), 3, true}}};
  const int64_t graphsBefore = gpu->graphSteps();
  for (const auto& batch : steps) {
    for (int trial = 0; trial < 6; ++trial) {
      SamplingParams sp[2];
      for (int r = 0; r < 2; ++r) {
        sp[r].temperature = trial == 0 ? 0.0f : 0.6f + 0.3f * float(r);
        sp[r].topK = trial % 2 ? 40 : 0;
        sp[r].topP = trial % 3 ? 0.9f : 1.0f;
        sp[r].minP = trial == 5 ? 0.05f : 0.0f;
        sp[r].logprobs = 5;
        sp[r].seed = rng();
      }
      const uint64_t step = uint64_t(trial);
      std::vector<float> logits(2 * size_t(vocab));
      REQUIRE(gpu->forward(batch, logits.data()).toString() == "OK");
      const pd::kernels::SampleRowParams rp[2] = {rowParams(sp[0], step), rowParams(sp[1], step)};
      SampledToken got[2];
      REQUIRE(gpu->forwardAndSample(batch, rp, 5, got).toString() == "OK");
      for (int r = 0; r < 2; ++r) {
        const SampledToken want = sample(logits.data() + size_t(r) * vocab, vocab, sp[r], step);
        CHECK(got[r].id == want.id);
        CHECK(std::fabs(got[r].logprob - want.logprob) < 1e-5f);
        REQUIRE(got[r].topLogprobs.size() == 5);
        for (int j = 0; j < 5; ++j) CHECK(got[r].topLogprobs[j].first == want.topLogprobs[j].first);
      }
    }
  }
  CHECK(gpu->graphSteps() - graphsBefore == 12);  // decode steps, sampled or not, were graphed
  // Wrong parameter count and bad row params are refused with the problem named.
  const pd::kernels::SampleRowParams one[1] = {};
  SampledToken out[2];
  CHECK(gpu->forwardAndSample(steps[1], one, 0, out).message().find("1 sampling params for 2") != std::string::npos);
  pd::kernels::SampleRowParams badRows[2] = {};
  badRows[1].topP = 0.0f;
  CHECK(gpu->forwardAndSample(steps[1], badRows, 0, out).message().find("row 1") != std::string::npos);
}

namespace {
// A bf16 checkpoint (make-model --dtype bf16), as loadModel's f32 host copy or described only.
std::string bf16ModelDir() {
  MakeModelOptions o;
  o.preset = "small";
  o.seed = 11;
  o.dtype = "bf16";
  return madeModelDir("cuda_small_bf16", o);
}
}  // namespace

TEST_CASE("weights streamed from a bf16 checkpoint give the host-uploaded backend's logits exactly",
          "[cuda][backend][stream]") {
  if (!haveGpu()) return;
  const std::string dir = bf16ModelDir();
  auto host = loadModel(dir);
  REQUIRE(host.status().toString() == "OK");
  auto described = describeModel(dir);
  REQUIRE(described.status().toString() == "OK");
  REQUIRE(!(*described)->hasHostTensors());
  for (int tp : {1, 2}) {
    INFO("tensor_parallel_size " << tp << " (ranks sharing the device)");
    CudaBackendOptions o;
    o.useCudaGraphs = false;
    o.tensorParallelSize = tp;
    o.tpRanksShareDevice = tp > 1;
    o.weightStagingBytes = 1 << 20;  // many chunks per tensor
    const KvLayout layout = kvLayoutFor((*host)->config, 16, 16, KvDtype::kBF16);
    auto uploaded = createCudaBackend(*host, layout, o);
    REQUIRE(uploaded.status().toString() == "OK");
    auto streamed = createCudaBackend(*described, layout, o);
    REQUIRE(streamed.status().toString() == "OK");
    CHECK((*streamed)->weightLoadSeconds() > 0);
    checkSameRuns(**uploaded, **streamed, 6);  // same bf16 weights: bit-exact
  }
}

namespace {
// An FP8 block-scaled checkpoint (make-model --dtype bf16 --quantization fp8: projections F8_E4M3
// with 128x128 block scales, the rest bf16).
std::string fp8ModelDir() {
  MakeModelOptions o;
  o.preset = "small";
  o.seed = 11;
  o.dtype = "bf16";
  o.quantization = "fp8";
  return madeModelDir("cuda_small_fp8", o);
}
}  // namespace

// FP8 weights held on the device (docs/models.md, "FP8 checkpoints"): a described (streamed)
// FP8 checkpoint keeps its projections as e4m3 codes with block scales and multiplies with
// them -- fp8Dequantize + the cuBLAS GEMM for the prefill chunks (40 and 16 tokens), fp8Gemv
// on the codes for the 7-token chunk and the 2-row decode steps (graphed at TP = 1). The CPU
// backend dequantizes the same checkpoint to f32 on the host. Bounds:
//   f32 activations (weightDtype kF32): both sides multiply by the same f32 weights (e4m3 *
//   scale, one f32 product), so every row is within the f32 backend's 1e-4 and the greedy
//   tokens are the CPU's;
//   bf16 activations (the default): the bf16 backend's 5e-2 (activations rounded to 8
//   significant bits; the prefill GEMM's weights rounded to bf16 once more), compared on
//   every row whose inputs are the CPU's (a near-tie may flip a greedy token and every later
//   row with it).
// TP 2 runs both ranks on one device: rank 1's down_proj column slice starts at column 688,
// mid-block, so the scales' column offset is exercised.
TEST_CASE("FP8 weights held on the device match the CPU backend on the same FP8 checkpoint",
          "[cuda][backend][stream][fp8]") {
  if (!haveGpu()) return;
  const std::string dir = fp8ModelDir();
  auto host = loadModel(dir);
  REQUIRE(host.status().toString() == "OK");
  REQUIRE((*host)->config.quantization.fp8);
  auto described = describeModel(dir);
  REQUIRE(described.status().toString() == "OK");
  const KvLayout layout = kvLayoutFor((*host)->config, 16, 16, KvDtype::kF32);
  std::vector<int32_t> cpuTokens;
  const auto want = cpuTwoSeqs(*host, layout, 6, &cpuTokens);
  struct Variant {
    KvDtype w;
    double tol;
  };
  for (int tp : {1, 2})
    for (Variant v : {Variant{KvDtype::kF32, 1e-4}, Variant{KvDtype::kBF16, 5e-2}}) {
      DYNAMIC_SECTION("tensor_parallel_size " << tp << ", activations " << kvDtypeName(v.w)) {
        CudaBackendOptions o;
        o.weightDtype = v.w;
        o.useCudaGraphs = tp == 1;
        o.tensorParallelSize = tp;
        o.tpRanksShareDevice = tp > 1;
        o.weightStagingBytes = 1 << 20;  // codes and scales in several chunks
        auto gpu = createCudaBackend(*described, layout, o);
        REQUIRE(gpu.status().toString() == "OK");
        std::vector<int32_t> tokens;
        const auto got = runTwoSeqs(**gpu, 6, &tokens);
        REQUIRE(got.size() == want.size());
        if (v.w == KvDtype::kF32) CHECK(tokens == cpuTokens);
        checkRowsWhileIdsAgree(got, want, tokens, cpuTokens, v.tol);
        if (tp == 1) CHECK((*gpu)->graphSteps() == 6);  // fp8Gemv inside captured graphs
      }
    }
}

// The FP8 backend's device memory: its projections take 1 + 4/128 bytes a weight (plus one
// bf16 dequant buffer for the largest), the bf16 backend's 2. The small preset's 8 layers hold
// 23.2M projection weights: 46 MiB in bf16, ~24 MiB + 2.8 MiB scratch in FP8; the rest of both
// backends (embedding, KV cache, scratch, cuBLAS workspace) is the same.
// An FP8 block-scaled Mixtral streamed as a worker loads it: attention projections FP8 on the
// device (W8A16), experts dequantized into the weight dtype while streaming. Against the CPU
// backend on the same checkpoint: f32 activations tight with identical greedy ids, bf16 within
// the bf16 tolerance while the ids agree.
TEST_CASE("an FP8 Mixtral checkpoint on the device matches the CPU backend", "[cuda][backend][stream][fp8][moe]") {
  if (!haveGpu()) return;
  MakeModelOptions mo;
  mo.preset = "tiny";
  mo.seed = 11;
  mo.arch = "mixtral";
  mo.dtype = "bf16";
  mo.quantization = "fp8";
  const std::string dir = madeModelDir("cuda_tiny_mixtral_fp8", mo);
  auto host = loadModel(dir);
  REQUIRE(host.status().toString() == "OK");
  auto described = describeModel(dir);
  REQUIRE(described.status().toString() == "OK");
  const KvLayout layout = kvLayoutFor((*host)->config, 16, 16, KvDtype::kF32);
  std::vector<int32_t> cpuTokens;
  const auto want = cpuTwoSeqs(*host, layout, 6, &cpuTokens);
  for (KvDtype w : {KvDtype::kF32, KvDtype::kBF16}) {
    DYNAMIC_SECTION("activations " << kvDtypeName(w)) {
      CudaBackendOptions o;
      o.weightDtype = w;
      o.weightStagingBytes = 1 << 20;
      auto gpu = createCudaBackend(*described, layout, o);
      REQUIRE(gpu.status().toString() == "OK");
      std::vector<int32_t> tokens;
      const auto got = runTwoSeqs(**gpu, 6, &tokens);
      REQUIRE(got.size() == want.size());
      if (w == KvDtype::kF32) CHECK(tokens == cpuTokens);
      checkRowsWhileIdsAgree(got, want, tokens, cpuTokens, w == KvDtype::kF32 ? 1e-4 : 5e-2);
      CHECK((*gpu)->graphSteps() == 0);
    }
  }
}

TEST_CASE("FP8 weights on the device take about half the memory of bf16", "[cuda][backend][stream][fp8]") {
  if (!haveGpu()) return;
  const std::string dir = fp8ModelDir();
  auto host = loadModel(dir);
  REQUIRE(host.status().toString() == "OK");
  auto described = describeModel(dir);
  REQUIRE(described.status().toString() == "OK");
  const KvLayout layout = kvLayoutFor((*host)->config, 16, 16, KvDtype::kBF16);
  auto used = [&](std::shared_ptr<const ModelWeights> m) {
    size_t free0 = 0, free1 = 0, total = 0;
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemGetInfo(&free0, &total) == cudaSuccess);
    CudaBackendOptions o;
    o.useCudaGraphs = false;
    auto b = createCudaBackend(std::move(m), layout, o);
    REQUIRE(b.status().toString() == "OK");
    REQUIRE(cudaMemGetInfo(&free1, &total) == cudaSuccess);
    return free0 > free1 ? free0 - free1 : size_t(0);
  };
  // A first backend loads cuBLAS's and our modules (lazily, once per process): not counted.
  (void)used(*host);
  const size_t bf16Bytes = used(*host);  // host tensors: uploaded as bf16
  const size_t fp8Bytes = used(*described);
  INFO("bf16 backend " << bf16Bytes << " bytes, fp8 backend " << fp8Bytes);
  CHECK(fp8Bytes + (size_t(15) << 20) < bf16Bytes);
}

TEST_CASE("gpu_memory_utilization sizes the KV cache from the device and serves the same logits",
          "[cuda][backend][utilization]") {
  if (!haveGpu()) return;
  auto model = tinyModel();
  CudaBackendOptions o;
  o.useCudaGraphs = false;
  o.gpuMemoryUtilization = 0.3;
  o.reserveTokens = 2048;
  o.reserveSeqs = 64;
  auto sized = createCudaBackend(model, kvLayoutFor(model->config, 0, 16, KvDtype::kBF16), o);
  REQUIRE(sized.status().toString() == "OK");
  const KvLayout& l = (*sized)->kvLayout();
  INFO("blocks " << l.numBlocks << ", " << l.totalBytes() << " bytes");
  CHECK(l.numBlocks > 1000);  // a tiny model: 30% of any GPU holds a great many blocks
  CHECK((*sized)->kvRegion().len == l.totalBytes());
  auto fixed = makeCuda(model, KvDtype::kBF16, KvDtype::kBF16, false);
  std::vector<int32_t> a, b;
  const auto want = runTwoSeqs(*fixed, 4, &a);
  const auto got = runTwoSeqs(**sized, 4, &b);
  CHECK(a == b);
  for (size_t i = 0; i < want.size(); ++i) CHECK(want[i] == got[i]);
  // A layout with blocks and a utilization both is refused, as is a fraction above 1.
  auto both = createCudaBackend(model, kvLayoutFor(model->config, 16, 16, KvDtype::kBF16), o);
  CHECK_THAT(both.status().message(), Catch::Contains("numBlocks 0 (the backend sizes it)"));
  o.gpuMemoryUtilization = 1.5;
  auto over = createCudaBackend(model, kvLayoutFor(model->config, 0, 16, KvDtype::kBF16), o);
  CHECK_THAT(over.status().message(), Catch::Contains("outside (0, 1]"));
  // A share smaller than the weights and scratch: the error names every term.
  o.gpuMemoryUtilization = 1e-6;
  auto tiny = createCudaBackend(model, kvLayoutFor(model->config, 0, 16, KvDtype::kBF16), o);
  CHECK(tiny.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(tiny.status().message(), Catch::Contains("activation peak"));
}

// DeepseekV3ForCausalLM made dense (first_k_dense_replace = every layer): multi-head latent
// attention on CUDA (cuda_mla.h) against the CPU backend's (cpu_mla.h), with q low-rank or a
// plain q_proj, with and without YaRN (its frequencies, cos/sin magnitude and softmax mscale^2).
namespace {

std::string denseDeepseekDir(const std::string& preset, bool qLora, bool yarn) {
  MakeModelOptions o;
  o.preset = preset;
  o.arch = "deepseek_v3";
  o.seed = 13;
  o.mlaNoQLora = !qLora;
  o.mlaYarn = yarn ? 1 : 0;
  o.firstDenseLayers = 64;  // more than either preset's layers: every layer dense
  return madeModelDir("cuda_dsv3_dense_" + preset + (qLora ? "_qlora" : "_qproj") + (yarn ? "_yarn" : ""), o);
}

// The GPU's latent KV region as f32 values (f32 or bf16 cache).
std::vector<float> latentKvOf(const CudaBackend& b) {
  const KvLayout& l = b.kvLayout();
  std::vector<char> raw(l.totalBytes());
  REQUIRE(cudaMemcpy(raw.data(), b.kvRegion().ptr(), raw.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<float> v(raw.size() / l.elemBytes());
  if (l.dtype == KvDtype::kF32) {
    std::memcpy(v.data(), raw.data(), raw.size());
  } else {
    REQUIRE(l.dtype == KvDtype::kBF16);
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      const uint32_t u = uint32_t(h) << 16;
      std::memcpy(&v[i], &u, 4);
    }
  }
  return v;
}

}  // namespace

TEST_CASE("cuda backend: DeepseekV3 multi-head latent attention matches the CPU backend", "[cuda][backend][mla]") {
  if (!haveGpu()) return;
  struct Which {
    const char* preset;
    bool qLora, yarn;
  };
  for (Which which : {Which{"tiny", true, false}, Which{"tiny", false, true}, Which{"small", true, true}}) {
    auto loaded = loadModel(denseDeepseekDir(which.preset, which.qLora, which.yarn));
    REQUIRE(loaded.status().toString() == "OK");
    auto model = loaded.value();
    const ModelConfig& c = model->config;
    REQUIRE(c.isMla());
    REQUIRE(c.rope.yarn == which.yarn);
    REQUIRE((c.mla.qLoraRank > 0) == which.qLora);
    for (int l = 0; l < c.numLayers; ++l) REQUIRE_FALSE(c.isMoeLayer(l));
    CHECK(cudaSupportsModel(c).isOk());

    const KvLayout cpuLayout = kvLayoutFor(c, 16, 16);  // the CPU keeps latents in f32
    std::vector<float> cpuKv, cpuPrefillKv;
    std::vector<int32_t> cpuTokens;
    const auto want = cpuTwoSeqs(model, cpuLayout, 8, &cpuTokens, &cpuKv);
    // The cache after the prefill alone (chunks 40 | 16 + 7): both sides wrote the same tokens.
    std::vector<int32_t> none;
    cpuTwoSeqs(model, cpuLayout, 0, &none, &cpuPrefillKv);

    struct Variant {
      KvDtype w, kv;
      double tol, kvTol;
    };
    for (Variant v :
         {Variant{KvDtype::kF32, KvDtype::kF32, 1e-4, 1e-4}, Variant{KvDtype::kBF16, KvDtype::kBF16, 5e-2, 3e-2}}) {
      DYNAMIC_SECTION(which.preset << (which.qLora ? " q_lora" : " q_proj") << (which.yarn ? " yarn" : "")
                                   << " weights " << kvDtypeName(v.w) << " kv " << kvDtypeName(v.kv)) {
        auto gpu = makeCuda(model, v.w, v.kv, true);
        CHECK(gpu->kvLayout().latent);
        CHECK(gpu->kvLayout().fingerprint() == kvLayoutFor(c, 16, 16, v.kv).fingerprint());
        CHECK(gpu->kvRegion().len == kvLayoutFor(c, 16, 16, v.kv).totalBytes());
        std::vector<int32_t> tokens;
        const auto got = runTwoSeqs(*gpu, 8, &tokens);
        REQUIRE(got.size() == want.size());
        // 16-bit: a near-tie may flip a greedy token and every later row: prefill rows only.
        const size_t compareRows = v.w == KvDtype::kF32 ? got.size() : 2;
        if (v.w == KvDtype::kF32) {
          CHECK(tokens == cpuTokens);
          CHECK(relError(latentKvOf(*gpu), cpuKv) < v.kvTol);
        }
        checkRowsNear(got, want, compareRows, v.tol);
        CHECK(gpu->graphSteps() == 8);

        auto prefill = makeCuda(model, v.w, v.kv, false);
        std::vector<int32_t> none2;
        runTwoSeqs(*prefill, 0, &none2);
        const double kvErr = relError(latentKvOf(*prefill), cpuPrefillKv);
        INFO("latent KV after the prefill: rel error " << kvErr);
        CHECK(kvErr < v.kvTol);
      }
    }
  }
}

TEST_CASE("cuda backend: a described DeepseekV3 model loads as the host-uploaded one", "[cuda][backend][mla]") {
  if (!haveGpu()) return;
  const std::string dir = denseDeepseekDir("tiny", true, true);
  auto loaded = loadModel(dir);
  auto described = describeModel(dir);
  REQUIRE(loaded.status().toString() == "OK");
  REQUIRE(described.status().toString() == "OK");
  auto a = makeCuda(loaded.value(), KvDtype::kBF16, KvDtype::kBF16, true);
  auto b = makeCuda(described.value(), KvDtype::kBF16, KvDtype::kBF16, true);
  std::vector<int32_t> ta, tb;
  const auto ra = runTwoSeqs(*a, 4, &ta);
  const auto rb = runTwoSeqs(*b, 4, &tb);
  CHECK(ta == tb);
  for (size_t i = 0; i < ra.size(); ++i) CHECK(relError(rb[i], ra[i]) < 1e-6);
}

TEST_CASE("cuda backend reports each layer's latent KV once it is in device memory", "[cuda][backend][mla]") {
  if (!haveGpu()) return;
  auto loaded = loadModel(denseDeepseekDir("tiny", true, false));
  REQUIRE(loaded.status().toString() == "OK");
  auto model = loaded.value();
  auto gpu = makeCuda(model, KvDtype::kF32, KvDtype::kF32, true);
  const KvLayout& L = gpu->kvLayout();
  REQUIRE(L.latent);
  const MemDesc region = gpu->kvRegion();
  CHECK(region.len == L.totalBytes());
  // Block 3 of each layer: every token's [c_kv | k_pe] must be written by the layer's callback.
  const std::vector<float> logits = forwardCheckingLayerReadiness(*gpu, L, {region}, model->config);
  CHECK(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
}
