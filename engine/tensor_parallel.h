// Tensor-parallel sharding plan for one worker spread over tensor_parallel_size GPUs
// (Megatron-style): q|k|v and gate|up are column-parallel (each rank owns whole heads and an
// ffn slice, no communication), o_proj and down_proj are row-parallel (each rank multiplies
// its slice of the input features and an all-reduce sums the partial outputs). Each rank
// keeps the KV cache of its own kv heads only, so the KV layout -- and the transfer
// descriptors built from it -- are per rank: numKvHeads / tp heads in every block, rank r's
// blocks holding kv heads [r*kvHeadsPerRank, (r+1)*kvHeadsPerRank).
//
// Pure functions over a ModelConfig and host f32 weights; no CUDA needed (the CUDA backend
// slices its per-rank weights with them, and tests check the bytes on the CPU).
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "common/base/status.h"
#include "engine/kv_layout.h"
#include "engine/model_config.h"

namespace pd::engine {

// A run of rows (or of columns) of a row-major matrix: [begin, begin + count).
struct RowRange {
  int begin = 0;
  int count = 0;
  bool operator==(const RowRange&) const = default;
};

struct TensorParallelPlan {
  int size = 1;            // ranks
  int headsPerRank = 0;    // query heads
  int kvHeadsPerRank = 0;  // kv heads (and KV cache heads)
  int ffnPerRank = 0;      // intermediate features
  int headDim = 0;
  // Rank r owns query heads [r*headsPerRank, (r+1)*headsPerRank), kv heads likewise, and
  // intermediate features [r*ffnPerRank, (r+1)*ffnPerRank). Row offsets into the fused
  // weights (model_weights.h) of rank r:
  int qRowBegin(int r) const { return r * headsPerRank * headDim; }

  // Full-model widths (the plan divides them exactly).
  int qDim() const { return size * headsPerRank * headDim; }
  int kvDim() const { return size * kvHeadsPerRank * headDim; }
  int ffn() const { return size * ffnPerRank; }
  // Per-rank widths: rows of the rank's q|k|v slice, its q part, each of its k and v parts.
  int rankQkvRows() const { return (headsPerRank + 2 * kvHeadsPerRank) * headDim; }
  int rankQDim() const { return headsPerRank * headDim; }
  int rankKvDim() const { return kvHeadsPerRank * headDim; }

  // Rows of the fused q|k|v weight [qDim + 2*kvDim][hidden] (and of its bias) that rank r
  // owns, in the order q, k, v; stacked, they are the rank's own fused [rankQkvRows][hidden].
  std::array<RowRange, 3> qkvRows(int r) const;
  // Rows of the fused gate|up weight [2*ffn][hidden] of rank r, in the order gate, up.
  std::array<RowRange, 2> gateUpRows(int r) const;
  // Input columns of o_proj [hidden][qDim] (rank r's attention heads) and of down_proj
  // [hidden][ffn] (rank r's ffn slice): the row-parallel layers.
  RowRange oColumns(int r) const { return {qRowBegin(r), rankQDim()}; }
  RowRange downColumns(int r) const { return {r * ffnPerRank, ffnPerRank}; }
};

// Fails (kInvalidArgument, naming the value) unless size is 1, 2, 4 or 8 and divides the
// query heads, the kv heads and the intermediate size.
Result<TensorParallelPlan> planTensorParallel(const ModelConfig& config, int size);

// The KV layout one rank holds: the full layout with numKvHeads / size heads.
KvLayout perRankKvLayout(const KvLayout& full, const TensorParallelPlan& plan);

// Copies the given rows of a row-major [*][cols] matrix w, one range after the other, into a
// new [sum of counts][cols] matrix (a vector bias is the cols == 1 case). The ranges must lie
// inside w (the caller's plan guarantees it).
std::vector<float> sliceRows(const float* w, size_t cols, std::span<const RowRange> rows);

// Copies columns [columns.begin, + count) of a row-major [rows][cols] matrix into a new
// [rows][columns.count] matrix.
std::vector<float> sliceColumns(const float* w, size_t rows, size_t cols, RowRange columns);

}  // namespace pd::engine
