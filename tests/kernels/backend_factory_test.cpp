// Runs in every build, with or without a GPU: `backend: cuda` is either served or refused
// with a message naming why; the tensor-parallel plan checks the model's shape, and its
// weight slices are exact copies of the right rows / columns (checked byte for byte).
#include <algorithm>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/cuda_backend.h"
#include "engine/tensor_parallel.h"

using namespace pd;
using namespace pd::engine;

TEST_CASE("createBackend: cuda without a device (or without CUDA) is a clear error", "[backend][factory]") {
  const Status avail = cudaDeviceAvailable();
  if (avail.isOk()) {
    WARN("a CUDA device is present: the refusal path is not exercised here");
    return;
  }
#if defined(PD_HAVE_CUDA)
  CHECK(avail.code() == StatusCode::kUnavailable);
  CHECK(avail.message().rfind("cuda backend: no CUDA device found (cudaGetDeviceCount: ", 0) == 0);
#else
  CHECK(avail.code() == StatusCode::kUnimplemented);
  CHECK(avail.message().find("no CUDA support") != std::string::npos);
#endif
  // The factory refuses before it looks at the model.
  KvLayout layout;
  auto b = createBackend("cuda", nullptr, layout, nullptr);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().message() == avail.message());
}

TEST_CASE("createBackend: unknown backend names list the allowed values", "[backend][factory]") {
  auto b = createBackend("tpu", nullptr, KvLayout{}, nullptr);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == StatusCode::kInvalidArgument);
  CHECK(b.status().message() == "backend \"tpu\" is not known (allowed: cpu, cuda)");
}

TEST_CASE("tensor-parallel plan splits heads, kv heads and ffn and the KV layout is per rank", "[backend][tp]") {
  ModelConfig c;
  c.numHeads = 32;
  c.numKvHeads = 8;
  c.headDim = 128;
  c.intermediateSize = 14336;
  auto p = planTensorParallel(c, 4);
  REQUIRE(p.ok());
  CHECK(p->headsPerRank == 8);
  CHECK(p->kvHeadsPerRank == 2);
  CHECK(p->ffnPerRank == 3584);
  CHECK(p->qRowBegin(3) == 3 * 8 * 128);
  KvLayout full;
  full.numLayers = 2;
  full.numBlocks = 10;
  full.numKvHeads = 8;
  full.headDim = 128;
  const KvLayout r = perRankKvLayout(full, *p);
  CHECK(r.numKvHeads == 2);
  CHECK(r.totalBytes() * 4 == full.totalBytes());
  CHECK(r.fingerprint() == "L2.B16.H2.D128.f32");

  CHECK(planTensorParallel(c, 3).status().message() == "tensor_parallel_size 3 is not supported (allowed: 1, 2, 4, 8)");
  c.numKvHeads = 4;
  CHECK(planTensorParallel(c, 8).status().message().find("does not divide the model's 4 kv heads") !=
        std::string::npos);
  CHECK(planTensorParallel(c, 1).ok());
}

namespace {

// A fused row-major matrix whose every element names its place: row * 100 + column.
std::vector<float> numbered(int rows, int cols) {
  std::vector<float> w(size_t(rows) * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) w[size_t(r) * cols + c] = float(r * 100 + c);
  return w;
}

// Rows [begin, begin + count) of a numbered matrix, as sliceRows should copy them.
void appendNumberedRows(std::vector<float>* out, int begin, int count, int cols) {
  for (int r = begin; r < begin + count; ++r)
    for (int c = 0; c < cols; ++c) out->push_back(float(r * 100 + c));
}

bool sameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("tensor-parallel slices of the fused weights are exact row / column copies", "[backend][tp]") {
  // 4 heads, 2 kv heads, head dim 2, hidden 3, ffn 6, over 2 ranks: q rows [0, 8), k rows
  // [8, 12), v rows [12, 16) of the fused q|k|v; gate rows [0, 6), up rows [6, 12).
  ModelConfig c;
  c.numHeads = 4;
  c.numKvHeads = 2;
  c.headDim = 2;
  c.hiddenSize = 3;
  c.intermediateSize = 6;
  auto p = planTensorParallel(c, 2);
  REQUIRE(p.ok());
  const int hidden = 3;
  CHECK(p->qDim() == 8);
  CHECK(p->kvDim() == 4);
  CHECK(p->ffn() == 6);
  CHECK(p->rankQkvRows() == 8);  // 2 q heads + 1 k head + 1 v head, 2 rows each

  // Rank 1: q heads 2..3 (rows 4..7), kv head 1: k rows 10..11, v rows 14..15.
  const auto qkv1 = p->qkvRows(1);
  CHECK(qkv1[0] == RowRange{4, 4});
  CHECK(qkv1[1] == RowRange{10, 2});
  CHECK(qkv1[2] == RowRange{14, 2});
  const auto qkv0 = p->qkvRows(0);
  CHECK(qkv0[0] == RowRange{0, 4});
  CHECK(qkv0[1] == RowRange{8, 2});
  CHECK(qkv0[2] == RowRange{12, 2});

  const std::vector<float> qkv = numbered(16, hidden);
  std::vector<float> want;
  appendNumberedRows(&want, 4, 4, hidden);
  appendNumberedRows(&want, 10, 2, hidden);
  appendNumberedRows(&want, 14, 2, hidden);
  CHECK(sameBytes(sliceRows(qkv.data(), hidden, qkv1), want));

  // The bias is the cols == 1 case: values 0, 100, ..., 1500 -> rank 1 takes rows as above.
  const std::vector<float> bias = numbered(16, 1);
  CHECK(sameBytes(sliceRows(bias.data(), 1, qkv1), {400, 500, 600, 700, 1000, 1100, 1400, 1500}));

  // gate|up of rank 1: gate rows 3..5, up rows 9..11.
  const auto gu1 = p->gateUpRows(1);
  CHECK(gu1[0] == RowRange{3, 3});
  CHECK(gu1[1] == RowRange{9, 3});
  const std::vector<float> gateUp = numbered(12, hidden);
  want.clear();
  appendNumberedRows(&want, 3, 3, hidden);
  appendNumberedRows(&want, 9, 3, hidden);
  CHECK(sameBytes(sliceRows(gateUp.data(), hidden, gu1), want));

  // o_proj [hidden][qDim]: rank 1 takes columns 4..7 of every row; down [hidden][ffn]: 3..5.
  CHECK(p->oColumns(1) == RowRange{4, 4});
  CHECK(p->downColumns(1) == RowRange{3, 3});
  const std::vector<float> o = numbered(hidden, 8);
  CHECK(sameBytes(sliceColumns(o.data(), hidden, 8, p->oColumns(1)),
                  {4, 5, 6, 7, 104, 105, 106, 107, 204, 205, 206, 207}));
  const std::vector<float> down = numbered(hidden, 6);
  CHECK(sameBytes(sliceColumns(down.data(), hidden, 6, p->downColumns(0)), {0, 1, 2, 100, 101, 102, 200, 201, 202}));
}

TEST_CASE(
    "tensor-parallel slices cover every row once and the row-parallel partials sum to "
    "the full product",
    "[backend][tp]") {
  ModelConfig c;
  c.numHeads = 8;
  c.numKvHeads = 4;
  c.headDim = 4;
  c.hiddenSize = 5;
  c.intermediateSize = 12;
  for (int size : {1, 2, 4}) {
    DYNAMIC_SECTION("tp " << size) {
      auto p = planTensorParallel(c, size);
      REQUIRE(p.ok());
      const int qkvRows = p->qDim() + 2 * p->kvDim();
      std::vector<int> seen(qkvRows, 0), seenGu(2 * p->ffn(), 0);
      for (int r = 0; r < size; ++r) {
        for (const RowRange& g : p->qkvRows(r))
          for (int i = g.begin; i < g.begin + g.count; ++i) ++seen[i];
        for (const RowRange& g : p->gateUpRows(r))
          for (int i = g.begin; i < g.begin + g.count; ++i) ++seenGu[i];
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
      CHECK(std::all_of(seenGu.begin(), seenGu.end(), [](int n) { return n == 1; }));

      // o_proj y = W a with small integers (exact in f32): the sum over ranks of
      // W[:, cols_r] a[cols_r] is y, which is what the all-reduce computes.
      const int hidden = c.hiddenSize, in = p->qDim();
      std::vector<float> w(size_t(hidden) * in), a(in);
      for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i * 7 % 11) - 5);
      for (int i = 0; i < in; ++i) a[i] = float(i % 5 - 2);
      std::vector<float> full(hidden, 0.0f), summed(hidden, 0.0f);
      for (int o = 0; o < hidden; ++o)
        for (int i = 0; i < in; ++i) full[o] += w[size_t(o) * in + i] * a[i];
      for (int r = 0; r < size; ++r) {
        const RowRange cols = p->oColumns(r);
        const std::vector<float> wr = sliceColumns(w.data(), hidden, in, cols);
        for (int o = 0; o < hidden; ++o)
          for (int i = 0; i < cols.count; ++i) summed[o] += wr[size_t(o) * cols.count + i] * a[cols.begin + i];
      }
      CHECK(sameBytes(summed, full));
    }
  }
}

// Qwen3 (per-head q/k RMSNorm) and the mixture-of-experts families pass the architecture
// check; without a device the factory then fails on the device, not on the model.
TEST_CASE("cudaSupportsModel accepts Qwen3 and the mixture-of-experts models", "[backend][factory]") {
  struct Case {
    const char* arch;
    const char* extra;
  };
  for (Case k : {Case{"Qwen3ForCausalLM", ""},
                 Case{"Qwen3MoeForCausalLM",
                      R"(, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "norm_topk_prob": true)"},
                 Case{"MixtralForCausalLM", R"(, "num_local_experts": 8, "num_experts_per_tok": 2)"}}) {
    DYNAMIC_SECTION(k.arch) {
      auto m = std::make_shared<ModelWeights>();
      auto c = parseModelConfig(std::string(R"({"architectures": [")") + k.arch +
                                    R"("], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 259)" +
                                    k.extra + "}",
                                "config.json");
      REQUIRE(c.status().toString() == "OK");
      m->config = *c;
      CHECK(m->config.isMoe() == (std::string(k.arch) != "Qwen3ForCausalLM"));
      CHECK(m->config.qkNorm == (std::string(k.arch) != "MixtralForCausalLM"));
      CHECK(cudaSupportsModel(m->config).toString() == "OK");
      if (cudaDeviceAvailable().isOk()) continue;  // the device path is test_cuda_backend's
      // No device: the refusal is the device's, not the model's.
      auto b = createCudaBackend(m, kvLayoutFor(m->config, 8, 16));
      REQUIRE_FALSE(b.ok());
      CHECK(b.status().message() == cudaDeviceAvailable().message());
    }
  }
}

// DeepseekV3ForCausalLM: its multi-head latent attention (cuda_mla.h) and its mixture-of-
// experts layers (cuda_moe.h) run on CUDA, so a config with MoE layers passes the architecture
// check as a dense one does. What the MLA path does not implement is refused by name before
// any device probe (in a CUDA build); without a device the refusal is then the device's.
TEST_CASE("createCudaBackend: DeepseekV3ForCausalLM passes with MoE layers and refuses TP and fp8 KV by name",
          "[backend][factory]") {
  auto deepseek = [](int firstDense) {
    auto c = parseModelConfig(R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 259,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": )" + std::to_string(firstDense) +
                                  "}",
                              "deepseek.json");
    REQUIRE(c.status().toString() == "OK");
    auto m = std::make_shared<ModelWeights>();
    m->config = *c;
    return m;
  };
  for (int firstDense : {1, 2}) {  // 1: layer 1 is a mixture of experts; 2: every layer dense
    DYNAMIC_SECTION("first_k_dense_replace " << firstDense) {
      auto m = deepseek(firstDense);
      CHECK(m->config.isMla());
      CHECK(m->config.isMoeLayer(1) == (firstDense == 1));
      CHECK(cudaSupportsModel(m->config).toString() == "OK");
      const KvLayout layout = kvLayoutFor(m->config, 8, 16);
      CHECK(layout.latent);
#if defined(PD_HAVE_CUDA)  // a build without CUDA refuses every model for want of it (cuda_backend_stub.cpp)
      CudaBackendOptions tp2;
      tp2.tensorParallelSize = 2;
      auto t = createCudaBackend(m, layout, tp2);
      REQUIRE_FALSE(t.ok());
      CHECK(t.status().code() == StatusCode::kUnimplemented);
      CHECK(t.status().message().find("tensor_parallel_size 2 with DeepseekV3ForCausalLM") != std::string::npos);
      auto fp8 = createCudaBackend(m, kvLayoutFor(m->config, 8, 16, KvDtype::kFp8));
      REQUIRE_FALSE(fp8.ok());
      CHECK(fp8.status().code() == StatusCode::kUnimplemented);
      CHECK(fp8.status().message().find("KV dtype fp8 for DeepseekV3ForCausalLM") != std::string::npos);
#endif
      if (cudaDeviceAvailable().isOk()) continue;  // the device path is test_cuda_backend's
      auto b = createCudaBackend(m, layout);
      REQUIRE_FALSE(b.ok());
      CHECK(b.status().message() == cudaDeviceAvailable().message());
      auto f = createBackend("cuda", m, layout, nullptr);
      REQUIRE_FALSE(f.ok());
      CHECK(f.status().message() == b.status().message());
    }
  }
}
