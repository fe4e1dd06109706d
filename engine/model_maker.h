// Writes a complete Hugging Face model directory with seeded random weights: config.json,
// model.safetensors (or shards + model.safetensors.index.json), a byte-level BPE
// tokenizer.json, tokenizer_config.json (with a Jinja chat template) and
// generation_config.json. Used by `pdserve make-model` and by tests, which build their model
// variants at test time. The text such a model produces is noise; it exists so the whole
// cluster runs anywhere.
//
// Token ids: 0..255 are the 256 byte tokens (GPT-2 bytes-to-unicode mapping, no merges),
// 256 "<|begin_of_text|>" (BOS), 257 "<|end_of_text|>" (EOS), 258 "<|pad|>".
#pragma once

#include <cstdint>
#include <string>

#include "common/base/status.h"

namespace pd::engine {

struct MakeModelOptions {
  std::string preset = "tiny";  // tiny | small
  uint64_t seed = 1;
  bool tieEmbeddings = false;
  bool qkvBias = false;  // writes Qwen2ForCausalLM (the same as arch "qwen2")
  // llama | qwen2 (q/k/v bias) | qwen3 (per-head q/k RMSNorm, head_dim 2x hidden/heads as in
  // the real Qwen3 models, where q's width differs from the hidden size) | mixtral (8 experts,
  // top 2) | qwen3_moe (Qwen3 attention; 16 experts, top 4, norm_topk_prob; on the tiny preset
  // layer 0 is dense through mlp_only_layers) | deepseek_v3 (DeepseekV3ForCausalLM: multi-head
  // latent attention with q and kv low-rank projections; 16 routed experts of ffn/4 in 4
  // groups (top 2 groups, top 4 experts, sigmoid, correction bias, routed_scaling_factor 2.5),
  // 1 shared expert, layer 0 dense; the small preset also YaRN; one multi-token-prediction
  // layer that is written and never read).
  std::string arch = "llama";
  std::string dtype = "f32";  // f32 | bf16
  // "fp8": an FP8 block-scaled checkpoint (fp8_blocks.h), as DeepSeek-V3 and the Qwen3 FP8
  // releases ship: every linear projection (`*_proj.weight`, Mixtral's experts' w1/w2/w3) is
  // quantized per 128x128 block to F8_E4M3 with an F32 `*.weight_scale_inv`, from the values
  // `dtype` gives; embeddings, norms, routers and lm_head stay in `dtype`; config.json gets the
  // quantization_config. "" (default): unquantized.
  std::string quantization;
  // Variants for tests (hidden CLI flags):
  int numKvHeads = 0;         // 0 = the preset's value
  bool ropeLlama3 = false;    // rope_scaling {rope_type: llama3, factor 8, 1, 4, 8192}
  int shards = 1;             // > 1 writes model-0000i-of-0000n.safetensors + index
  bool moeAllSparse = false;  // qwen3_moe on the tiny preset: experts in layer 0 too (no mlp_only_layers)
  // deepseek_v3 variants (tests):
  bool mlaNoQLora = false;  // q_lora_rank null: a plain q_proj
  // -1 = the preset's; 0 = rope_scaling null; 1 = yarn (factor 4, mscale_all_dim 0.8 on the tiny
  // preset); 2 = yarn with mscale_all_dim 1.0 = mscale (as DeepSeek-V3 and the small preset)
  int mlaYarn = -1;
  int moeGroups = 0;          // n_group (topk_group = n_group / 2, at least 1); 0 = the preset's 4
  int firstDenseLayers = -1;  // first_k_dense_replace; -1 = the preset's 1
};

// Writes into outDir (created if missing; existing files are overwritten).
Status makeModel(const MakeModelOptions& options, const std::string& outDir);

// The special token ids make-model writes.
inline constexpr int kMadeBosId = 256;
inline constexpr int kMadeEosId = 257;
inline constexpr int kMadePadId = 258;

}  // namespace pd::engine
