#include "common/engine/tensor_parallel.h"

#include <string>

namespace pd::engine {

Result<TensorParallelPlan> planTensorParallel(const ModelConfig& c, int size) {
  const std::string what = "tensor_parallel_size " + std::to_string(size);
  if (size != 1 && size != 2 && size != 4 && size != 8)
    return invalidArgument(what + " is not supported (allowed: 1, 2, 4, 8)");
  if (c.numHeads % size != 0)
    return invalidArgument(what + " does not divide the model's " + std::to_string(c.numHeads) +
                           " attention heads");
  if (c.numKvHeads % size != 0)
    return invalidArgument(what + " does not divide the model's " + std::to_string(c.numKvHeads) +
                           " kv heads (kv-head replication is not implemented)");
  if (c.intermediateSize % size != 0)
    return invalidArgument(what + " does not divide the model's intermediate_size " +
                           std::to_string(c.intermediateSize));
  TensorParallelPlan p;
  p.size = size;
  p.headsPerRank = c.numHeads / size;
  p.kvHeadsPerRank = c.numKvHeads / size;
  p.ffnPerRank = c.intermediateSize / size;
  p.headDim = c.headDim;
  return p;
}

KvLayout perRankKvLayout(const KvLayout& full, const TensorParallelPlan& plan) {
  KvLayout l = full;
  l.numKvHeads = full.numKvHeads / plan.size;
  return l;
}

}  // namespace pd::engine
