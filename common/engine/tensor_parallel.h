// Tensor-parallel sharding plan for one worker spread over tensor_parallel_size GPUs
// (Megatron-style): q|k|v and gate|up are column-parallel (each rank owns whole heads and an
// ffn slice, no communication), o_proj and down_proj are row-parallel (each rank multiplies
// its slice of the input features and an all-reduce sums the partial outputs). Each rank
// keeps the KV cache of its own kv heads only, so the KV layout -- and the transfer
// descriptors built from it -- are per rank: numKvHeads / tp heads in every block.
//
// Pure functions over a ModelConfig; no CUDA needed (the CUDA backend and tests use them).
#pragma once

#include "common/base/status.h"
#include "common/engine/kv_layout.h"
#include "common/engine/model_config.h"

namespace pd::engine {

struct TensorParallelPlan {
  int size = 1;            // ranks
  int headsPerRank = 0;    // query heads
  int kvHeadsPerRank = 0;  // kv heads (and KV cache heads)
  int ffnPerRank = 0;      // intermediate features
  // Rank r owns query heads [r*headsPerRank, (r+1)*headsPerRank), kv heads likewise, and
  // intermediate features [r*ffnPerRank, (r+1)*ffnPerRank). Row offsets into the fused
  // weights (model_weights.h) of rank r:
  int qRowBegin(int r) const { return r * headsPerRank * headDim; }
  int headDim = 0;
};

// Fails (kInvalidArgument, naming the value) unless size is 1, 2, 4 or 8 and divides the
// query heads, the kv heads and the intermediate size.
Result<TensorParallelPlan> planTensorParallel(const ModelConfig& config, int size);

// The KV layout one rank holds: the full layout with numKvHeads / size heads.
KvLayout perRankKvLayout(const KvLayout& full, const TensorParallelPlan& plan);

}  // namespace pd::engine
