#include "tools/plan/hardware.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace pd::plan {

const std::vector<GpuSpec>& gpuCatalog() {
  // Dense rates from NVIDIA's datasheets (docs/plan.md lists them); the NIC is the per-GPU
  // adapter of the vendor's reference node (DGX/HGX: one ConnectX per GPU).
  static const std::vector<GpuSpec> kGpus = {
      {"h100-sxm", "NVIDIA H100 SXM5 80GB", 989, 1979, 3350, 80, 450, 400},
      {"h200", "NVIDIA H200 SXM 141GB", 989, 1979, 4800, 141, 450, 400},
      {"a100-80gb", "NVIDIA A100 SXM4 80GB", 312, 0, 2039, 80, 300, 200},
      {"l40s", "NVIDIA L40S 48GB (PCIe, no NVLink)", 362, 733, 864, 48, 32, 200},
      {"b200", "NVIDIA B200 (HGX B200) 180GB", 2250, 4500, 8000, 180, 900, 400},
  };
  return kGpus;
}

Result<GpuSpec> findGpu(std::string_view name) {
  std::string known;
  for (const auto& g : gpuCatalog()) {
    if (g.name == name) return g;
    known += (known.empty() ? "" : ", ") + g.name;
  }
  return invalidArgument("--gpu: unknown GPU \"" + std::string(name) + "\" (known: " + known + ")");
}

int64_t ModelShape::params() const {
  const auto& c = config;
  const int64_t h = c.hiddenSize;
  const int64_t attn = c.attentionParams();
  int64_t layers = 0;
  for (int l = 0; l < c.numLayers; ++l)
    layers +=
        attn + (c.isMoeLayer(l) ? int64_t(c.moe.numExperts) * (h + 3 * h * c.moe.expertFfn) +
                                      (c.moe.sigmoidScoring ? c.moe.numExperts : 0) + 3 * h * int64_t(c.moe.sharedFfn())
                                : 3 * h * c.intermediateSize);
  const int64_t embeddings = int64_t(c.vocabSize) * h * (c.tieWordEmbeddings ? 1 : 2);
  return layers + h + embeddings;
}

double ModelShape::paramsRead(double tokens) const {
  const auto& c = config;
  if (!c.isMoe()) return double(params());
  const double e = c.moe.numExperts, k = c.moe.expertsPerToken;
  const double touched = e * (1.0 - std::pow(1.0 - k / e, std::max(1.0, tokens)));
  const double expert = 3.0 * c.hiddenSize * c.moe.expertFfn;
  int sparse = 0;
  for (int l = 0; l < c.numLayers; ++l) sparse += c.isMoeLayer(l) ? 1 : 0;
  return double(params()) - sparse * (e - touched) * expert;
}

double ModelShape::linearParamsPerToken() const {
  const auto& c = config;
  const double h = c.hiddenSize;
  double total = 0;
  for (int l = 0; l < c.numLayers; ++l)
    total += double(c.attentionParams()) - 2 * h +
             (c.isMoeLayer(l) ? c.moe.numExperts * h + c.moe.expertsPerToken * 3.0 * h * c.moe.expertFfn +
                                    3.0 * h * c.moe.sharedFfn()
                              : 3.0 * h * c.intermediateSize);
  return total;
}

// Multi-head latent attention keeps kv_lora_rank + qk_rope_head_dim values per token and layer
// (no separate V), the others K and V of every kv head.
int64_t ModelShape::kvBytesPerToken() const {
  return int64_t(config.numLayers) * config.kvElemsPerTokenLayer() * kvBytes;
}

namespace {

// Presets as the config.json of the published checkpoints (the keys the engine reads).
struct Preset {
  const char* name;
  const char* json;
};
const Preset kPresets[] = {
    {"llama-3-8b",
     R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "torch_dtype": "bfloat16"})"},
    {"llama-3-70b",
     R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
         "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "torch_dtype": "bfloat16"})"},
    // Llama-2-13B: the shape of OPT-13B (40 layers, 5120 wide, 40 heads, no GQA), for
    // DistServe's setting (docs/plan.md).
    {"llama-2-13b",
     R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 5120, "intermediate_size": 13824,
         "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
         "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "torch_dtype": "float16"})"},
    {"qwen2.5-7b",
     R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
         "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
         "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0, "torch_dtype": "bfloat16"})"},
    // Mixtral-8x7B: 46.7 B parameters, 12.9 B active (8 experts, top 2).
    {"mixtral-8x7b",
     R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
         "torch_dtype": "bfloat16"})"},
    // Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active (128 experts of 768, top 8).
    {"qwen3-30b-a3b",
     R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
         "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "torch_dtype": "bfloat16"})"},
    // Qwen3-235B-A22B: 235 B parameters, 22 B active (128 experts of 1536, top 8).
    {"qwen3-235b-a22b",
     R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
         "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "norm_topk_prob": true,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "torch_dtype": "bfloat16"})"},
    // DeepSeek-V3 (and R1): 671 B parameters, 37 B active; multi-head latent attention keeps
    // 512 + 64 values per token and layer. The multi-token-prediction layer is not counted.
    {"deepseek-v3",
     R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
         "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
         "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8,
         "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
         "routed_scaling_factor": 2.5, "vocab_size": 129280, "max_position_embeddings": 163840,
         "rms_norm_eps": 1e-6, "rope_theta": 10000,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
         "torch_dtype": "bfloat16"})"},
    // Kimi K2: DeepSeek-V3's architecture with 384 experts in one group, 64 heads, one dense
    // layer: 1.03 T parameters, 32 B active.
    {"kimi-k2",
     R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
         "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
         "moe_intermediate_size": 2048, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1,
         "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
         "routed_scaling_factor": 2.827, "vocab_size": 163840, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
         "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
         "torch_dtype": "bfloat16"})"},
};

}  // namespace

Result<ModelShape> findModel(std::string_view nameOrPath) {
  ModelShape m;
  m.name = std::string(nameOrPath);
  for (const auto& p : kPresets) {
    if (nameOrPath == p.name) {
      auto c = engine::parseModelConfig(p.json, std::string("preset ") + p.name);
      if (!c.ok()) return c.status();
      m.config = *c;
      return m;
    }
  }
  namespace fs = std::filesystem;
  fs::path path(nameOrPath);
  if (fs::is_directory(path)) path /= "config.json";
  std::ifstream in(path);
  if (!in) {
    std::string known;
    for (const auto& p : kPresets) known += (known.empty() ? "" : ", ") + std::string(p.name);
    return invalidArgument("--model: \"" + std::string(nameOrPath) + "\" is neither a preset (" + known +
                           ") nor a readable config.json or model directory");
  }
  std::stringstream text;
  text << in.rdbuf();
  auto c = engine::parseModelConfig(text.str(), path.string());
  if (!c.ok()) return c.status();
  m.config = *c;
  m.name = path.parent_path().filename().string().empty() ? path.string() : path.parent_path().filename().string();
  return m;
}

}  // namespace pd::plan
