// Embedding gather: out[t] = table[ids[t]].
//
// Pure function; ids must already be validated in [0, vocab) by the caller.
#pragma once

#include <cstdint>

namespace pd::kernels::cpu {

// table: [vocab][dim], ids: [numTokens], out: [numTokens][dim].
void embeddingGather(const float* table, const int32_t* ids, int numTokens, int dim, float* out);

}  // namespace pd::kernels::cpu
