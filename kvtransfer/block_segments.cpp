#include "kvtransfer/block_segments.h"

#include <string>

namespace pd::kvt {

Result<Segments> blockSegments(const BlockPool& src, std::span<const int> srcBlocks, const BlockPool& dst,
                               std::span<const int> dstBlocks, int layerBegin, int layerEnd) {
  if (src.blockBytes != dst.blockBytes || src.numLayers != dst.numLayers) {
    return invalidArgument("kv transfer: block pools disagree: source " + std::to_string(src.numLayers) +
                           " layers of " + std::to_string(src.blockBytes) + "-byte blocks, target " +
                           std::to_string(dst.numLayers) + " layers of " + std::to_string(dst.blockBytes) +
                           "-byte blocks");
  }
  if (layerBegin < 0 || layerEnd > src.numLayers || layerBegin >= layerEnd) {
    return invalidArgument("kv transfer: layer range [" + std::to_string(layerBegin) + ", " + std::to_string(layerEnd) +
                           ") is empty or outside [0, " + std::to_string(src.numLayers) + ")");
  }
  if (srcBlocks.size() != dstBlocks.size()) {
    return invalidArgument("kv transfer: " + std::to_string(srcBlocks.size()) + " source blocks but " +
                           std::to_string(dstBlocks.size()) + " target blocks");
  }
  for (size_t i = 0; i < srcBlocks.size(); ++i) {
    if (srcBlocks[i] < 0 || srcBlocks[i] >= src.numBlocks) {
      return invalidArgument("kv transfer: source block id " + std::to_string(srcBlocks[i]) + " outside [0, " +
                             std::to_string(src.numBlocks) + ")");
    }
    if (dstBlocks[i] < 0 || dstBlocks[i] >= dst.numBlocks) {
      return invalidArgument("kv transfer: target block id " + std::to_string(dstBlocks[i]) + " outside [0, " +
                             std::to_string(dst.numBlocks) + ")");
    }
  }
  Segments out;
  const size_t n = srcBlocks.size();
  for (int layer = layerBegin; layer < layerEnd; ++layer) {
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && srcBlocks[j] == srcBlocks[j - 1] + 1 && dstBlocks[j] == dstBlocks[j - 1] + 1) ++j;
      const size_t len = (j - i) * src.blockBytes;
      out.local.push_back(MemDesc{src.base + src.blockOffset(layer, srcBlocks[i]), len, src.device, src.kind});
      out.remote.push_back(MemDesc{dst.base + dst.blockOffset(layer, dstBlocks[i]), len, dst.device, dst.kind});
      i = j;
    }
  }
  return out;
}

}  // namespace pd::kvt
