// A model's weights, loaded from a Hugging Face directory and converted to f32 (FP8
// block-scaled weights dequantized with their scales, fp8_blocks.h).
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
#include <cstdint>
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

// A dense layer's linear weight held in a compact format instead of f32 (engine.weight_format;
// docs/engine-cpu.md, "Quantized weights"): bf16 (pd/kernels/linear_bf16.h), or int8 in blocks
// of 32 columns with an f32 scale each (q8_0, pd/kernels/linear_q8.h).
struct CompactWeight {
  std::vector<uint16_t> bf16;  // [n][k], or empty
  std::vector<int8_t> q8;      // [n][k], or empty
  std::vector<float> scales;   // [n][ceil(k / 32)] with q8
  bool empty() const { return bf16.empty() && q8.empty(); }
  size_t bytes() const { return bf16.size() * 2 + q8.size() + scales.size() * 4; }
  // w [n][k] f32 converted to `format` ("bf16" or "q8_0"; anything else gives an empty weight).
  static CompactWeight convert(const float* w, int n, int k, const std::string& format);
};

// One expert of a mixture-of-experts layer: the same fused SwiGLU MLP as a dense layer's,
// each weight stored in the rows8 layout (pd/kernels/linear.h: groups of 8 rows interleaved 8
// columns at a time) so that a batch-1 decode reads it as one sequential stream; read them with
// pd::kernels::cpu::rows8Index, linearSkinnyRows8 or gemmRows8, never as row-major.
struct ExpertWeights {
  WeightBuffer gateUp;  // [2*expertFfn][hidden], rows8
  WeightBuffer down;    // [hidden][expertFfn], rows8

  // Row-major copies, for the readers that do not take rows8 (the CUDA upload, the GGUF
  // writer, tests): gate|up [2*expertFfn][hidden], down [hidden][expertFfn].
  std::vector<float> gateUpRowMajor(int hidden) const;
  std::vector<float> downRowMajor(int hidden) const;
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
  // Loaded with a compact weight format (ModelWeights::weightFormat not "f32"): qkv, o,
  // gateUp and down held here only, their f32 buffers above empty.
  CompactWeight qkvCompact, oCompact, gateUpCompact, downCompact;
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
  // "f32", or "bf16" / "q8_0" when loaded with that format: the dense layers' four linear
  // weights are then held only in LayerWeights' compact fields (a half / about a quarter of
  // their f32 bytes resident); norms, biases, embeddings, lm_head and experts stay f32.
  std::string weightFormat = "f32";

  const float* lmHeadData() const { return lmHead.empty() ? embed.data() : lmHead.data(); }
  // False for describeModel()'s weights: the config and dir only, the tensors still on disk.
  bool hasHostTensors() const { return !embed.empty(); }
  size_t totalBytes() const;  // resident bytes of the tensors, compact formats included
  size_t f32Bytes() const;    // of the f32 tensors only
};

// Loads DIR (config.json + safetensors). Start-up work; any thread.
Result<std::shared_ptr<const ModelWeights>> loadModel(const std::string& modelDir);
// The same, the dense layers' linear weights converted to `weightFormat` ("f32", "bf16" or
// "q8_0"; anything else is refused by name) and their f32 copies freed, layer by layer: what
// the CPU backend with that engine.weight_format computes from, in a half (bf16) or about a
// quarter (q8_0) of the f32 bytes. Loading still reads each tensor into f32 first.
Result<std::shared_ptr<const ModelWeights>> loadModel(const std::string& modelDir, const std::string& weightFormat);
// The config and directory only, no tensor read: for backends that stream the weights from
// `dir` to their device in the stored dtype (the CUDA backend, weight_stream.h) instead of
// holding an f32 host copy. The CPU backend refuses such a model.
Result<std::shared_ptr<const ModelWeights>> describeModel(const std::string& modelDir);
// Loads the weights for an already parsed config (tests use this to vary the config).
Result<std::shared_ptr<const ModelWeights>> loadModelWeights(const std::string& modelDir, const ModelConfig& config);

}  // namespace pd::engine
