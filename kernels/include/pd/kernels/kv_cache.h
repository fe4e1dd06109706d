// Paged KV cache writes and reads, one layer at a time: the f32 cache, and the same pool in
// bf16 or in 8-bit codes with a scale per token and kv head (PagedKv below).
//
// A layer's pool (engine/kv_layout.h) is [numBlocks][2 (k|v)][blockSize][numKvHeads]
// [headDim]. A token's slot is blockTable[pos / blockSize] * blockSize + pos % blockSize;
// callers compute slots and validate block ids. Pure functions; callers split work across
// threads on disjoint tokens / heads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pd::kernels::cpu {

// The element format of a KV pool; the values match engine::KvDtype (engine/kv_layout.h).
//   kBf16: bf16, rounded to nearest even on write.
//   kInt8: code = round(x / s), s = max |x| / 127 over the token's kv-head row of headDim.
//   kFp8:  OCP e4m3fn code of x / s (nearest even), s = max |x| / 448 over the same row.
enum class KvFormat : uint8_t { kF32 = 0, kBf16 = 2, kInt8 = 3, kFp8 = 4 };

// One layer's pool in any format. A block is [k|v][blockSize][numKvHeads][headDim] elements;
// for kInt8/kFp8 they are followed by the f32 scales [k|v][blockSize][numKvHeads] (value =
// code * scale), so one block stays one byte range.
struct PagedKv {
  void* layer = nullptr;  // the layer's first block (written by kvCacheWrite only)
  KvFormat format = KvFormat::kF32;
  int blockSize = 0, numKvHeads = 0, headDim = 0;

  size_t elemBytes() const { return format == KvFormat::kF32 ? 4 : format == KvFormat::kBf16 ? 2 : 1; }
  bool scaled() const { return format == KvFormat::kInt8 || format == KvFormat::kFp8; }
  size_t tokenElems() const { return size_t(numKvHeads) * headDim; }
  size_t dataBytes() const { return 2 * size_t(blockSize) * tokenElems() * elemBytes(); }
  size_t blockBytes() const { return dataBytes() + (scaled() ? 2 * size_t(blockSize) * numKvHeads * 4 : 0); }
  // Codes of K (v = false) or V of the token in `slot` (block * blockSize + offset), kv head h.
  uint8_t* row(int slot, int h, bool v) const {
    const int b = slot / blockSize, o = slot % blockSize;
    return static_cast<uint8_t*>(layer) + size_t(b) * blockBytes() +
           ((v ? size_t(blockSize) * tokenElems() : 0) + size_t(o) * tokenElems() + size_t(h) * headDim) * elemBytes();
  }
  // Its scale (8-bit formats only).
  float* scale(int slot, int h, bool v) const {
    const int b = slot / blockSize, o = slot % blockSize;
    return reinterpret_cast<float*>(static_cast<uint8_t*>(layer) + size_t(b) * blockBytes() + dataBytes()) +
           (v ? size_t(blockSize) * numKvHeads : 0) + size_t(o) * numKvHeads + h;
  }
};

// One row of n values to `format` (codes: n elements of elemBytes; *scale set for the 8-bit
// formats, 1 otherwise). Error bounds, per element: bf16 |x| * 2^-8; int8 max|x| / 254;
// fp8 max(|x| * 2^-4, max|x| / 448 * 2^-10). An all-zero row gets scale 0 and zero codes.
void kvQuantizeRow(const float* x, int n, KvFormat format, void* codes, float* scale);
// The inverse: out[i] = value of codes[i] * scale.
void kvDequantizeRow(const void* codes, float scale, int n, KvFormat format, float* out);
// One fp8 e4m3fn code <-> float (the code of |x| > 448 is 448's; NaN codes read as NaN).
uint8_t fp8E4m3FromFloat(float x);
float fp8E4m3ToFloat(uint8_t code);

// kvCacheWrite / kvGatherHead below, for a pool in any format (the f32 versions are these
// with KvFormat::kF32). K and V rows are quantized per kv head.
void kvCacheWrite(const PagedKv& kv, const float* k, const float* v, int rowStride, const int32_t* slots,
                  int numTokens);
void kvGatherHead(const PagedKv& kv, const int32_t* blockTable, int numPositions, int kvHead, float* kOut, float* vOut);

// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim] (written),
// k, v: [numTokens][rowStride] with numKvHeads*headDim floats each at row start,
// slots: [numTokens].
void kvCacheWrite(float* layerKv, const float* k, const float* v, int rowStride, const int32_t* slots, int numTokens,
                  int blockSize, int numKvHeads, int headDim);

// Copies one kv head's K and V for positions [0, numPositions) out of the paged pool into
// contiguous rows (the operand layout a GEMM wants).
// layerKv: [numBlocks][2][blockSize][numKvHeads][headDim], blockTable: [ceil(numPositions /
// blockSize)], kOut, vOut: [numPositions][headDim] out.
void kvGatherHead(const float* layerKv, const int32_t* blockTable, int numPositions, int blockSize, int numKvHeads,
                  int headDim, int kvHead, float* kOut, float* vOut);

}  // namespace pd::kernels::cpu
