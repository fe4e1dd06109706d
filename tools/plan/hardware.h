// tools/plan: what `pdserve plan` knows of the hardware and the model it sizes pools for.
//
// GpuSpec: datasheet figures of a named accelerator (dense tensor-core rates, no sparsity;
// sources in docs/plan.md). ModelShape: a model's dimensions, from a Hugging Face
// config.json or a preset, and the dtype its weights and KV cache are served in.
//
// Pure data and lookups; errors name the unknown name and list the known ones.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "engine/model_config.h"

namespace pd::plan {

struct GpuSpec {
  std::string name;         // "h100-sxm"
  std::string description;  // "NVIDIA H100 SXM5 80GB"
  double bf16Tflops = 0;    // dense BF16/FP16 tensor-core FLOP/s, in 1e12
  double fp8Tflops = 0;     // dense FP8, 0 when the part has none
  double memoryGBps = 0;    // HBM (or GDDR) bandwidth, 1e9 bytes/s
  double memoryGiB = 0;     // device memory
  double peerGBps = 0;      // GPU-to-GPU within a node, one direction (NVLink, or PCIe)
  double nicGbps = 0;       // network per GPU in a typical node of that part, 1e9 bits/s
};

// The named GPUs: h100-sxm, h200, a100-80gb, l40s, b200.
const std::vector<GpuSpec>& gpuCatalog();
Result<GpuSpec> findGpu(std::string_view name);

struct ModelShape {
  std::string name;
  engine::ModelConfig config;
  int weightBytes = 2;  // per parameter (bf16)
  int kvBytes = 2;      // per KV element (bf16)

  int64_t params() const;           // every weight, the embedding included (every expert)
  int64_t kvBytesPerToken() const;  // K and V (MLA: the latent vector) of one token over all layers
  // Weight parameters one step of `tokens` tokens reads. Dense: params(). Mixture of experts:
  // everything but the experts, plus the experts the tokens are expected to touch when each
  // picks expertsPerToken of numExperts uniformly: numExperts x (1 - (1 - k/E)^tokens) per
  // sparse layer (batch-1 decode: the active parameters; large batches: all of them).
  double paramsRead(double tokens) const;
  // Linear-layer parameters one token multiplies with (the active ones for MoE), lm_head and
  // norms excluded: its FLOPs are twice this.
  double linearParamsPerToken() const;
};

// Presets: llama-3-8b, llama-3-70b, llama-2-13b, qwen2.5-7b, mixtral-8x7b, qwen3-30b-a3b,
// qwen3-235b-a22b, deepseek-v3, kimi-k2. Anything else is read as a model directory
// (DIR/config.json) or a path to a config.json.
Result<ModelShape> findModel(std::string_view nameOrPath);

}  // namespace pd::plan
