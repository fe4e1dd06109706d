// A decoder-only model's shape and hyper-parameters, read from a Hugging Face config.json.
//
// Supported architectures (docs/design.md §4, docs/models.md): LlamaForCausalLM (Llama 2/3 incl.
// rope_scaling type "llama3", TinyLlama), MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias,
// tied embeddings) and Qwen3ForCausalLM (per-head q/k RMSNorm), with grouped-query attention.
// Qwen3 configs are read against a list of known keys: any other key is refused by name. Anything else is an error
// (kUnimplemented) naming what is not supported, never a silently different model. Plain value; parsing is start-up
// work and may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/status.h"

namespace pd::engine {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3 };

// The HF class names (config.json's "architectures"), which loading parses with too.
inline constexpr EnumNames<Architecture, 4> kArchitectureNames{{{Architecture::kLlama, "LlamaForCausalLM"},
                                                                {Architecture::kMistral, "MistralForCausalLM"},
                                                                {Architecture::kQwen2, "Qwen2ForCausalLM"},
                                                                {Architecture::kQwen3, "Qwen3ForCausalLM"}}};
// The HF class name, e.g. "LlamaForCausalLM".
inline const char* architectureName(Architecture a) { return enumName(kArchitectureNames, a); }

struct RopeConfig {
  double theta = 10000.0;
  // rope_scaling type "llama3" (Llama 3.1+); the fields mirror config.json.
  bool llama3 = false;
  double factor = 8.0;
  double lowFreqFactor = 1.0;
  double highFreqFactor = 4.0;
  int originalMaxPositionEmbeddings = 8192;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  int hiddenSize = 0;
  int intermediateSize = 0;
  int numLayers = 0;
  int numHeads = 0;
  int numKvHeads = 0;
  int headDim = 0;  // config "head_dim" when present, else hiddenSize / numHeads
  int vocabSize = 0;
  int maxPositionEmbeddings = 0;
  float rmsNormEps = 1e-6f;
  RopeConfig rope;
  bool tieWordEmbeddings = false;
  bool qkvBias = false;  // Qwen2 always; Llama when attention_bias
  bool oBias = false;    // Llama attention_bias also biases o_proj
  // Qwen3: RMSNorm over each q and k head (weights [headDim], eps rmsNormEps) after the
  // projections and before RoPE.
  bool qkNorm = false;
  int slidingWindow = 0;  // 0 = none; Mistral's sliding_window (contexts past it are refused)
  int bosTokenId = -1;
  std::vector<int> eosTokenIds;
  std::string torchDtype;  // informational ("bfloat16", "float32", ...)

  int qDim() const { return numHeads * headDim; }
  int kvDim() const { return numKvHeads * headDim; }
  // Weight parameters the forward pass reads per generated token (embedding row excluded,
  // lm_head included): the bandwidth floor of batch-1 decode is this times sizeof(float).
  int64_t decodeWeightParams() const;
  // The context at which one token's attention (QK and AV: 4 x qDim FLOPs per layer and
  // attended position) costs as many FLOPs as its linear layers (lm_head left out: a prompt
  // chunk samples one row). A prompt token at position p costs (1 + p / span) tokens at
  // position 0; on the CPU backend (small model, chunks of 64-512 tokens after 0-2,048
  // cached ones) forwards follow that within 4% (`engine_bench --only context`).
  double attentionSpanTokens() const;
};

// Parses config.json text. `source` names the file in error messages.
Result<ModelConfig> parseModelConfig(const std::string& jsonText, const std::string& source);
// Reads and parses DIR/config.json.
Result<ModelConfig> loadModelConfig(const std::string& modelDir);

}  // namespace pd::engine
