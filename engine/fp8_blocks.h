// FP8 block-scaled weights: the checkpoint format DeepSeek-V3 and the Qwen3 FP8 releases ship
// (docs/models.md, "FP8 checkpoints").
//
// config.json carries
//   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//                           "weight_block_size": [128, 128]}
// and each quantized linear weight X.weight [out][in] is stored as F8_E4M3 codes next to
// X.weight_scale_inv [ceil(out / bo)][ceil(in / bi)] (F32, BF16 or F16), one scale per block of
// bo rows x bi columns (the last block of a row or column may be partial). The weight is
//   w[r][c] = e4m3(code[r][c]) * scale_inv[r / bo][c / bi]     (one f32 multiply)
// Every other tensor (norms, embeddings, lm_head, routers) keeps its stored dtype. Loading
// follows the tensors: any F8_E4M3 tensor is dequantized with its scales, anything else is
// read as before, so `modules_to_not_convert` / `ignored_layers` need no interpretation.
//
// "dynamic" activations: vLLM quantizes activations per token group at run time; pdserve
// computes the products in its own dtypes (f32 on cpu; on cuda the activations' dtype, with
// the weights kept FP8 and dequantized in the kernels), which is at least as precise.
//
// Plain functions and values; any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/base/status.h"

namespace pd::engine {

// What config.json's quantization_config says about the weights. Default: unquantized.
struct WeightQuantization {
  bool fp8 = false;  // quant_method "fp8" with block scales
  int blockRows = 128;
  int blockCols = 128;
  bool operator==(const WeightQuantization&) const = default;
};

// Reads a quantization_config object. Refused by name (kUnimplemented): a quant_method other
// than "fp8", fmt other than "e4m3", activation_scheme other than "dynamic" (static input
// scales are not applied), no weight_block_size (per-tensor FP8 scales), and any key this
// list does not know. weight_block_size must be two positive integers <= 4096
// (kInvalidArgument otherwise). `src` prefixes the messages.
Result<WeightQuantization> parseQuantizationConfig(const nlohmann::json& qc, const std::string& src);

// The shape of X.weight_scale_inv for a [rows][cols] weight.
std::vector<int64_t> fp8ScaleShape(int64_t rows, int64_t cols, const WeightQuantization& q);

// One weight's scales in f32, row-major [ceil(rows / blockRows)][ceil(cols / blockCols)].
struct Fp8BlockScales {
  int64_t rows = 0, cols = 0;
  int blockRows = 128, blockCols = 128;
  std::vector<float> scaleInv;
  int64_t blocksPerRow() const { return (cols + blockCols - 1) / blockCols; }
  float at(int64_t r, int64_t c) const { return scaleInv[size_t((r / blockRows) * blocksPerRow() + c / blockCols)]; }
};

// Dequantizes n consecutive codes of the row-major [rows][cols] weight starting at flat index
// `first` (a run may start mid-row and span rows) into dst.
void fp8DequantRun(const uint8_t* codes, size_t n, int64_t first, const Fp8BlockScales& s, float* dst);

// Quantizes a row-major [rows][cols] f32 weight per block: scale_inv = max |w| over the block
// / 448 (1 for an all-zero block), code = f32ToE4m3(w / scale_inv). codes: rows * cols;
// scaleInv: fp8ScaleShape's element count. The relative error of each weight is at most
// 2^-4 (e4m3's 3 mantissa bits, round to nearest) unless it falls in the subnormal range
// (below 2^-6 of the block's scale), where the absolute error is at most 2^-10 * scale_inv.
// The device layout of an FP8 weight slice held as codes (the CUDA backend's W8A16 path,
// docs/models.md "FP8 checkpoints"): the codes of rows [rowBegin, +rowCount) x columns
// [colBegin, +colCount) row-major, and per row its block scales ("row-expanded"):
//   scales[i][j], j < fp8RowScaleCols(colOffset, colCount, blockCols),
//   colOffset = colBegin % blockCols,
//   w[i][c] = e4m3(code[i][c]) * scales[i][(colOffset + c) / blockCols]
// One float per row per block (1/32 of the codes' bytes at 128-column blocks): rows of
// different projections can be stacked (q|k|v, gate|up) and sliced by tensor-parallel rank
// at any row or column without the slice having to start on a block boundary.
int64_t fp8RowScaleCols(int64_t colOffset, int64_t colCount, int blockCols);
// Fills out[rowCount][fp8RowScaleCols(colBegin % blockCols, colCount, blockCols)] from the
// whole tensor's scales. The slice must lie inside [s.rows][s.cols] (checked by the caller).
void fp8ExpandRowScales(const Fp8BlockScales& s, int64_t rowBegin, int64_t rowCount, int64_t colBegin, int64_t colCount,
                        float* out);

void fp8QuantizeBlocks(const float* w, int64_t rows, int64_t cols, const WeightQuantization& q, uint8_t* codes,
                       float* scaleInv);

}  // namespace pd::engine
