// A GGUF (version 3) writer for f32 tensors, and the conversion of a loaded Llama-shaped
// model into llama.cpp's `llama` architecture: engine_bench uses it to hand llama-bench the
// very weights it measures itself on (bench only; no serving code reads or writes GGUF).
//
// Format (ggml's gguf.h, GGUF_VERSION 3), all little-endian:
//   "GGUF" u32 version u64 n_tensors u64 n_kv
//   n_kv x { string key, u32 type, value }        string = u64 length + bytes (no NUL)
//   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset }
//   zero padding to `alignment` (general.alignment, default 32), then the data section: each
//   tensor at its offset (relative to the section start, a multiple of the alignment).
// ne[0] is the innermost (fastest varying) dimension: a row-major [rows][cols] matrix is
// ne = {cols, rows}.
//
// Not thread-safe; a writer is used by one thread. Tensors are borrowed: the data passed to
// addTensorF32 must outlive write().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "engine/model_weights.h"

namespace pd::engine {

inline constexpr uint32_t kGgufVersion = 3;
inline constexpr uint64_t kGgufAlignment = 32;  // GGUF_DEFAULT_ALIGNMENT
// gguf_type values (gguf.h) this writer emits.
inline constexpr uint32_t kGgufTypeU32 = 4;
inline constexpr uint32_t kGgufTypeF32 = 6;
inline constexpr uint32_t kGgufTypeString = 8;
inline constexpr uint32_t kGgmlTypeF32 = 0;  // ggml_type GGML_TYPE_F32

class GgufWriter {
 public:
  void addString(const std::string& key, const std::string& value);
  void addU32(const std::string& key, uint32_t value);
  void addF32(const std::string& key, float value);
  // ne: ggml order (innermost first); data holds the product of ne floats.
  void addTensorF32(const std::string& name, std::vector<uint64_t> ne, const float* data);

  // Writes the file (replacing it). Errors name the path.
  Status write(const std::string& path) const;

 private:
  struct Kv {
    std::string key;
    uint32_t type;
    std::string value;  // encoded value bytes
  };
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    const float* data;
    uint64_t count;
  };
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

// Writes `model` (f32 host tensors) as a llama.cpp `llama` GGUF at `path`: token_embd,
// blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,ffn_up,ffn_down},
// output_norm and output (left out when the embeddings are tied: llama.cpp then reuses
// token_embd), the llama.* hyper-parameters and `tokenizer.ggml.model` "no_vocab" with
// llama.vocab_size (llama.cpp then runs on token ids alone; no tokenizer is written).
// attn_q / attn_k rows are permuted from Hugging Face's rotate-half RoPE layout to ggml's
// interleaved one, as llama.cpp's convert_hf_to_gguf.py does, so llama.cpp computes the same
// function. Refused (invalidArgument naming the feature): attention biases, Llama 3 RoPE
// scaling, a sliding window, and a model without host tensors.
Status writeLlamaGguf(const ModelWeights& model, const std::string& path);

}  // namespace pd::engine
