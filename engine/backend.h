// engine::Backend: runs one forward step of the model over a flattened, variable-length
// batch in which prefill chunks and decode tokens of different sequences run together
// (docs/design.md §3, §4).
//
// One step:
//   - every SeqChunk contributes numTokens tokens at positions [startPos, startPos+numTokens);
//     a decode token is a chunk of 1, a prefill chunk is any run of prompt tokens;
//   - for each layer the chunk's K/V are written into the paged KV cache
//     (kv_layout.h) at slot blockTable[pos / blockSize] * blockSize + pos % blockSize, then
//     each token attends causally over positions [0, its own position] of its sequence;
//   - logits of the LAST token of every chunk with wantLogits are written, in batch order,
//     to logits[numWantLogits][vocab].
//
// The KV region is not owned by the backend (KvCacheManager owns it); the caller
// guarantees the blocks named in the tables stay valid during forward(), that positions
// [0, startPos) were written by earlier steps (or received from a prefill worker), and that
// no sequence appears twice in one batch.
//
// Threads: a backend is driven by one thread (the worker's loop thread); forward() is not
// reentrant. onLayerKvReady(l) is called on that thread after layer l's K/V for this step
// are in the cache (and before its attention runs), so a prefill worker can start pushing
// layer l while layer l+1 computes; it must return quickly (post work, do not block).
//
// Errors: malformed batches (token id outside the vocabulary, block table too short, block
// id outside the pool, sequence beyond a sliding window) return kInvalidArgument /
// kOutOfRange naming the chunk and value, and leave the cache untouched.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "common/base/status.h"
#include "engine/kv_layout.h"
#include "engine/model_config.h"
#include "engine/sampling.h"

namespace pd::engine {

struct SeqChunk {
  const int32_t* tokens = nullptr;  // [numTokens]
  int numTokens = 0;
  int startPos = 0;                     // position of tokens[0] in its sequence
  const int32_t* blockTable = nullptr;  // [numBlocks] block ids in the KV pool
  int numBlocks = 0;                    // must cover startPos + numTokens positions
  bool wantLogits = false;              // logits of this chunk's last token
};

using LayerKvReadyFn = std::function<void(int layer)>;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const KvLayout& kvLayout() const = 0;

  // logits: [count of chunks with wantLogits][vocabSize], may be null when none want them.
  virtual Status forward(std::span<const SeqChunk> batch, float* logits, const LayerKvReadyFn& onLayerKvReady = {}) = 0;

  // Optional: backends that sample where the logits are (the CUDA backend) say so here, and
  // the Engine then calls forwardAndSample() instead of forward() + sample() per row.
  virtual bool samplesOnDevice() const { return false; }
  // The step of forward(), then every logits row sampled as pd::engine::sample() would:
  // params: one per chunk with wantLogits (rowParams(request params, step)); topN: top
  // logprobs for every row (0..kMaxLogprobs, most likely first); out: [rows]. Returns the
  // same tokens sample() picks from forward()'s logits. Default: kUnimplemented.
  virtual Status forwardAndSample(std::span<const SeqChunk> batch, std::span<const pd::kernels::SampleRowParams> params,
                                  int topN, SampledToken* out, const LayerKvReadyFn& onLayerKvReady = {}) {
    (void)batch, (void)params, (void)topN, (void)out, (void)onLayerKvReady;
    return unimplemented("backend: forwardAndSample: this backend samples on the host");
  }
};

// What a valid batch adds up to.
struct BatchShape {
  int totalTokens = 0;
  int numLogits = 0;     // chunks with wantLogits
  int tableEntries = 0;  // block-table entries the chunks use
};

// Checks a batch against the model and the KV layout before anything is computed: token ids
// in the vocabulary, block tables covering every position with ids inside the pool, no
// context beyond a sliding window (not implemented). Errors name the chunk and the value.
Result<BatchShape> validateBatch(std::span<const SeqChunk> batch, const ModelConfig& config, const KvLayout& layout);

// The KV layout that holds `numBlocks` blocks of `blockSize` tokens per layer for `config`.
inline KvLayout kvLayoutFor(const ModelConfig& config, int numBlocks, int blockSize = 16,
                            KvDtype dtype = KvDtype::kF32) {
  KvLayout l;
  l.numLayers = config.numLayers;
  l.numBlocks = numBlocks;
  l.blockSize = blockSize;
  l.numKvHeads = config.numKvHeads;
  l.headDim = config.headDim;
  l.dtype = dtype;
  l.latent = config.isMla();
  return l;
}

}  // namespace pd::engine
