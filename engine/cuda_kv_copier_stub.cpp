// Built instead of cuda_kv_copier.cpp when the build has no CUDA: there is no device region
// to copy, and the call says why.
#include "engine/cuda_kv_copier.h"

namespace pd::engine {

Result<std::unique_ptr<KvBlockCopier>> createCudaKvBlockCopier(const KvLayout&, const std::vector<MemDesc>&,
                                                               const CudaKvCopierOptions&) {
  return unimplemented(
      "kv block copier: this build has no CUDA support (configure with -DPD_WITH_CUDA=ON on a machine with nvcc)");
}

}  // namespace pd::engine
