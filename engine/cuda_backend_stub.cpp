// Built instead of cuda_backend.cpp when the build has no CUDA (PD_WITH_CUDA=OFF or no nvcc):
// `backend: cuda` is refused with the reason.
#include "engine/cuda_backend.h"

namespace pd::engine {

Status cudaDeviceAvailable() {
  return unimplemented(
      "cuda backend: this build has no CUDA support (configure with -DPD_WITH_CUDA=ON on a "
      "machine with nvcc)");
}

Result<std::unique_ptr<CudaBackend>> createCudaBackend(std::shared_ptr<const ModelWeights> model, const KvLayout&,
                                                       const CudaBackendOptions&) {
  if (model) PD_RETURN_IF_ERROR(cudaSupportsModel(model->config));
  return cudaDeviceAvailable();
}

}  // namespace pd::engine
