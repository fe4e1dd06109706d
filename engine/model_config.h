// A decoder-only model's shape and hyper-parameters, read from a Hugging Face config.json.
//
// Supported architectures (docs/design.md §4, docs/models.md): LlamaForCausalLM (Llama 2/3 incl.
// rope_scaling type "llama3", TinyLlama), MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias,
// tied embeddings), Qwen3ForCausalLM (per-head q/k RMSNorm), and the mixture-of-experts
// MixtralForCausalLM and Qwen3MoeForCausalLM, with grouped-query attention. Configs of the
// Qwen3 and MoE families are read against a list of known keys: any other key is refused by name. Anything else is an
// error (kUnimplemented) naming what is not supported, never a silently different model. Plain value; parsing is
// start-up work and may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/status.h"
#include "engine/fp8_blocks.h"

namespace pd::engine {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3, kMixtral, kQwen3Moe };

// The HF class names (config.json's "architectures"), which loading parses with too.
inline constexpr EnumNames<Architecture, 6> kArchitectureNames{{{Architecture::kLlama, "LlamaForCausalLM"},
                                                                {Architecture::kMistral, "MistralForCausalLM"},
                                                                {Architecture::kQwen2, "Qwen2ForCausalLM"},
                                                                {Architecture::kQwen3, "Qwen3ForCausalLM"},
                                                                {Architecture::kMixtral, "MixtralForCausalLM"},
                                                                {Architecture::kQwen3Moe, "Qwen3MoeForCausalLM"}}};
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

// A sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE): a router [experts][hidden]
// scores every expert, softmax over all of them, the top `expertsPerToken` run (each a SwiGLU
// MLP of width expertFfn) and their outputs are summed weighted by those probabilities,
// renormalised to sum 1 when normTopkProb.
struct MoeConfig {
  int numExperts = 0;  // 0: a dense model
  int expertsPerToken = 0;
  int expertFfn = 0;             // Mixtral: intermediate_size; Qwen3-MoE: moe_intermediate_size
  bool normTopkProb = true;      // Mixtral always; Qwen3-MoE: norm_topk_prob
  int sparseStep = 1;            // Qwen3-MoE decoder_sparse_step: layer l is sparse when (l + 1) % step == 0
  std::vector<int> denseLayers;  // Qwen3-MoE mlp_only_layers: dense MLP (intermediate_size) there
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
  MoeConfig moe;
  int slidingWindow = 0;  // 0 = none; Mistral's sliding_window (contexts past it are refused)
  int bosTokenId = -1;
  std::vector<int> eosTokenIds;
  std::string torchDtype;  // informational ("bfloat16", "float32", ...)
  // config.json quantization_config (fp8_blocks.h): FP8 block-scaled weights, or none.
  WeightQuantization quantization;

  int qDim() const { return numHeads * headDim; }
  int kvDim() const { return numKvHeads * headDim; }
  bool isMoe() const { return moe.numExperts > 0; }
  // Whether layer l's feed-forward block is the mixture of experts (else the dense MLP).
  bool isMoeLayer(int l) const;
  // Weight parameters the forward pass reads per generated token (embedding row excluded,
  // lm_head included): the bandwidth floor of batch-1 decode is this times sizeof(float).
  // For a mixture of experts: the router and the expertsPerToken experts a token runs (the
  // active parameters), not every expert.
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
