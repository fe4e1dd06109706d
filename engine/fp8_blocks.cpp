#include "engine/fp8_blocks.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "engine/safetensors.h"

namespace pd::engine {

Result<WeightQuantization> parseQuantizationConfig(const nlohmann::json& qc, const std::string& src) {
  const std::string at = src + ": quantization_config";
  if (!qc.is_object()) return invalidArgument(at + " must be an object, got " + qc.dump());
  // modules_to_not_convert / ignored_layers name the modules left unquantized: loading follows
  // each tensor's stored dtype, so they are accepted and need no reading.
  static const char* const kKnown[] = {
      "quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers"};
  for (auto it = qc.begin(); it != qc.end(); ++it)
    if (std::find(std::begin(kKnown), std::end(kKnown), it.key()) == std::end(kKnown))
      return unimplemented(at + " key \"" + it.key() + "\" is not implemented (refused rather than ignored)");
  auto str = [&](const char* key, const char* dflt) -> Result<std::string> {
    auto it = qc.find(key);
    if (it == qc.end() || it->is_null()) {
      if (!dflt) return invalidArgument(at + " is missing \"" + key + "\"");
      return std::string(dflt);
    }
    if (!it->is_string()) return invalidArgument(at + " \"" + key + "\" must be a string, got " + it->dump());
    return it->get<std::string>();
  };
  PD_ASSIGN_OR_RETURN(const std::string method, str("quant_method", nullptr));
  if (method != "fp8")
    return unimplemented(at + " quant_method \"" + method + "\" is not implemented (supported: fp8)");
  // fmt is DeepSeek's spelling of the element type; vLLM assumes e4m3 when it is absent.
  PD_ASSIGN_OR_RETURN(const std::string fmt, str("fmt", "e4m3"));
  if (fmt != "e4m3") return unimplemented(at + " fmt \"" + fmt + "\" is not implemented (supported: e4m3)");
  PD_ASSIGN_OR_RETURN(const std::string act, str("activation_scheme", "dynamic"));
  if (act != "dynamic")
    return unimplemented(at + " activation_scheme \"" + act +
                         "\" is not implemented (supported: dynamic; static input scales are not applied)");
  auto bs = qc.find("weight_block_size");
  if (bs == qc.end() || bs->is_null())
    return unimplemented(at +
                         " without weight_block_size (per-tensor FP8 scales) is not implemented "
                         "(supported: block scales, e.g. [128, 128])");
  if (!bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() || !(*bs)[1].is_number_integer())
    return invalidArgument(at + " weight_block_size must be two integers [rows, columns], got " + bs->dump());
  WeightQuantization q;
  q.fp8 = true;
  const int64_t r = (*bs)[0].get<int64_t>(), c = (*bs)[1].get<int64_t>();
  if (r <= 0 || c <= 0 || r > 4096 || c > 4096)
    return invalidArgument(at + " weight_block_size " + bs->dump() + " is out of range (1..4096 each)");
  q.blockRows = int(r);
  q.blockCols = int(c);
  return q;
}

std::vector<int64_t> fp8ScaleShape(int64_t rows, int64_t cols, const WeightQuantization& q) {
  return {(rows + q.blockRows - 1) / q.blockRows, (cols + q.blockCols - 1) / q.blockCols};
}

void fp8DequantRun(const uint8_t* codes, size_t n, int64_t first, const Fp8BlockScales& s, float* dst) {
  int64_t r = first / s.cols, c = first % s.cols;
  size_t i = 0;
  while (i < n) {
    // Within one row, one block's columns share a scale.
    const int64_t blockEnd = std::min(s.cols, (c / s.blockCols + 1) * s.blockCols);
    const size_t run = std::min(n - i, size_t(blockEnd - c));
    const float scale = s.at(r, c);
    for (size_t k = 0; k < run; ++k) dst[i + k] = e4m3ToF32(codes[i + k]) * scale;
    i += run;
    c += int64_t(run);
    if (c == s.cols) {
      c = 0;
      ++r;
    }
  }
}

int64_t fp8RowScaleCols(int64_t colOffset, int64_t colCount, int blockCols) {
  return (colOffset + colCount + blockCols - 1) / blockCols;
}

void fp8ExpandRowScales(const Fp8BlockScales& s, int64_t rowBegin, int64_t rowCount, int64_t colBegin, int64_t colCount,
                        float* out) {
  const int64_t firstBlock = colBegin / s.blockCols;
  const int64_t n = fp8RowScaleCols(colBegin % s.blockCols, colCount, s.blockCols);
  for (int64_t i = 0; i < rowCount; ++i) {
    const float* src = &s.scaleInv[size_t(((rowBegin + i) / s.blockRows) * s.blocksPerRow() + firstBlock)];
    std::copy(src, src + n, out + i * n);
  }
}

void fp8QuantizeBlocks(const float* w, int64_t rows, int64_t cols, const WeightQuantization& q, uint8_t* codes,
                       float* scaleInv) {
  const int64_t br = q.blockRows, bc = q.blockCols;
  const int64_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc;
  for (int64_t bi = 0; bi < nbr; ++bi)
    for (int64_t bj = 0; bj < nbc; ++bj) {
      const int64_t r0 = bi * br, r1 = std::min(rows, r0 + br), c0 = bj * bc, c1 = std::min(cols, c0 + bc);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      scaleInv[bi * nbc + bj] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) codes[r * cols + c] = f32ToE4m3(w[r * cols + c] / s);
    }
}

}  // namespace pd::engine
