// The KV cache's memory layout (docs/design.md §4), shared by the KvCacheManager that owns the
// region, the backends that read and write it, and the workers that describe it to
// kvtransfer.
//
// All layers live in one contiguous region. Per layer a pool of `numBlocks` blocks, each
//   [k|v][token in block][kv_head][head_dim]
// so one block of one layer is 2 * blockSize * numKvHeads * headDim elements, and a run of
// consecutive block ids within one layer is one contiguous byte range (one transfer
// segment). The layout is a plain value: copying it does not copy the cache.
//
// The 8-bit dtypes (int8, fp8 e4m3) carry one f32 scale per token and kv head, stored inside
// the block after the data, so a block still is one byte range that transfers, the prefix
// cache and the KV tiers copy without knowing the dtype:
//   [k|v][token in block][kv_head][head_dim] 1-byte codes, then [k|v][token][kv_head] f32
// (value = code * scale; docs/kv_cache.md, "Quantized KV cache").
//
// Latent KV (multi-head latent attention, DeepseekV3): `latent` set, one "head"
// (numKvHeads 1) of headDim = kv_lora_rank + qk_rope_head_dim values per token holding
// [c_kv | k_pe], and no separate V: a block is [token in block][headDim], half the elements
// of a [k|v] block of the same width.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/base/enum_names.h"

namespace pd::engine {

// kInt8 and kFp8 (OCP e4m3fn) are scaled per token and kv head (see above).
enum class KvDtype : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kInt8 = 3, kFp8 = 4 };

inline size_t kvDtypeBytes(KvDtype d) {
  return d == KvDtype::kF32 ? 4 : (d == KvDtype::kInt8 || d == KvDtype::kFp8) ? 1 : 2;
}
// Bytes of the scale each token and kv head carries for K (and again for V); 0 when unscaled.
inline size_t kvDtypeScaleBytes(KvDtype d) { return (d == KvDtype::kInt8 || d == KvDtype::kFp8) ? 4 : 0; }
inline constexpr EnumNames<KvDtype, 5> kKvDtypeNames{{{KvDtype::kF32, "f32"},
                                                      {KvDtype::kF16, "f16"},
                                                      {KvDtype::kBF16, "bf16"},
                                                      {KvDtype::kInt8, "int8"},
                                                      {KvDtype::kFp8, "fp8"}}};
inline const char* kvDtypeName(KvDtype d) { return enumName(kKvDtypeNames, d); }
// The dtype as the layout fingerprint names it: the scale scheme is part of what peers must
// agree on: "int8-tks32" is int8 codes with f32 scales per token and kv head.
inline std::string kvDtypeFingerprint(KvDtype d) {
  return kvDtypeScaleBytes(d) ? std::string(kvDtypeName(d)) + "-tks32" : std::string(kvDtypeName(d));
}

struct KvLayout {
  int numLayers = 0;
  int numBlocks = 0;   // blocks per layer
  int blockSize = 16;  // tokens per block
  int numKvHeads = 0;
  int headDim = 0;
  KvDtype dtype = KvDtype::kF32;
  bool latent = false;  // MLA: one latent vector per token, no V (see above)

  size_t elemBytes() const { return kvDtypeBytes(dtype); }
  // Elements of K (or of V) for one token: numKvHeads * headDim.
  size_t tokenElems() const { return size_t(numKvHeads) * headDim; }
  // K and V elements of one block (latent: the one vector per token; the scales of an 8-bit
  // dtype not counted).
  size_t blockElems() const { return (latent ? 1 : 2) * size_t(blockSize) * tokenElems(); }
  // Bytes of one block of one layer: the elements, then for int8/fp8 the K and V scales.
  size_t blockBytes() const { return blockElems() * elemBytes() + scaleBytesPerBlock(); }
  // 8-bit dtypes: byte offset of the block's K scales [blockSize][numKvHeads] f32, followed by
  // the V scales (none for a latent layout); 0 bytes of them otherwise.
  size_t scalesOffsetInBlock() const { return blockElems() * elemBytes(); }
  size_t scaleBytesPerBlock() const {
    return (latent ? 1 : 2) * size_t(blockSize) * numKvHeads * kvDtypeScaleBytes(dtype);
  }
  size_t layerBytes() const { return blockBytes() * numBlocks; }
  size_t totalBytes() const { return layerBytes() * numLayers; }

  // Byte offset of (layer, block) from the start of the region.
  size_t blockOffset(int layer, int block) const { return size_t(layer) * layerBytes() + size_t(block) * blockBytes(); }
  // Element offsets within one block: K (or the latent vector) of token t, V of token t (not
  // for a latent layout).
  size_t kOffsetInBlock(int token) const { return size_t(token) * tokenElems(); }
  size_t vOffsetInBlock(int token) const { return size_t(blockSize) * tokenElems() + size_t(token) * tokenElems(); }

  // A stable string naming everything a peer must agree on before bytes can be copied
  // block for block ("L2.B16.H2.D32.f32", "L2.B16.H2.D32.int8-tks32"; latent:
  // "MLA.L2.B16.H1.D160.f32"); the model id is added by the caller. The dtype (with its scale
  // scheme) stays the last field: the router reads it.
  std::string fingerprint() const {
    return std::string(latent ? "MLA." : "") + "L" + std::to_string(numLayers) + ".B" + std::to_string(blockSize) +
           ".H" + std::to_string(numKvHeads) + ".D" + std::to_string(headDim) + "." + kvDtypeFingerprint(dtype);
  }
};

}  // namespace pd::engine
