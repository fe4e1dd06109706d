// DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2) on the CPU backend: the published configs
// parse with their active parameters and latent KV per token; what is not implemented is
// refused by name; the tiny preset and its variants (q_lora_rank null or set, YaRN on or off,
// n_group 1 or more, first dense layers or none) match the float64 NumPy forward written from
// the published modeling_deepseek.py (tests/reference/llama_reference.py) in greedy ids and
// logits; the KV layout is latent; routing reads only the chosen groups' experts.
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/cpu_moe.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd::engine;
using namespace pd::engine::test;

namespace {

// DeepSeek-V3's config.json as published (its FP8 weights with 128 x 128 block scales:
// docs/models.md, "FP8 checkpoints"), and Kimi K2's differences.
const char* kDeepseekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
               "AutoModel": "modeling_deepseek.DeepseekV3Model",
               "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
  "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
  "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
  "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
  "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
  "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
  "q_lora_rank": 1536, "qk_nope_head_dim": 128,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280})";

void checkAgainstNumpy(const std::string& name, const MakeModelOptions& o) {
  const std::string dir = makeTestModel(name, o);
  auto model = loadModel(dir);
  REQUIRE(model.status().toString() == "OK");
  TestKv kv((*model)->config, 64);
  auto backend = makeBackend(*model, kv);
  const auto prompt = testPrompt(37, 11);
  std::vector<int32_t> generated;
  const auto rows = runGreedy(*backend, kv, prompt, 0, 5, &generated);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), generated.begin(), generated.end());
  const auto ref = numpyReference(dir, all, int(prompt.size()), (*model)->config.vocabSize);
  REQUIRE(ref.size() == rows.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    INFO(name << " row " << i);
    CHECK(relError(rows[i], ref[i]) < 1e-4);
    const int refArgmax = int(std::max_element(ref[i].begin(), ref[i].end()) - ref[i].begin());
    if (i < generated.size()) CHECK(refArgmax == generated[i]);
  }
  // The same prompt in chunks of 10 (each chunk attends to the latent KV the earlier ones
  // wrote) gives the same logits.
  TestKv kv2((*model)->config, 64, 16, 99);
  auto chunked = makeBackend(*model, kv2);
  std::vector<int32_t> g2;
  const auto rows2 = runGreedy(*chunked, kv2, prompt, 10, 5, &g2);
  CHECK(g2 == generated);
  for (size_t i = 0; i < rows.size(); ++i) CHECK(relError(rows2[i], rows[i]) < 1e-5);
  // In chunks of 3: chunks this short attend token by token over the cache in place
  // (latentAttention, as a decode step does) instead of the GEMM tiles.
  TestKv kv3((*model)->config, 64, 16, 7);
  auto small = makeBackend(*model, kv3);
  std::vector<int32_t> g3;
  const auto rows3 = runGreedy(*small, kv3, prompt, 3, 5, &g3);
  CHECK(g3 == generated);
  for (size_t i = 0; i < rows.size(); ++i) CHECK(relError(rows3[i], rows[i]) < 1e-5);
}

MakeModelOptions deepseek(uint64_t seed) {
  MakeModelOptions o;
  o.arch = "deepseek_v3";
  o.seed = seed;
  return o;
}

std::vector<float> firstLogits(const std::string& dir) {
  auto m = loadModel(dir);
  REQUIRE(m.ok());
  TestKv kv((*m)->config, 8);
  auto b = makeBackend(*m, kv);
  std::vector<int32_t> g;
  return runGreedy(*b, kv, testPrompt(37, 11), 0, 0, &g)[0];
}

}  // namespace

TEST_CASE("DeepSeek-V3 and Kimi K2 configs parse: MLA, YaRN, routing, active parameters, latent KV") {
  auto c = parseModelConfig(kDeepseekV3, "deepseek-v3.json");
  REQUIRE(c.status().toString() == "OK");
  CHECK(c->architecture == Architecture::kDeepseekV3);
  CHECK(c->isMla());
  CHECK(c->mla.qLoraRank == 1536);
  CHECK(c->mla.latentDim() == 576);
  CHECK(c->numKvHeads == 1);
  CHECK(c->headDim == 576);
  CHECK(c->mtpLayers == 1);
  CHECK(c->quantization == WeightQuantization{true, 128, 128});
  CHECK(c->rope.yarn);
  CHECK(c->rope.factor == 40);
  CHECK(c->rope.originalMaxPositionEmbeddings == 4096);
  // softmax scale: 1/sqrt(192) x (0.1 ln 40 + 1)^2
  const double m = 0.1 * std::log(40.0) + 1.0;
  CHECK(std::abs(c->softmaxScale() - m * m / std::sqrt(192.0)) < 1e-12);
  CHECK(c->moe.sigmoidScoring);
  CHECK(c->moe.numExperts == 256);
  CHECK(c->moe.numGroups == 8);
  CHECK(c->moe.topkGroups == 4);
  CHECK(c->moe.sharedFfn() == 2048);
  CHECK(c->moe.routedScalingFactor == 2.5);
  CHECK(!c->isMoeLayer(2));  // first_k_dense_replace 3
  CHECK(c->isMoeLayer(3));
  // 37 B activated parameters by the model card (embedding table counted): 36.6 B without it.
  INFO("active " << c->decodeWeightParams());
  CHECK(std::abs(double(c->decodeWeightParams() + int64_t(c->vocabSize) * c->hiddenSize) / 1e9 - 37.5) < 0.5);
  // Latent KV: (512 + 64) values per token and layer.
  CHECK(c->kvElemsPerTokenLayer() == 576);
  const KvLayout l = kvLayoutFor(*c, 4, 16, KvDtype::kBF16);
  CHECK(l.latent);
  CHECK(l.blockBytes() == size_t(16) * 576 * 2);
  CHECK(l.blockBytes() * l.numLayers / 16 == 70272);  // ~70 KB per token in bf16

  // Kimi K2: 384 experts in one group, 64 heads, the first layer dense; 32 B activated.
  auto k2 = nlohmann::json::parse(kDeepseekV3);
  k2["n_routed_experts"] = 384;
  k2["n_group"] = 1;
  k2["topk_group"] = 1;
  k2["num_attention_heads"] = 64;
  k2["num_key_value_heads"] = 64;
  k2["first_k_dense_replace"] = 1;
  k2["routed_scaling_factor"] = 2.827;
  k2["vocab_size"] = 163840;
  k2["rope_scaling"] = {{"beta_fast", 1.0}, {"beta_slow", 1.0},      {"factor", 32.0},
                        {"mscale", 1.0},    {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096},
                        {"type", "yarn"}};
  c = parseModelConfig(k2.dump(), "kimi-k2.json");
  REQUIRE(c.status().toString() == "OK");
  INFO("kimi active " << c->decodeWeightParams());
  CHECK(std::abs(double(c->decodeWeightParams() + int64_t(c->vocabSize) * c->hiddenSize) / 1e9 - 32.9) < 0.6);
}

TEST_CASE("DeepSeek configs: what is not implemented is refused by name") {
  const auto base = nlohmann::json::parse(kDeepseekV3);
  auto refused = [&](const nlohmann::json& edit, const std::string& named) {
    nlohmann::json j = base;
    for (auto& [k, v] : edit.items()) j[k] = v;
    auto r = parseModelConfig(j.dump(), "deepseek.json");
    INFO(edit.dump());
    REQUIRE(!r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains(named));
  };
  refused({{"index_n_heads", 64}}, "config key \"index_n_heads\"");
  refused({{"topk_method", "greedy"}}, "topk_method \"greedy\"");
  refused({{"scoring_func", "softmax"}}, "scoring_func \"softmax\"");
  refused({{"attention_bias", true}}, "attention_bias true");
  refused({{"rope_interleave", false}}, "rope_interleave false");
  refused({{"head_dim", 128}}, "head_dim 128");
  refused({{"n_group", 7}}, "not a multiple of n_group 7");
  refused({{"topk_group", 9}}, "topk_group 9");
  refused({{"rope_scaling",
            {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096}, {"attention_factor", 1.2}}}},
          "rope_scaling key \"attention_factor\"");
  refused({{"rope_scaling", {{"type", "dynamic"}, {"factor", 2}}}}, "rope_scaling type \"dynamic\"");
  nlohmann::json noRank = base;
  noRank.erase("kv_lora_rank");
  auto missing = parseModelConfig(noRank.dump(), "deepseek.json");
  REQUIRE(!missing.ok());
  CHECK_THAT(missing.status().message(), Catch::Contains("missing required key \"kv_lora_rank\""));
  // YaRN is DeepSeek's: a Llama config with it is still refused.
  nlohmann::json llama = nlohmann::json::parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 259,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 512}})");
  auto r = parseModelConfig(llama.dump(), "llama.json");
  REQUIRE(!r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("yarn"));
}

TEST_CASE("deepseek tiny matches NumPy: q low-rank, 4 expert groups, a dense first layer") {
  checkAgainstNumpy("deepseek_tiny", deepseek(41));
}

TEST_CASE("deepseek tiny variants match NumPy: q_proj and YaRN; one group and no dense layer; bf16") {
  MakeModelOptions a = deepseek(43);
  a.mlaNoQLora = true;
  a.mlaYarn = 1;
  checkAgainstNumpy("deepseek_tiny_noqlora_yarn", a);
  MakeModelOptions b = deepseek(47);
  b.moeGroups = 1;
  b.firstDenseLayers = 0;
  b.tieEmbeddings = true;
  checkAgainstNumpy("deepseek_tiny_1group_nodense_tied", b);
  MakeModelOptions c = deepseek(53);
  c.moeGroups = 8;
  c.dtype = "bf16";
  checkAgainstNumpy("deepseek_tiny_8groups_bf16", c);
}

TEST_CASE("deepseek: YaRN and the expert groups change the logits (the reference tests can fail)") {
  const auto plain = firstLogits(makeTestModel("deepseek_tiny", deepseek(41)));
  MakeModelOptions y = deepseek(41);
  y.mlaYarn = 1;
  CHECK(relError(firstLogits(makeTestModel("deepseek_tiny_yarn41", y)), plain) > 1e-4);
  MakeModelOptions g = deepseek(41);
  g.moeGroups = 1;  // the same weights routed over all 16 experts at once
  CHECK(relError(firstLogits(makeTestModel("deepseek_tiny_1group41", g)), plain) > 1e-4);
}

TEST_CASE("deepseek: the KV layout is latent and the backend refuses what it does not run") {
  auto m = loadModel(makeTestModel("deepseek_tiny", deepseek(41)));
  REQUIRE(m.ok());
  const ModelConfig& c = (*m)->config;
  const KvLayout latent = kvLayoutFor(c, 8, 16);
  CHECK(latent.latent);
  CHECK(latent.tokenElems() == 40);  // kv_lora_rank 32 + qk_rope_head_dim 8
  CHECK(latent.blockElems() == 16 * 40);
  CHECK(latent.fingerprint() == "MLA.L2.B16.H1.D40.f32");
  KvLayout gqa = latent;
  gqa.latent = false;  // the same numbers read as K and V
  CHECK(gqa.blockElems() == 2 * latent.blockElems());
  CHECK(gqa.fingerprint() != latent.fingerprint());
  std::vector<float> region(gqa.totalBytes() / 4);
  auto b = createCpuBackend(*m, gqa, region.data());
  REQUIRE(!b.ok());
  CHECK_THAT(b.status().message(), Catch::Contains("latent"));
  CpuBackendOptions bf16;
  bf16.weightFormat = "bf16";
  b = createCpuBackend(*m, latent, region.data(), bf16);
  REQUIRE(!b.ok());
  CHECK(b.status().code() == pd::StatusCode::kUnimplemented);
  CHECK_THAT(b.status().message(), Catch::Contains("DeepseekV3ForCausalLM"));
}

TEST_CASE("deepseek routing: k experts from the best groups only, the bias steering the choice only") {
  auto m = loadModel(makeTestModel("deepseek_tiny", deepseek(41)));
  REQUIRE(m.ok());
  const ModelConfig& c = (*m)->config;
  REQUIRE(c.isMoeLayer(1));
  const LayerWeights& w = (*m)->layers[1];
  const int h = c.hiddenSize, ne = c.moe.numExperts, per = ne / c.moe.numGroups;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> xn(static_cast<size_t>(h));
  for (auto& v : xn) v = nd(rng);
  // The router's logits, in double, and the published rule applied by hand.
  std::vector<double> s(ne), choice(ne);
  for (int e = 0; e < ne; ++e) {
    double z = 0;
    for (int i = 0; i < h; ++i) z += double(xn[i]) * w.router.data()[size_t(e) * h + i];
    s[e] = 1 / (1 + std::exp(-z));
    choice[e] = s[e] + w.routerBias.data()[e];
  }
  std::vector<std::pair<double, int>> groups;
  for (int g = 0; g < c.moe.numGroups; ++g) {
    std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
    std::sort(v.rbegin(), v.rend());
    groups.push_back({-(v[0] + v[1]), g});
  }
  std::sort(groups.begin(), groups.end());
  std::vector<std::pair<double, int>> cands;
  for (int i = 0; i < c.moe.topkGroups; ++i)
    for (int e = groups[i].second * per; e < (groups[i].second + 1) * per; ++e) cands.push_back({-choice[e], e});
  std::sort(cands.begin(), cands.end());
  std::set<int> expected;
  for (int j = 0; j < c.moe.expertsPerToken; ++j) expected.insert(cands[j].second);

  CpuMoe moe(c);
  std::map<const float*, int> reads;
  auto linear = [&](const float* x, int n, int in, const float* wt, int out, float* y, float beta) {
    ++reads[wt];
    for (int i = 0; i < n; ++i)
      for (int o = 0; o < out; ++o) {
        double acc = 0;
        for (int k = 0; k < in; ++k) acc += double(x[size_t(i) * in + k]) * wt[size_t(o) * in + k];
        y[size_t(i) * out + o] = float(acc + (beta != 0 ? beta * y[size_t(i) * out + o] : 0));
      }
  };
  std::vector<float> x(static_cast<size_t>(h), 0.0f);
  moe.forward(w, xn.data(), 1, x.data(), linear, [&](const std::vector<CpuMoe::LinearJob>& jobs) {
    for (const auto& j : jobs) linear(j.x, j.n, j.in, j.w, j.out, j.y, 0.0f);
  });
  std::set<int> ran;
  for (int e = 0; e < ne; ++e)
    if (moe.lastExpertRows()[e] > 0) ran.insert(e);
  CHECK(ran == expected);
  // The router, the chosen experts and the shared expert (gate|up, down), once each; no other.
  CHECK(reads.size() == 1 + 2 * expected.size() + 2);
  CHECK(reads[w.router.data()] == 1);
  CHECK(reads[w.gateUp.data()] == 1);
  CHECK(reads[w.down.data()] == 1);
  for (int e : expected) CHECK(reads[w.experts[e].gateUp.data()] == 1);
  // Without the bias the choice differs for this token (so the bias is used), and the weights
  // would not: they are the sigmoid scores either way.
  std::vector<std::pair<double, int>> plain;
  for (int e = 0; e < ne; ++e) plain.push_back({-s[e], e});
  std::sort(plain.begin(), plain.end());
  std::set<int> unbiased;
  for (int j = 0; j < c.moe.expertsPerToken; ++j) unbiased.insert(plain[j].second);
  CHECK(unbiased != expected);
}
