#include "engine/kv_budget.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace pd::engine {

std::string formatGiB(uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GiB", double(bytes) / double(uint64_t(1) << 30));
  return b;
}

Result<KvBudget> kvBudgetFromUtilization(const KvBudgetInput& in) {
  if (!(in.utilization > 0.0 && in.utilization <= 1.0))
    return invalidArgument("engine.gpu_memory_utilization: " + std::to_string(in.utilization) + " is outside (0, 1]");
  if (in.bytesPerBlock == 0 || in.blockSize <= 0)
    return invalidArgument("kv budget: bytesPerBlock and blockSize must be > 0");
  KvBudget b;
  b.shareBytes = uint64_t(std::floor(in.utilization * double(in.deviceTotalBytes)));
  const uint64_t used = in.weightBytes + in.activationBytes;
  const uint64_t left = b.shareBytes > used ? b.shareBytes - used : 0;
  b.numBlocks = std::min<int64_t>(int64_t(left / in.bytesPerBlock), kMaxKvBlocks);
  if (b.numBlocks < 1) {
    char util[32];
    std::snprintf(util, sizeof util, "%g", in.utilization);
    return resourceExhausted("engine.gpu_memory_utilization: " + std::string(util) + " of " +
                             formatGiB(in.deviceTotalBytes) + " is " + formatGiB(b.shareBytes) +
                             ", which after the weights (" + formatGiB(in.weightBytes) + ") and the activation peak (" +
                             formatGiB(in.activationBytes) + ") holds no KV block of " +
                             std::to_string(in.bytesPerBlock) +
                             " bytes: raise it, or shrink the model, model.dtype or "
                             "engine.max_batch_tokens");
  }
  b.kvBytes = uint64_t(b.numBlocks) * in.bytesPerBlock;
  b.tokens = b.numBlocks * in.blockSize;
  return b;
}

}  // namespace pd::engine
