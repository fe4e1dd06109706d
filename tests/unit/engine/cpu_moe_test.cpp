// The CPU mixture-of-experts block (engine/cpu_moe.h): which weights each step reads. A
// batch-1 decode must read the router and only the experts its token chose; a prefill reads
// each chosen expert once for all the tokens routed to it. Numerics are the NumPy reference
// tests' job (model_reference_test.cpp). The row plan both backends share (moe_routing.h).
#include "engine/cpu_moe.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/moe_routing.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd::engine;
using namespace pd::engine::test;

namespace {

struct Reads {
  std::map<const float*, int> calls;  // weight pointer -> linear calls that read it
  std::map<const float*, int> rows;   // weight pointer -> token rows it was applied to
};

// A reference linear product that records what it read.
CpuMoe::LinearFn recording(Reads* r) {
  return [r](const float* x, int n, int in, const float* w, int out, float* y, float beta) {
    ++r->calls[w];
    r->rows[w] += n;
    for (int i = 0; i < n; ++i)
      for (int o = 0; o < out; ++o) {
        double s = 0;
        for (int k = 0; k < in; ++k) s += double(x[size_t(i) * in + k]) * w[size_t(o) * in + k];
        y[size_t(i) * out + o] = float(s + (beta != 0 ? beta * y[size_t(i) * out + o] : 0));
      }
  };
}

// The group runner over the recording linear product, one job at a time.
CpuMoe::LinearManyFn many(CpuMoe::LinearFn linear) {
  return [linear](const std::vector<CpuMoe::LinearJob>& jobs) {
    for (const auto& j : jobs) linear(j.x, j.n, j.in, j.w, j.out, j.y, 0.0f);
  };
}

}  // namespace

TEST_CASE("MoE: a decode token reads the router and its k experts only, a prefill each chosen expert once") {
  MakeModelOptions o;
  o.arch = "mixtral";
  o.seed = 29;
  auto m = loadModel(makeTestModel("mixtral_tiny", o));
  REQUIRE(m.ok());
  const ModelConfig& c = (*m)->config;
  REQUIRE(c.moe.numExperts == 8);
  REQUIRE(c.moe.expertsPerToken == 2);
  const LayerWeights& w = (*m)->layers[1];
  CpuMoe moe(c);
  const int h = c.hiddenSize;

  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> xn(size_t(64) * h), x(size_t(64) * h, 0.0f);
  for (auto& v : xn) v = nd(rng);

  // Batch 1: the router, then for each of its 2 experts gate|up and down, once each.
  Reads one;
  moe.forward(w, xn.data(), 1, x.data(), recording(&one), many(recording(&one)));
  CHECK(one.calls.size() == 1 + 2 * 2);
  CHECK(one.calls[w.router.data()] == 1);
  int expertsRead = 0;
  for (int e = 0; e < c.moe.numExperts; ++e) {
    const bool read = one.calls.count(w.experts[e].gateUp.data()) > 0;
    CHECK(read == (one.calls.count(w.experts[e].down.data()) > 0));
    CHECK(read == (moe.lastExpertRows()[e] == 1));
    expertsRead += read;
  }
  CHECK(expertsRead == 2);
  // The experts' weights read per decode token: router + 2 of 8 experts.
  size_t bytes = 0;
  for (auto& [p, n] : one.calls) {
    (void)n;
    if (p == w.router.data()) bytes += w.router.size() * 4;
    for (const auto& e : w.experts) {
      if (p == e.gateUp.data()) bytes += e.gateUp.size() * 4;
      if (p == e.down.data()) bytes += e.down.size() * 4;
    }
  }
  CHECK(bytes == size_t(c.moe.numExperts) * h * 4 + 2 * size_t(3) * h * c.moe.expertFfn * 4);

  // 64 tokens: each chosen expert is read by one gate|up and one down call covering all its
  // rows; the rows add up to 64 x 2.
  Reads prefill;
  moe.forward(w, xn.data(), 64, x.data(), recording(&prefill), many(recording(&prefill)));
  int totalRows = 0, used = 0;
  for (int e = 0; e < c.moe.numExperts; ++e) {
    const int rows = moe.lastExpertRows()[e];
    totalRows += rows;
    if (rows == 0) {
      CHECK(prefill.calls.count(w.experts[e].gateUp.data()) == 0);
      continue;
    }
    ++used;
    CHECK(prefill.calls[w.experts[e].gateUp.data()] == 1);
    CHECK(prefill.rows[w.experts[e].gateUp.data()] == rows);
    CHECK(prefill.calls[w.experts[e].down.data()] == 1);
  }
  CHECK(totalRows == 64 * 2);
  CHECK(used >= 4);  // random tokens spread over the experts
}

TEST_CASE("MoE configs: Mixtral and Qwen3-MoE parse, unknown keys and bad layer lists are refused by name") {
  const nlohmann::json mixtral = nlohmann::json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": false, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000})");
  auto c = parseModelConfig(mixtral.dump(), "mixtral.json");
  REQUIRE(c.status().toString() == "OK");
  CHECK(c->moe.numExperts == 8);
  CHECK(c->moe.expertFfn == 14336);
  CHECK(c->moe.normTopkProb);
  CHECK(c->isMoeLayer(0));
  // Mixtral-8x7B: 12.9 B active parameters of 46.7 B by its model card, which counts the
  // embedding table; without it (a token reads one row) 12.75 B.
  CHECK(std::abs(double(c->decodeWeightParams()) / 1e9 - 12.75) < 0.01);

  const nlohmann::json qwen3moe = nlohmann::json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  c = parseModelConfig(qwen3moe.dump(), "qwen3moe.json");
  REQUIRE(c.status().toString() == "OK");
  CHECK(c->qkNorm);
  CHECK(c->moe.numExperts == 128);
  CHECK(c->moe.expertsPerToken == 8);
  CHECK(c->moe.expertFfn == 768);
  // Qwen3-30B-A3B: 3.3 B active parameters by its model card (embedding table counted), 3.04 B
  // without the embedding table.
  CHECK(std::abs(double(c->decodeWeightParams()) / 1e9 - 3.04) < 0.01);

  nlohmann::json j = qwen3moe;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {0, 5};
  c = parseModelConfig(j.dump(), "qwen3moe.json");
  REQUIRE(c.ok());
  CHECK(!c->isMoeLayer(0));  // (0 + 1) % 2 != 0
  CHECK(c->isMoeLayer(1));
  CHECK(!c->isMoeLayer(5));  // mlp_only_layers, although (5 + 1) % 2 == 0
  CHECK(c->isMoeLayer(3));

  auto refused = [](nlohmann::json base, const nlohmann::json& edit, const std::string& named) {
    for (auto& [k, v] : edit.items()) base[k] = v;
    auto r = parseModelConfig(base.dump(), "moe.json");
    INFO(edit.dump());
    REQUIRE(!r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains(named));
  };
  refused(mixtral, {{"moe_intermediate_size", 768}}, "config key \"moe_intermediate_size\"");
  refused(qwen3moe, {{"n_shared_experts", 1}}, "config key \"n_shared_experts\"");
  refused(qwen3moe, {{"mlp_only_layers", {48}}}, "mlp_only_layers entry 48");
  refused(qwen3moe, {{"num_experts_per_tok", 129}}, "num_experts_per_tok 129");
  nlohmann::json noTopk = mixtral;
  noTopk.erase("num_experts_per_tok");
  refused(noTopk, {}, "num_experts_per_tok");
}

// The row plan both backends run (moe_routing.h): rows grouped by expert with tokens ascending
// inside each, every (token, slot) exactly once, and each token's slots ascending by row (=
// by expert), carrying their routing weights. Random top-k choices over many tokens.
TEST_CASE("MoE row plan: rows grouped by expert, each token's slots ascending with their weights") {
  const int T = 37, k = 4, ne = 16;
  std::mt19937 rng(7);
  std::vector<int> chosen(size_t(T) * k);
  std::vector<float> weights(chosen.size());
  for (int t = 0; t < T; ++t) {
    std::vector<int> ids(ne);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < k; ++j) {
      chosen[size_t(t) * k + j] = ids[j];
      weights[size_t(t) * k + j] = float(t * 100 + ids[j]);  // names its (token, expert)
    }
  }
  MoeRowPlan p;
  planMoeRows(chosen.data(), weights.data(), T, k, ne, &p);
  REQUIRE(p.start.size() == size_t(ne + 1));
  CHECK(p.start[0] == 0);
  CHECK(p.start[ne] == T * k);
  auto expertOf = [&](int r) { return int(std::upper_bound(p.start.begin(), p.start.end(), r) - p.start.begin()) - 1; };
  for (int e = 0; e < ne; ++e) {
    CHECK(p.start[e + 1] - p.start[e] == p.rowsPerExpert[e]);
    CHECK(p.rowsPerExpert[e] == int(std::count(chosen.begin(), chosen.end(), e)));
    for (int r = p.start[e] + 1; r < p.start[e + 1]; ++r) CHECK(p.srcRows[r - 1] < p.srcRows[r]);  // tokens ascending
  }
  std::vector<int> seen(size_t(T) * k, 0);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      const size_t s = size_t(t) * k + j;
      const int r = p.slotRows[s];
      REQUIRE(r >= 0);
      REQUIRE(r < T * k);
      ++seen[r];
      CHECK(p.srcRows[r] == t);
      const int e = expertOf(r);
      CHECK(std::count(chosen.begin() + t * k, chosen.begin() + (t + 1) * k, e) == 1);  // one of t's experts
      CHECK(p.slotWeights[s] == float(t * 100 + e));                                    // with its weight
      if (j > 0) CHECK(p.slotRows[s - 1] < r);                                          // ascending
    }
  }
  CHECK(std::count(seen.begin(), seen.end(), 1) == T * k);  // every row once
}
