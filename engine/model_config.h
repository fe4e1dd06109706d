// A decoder-only model's shape and hyper-parameters, read from a Hugging Face config.json.
//
// Supported architectures (docs/design.md §4, docs/models.md): LlamaForCausalLM (Llama 2/3 incl.
// rope_scaling type "llama3", TinyLlama), MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias,
// tied embeddings), Qwen3ForCausalLM (per-head q/k RMSNorm), and the mixture-of-experts
// MixtralForCausalLM and Qwen3MoeForCausalLM, with grouped-query attention, and
// DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2: multi-head latent attention, YaRN, shared
// and group-routed sigmoid experts). Configs of the Qwen3, MoE and DeepSeek families are read
// against a list of known keys: any other key is refused by name. Anything else is an
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

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3, kMixtral, kQwen3Moe, kDeepseekV3 };

// The HF class names (config.json's "architectures"), which loading parses with too.
inline constexpr EnumNames<Architecture, 7> kArchitectureNames{{{Architecture::kLlama, "LlamaForCausalLM"},
                                                                {Architecture::kMistral, "MistralForCausalLM"},
                                                                {Architecture::kQwen2, "Qwen2ForCausalLM"},
                                                                {Architecture::kQwen3, "Qwen3ForCausalLM"},
                                                                {Architecture::kMixtral, "MixtralForCausalLM"},
                                                                {Architecture::kQwen3Moe, "Qwen3MoeForCausalLM"},
                                                                {Architecture::kDeepseekV3, "DeepseekV3ForCausalLM"}}};
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
  // rope_scaling type "yarn" (DeepSeek-V3, Kimi K2): factor and originalMaxPositionEmbeddings
  // above, the correction range from betaFast / betaSlow, and the magnitude scale
  // yarnMscale(factor, mscale) / yarnMscale(factor, mscaleAllDim) on cos and sin.
  bool yarn = false;
  double betaFast = 32.0;
  double betaSlow = 1.0;
  double mscale = 1.0;
  double mscaleAllDim = 0.0;
};

// YaRN's attention magnitude factor: 1 when factor <= 1, else 0.1 * m * ln(factor) + 1.
double yarnMscale(double factor, double m);

// Multi-head latent attention (DeepseekV3ForCausalLM). Per token: q = q_b(norm(q_a(x))) (or
// q_proj(x) when qLoraRank is 0), heads of qkNopeHeadDim + qkRopeHeadDim; the latent
// [c_kv | k_pe] = kv_a_proj_with_mqa(x), c_kv RMS-normalised (kvLoraRank values) and k_pe
// (qkRopeHeadDim values, shared by every head) rotated. kv_b_proj expands c_kv to each head's
// k_nope and v (vHeadDim). The KV cache keeps only [c_kv | k_pe]: one "head" of latentDim().
struct MlaConfig {
  int qLoraRank = 0;  // 0: q_lora_rank null (a plain q_proj)
  int kvLoraRank = 0;
  int qkNopeHeadDim = 0;
  int qkRopeHeadDim = 0;
  int vHeadDim = 0;
  int qHeadDim() const { return qkNopeHeadDim + qkRopeHeadDim; }
  int latentDim() const { return kvLoraRank + qkRopeHeadDim; }
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
  // DeepseekV3: sigmoid scores, e_score_correction_bias added for the choice only, the top
  // topkGroups of numGroups expert groups (a group scores the sum of its 2 best) and the top k
  // experts inside them; weights are the sigmoid scores (renormalised when normTopkProb) times
  // routedScalingFactor. numSharedExperts run on every token (one MLP of width
  // numSharedExperts x expertFfn). Layer l is sparse when l >= firstDenseLayers and
  // l % layerFreq == 0.
  bool sigmoidScoring = false;
  int numGroups = 1;
  int topkGroups = 1;
  double routedScalingFactor = 1.0;
  int numSharedExperts = 0;
  int firstDenseLayers = 0;
  int layerFreq = 1;
  int sharedFfn() const { return numSharedExperts * expertFfn; }
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
  // DeepseekV3: multi-head latent attention. Then numKvHeads is 1 and headDim is
  // mla.latentDim() (what one token's KV holds per layer), and qDim()/kvDim() do not apply.
  MlaConfig mla;
  // DeepseekV3 num_nextn_predict_layers: multi-token-prediction layers the checkpoint carries
  // after the last layer. Not run (loading logs that it is ignored); generation is unchanged.
  int mtpLayers = 0;
  int slidingWindow = 0;  // 0 = none; Mistral's sliding_window (contexts past it are refused)
  int bosTokenId = -1;
  std::vector<int> eosTokenIds;
  std::string torchDtype;  // informational ("bfloat16", "float32", ...)
  // config.json quantization_config (fp8_blocks.h): FP8 block-scaled weights, or none.
  WeightQuantization quantization;

  int qDim() const { return numHeads * headDim; }
  int kvDim() const { return numKvHeads * headDim; }
  bool isMoe() const { return moe.numExperts > 0; }
  bool isMla() const { return mla.kvLoraRank > 0; }
  // Weights of one layer's attention block, its two norms included.
  int64_t attentionParams() const;
  // KV elements one token keeps per layer: 2 x kvDim(), or latentDim() under MLA.
  int64_t kvElemsPerTokenLayer() const { return isMla() ? mla.latentDim() : 2 * int64_t(kvDim()); }
  // The scale on q.k before the softmax: 1/sqrt(head dim), for MLA 1/sqrt(qHeadDim) times
  // yarnMscale(factor, mscaleAllDim)^2 under YaRN.
  double softmaxScale() const;
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
