// createBackend: the worker's `backend:` name -> a Backend. Built in every configuration;
// without CUDA, createCudaBackend (cuda_backend_stub.cpp) explains why "cuda" is refused.
#include <string>

#include "engine/cuda_backend.h"

namespace pd::engine {

Status cudaSupportsModel(const ModelConfig& c) {
  // Every architecture parseModelConfig accepts runs on CUDA: Qwen3's per-head q/k RMSNorm
  // (headRmsNorm), mixture-of-experts layers (cuda_moe.h), multi-head latent attention
  // (cuda_mla.h). What a path does not implement (tensor parallelism with MoE or MLA, an fp8
  // latent cache) createCudaBackend refuses by name; a new architecture's refusal goes here.
  (void)c;
  return Status::ok();
}

Result<std::unique_ptr<Backend>> createBackend(const std::string& kind, std::shared_ptr<const ModelWeights> model,
                                               const KvLayout& layout, void* hostKvBase,
                                               const CpuBackendOptions& cpuOptions,
                                               const CudaBackendOptions& cudaOptions) {
  if (kind == "cpu") return createCpuBackend(std::move(model), layout, hostKvBase, cpuOptions);
  if (kind == "cuda") {
    auto b = createCudaBackend(std::move(model), layout, cudaOptions);
    if (!b.ok()) return b.status();
    return std::unique_ptr<Backend>(std::move(b).value());
  }
  return invalidArgument("backend \"" + kind + "\" is not known (allowed: cpu, cuda)");
}

}  // namespace pd::engine
