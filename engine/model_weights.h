// A model's weights, loaded from a Hugging Face directory and converted to f32.
//
//   PD_ASSIGN_OR_RETURN(auto model, pd::engine::loadModel("/models/tiny"));
//   // model->config, model->layers[l].qkv, ...
//
// Loading reads config.json and either model.safetensors or, when present,
// model.safetensors.index.json and its shards. Every tensor is read with pread() into
// 64-byte aligned anonymous memory (2 MiB aligned and huge-page advised when large): never
// file-mapped pages. Errors name the file, tensor and shapes involved.
//
// Layout choices for the forward pass: q|k|v projections are fused into one row-major
// [qDim + 2*kvDim][hidden] matrix (one GEMM per layer), gate|up into [2*ffn][hidden].
// ModelWeights is immutable after loading and safe to share between threads and backends.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "engine/model_config.h"

namespace pd::engine {

// An owning, aligned f32 buffer in anonymous memory.
class WeightBuffer {
 public:
  WeightBuffer() = default;
  explicit WeightBuffer(size_t count);  // zero-filled
  ~WeightBuffer();
  WeightBuffer(WeightBuffer&& o) noexcept;
  WeightBuffer& operator=(WeightBuffer&& o) noexcept;
  WeightBuffer(const WeightBuffer&) = delete;
  WeightBuffer& operator=(const WeightBuffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }

 private:
  float* data_ = nullptr;
  size_t count_ = 0;
};

// One expert of a mixture-of-experts layer: the same fused SwiGLU MLP as a dense layer's.
struct ExpertWeights {
  WeightBuffer gateUp;  // [2*expertFfn][hidden]
  WeightBuffer down;    // [hidden][expertFfn]
};

struct LayerWeights {
  WeightBuffer inputNorm;  // [hidden]
  WeightBuffer qkv;        // [qDim + 2*kvDim][hidden]
  WeightBuffer qkvBias;    // [qDim + 2*kvDim] or empty
  WeightBuffer qNorm;      // [headDim], Qwen3 (config.qkNorm) only; else empty
  WeightBuffer kNorm;      // [headDim], Qwen3 only
  WeightBuffer o;          // [hidden][qDim]
  WeightBuffer oBias;      // [hidden] or empty
  WeightBuffer postNorm;   // [hidden]
  WeightBuffer gateUp;     // [2*ffn][hidden]; in a MoE layer the shared experts' or empty
  WeightBuffer down;       // [hidden][ffn]; likewise
  // Multi-head latent attention (config.isMla(); qkv empty there, o [hidden][heads*vHeadDim]):
  WeightBuffer qA;       // q_a_proj [qLoraRank][hidden]; empty when q_lora_rank is null
  WeightBuffer qANorm;   // q_a_layernorm [qLoraRank]
  WeightBuffer qB;       // q_b_proj [heads*qHeadDim][qLoraRank], or q_proj [heads*qHeadDim][hidden]
  WeightBuffer kvA;      // kv_a_proj_with_mqa [kvLoraRank + qkRopeHeadDim][hidden]
  WeightBuffer kvANorm;  // kv_a_layernorm [kvLoraRank]
  WeightBuffer kvB;      // kv_b_proj [heads*(qkNopeHeadDim + vHeadDim)][kvLoraRank]
  // Mixture-of-experts layers (config.isMoeLayer) only; each expert in its own buffer so a
  // token reads just the experts it was routed to.
  WeightBuffer router;      // [numExperts][hidden]
  WeightBuffer routerBias;  // [numExperts] DeepseekV3 e_score_correction_bias (the choice only)
  std::vector<ExpertWeights> experts;
};

struct ModelWeights {
  ModelConfig config;
  std::string dir;
  // Checkpoint::weightsFingerprint() of dir's tensors: peers computing one model must agree.
  std::string weightsFingerprint;
  WeightBuffer embed;      // [vocab][hidden]
  WeightBuffer finalNorm;  // [hidden]
  WeightBuffer lmHead;     // [vocab][hidden]; empty when tied
  std::vector<LayerWeights> layers;

  const float* lmHeadData() const { return lmHead.empty() ? embed.data() : lmHead.data(); }
  // False for describeModel()'s weights: the config and dir only, the tensors still on disk.
  bool hasHostTensors() const { return !embed.empty(); }
  size_t totalBytes() const;
};

// Loads DIR (config.json + safetensors). Start-up work; any thread.
Result<std::shared_ptr<const ModelWeights>> loadModel(const std::string& modelDir);
// The config and directory only, no tensor read: for backends that stream the weights from
// `dir` to their device in the stored dtype (the CUDA backend, weight_stream.h) instead of
// holding an f32 host copy. The CPU backend refuses such a model.
Result<std::shared_ptr<const ModelWeights>> describeModel(const std::string& modelDir);
// Loads the weights for an already parsed config (tests use this to vary the config).
Result<std::shared_ptr<const ModelWeights>> loadModelWeights(const std::string& modelDir, const ModelConfig& config);

}  // namespace pd::engine
