// Multi-head latent attention on the CUDA backend (DeepseekV3ForCausalLM; docs/models.md,
// "DeepSeek-V3"): the same absorbed form as the CPU backend's (cpu_mla.h), on the device.
//
// Per layer, from the normalised input xn [T][hidden] (weight dtype):
//   project(): [q_a | kv_a] = xn . [q_a_proj | kv_a_proj_with_mqa]^T as one GEMM (q_proj instead
//     of q_a when q_lora_rank is null); q = q_b(rmsNorm(q_a)); c_kv = rmsNorm(kv_a's first
//     kvLoraRank values), k_pe = interleaved RoPE of the rest (YaRN frequencies and mscale), and
//     [c_kv | k_pe] written to the latent cache at each token's slot (pd/kernels/cuda/mla.h).
//   attend(): q split per head into q_nope (weight dtype) and rotated q_pe; q_lat = q_nope .
//     W_UK per head (kv_b_proj's key rows, one strided batched cuBLAS GEMM over the heads);
//     mlaAttention over the cached latents (scores q_lat . c_kv + q_pe . k_pe times
//     softmaxScale(), mscale^2 included; output sum p . c_kv); then per head the latent output
//     times W_UV^T (kv_b_proj's value rows, a second batched GEMM) into attnOut
//     [T][heads * vHeadDim], o_proj's input (the backend runs o_proj).
// Between the two the layer's latent KV is in device memory (the backend records its layer
// event there).
//
// Weights: uploaded once from the model's host f32 tensors through the backend's UploadFn
// (matrices in the weight dtype, norms f32). Scratch: allocScratch(capT) through the backend's
// AllocFn (freed with the backend's scratch; zeroed, so graph padding rows stay finite).
// Tensor parallelism is not implemented for MLA (createCudaBackend refuses it by name).
//
// Not thread-safe: one per backend, driven from its forward() on its one stream.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "common/base/status.h"
#include "engine/model_weights.h"
#include "pd/kernels/cuda/attention.h"
#include "pd/kernels/cuda/dtype.h"

namespace pd::engine {

class CudaMla {
 public:
  // Copies n host f32 values to new device memory (weight dtype, or f32 when asF32).
  using UploadFn = std::function<Status(const float* src, size_t n, bool asF32, void** out)>;
  // New device memory of `bytes` (zeroed), owned by the backend.
  using AllocFn = std::function<Status(void** p, size_t bytes)>;
  // y[n][out] (f32) = x[n][in] (weight dtype) * W^T + beta * y, on the backend's handle.
  using GemmFn = std::function<Status(const void* x, int n, int in, const void* w, int out, float* y, float beta)>;

  // The step's device metadata, as the backend laid it out (pd/kernels/cuda/attention.h).
  struct Step {
    int numTokens = 0;
    const int32_t* slots = nullptr;  // [T]; negative: graph padding, nothing written
    const int32_t* blockTables = nullptr;
    const pd::kernels::cuda::AttnSeq* seqs = nullptr;
    const pd::kernels::cuda::AttnWork* work = nullptr;  // built with group = numHeads
    int numWork = 0;
    int blockSize = 0;
    const float* cos = nullptr;  // [T][ropeHalf()] from invFreq()
    const float* sin = nullptr;
  };

  CudaMla(const ModelConfig& config, pd::kernels::cuda::DType weightDtype, pd::kernels::cuda::DType kvDtype);

  // The RoPE inverse frequencies of the rope part (ropeHalf() values, YaRN applied) the
  // backend turns into the step's cos/sin tables.
  const std::vector<float>& invFreq() const { return invFreq_; }
  int ropeHalf() const { return cfg_.mla.qkRopeHeadDim / 2; }
  // o_proj's input width: heads * vHeadDim.
  int outDim() const { return cfg_.numHeads * cfg_.mla.vHeadDim; }

  Status uploadWeights(const ModelWeights& model, const UploadFn& upload);
  Status allocScratch(int capT, const AllocFn& alloc);

  Status project(int layer, const void* xn, const Step& step, void* layerKv, const GemmFn& gemm, cudaStream_t stream);
  Status attend(int layer, const Step& step, const void* layerKv, void* attnOut, cublasHandle_t cublas,
                cudaStream_t stream);

 private:
  struct Layer {
    void* a = nullptr;         // [qRows + latentDim][hidden]: q_a_proj (or q_proj) rows, then kv_a's
    float* qANorm = nullptr;   // [qLoraRank] or null
    void* qB = nullptr;        // [heads * qHeadDim][qLoraRank] or null
    float* kvANorm = nullptr;  // [kvLoraRank]
    void* kvB = nullptr;       // [heads * (qkNope + vHeadDim)][kvLoraRank]
  };
  int qRows() const;  // q_a's rows, or q_proj's

  const ModelConfig& cfg_;
  pd::kernels::cuda::DType wdt_, kvdt_;
  float scale_, mscale_;
  std::vector<float> invFreq_;
  std::vector<Layer> layers_;
  // Scratch [capT] rows: the stacked product (f32), q_a normalised (weight dtype), q (f32),
  // q_nope (weight dtype), the absorbed queries [T][heads][latentDim] (f32), the latent
  // outputs [T][heads][kvLoraRank] (weight dtype).
  float* stacked_ = nullptr;
  void* qa_ = nullptr;
  float* q_ = nullptr;
  void* qNope_ = nullptr;
  float* qLat_ = nullptr;
  void* oLat_ = nullptr;
};

}  // namespace pd::engine
