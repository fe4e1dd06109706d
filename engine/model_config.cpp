#include "engine/model_config.h"

#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pd::engine {

int64_t ModelConfig::decodeWeightParams() const {
  const int64_t h = hiddenSize;
  const int64_t perLayer =
      h * (qDim() + 2 * kvDim()) + int64_t(qDim()) * h + 3 * h * intermediateSize + 2 * h + (qkNorm ? 2 * headDim : 0);
  return perLayer * numLayers + h + int64_t(vocabSize) * h;
}

double ModelConfig::attentionSpanTokens() const {
  const double h = hiddenSize;
  const double linearPerLayer = h * (qDim() + 2 * kvDim()) + double(qDim()) * h + 3 * h * intermediateSize;
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

// Every config.json key a Qwen3ForCausalLM checkpoint may carry and what this parser makes of
// it. A key outside the list may change the model in a way the forward pass does not know,
// so it is refused by name instead of ignored.
constexpr const char* kQwen3Keys[] = {
    // the model's shape and numerics (read below)
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "hidden_act", "attention_bias", "tie_word_embeddings", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types", "bos_token_id", "eos_token_id", "pad_token_id",
    // training or bookkeeping only: they do not change inference
    "attention_dropout", "initializer_range", "use_cache", "torch_dtype", "dtype", "transformers_version"};

Status checkQwen3Keys(const json& j, const std::string& src) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : kQwen3Keys) known = known || it.key() == k;
    if (!known)
      return unimplemented(src + ": config key \"" + it.key() +
                           "\" is not implemented for Qwen3ForCausalLM (refused rather than ignored)");
  }
  if (j.value("use_sliding_window", false))
    return unimplemented(src + ": use_sliding_window true is not implemented for Qwen3ForCausalLM");
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return invalidArgument(src + ": \"layer_types\" must be an array");
    for (const auto& t : *it)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        return unimplemented(src + ": layer_types entry " + t.dump() +
                             " is not implemented for Qwen3ForCausalLM (only \"full_attention\")");
  }
  if (auto it = j.find("attention_dropout"); it != j.end() && it->is_number() && it->get<double>() != 0.0)
    return unimplemented(src + ": attention_dropout " + it->dump() + " (inference uses none; 0 expected)");
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
  if (c.architecture == Architecture::kQwen3) {
    PD_RETURN_IF_ERROR(checkQwen3Keys(j, src));
    c.qkNorm = true;
  }

  PD_RETURN_IF_ERROR(readInt(j, "hidden_size", true, &c.hiddenSize, src));
  PD_RETURN_IF_ERROR(readInt(j, "intermediate_size", true, &c.intermediateSize, src));
  PD_RETURN_IF_ERROR(readInt(j, "num_hidden_layers", true, &c.numLayers, src));
  PD_RETURN_IF_ERROR(readInt(j, "num_attention_heads", true, &c.numHeads, src));
  c.numKvHeads = c.numHeads;
  PD_RETURN_IF_ERROR(readInt(j, "num_key_value_heads", false, &c.numKvHeads, src));
  PD_RETURN_IF_ERROR(readInt(j, "vocab_size", true, &c.vocabSize, src));
  c.maxPositionEmbeddings = 2048;
  PD_RETURN_IF_ERROR(readInt(j, "max_position_embeddings", false, &c.maxPositionEmbeddings, src));
  if (c.hiddenSize % c.numHeads != 0 && !j.contains("head_dim"))
    return invalidArgument(src + ": hidden_size " + std::to_string(c.hiddenSize) +
                           " is not a multiple of num_attention_heads " + std::to_string(c.numHeads));
  c.headDim = c.hiddenSize / c.numHeads;
  PD_RETURN_IF_ERROR(readInt(j, "head_dim", false, &c.headDim, src));
  if (c.numHeads % c.numKvHeads != 0)
    return invalidArgument(src + ": num_attention_heads " + std::to_string(c.numHeads) +
                           " is not a multiple of num_key_value_heads " + std::to_string(c.numKvHeads));
  if (c.headDim % 2 != 0 || c.headDim > 512)
    return unimplemented(src + ": head_dim " + std::to_string(c.headDim) + " (must be even and <= 512)");

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
    const bool use = c.architecture == Architecture::kMistral ||
                     (c.architecture == Architecture::kQwen2 && j.value("use_sliding_window", false));
    if (use) c.slidingWindow = it->get<int>();
  }

  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalidArgument(src + ": rope_scaling must be an object or null");
    std::string type = it->value("rope_type", std::string());
    if (type.empty()) type = it->value("type", std::string());
    if (type == "default") {
      // no scaling
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
      return unimplemented(src + ": rope_scaling type \"" + type + "\" (supported: llama3)");
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
