#include "pd/kernels/embedding.h"

#include <cstring>

namespace pd::kernels::cpu {

void embeddingGather(const float* table, const int32_t* ids, int numTokens, int dim, float* out) {
  for (int t = 0; t < numTokens; ++t)
    std::memcpy(out + size_t(t) * dim, table + size_t(ids[t]) * dim, sizeof(float) * dim);
}

}  // namespace pd::kernels::cpu
