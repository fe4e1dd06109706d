// KV cache sizing by device-memory fraction (engine.gpu_memory_utilization, vLLM's meaning:
// the fraction of the device's total memory this worker may use). What is left of that share
// after the weights and the measured activation peak (scratch buffers, cuBLAS workspace) is
// the KV cache, in whole blocks:
//
//   kvBytes   = utilization * deviceTotal - weights - activations
//   numBlocks = kvBytes / bytesPerBlock        (capped at kMaxKvBlocks: block ids are int32)
//   tokens    = numBlocks * blockSize          (tokens of context the cache holds)
//
// Pure arithmetic, no device: the CUDA backend feeds it what cudaMemGetInfo and its own
// allocations measured, per rank. Errors: utilization outside (0, 1], bytesPerBlock or
// blockSize 0 -> kInvalidArgument; a share that holds no block after weights and
// activations -> kResourceExhausted naming every term (in GiB) so the operator sees what to
// raise or shrink.
#pragma once

#include <cstdint>
#include <string>

#include "common/base/status.h"

namespace pd::engine {

inline constexpr int64_t kMaxKvBlocks = int64_t{1} << 30;

struct KvBudgetInput {
  uint64_t deviceTotalBytes = 0;
  double utilization = 0.9;
  uint64_t weightBytes = 0;
  uint64_t activationBytes = 0;
  uint64_t bytesPerBlock = 0;  // one block id in every layer (KvLayout::totalBytes() of 1 block)
  int blockSize = 16;
};

struct KvBudget {
  uint64_t shareBytes = 0;  // utilization * deviceTotal
  uint64_t kvBytes = 0;     // numBlocks * bytesPerBlock (<= the share's remainder)
  int64_t numBlocks = 0;
  int64_t tokens = 0;
};

Result<KvBudget> kvBudgetFromUtilization(const KvBudgetInput& in);

// "12.34 GiB"
std::string formatGiB(uint64_t bytes);

}  // namespace pd::engine
