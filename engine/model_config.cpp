#include "engine/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pd::engine {

double yarnMscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

bool ModelConfig::isMoeLayer(int l) const {
  if (!isMoe()) return false;
  if (architecture == Architecture::kDeepseekV3) return l >= moe.firstDenseLayers && l % moe.layerFreq == 0;
  for (int d : moe.denseLayers)
    if (d == l) return false;
  return (l + 1) % moe.sparseStep == 0;
}

int64_t ModelConfig::attentionParams() const {
  const int64_t h = hiddenSize;
  if (isMla()) {
    const int64_t nh = numHeads, qr = mla.qLoraRank, r = mla.kvLoraRank;
    const int64_t q = qr > 0 ? h * qr + qr + qr * nh * mla.qHeadDim() : h * nh * mla.qHeadDim();
    const int64_t kv = h * mla.latentDim() + r + r * nh * (mla.qkNopeHeadDim + mla.vHeadDim);
    return q + kv + nh * mla.vHeadDim * h + 2 * h;
  }
  return h * (qDim() + 2 * kvDim()) + int64_t(qDim()) * h + 2 * h + (qkNorm ? 2 * headDim : 0);
}

int64_t ModelConfig::decodeWeightParams() const {
  const int64_t h = hiddenSize;
  int64_t total = 0;
  for (int l = 0; l < numLayers; ++l)
    total +=
        attentionParams() +
        (isMoeLayer(l) ? int64_t(moe.numExperts) * h + (moe.sigmoidScoring ? moe.numExperts : 0) +
                             int64_t(moe.expertsPerToken) * 3 * h * moe.expertFfn + 3 * h * int64_t(moe.sharedFfn())
                       : 3 * h * intermediateSize);
  return total + h + int64_t(vocabSize) * h;
}

double ModelConfig::softmaxScale() const {
  if (!isMla()) return 1.0 / std::sqrt(double(headDim));
  double s = 1.0 / std::sqrt(double(mla.qHeadDim()));
  if (rope.yarn && rope.mscaleAllDim != 0) {
    const double m = yarnMscale(rope.factor, rope.mscaleAllDim);
    s *= m * m;
  }
  return s;
}

double ModelConfig::attentionSpanTokens() const {
  const double h = hiddenSize;
  const double ffn = isMoe() ? double(moe.expertsPerToken) * moe.expertFfn + moe.sharedFfn() : double(intermediateSize);
  if (isMla()) {
    // The absorbed form (docs/models.md): per attended position and head, q.latent over
    // latentDim and the weighted sum over kvLoraRank; kv_b_proj is applied once per query
    // token, so it counts with the linear layers (attentionParams).
    const double attnPerPos = 2.0 * numHeads * (mla.latentDim() + mla.kvLoraRank);
    return 2.0 * (double(attentionParams()) + 3 * h * ffn) / attnPerPos;
  }
  const double linearPerLayer = h * (qDim() + 2 * kvDim()) + double(qDim()) * h + 3 * h * ffn;
  return qDim() > 0 ? linearPerLayer / (2.0 * qDim()) : 0;  // 2 x params over 4 x qDim
}

namespace {

using nlohmann::json;

// Reads an integer key; `required` keys must be present and positive.
Status readInt(const json& j, const char* key, bool required, int* out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return invalidArgument(src + ": missing required key \"" + key + "\"");
    return Status::ok();
  }
  if (!it->is_number_integer()) return invalidArgument(src + ": \"" + key + "\" must be an integer, got " + it->dump());
  const int64_t v = it->get<int64_t>();
  if (v <= 0 || v > (int64_t(1) << 30))
    return invalidArgument(src + ": \"" + key + "\" = " + std::to_string(v) + " is out of range");
  *out = int(v);
  return Status::ok();
}

Status readNumber(const json& j, const char* key, double* out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_number()) return invalidArgument(src + ": \"" + key + "\" must be a number, got " + it->dump());
  *out = it->get<double>();
  return Status::ok();
}

// Every config.json key a checkpoint of the Qwen3 and mixture-of-experts families may carry.
// A key outside the lists may change the model in a way the forward pass does not know, so it
// is refused by name instead of ignored.
constexpr const char* kCommonKeys[] = {
    // the model's shape and numerics (read below)
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "hidden_act", "tie_word_embeddings", "sliding_window", "bos_token_id", "eos_token_id",
    "pad_token_id", "quantization_config",
    // training or bookkeeping only: they do not change inference
    "attention_dropout", "initializer_range", "use_cache", "torch_dtype", "dtype", "transformers_version"};
constexpr const char* kQwen3Keys[] = {"attention_bias", "use_sliding_window", "max_window_layers", "layer_types"};
// router_aux_loss_coef, output_router_logits, router_jitter_noise: training only.
constexpr const char* kMixtralKeys[] = {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                                        "output_router_logits", "router_jitter_noise"};
constexpr const char* kQwen3MoeKeys[] = {"num_experts",          "num_experts_per_tok",  "moe_intermediate_size",
                                         "norm_topk_prob",       "decoder_sparse_step",  "mlp_only_layers",
                                         "router_aux_loss_coef", "output_router_logits", "qkv_bias"};

// DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2). aux_loss_alpha, seq_aux: training only;
// ep_size, pretraining_tp: how the published code splits work over devices, not the math;
// auto_map: the Python class names.
constexpr const char* kDeepseekKeys[] = {"attention_bias",
                                         "q_lora_rank",
                                         "kv_lora_rank",
                                         "qk_nope_head_dim",
                                         "qk_rope_head_dim",
                                         "v_head_dim",
                                         "n_routed_experts",
                                         "n_shared_experts",
                                         "num_experts_per_tok",
                                         "moe_intermediate_size",
                                         "first_k_dense_replace",
                                         "moe_layer_freq",
                                         "n_group",
                                         "topk_group",
                                         "topk_method",
                                         "scoring_func",
                                         "norm_topk_prob",
                                         "routed_scaling_factor",
                                         "num_nextn_predict_layers",
                                         "rope_interleave",
                                         "aux_loss_alpha",
                                         "seq_aux",
                                         "ep_size",
                                         "pretraining_tp",
                                         "auto_map"};

template <size_t N>
bool inList(const std::string& key, const char* const (&list)[N]) {
  for (const char* k : list)
    if (key == k) return true;
  return false;
}

Status checkKnownKeys(const json& j, Architecture a, const std::string& src) {
  const std::string name = architectureName(a);
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    bool known = inList(k, kCommonKeys);
    if (a == Architecture::kQwen3 || a == Architecture::kQwen3Moe) known = known || inList(k, kQwen3Keys);
    if (a == Architecture::kMixtral) known = known || inList(k, kMixtralKeys);
    if (a == Architecture::kQwen3Moe) known = known || inList(k, kQwen3MoeKeys);
    if (a == Architecture::kDeepseekV3) known = known || inList(k, kDeepseekKeys);
    if (!known)
      return unimplemented(src + ": config key \"" + k + "\" is not implemented for " + name +
                           " (refused rather than ignored)");
  }
  if (j.value("use_sliding_window", false))
    return unimplemented(src + ": use_sliding_window true is not implemented for " + name);
  if (j.value("qkv_bias", false)) return unimplemented(src + ": qkv_bias true is not implemented for " + name);
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return invalidArgument(src + ": \"layer_types\" must be an array");
    for (const auto& t : *it)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        return unimplemented(src + ": layer_types entry " + t.dump() + " is not implemented for " + name +
                             " (only \"full_attention\")");
  }
  if (auto it = j.find("attention_dropout"); it != j.end() && it->is_number() && it->get<double>() != 0.0)
    return unimplemented(src + ": attention_dropout " + it->dump() + " (inference uses none; 0 expected)");
  return Status::ok();
}

// num_experts / num_local_experts, num_experts_per_tok, the expert width and Qwen3-MoE's
// layer pattern.
Status readMoe(const json& j, ModelConfig* c, const std::string& src) {
  MoeConfig& m = c->moe;
  const bool mixtral = c->architecture == Architecture::kMixtral;
  PD_RETURN_IF_ERROR(readInt(j, mixtral ? "num_local_experts" : "num_experts", true, &m.numExperts, src));
  PD_RETURN_IF_ERROR(readInt(j, "num_experts_per_tok", true, &m.expertsPerToken, src));
  if (m.expertsPerToken > m.numExperts)
    return invalidArgument(src + ": num_experts_per_tok " + std::to_string(m.expertsPerToken) + " exceeds the " +
                           std::to_string(m.numExperts) + " experts");
  if (mixtral) {
    m.expertFfn = c->intermediateSize;
    m.normTopkProb = true;
    return Status::ok();
  }
  PD_RETURN_IF_ERROR(readInt(j, "moe_intermediate_size", true, &m.expertFfn, src));
  m.normTopkProb = false;
  if (auto it = j.find("norm_topk_prob"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return invalidArgument(src + ": \"norm_topk_prob\" must be a boolean");
    m.normTopkProb = it->get<bool>();
  }
  PD_RETURN_IF_ERROR(readInt(j, "decoder_sparse_step", false, &m.sparseStep, src));
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return invalidArgument(src + ": \"mlp_only_layers\" must be an array of layer indices");
    for (const auto& e : *it) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= c->numLayers)
        return invalidArgument(src + ": mlp_only_layers entry " + e.dump() + " is not a layer index");
      m.denseLayers.push_back(e.get<int>());
    }
  }
  return Status::ok();
}

// DeepseekV3: the MLA shape, the routed and shared experts and their routing. Runs after the
// common keys; sets numKvHeads 1 and headDim latentDim() (the KV cache's one latent "head").
Status readDeepseek(const json& j, ModelConfig* c, const std::string& src) {
  MlaConfig& a = c->mla;
  if (j.value("attention_bias", false))
    return unimplemented(src + ": attention_bias true is not implemented for DeepseekV3ForCausalLM");
  if (auto it = j.find("rope_interleave"); it != j.end() && it->is_boolean() && !it->get<bool>())
    return unimplemented(src + ": rope_interleave false is not implemented (DeepSeek's RoPE pairs adjacent values)");
  PD_RETURN_IF_ERROR(readInt(j, "q_lora_rank", false, &a.qLoraRank, src));
  PD_RETURN_IF_ERROR(readInt(j, "kv_lora_rank", true, &a.kvLoraRank, src));
  PD_RETURN_IF_ERROR(readInt(j, "qk_nope_head_dim", true, &a.qkNopeHeadDim, src));
  PD_RETURN_IF_ERROR(readInt(j, "qk_rope_head_dim", true, &a.qkRopeHeadDim, src));
  PD_RETURN_IF_ERROR(readInt(j, "v_head_dim", true, &a.vHeadDim, src));
  if (a.qkRopeHeadDim % 2 != 0)
    return invalidArgument(src + ": qk_rope_head_dim " + std::to_string(a.qkRopeHeadDim) + " must be even");
  if (auto it = j.find("head_dim");
      it != j.end() && !it->is_null() && (!it->is_number_integer() || it->get<int64_t>() != a.qkRopeHeadDim))
    return unimplemented(src + ": head_dim " + it->dump() + " differs from qk_rope_head_dim " +
                         std::to_string(a.qkRopeHeadDim) + " (DeepseekV3 uses head_dim as the RoPE width only)");
  c->numKvHeads = 1;
  c->headDim = a.latentDim();
  if (auto it = j.find("num_nextn_predict_layers"); it != j.end() && it->is_number_integer())
    c->mtpLayers = std::max(0, it->get<int>());

  MoeConfig& m = c->moe;
  if (auto it = j.find("n_routed_experts"); it == j.end() || it->is_null()) return Status::ok();  // dense
  PD_RETURN_IF_ERROR(readInt(j, "n_routed_experts", true, &m.numExperts, src));
  PD_RETURN_IF_ERROR(readInt(j, "num_experts_per_tok", true, &m.expertsPerToken, src));
  PD_RETURN_IF_ERROR(readInt(j, "moe_intermediate_size", true, &m.expertFfn, src));
  if (auto it = j.find("n_shared_experts"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 64)
      return invalidArgument(src + ": \"n_shared_experts\" must be an integer in [0, 64], got " + it->dump());
    m.numSharedExperts = it->get<int>();
  }
  if (auto it = j.find("first_k_dense_replace"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      return invalidArgument(src + ": \"first_k_dense_replace\" must be a non-negative integer, got " + it->dump());
    m.firstDenseLayers = int(std::min<int64_t>(it->get<int64_t>(), c->numLayers));
  }
  PD_RETURN_IF_ERROR(readInt(j, "moe_layer_freq", false, &m.layerFreq, src));
  PD_RETURN_IF_ERROR(readInt(j, "n_group", false, &m.numGroups, src));
  PD_RETURN_IF_ERROR(readInt(j, "topk_group", false, &m.topkGroups, src));
  const std::string method = j.value("topk_method", std::string("noaux_tc"));
  if (method != "noaux_tc")
    return unimplemented(src + ": topk_method \"" + method + "\" is not implemented (only \"noaux_tc\")");
  const std::string scoring = j.value("scoring_func", std::string("sigmoid"));
  if (scoring != "sigmoid")
    return unimplemented(src + ": scoring_func \"" + scoring + "\" is not implemented (only \"sigmoid\")");
  m.sigmoidScoring = true;
  m.normTopkProb = false;
  if (auto it = j.find("norm_topk_prob"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return invalidArgument(src + ": \"norm_topk_prob\" must be a boolean");
    m.normTopkProb = it->get<bool>();
  }
  PD_RETURN_IF_ERROR(readNumber(j, "routed_scaling_factor", &m.routedScalingFactor, src));
  if (!(m.routedScalingFactor > 0)) return invalidArgument(src + ": routed_scaling_factor must be > 0");
  if (m.numExperts % m.numGroups != 0)
    return invalidArgument(src + ": n_routed_experts " + std::to_string(m.numExperts) +
                           " is not a multiple of n_group " + std::to_string(m.numGroups));
  if (m.numExperts / m.numGroups < 2)
    return invalidArgument(src + ": n_group " + std::to_string(m.numGroups) +
                           " leaves fewer than 2 experts per group (a group scores its 2 best)");
  if (m.topkGroups > m.numGroups)
    return invalidArgument(src + ": topk_group " + std::to_string(m.topkGroups) + " exceeds n_group " +
                           std::to_string(m.numGroups));
  if (m.expertsPerToken > m.topkGroups * (m.numExperts / m.numGroups))
    return invalidArgument(src + ": num_experts_per_tok " + std::to_string(m.expertsPerToken) +
                           " exceeds the experts of topk_group groups");
  return Status::ok();
}

// rope_scaling type "yarn": every key it may carry, read or refused by name.
Status readYarn(const json& r, ModelConfig* c, const std::string& src) {
  if (!c->isMla())
    return unimplemented(src + " type \"yarn\" is implemented for DeepseekV3ForCausalLM only, not " +
                         architectureName(c->architecture));
  for (auto it = r.begin(); it != r.end(); ++it) {
    static constexpr const char* kKeys[] = {"type",      "rope_type", "factor", "original_max_position_embeddings",
                                            "beta_fast", "beta_slow", "mscale", "mscale_all_dim"};
    if (!inList(it.key(), kKeys))
      return unimplemented(src + ": rope_scaling key \"" + it.key() + "\" is not implemented for yarn");
  }
  RopeConfig& p = c->rope;
  p.yarn = true;
  PD_RETURN_IF_ERROR(readNumber(r, "factor", &p.factor, src));
  PD_RETURN_IF_ERROR(readInt(r, "original_max_position_embeddings", true, &p.originalMaxPositionEmbeddings, src));
  PD_RETURN_IF_ERROR(readNumber(r, "beta_fast", &p.betaFast, src));
  PD_RETURN_IF_ERROR(readNumber(r, "beta_slow", &p.betaSlow, src));
  PD_RETURN_IF_ERROR(readNumber(r, "mscale", &p.mscale, src));
  PD_RETURN_IF_ERROR(readNumber(r, "mscale_all_dim", &p.mscaleAllDim, src));
  if (!(p.factor > 0) || !(p.betaFast > 0) || !(p.betaSlow > 0))
    return invalidArgument(src + ": yarn needs factor, beta_fast and beta_slow > 0");
  if (!c->isMla()) return unimplemented(src + ": rope_scaling yarn is implemented for DeepseekV3ForCausalLM only");
  return Status::ok();
}

}  // namespace

namespace {
Result<ModelConfig> parseImpl(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    return invalidArgument(src + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) return invalidArgument(src + ": expected a JSON object");

  ModelConfig c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string())
    return invalidArgument(src + ": missing \"architectures\" (e.g. [\"LlamaForCausalLM\"])");
  const std::string archName = (*arch)[0].get<std::string>();
  const std::optional<Architecture> known = enumFromName(kArchitectureNames, archName);
  if (!known)
    return unimplemented(src + ": unsupported architecture \"" + archName +
                         "\" (supported: " + enumNameList(kArchitectureNames) + ")");
  c.architecture = *known;
  const bool deepseek = c.architecture == Architecture::kDeepseekV3;
  const bool listed = c.architecture == Architecture::kQwen3 || c.architecture == Architecture::kMixtral ||
                      c.architecture == Architecture::kQwen3Moe || deepseek;
  if (listed) PD_RETURN_IF_ERROR(checkKnownKeys(j, c.architecture, src));
  c.qkNorm = c.architecture == Architecture::kQwen3 || c.architecture == Architecture::kQwen3Moe;

  PD_RETURN_IF_ERROR(readInt(j, "hidden_size", true, &c.hiddenSize, src));
  PD_RETURN_IF_ERROR(readInt(j, "intermediate_size", true, &c.intermediateSize, src));
  PD_RETURN_IF_ERROR(readInt(j, "num_hidden_layers", true, &c.numLayers, src));
  PD_RETURN_IF_ERROR(readInt(j, "num_attention_heads", true, &c.numHeads, src));
  c.numKvHeads = c.numHeads;
  PD_RETURN_IF_ERROR(readInt(j, "num_key_value_heads", false, &c.numKvHeads, src));
  PD_RETURN_IF_ERROR(readInt(j, "vocab_size", true, &c.vocabSize, src));
  c.maxPositionEmbeddings = 2048;
  PD_RETURN_IF_ERROR(readInt(j, "max_position_embeddings", false, &c.maxPositionEmbeddings, src));
  if (c.hiddenSize % c.numHeads != 0 && !j.contains("head_dim") && !deepseek)
    return invalidArgument(src + ": hidden_size " + std::to_string(c.hiddenSize) +
                           " is not a multiple of num_attention_heads " + std::to_string(c.numHeads));
  c.headDim = c.hiddenSize / c.numHeads;
  if (!deepseek) PD_RETURN_IF_ERROR(readInt(j, "head_dim", false, &c.headDim, src));
  if (deepseek) PD_RETURN_IF_ERROR(readDeepseek(j, &c, src));
  if (c.numHeads % c.numKvHeads != 0)
    return invalidArgument(src + ": num_attention_heads " + std::to_string(c.numHeads) +
                           " is not a multiple of num_key_value_heads " + std::to_string(c.numKvHeads));
  if (!c.isMla() && (c.headDim % 2 != 0 || c.headDim > 512))
    return unimplemented(src + ": head_dim " + std::to_string(c.headDim) + " (must be even and <= 512)");
  if (c.architecture == Architecture::kMixtral || c.architecture == Architecture::kQwen3Moe)
    PD_RETURN_IF_ERROR(readMoe(j, &c, src));

  double eps = 1e-6;
  PD_RETURN_IF_ERROR(readNumber(j, "rms_norm_eps", &eps, src));
  c.rmsNormEps = float(eps);
  PD_RETURN_IF_ERROR(readNumber(j, "rope_theta", &c.rope.theta, src));

  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "silu")
      return unimplemented(src + ": hidden_act " + it->dump() + " (only \"silu\" is supported)");
  }
  if (auto it = j.find("mlp_bias"); it != j.end() && it->is_boolean() && it->get<bool>())
    return unimplemented(src + ": mlp_bias true is not supported");
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && it->is_boolean()) c.tieWordEmbeddings = it->get<bool>();
  if (c.architecture == Architecture::kQwen2) {
    c.qkvBias = true;
  } else if (auto it = j.find("attention_bias"); it != j.end() && it->is_boolean() && it->get<bool>()) {
    c.qkvBias = true;
    c.oBias = true;
  }

  // Sliding windows: Mistral applies sliding_window when set; Qwen2 only with use_sliding_window.
  if (auto it = j.find("sliding_window"); it != j.end() && it->is_number_integer()) {
    const bool use = c.architecture == Architecture::kMistral || c.architecture == Architecture::kMixtral ||
                     (c.architecture == Architecture::kQwen2 && j.value("use_sliding_window", false));
    if (use) c.slidingWindow = it->get<int>();
  }

  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalidArgument(src + ": rope_scaling must be an object or null");
    std::string type = it->value("rope_type", std::string());
    if (type.empty()) type = it->value("type", std::string());
    if (type == "default") {
      // no scaling
    } else if (type == "yarn") {
      PD_RETURN_IF_ERROR(readYarn(*it, &c, src + ": rope_scaling"));
    } else if (type == "llama3") {
      c.rope.llama3 = true;
      PD_RETURN_IF_ERROR(readNumber(*it, "factor", &c.rope.factor, src + ": rope_scaling"));
      PD_RETURN_IF_ERROR(readNumber(*it, "low_freq_factor", &c.rope.lowFreqFactor, src + ": rope_scaling"));
      PD_RETURN_IF_ERROR(readNumber(*it, "high_freq_factor", &c.rope.highFreqFactor, src + ": rope_scaling"));
      PD_RETURN_IF_ERROR(readInt(*it, "original_max_position_embeddings", false, &c.rope.originalMaxPositionEmbeddings,
                                 src + ": rope_scaling"));
      if (c.rope.highFreqFactor <= c.rope.lowFreqFactor || c.rope.factor <= 0)
        return invalidArgument(src + ": rope_scaling llama3 needs factor > 0 and high_freq_factor > low_freq_factor");
    } else {
      return unimplemented(src + ": rope_scaling type \"" + type + "\" (supported: llama3; yarn for DeepseekV3)");
    }
  }

  if (auto it = j.find("bos_token_id"); it != j.end() && it->is_number_integer()) c.bosTokenId = it->get<int>();
  if (auto it = j.find("eos_token_id"); it != j.end()) {
    if (it->is_number_integer())
      c.eosTokenIds.push_back(it->get<int>());
    else if (it->is_array())
      for (const auto& e : *it)
        if (e.is_number_integer()) c.eosTokenIds.push_back(e.get<int>());
  }
  c.torchDtype = j.value("torch_dtype", std::string());
  if (auto it = j.find("quantization_config"); it != j.end() && !it->is_null()) {
    PD_ASSIGN_OR_RETURN(c.quantization, parseQuantizationConfig(*it, src));
  }
  return c;
}
}  // namespace

Result<ModelConfig> parseModelConfig(const std::string& text, const std::string& src) {
  // nlohmann throws on type mismatches inside value(); config parsing is start-up work, so
  // the exception is turned into a Status here and never leaves this function.
  try {
    return parseImpl(text, src);
  } catch (const std::exception& e) {
    return invalidArgument(src + ": " + e.what());
  }
}

Result<ModelConfig> loadModelConfig(const std::string& modelDir) {
  const std::string path = modelDir + "/config.json";
  std::ifstream in(path);
  if (!in) return notFound(path + ": cannot open (no such file or not readable)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parseModelConfig(ss.str(), path);
}

}  // namespace pd::engine
