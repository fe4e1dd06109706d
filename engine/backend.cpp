#include "engine/backend.h"

#include <string>

namespace pd::engine {

Result<BatchShape> validateBatch(std::span<const SeqChunk> batch, const ModelConfig& cfg, const KvLayout& layout) {
  int64_t total = 0, tables = 0;
  int numLogits = 0;
  for (size_t c = 0; c < batch.size(); ++c) {
    const SeqChunk& s = batch[c];
    const std::string where = "forward: chunk " + std::to_string(c) + ": ";
    if (s.numTokens <= 0 || !s.tokens)
      return invalidArgument(where + "numTokens " + std::to_string(s.numTokens) + " (must be >= 1 with tokens)");
    if (s.startPos < 0) return invalidArgument(where + "startPos " + std::to_string(s.startPos) + " < 0");
    const int64_t end = int64_t(s.startPos) + s.numTokens;
    if (cfg.slidingWindow > 0 && end > cfg.slidingWindow)
      return outOfRange(where + "context " + std::to_string(end) + " exceeds the model's sliding_window " +
                        std::to_string(cfg.slidingWindow) + " (sliding-window attention is not implemented)");
    if (int64_t(s.numBlocks) * layout.blockSize < end || !s.blockTable)
      return invalidArgument(where + "block table of " + std::to_string(s.numBlocks) + " blocks x " +
                             std::to_string(layout.blockSize) + " tokens does not cover position " +
                             std::to_string(end - 1));
    const int need = int((end + layout.blockSize - 1) / layout.blockSize);
    for (int b = 0; b < need; ++b)
      if (s.blockTable[b] < 0 || s.blockTable[b] >= layout.numBlocks)
        return outOfRange(where + "block id " + std::to_string(s.blockTable[b]) + " at table index " +
                          std::to_string(b) + " is outside the pool [0, " + std::to_string(layout.numBlocks) + ")");
    for (int t = 0; t < s.numTokens; ++t)
      if (s.tokens[t] < 0 || s.tokens[t] >= cfg.vocabSize)
        return outOfRange(where + "token id " + std::to_string(s.tokens[t]) + " at index " + std::to_string(t) +
                          " is outside the vocabulary [0, " + std::to_string(cfg.vocabSize) + ")");
    total += s.numTokens;
    tables += need;
    if (s.wantLogits) ++numLogits;
  }
  if (total > (int64_t(1) << 24))
    return invalidArgument("forward: batch of " + std::to_string(total) + " tokens is too large");
  return BatchShape{int(total), numLogits, int(tables)};
}

}  // namespace pd::engine
