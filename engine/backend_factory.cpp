// createBackend: the worker's `backend:` name -> a Backend. Built in every configuration;
// without CUDA, createCudaBackend (cuda_backend_stub.cpp) explains why "cuda" is refused.
#include <string>

#include "engine/cuda_backend.h"

namespace pd::engine {

Status cudaSupportsModel(const ModelConfig& c) {
  // Multi-head latent attention runs on CUDA (cuda_mla.h); what is refused is a mixture-of-
  // experts layer: a DeepseekV3 config with routed experts is dense when first_k_dense_replace
  // covers every layer, so the check is per layer, not on n_routed_experts.
  bool moeLayers = false;
  for (int l = 0; l < c.numLayers; ++l) moeLayers = moeLayers || c.isMoeLayer(l);
  if (moeLayers)
    return unimplemented(std::string("cuda backend: ") + architectureName(c.architecture) +
                         " (mixture of experts) is not implemented on CUDA; run it with backend: cpu");
  if (c.qkNorm)
    return unimplemented(std::string("cuda backend: ") + architectureName(c.architecture) +
                         " (per-head q/k RMSNorm) is not implemented on CUDA; run it with backend: cpu");
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
