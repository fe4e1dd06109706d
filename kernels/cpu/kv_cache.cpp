#include "pd/kernels/kv_cache.h"

#include <cstring>

namespace pd::kernels::cpu {

void kvCacheWrite(float* layerKv, const float* k, const float* v, int rowStride, const int32_t* slots, int numTokens,
                  int blockSize, int numKvHeads, int headDim) {
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  const size_t blockElems = 2 * size_t(blockSize) * tokenElems;
  for (int t = 0; t < numTokens; ++t) {
    const int block = slots[t] / blockSize, off = slots[t] % blockSize;
    float* kd = layerKv + size_t(block) * blockElems + size_t(off) * tokenElems;
    float* vd = kd + size_t(blockSize) * tokenElems;
    std::memcpy(kd, k + size_t(t) * rowStride, sizeof(float) * tokenElems);
    std::memcpy(vd, v + size_t(t) * rowStride, sizeof(float) * tokenElems);
  }
}

void kvGatherHead(const float* layerKv, const int32_t* blockTable, int numPositions, int blockSize, int numKvHeads,
                  int headDim, int kvHead, float* kOut, float* vOut) {
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  const size_t blockElems = 2 * size_t(blockSize) * tokenElems;
  for (int p = 0; p < numPositions; ++p) {
    const float* kb = layerKv + size_t(blockTable[p / blockSize]) * blockElems + size_t(p % blockSize) * tokenElems +
                      size_t(kvHead) * headDim;
    std::memcpy(kOut + size_t(p) * headDim, kb, sizeof(float) * headDim);
    std::memcpy(vOut + size_t(p) * headDim, kb + size_t(blockSize) * tokenElems, sizeof(float) * headDim);
  }
}

}  // namespace pd::kernels::cpu
