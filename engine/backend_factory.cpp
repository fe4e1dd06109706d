// createBackend: the worker's `backend:` name -> a Backend. Built in every configuration;
// without CUDA, createCudaBackend (cuda_backend_stub.cpp) explains why "cuda" is refused.
#include <string>

#include "engine/cuda_backend.h"

namespace pd::engine {

Status cudaSupportsModel(const ModelConfig& c) {
  // Qwen3's per-head q/k RMSNorm and the mixture-of-experts block run on CUDA (cuda_moe.h);
  // DeepSeek-V3's attention does not yet.
  if (c.isMla())
    return unimplemented(std::string("cuda backend: ") + architectureName(c.architecture) +
                         " (multi-head latent attention) is not implemented on CUDA; run it with backend: cpu");
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
