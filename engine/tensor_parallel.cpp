#include "engine/tensor_parallel.h"

#include <cstring>
#include <string>

namespace pd::engine {

Result<TensorParallelPlan> planTensorParallel(const ModelConfig& c, int size) {
  const std::string what = "tensor_parallel_size " + std::to_string(size);
  if (size != 1 && size != 2 && size != 4 && size != 8)
    return invalidArgument(what + " is not supported (allowed: 1, 2, 4, 8)");
  if (c.numHeads % size != 0)
    return invalidArgument(what + " does not divide the model's " + std::to_string(c.numHeads) + " attention heads");
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

std::array<RowRange, 3> TensorParallelPlan::qkvRows(int r) const {
  const int kvRank = rankKvDim();
  return {RowRange{qRowBegin(r), rankQDim()}, RowRange{qDim() + r * kvRank, kvRank},
          RowRange{qDim() + kvDim() + r * kvRank, kvRank}};
}

std::array<RowRange, 2> TensorParallelPlan::gateUpRows(int r) const {
  return {RowRange{r * ffnPerRank, ffnPerRank}, RowRange{ffn() + r * ffnPerRank, ffnPerRank}};
}

KvLayout perRankKvLayout(const KvLayout& full, const TensorParallelPlan& plan) {
  KvLayout l = full;
  l.numKvHeads = full.numKvHeads / plan.size;
  return l;
}

std::vector<float> sliceRows(const float* w, size_t cols, std::span<const RowRange> rows) {
  size_t total = 0;
  for (const RowRange& r : rows) total += size_t(r.count);
  std::vector<float> out(total * cols);
  float* dst = out.data();
  for (const RowRange& r : rows) {
    // Consecutive rows of a row-major matrix are one contiguous run.
    const size_t n = size_t(r.count) * cols;
    if (n > 0) std::memcpy(dst, w + size_t(r.begin) * cols, n * sizeof(float));
    dst += n;
  }
  return out;
}

std::vector<float> sliceColumns(const float* w, size_t rows, size_t cols, RowRange columns) {
  const size_t n = size_t(columns.count);
  std::vector<float> out(rows * n);
  if (n == 0) return out;
  for (size_t i = 0; i < rows; ++i)
    std::memcpy(out.data() + i * n, w + i * cols + size_t(columns.begin), n * sizeof(float));
  return out;
}

}  // namespace pd::engine
