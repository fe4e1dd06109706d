// The mixture-of-experts feed-forward block of the CUDA backend (cuda_backend.h; Mixtral,
// Qwen3-MoE, and DeepseekV3's routed + shared experts): the CUDA counterpart of cpu_moe.h.
//
// One layer's block over a step's T tokens, on one stream:
//   1. router logits [T][numExperts] = norm(x) W_router^T: the router is kept in f32 and the
//      normalised rows are formed again in f32 for it (a cuBLAS f32 GEMM), so the choice of
//      experts does not hinge on 16-bit rounding of the GEMM inputs;
//   2. the logits are copied to pinned host memory and the stream is SYNCHRONISED: routing
//      (routeMoeTokens, moe_routing.h -- the CPU backend's definition: softmax top-k with
//      norm_topk_prob, or DeepSeek's sigmoid + correction bias + group-limited top-k +
//      routed_scaling_factor) runs on the host, which then knows how many rows each expert
//      gets. A step with a MoE layer therefore cannot be captured in a CUDA graph: the
//      backend runs MoE models eagerly (cuda_backend.h, "CUDA graphs");
//   3. the routed rows of xn are gathered into one expert-grouped matrix (moeGatherRows), and
//      each expert that any token chose runs its gate|up and down products as cuBLAS GEMMs on
//      its own rows (one GEMM per chosen expert and product; an expert no token chose is
//      never read, so a decode step reads the router and its chosen experts only), SwiGLU
//      between them over all rows at once;
//   4. every token's outputs are added to the residual x in ascending expert order
//      (moeCombine: the CPU backend's order of additions), then DeepseekV3's shared experts
//      (one SwiGLU MLP of width sharedFfn over every token) add theirs (GEMM beta = 1).
//
// Weights: expert gate|up [2*expertFfn][hidden] and down [hidden][expertFfn] in the weight
// dtype, one device image per expert; the router [numExperts][hidden] in f32; the correction
// bias in host memory (routing is on the host). Tensor parallelism and expert parallelism are
// not implemented: createCudaBackend refuses a MoE model at tensor_parallel_size > 1.
//
// Ownership / threads: one CudaMoe per backend, on the backend's thread; it owns its scratch
// (device buffers and pinned host buffers, grown on demand: growing synchronises the stream
// first) and borrows the stream, the cuBLAS handle and the weights. Errors: CUDA / cuBLAS
// failures -> kInternal naming the call.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "common/base/status.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/moe_routing.h"
#include "engine/weight_stream.h"
#include "pd/kernels/cuda/dtype.h"

namespace pd::engine {

// One MoE layer's weights on the device (borrowed from the backend's allocations).
struct CudaMoeLayer {
  struct Expert {
    const void* gateUp = nullptr;  // [2*expertFfn][hidden], weight dtype
    const void* down = nullptr;    // [hidden][expertFfn]
  };
  const float* router = nullptr;       // [numExperts][hidden] f32
  std::vector<float> routerBias;       // host [numExperts] (DeepseekV3 e_score_correction_bias) or empty
  std::vector<Expert> experts;         // [numExperts]
  const void* sharedGateUp = nullptr;  // [2*sharedFfn][hidden] or null (no shared experts)
  const void* sharedDown = nullptr;    // [hidden][sharedFfn]
};

// Copies n host f32 values to new device memory of the backend (asF32: kept f32, else converted
// to the weight dtype) and returns it in *out; the backend owns it.
using CudaUploadFn = std::function<Status(const float* src, size_t n, bool asF32, void** out)>;

// A loaded model's MoE layer (host f32 tensors) to the device through `upload`. The shared
// experts, when the layer has them, are the dense gateUp/down the backend already uploaded
// (sharedGateUp/sharedDown, null when the layer has none).
Status uploadCudaMoeLayer(const LayerWeights& w, const CudaUploadFn& upload, const void* sharedGateUp,
                          const void* sharedDown, CudaMoeLayer* out);
// A streamed layer's MoE weights (weight_stream.h DeviceLayer: router, experts, the shared
// experts in gateUp/down).
CudaMoeLayer cudaMoeLayerFromStream(const DeviceLayer& d);

// Device bytes of one MoE layer's router and experts (the shared experts count as the dense
// MLP's), for the backend's memory check.
size_t cudaMoeLayerBytes(const ModelConfig& c, size_t weightBytes);

class CudaMoe {
 public:
  CudaMoe(const ModelConfig& config, pd::kernels::cuda::DType weightDtype, cublasHandle_t cublas, cudaStream_t stream)
      : cfg_(config), wdt_(weightDtype), cublas_(cublas), stream_(stream) {}
  ~CudaMoe();
  CudaMoe(const CudaMoe&) = delete;
  CudaMoe& operator=(const CudaMoe&) = delete;

  // Allocates the scratch for steps of up to T tokens now (the backend's reserved step, so a
  // gpu_memory_utilization measurement sees it).
  Status reserve(int T);

  // x[T][hidden] (f32, the residual stream) += the layer's MoE block of the post-attention
  // normalised rows: xn [T][hidden] in the weight dtype (= rmsNorm(x) * normWeight), with
  // normWeight [hidden] f32 and eps as the backend normalised them. Enqueued on the stream
  // with one synchronisation (routing); returns with the combine and shared experts enqueued.
  Status forward(const CudaMoeLayer& w, const float* normWeight, float eps, float* x, const void* xn, int T);

  // The rows each expert got in the last forward() (tests).
  const std::vector<int>& lastExpertRows() const { return plan_.rowsPerExpert; }

 private:
  Status grow(int T);
  void release();
  // y[n][out] (f32) = x[n][in] * W^T + beta * y, x and W in `dt`.
  Status gemm(const void* x, int n, int in, const void* w, int out, float* y, float beta, pd::kernels::cuda::DType dt);

  const ModelConfig& cfg_;
  pd::kernels::cuda::DType wdt_;
  cublasHandle_t cublas_;
  cudaStream_t stream_;
  int cap_ = 0;  // tokens the scratch holds
  std::vector<void*> dev_;
  std::vector<void*> host_;
  float* xnF32_ = nullptr;       // [cap][hidden] (16-bit weights only)
  float* logits_ = nullptr;      // [cap][numExperts]
  void* xe_ = nullptr;           // [cap*k][hidden] weight dtype
  float* gu_ = nullptr;          // [cap*k][2*expertFfn]
  void* act_ = nullptr;          // [cap*k][expertFfn] weight dtype
  float* ye_ = nullptr;          // [cap*k][hidden]
  float* sgu_ = nullptr;         // [cap][2*sharedFfn]
  void* sact_ = nullptr;         // [cap][sharedFfn] weight dtype
  int32_t* metaDev_ = nullptr;   // srcRows [cap*k] | slotRows [cap*k] | slot weights [cap*k] (f32)
  float* logitsHost_ = nullptr;  // pinned [cap][numExperts]
  int32_t* metaHost_ = nullptr;  // pinned, as metaDev_
  std::vector<int> chosen_;
  std::vector<float> weights_;
  MoeRowPlan plan_;
};

}  // namespace pd::engine
