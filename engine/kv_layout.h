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

enum class KvDtype : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline size_t kvDtypeBytes(KvDtype d) { return d == KvDtype::kF32 ? 4 : 2; }
inline constexpr EnumNames<KvDtype, 3> kKvDtypeNames{
    {{KvDtype::kF32, "f32"}, {KvDtype::kF16, "f16"}, {KvDtype::kBF16, "bf16"}}};
inline const char* kvDtypeName(KvDtype d) { return enumName(kKvDtypeNames, d); }

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
  size_t blockElems() const { return (latent ? 1 : 2) * size_t(blockSize) * tokenElems(); }
  size_t blockBytes() const { return blockElems() * elemBytes(); }
  size_t layerBytes() const { return blockBytes() * numBlocks; }
  size_t totalBytes() const { return layerBytes() * numLayers; }

  // Byte offset of (layer, block) from the start of the region.
  size_t blockOffset(int layer, int block) const { return size_t(layer) * layerBytes() + size_t(block) * blockBytes(); }
  // Element offsets within one block: K (or the latent vector) of token t, V of token t (not
  // for a latent layout).
  size_t kOffsetInBlock(int token) const { return size_t(token) * tokenElems(); }
  size_t vOffsetInBlock(int token) const { return size_t(blockSize) * tokenElems() + size_t(token) * tokenElems(); }

  // A stable string naming everything a peer must agree on before bytes can be copied
  // block for block ("L2.B16.H2.D32.f32"; latent: "MLA.L2.B16.H1.D160.f32"); the model id
  // is added by the caller.
  std::string fingerprint() const {
    return std::string(latent ? "MLA." : "") + "L" + std::to_string(numLayers) + ".B" + std::to_string(blockSize) +
           ".H" + std::to_string(numKvHeads) + ".D" + std::to_string(headDim) + "." + kvDtypeName(dtype);
  }
};

}  // namespace pd::engine
