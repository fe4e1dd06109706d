// A GGUF (version 3) writer for f32 tensors, and the conversion of a loaded model into
// llama.cpp's architectures (`llama`, `qwen3`, `qwen3moe`): engine_bench uses it to hand
// llama-bench the very weights it measures itself on (bench only; no serving code reads or
// writes GGUF).
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
// addTensorF32 / addTensorF32Parts must outlive write().
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
inline constexpr uint32_t kGgufTypeBool = 7;
inline constexpr uint32_t kGgufTypeString = 8;
inline constexpr uint32_t kGgmlTypeF32 = 0;  // ggml_type GGML_TYPE_F32

class GgufWriter {
 public:
  void addString(const std::string& key, const std::string& value);
  void addU32(const std::string& key, uint32_t value);
  void addF32(const std::string& key, float value);
  void addBool(const std::string& key, bool value);
  // ne: ggml order (innermost first); data holds the product of ne floats.
  void addTensorF32(const std::string& name, std::vector<uint64_t> ne, const float* data);
  // The same tensor held in parts.size() equal consecutive pieces (one per expert of a 3-D
  // expert tensor, ne[2] = parts.size()), written back to back without a copy.
  void addTensorF32Parts(const std::string& name, std::vector<uint64_t> ne, std::vector<const float*> parts);

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
    std::vector<const float*> parts;  // equal pieces, in order
    uint64_t count;                   // floats in all the parts together
  };
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

// The llama.cpp architecture `model` is written as: "llama" (Llama, Mistral, Mixtral), "qwen3",
// "qwen3moe" or "deepseek2" (DeepSeek-V3); an error naming what llama.cpp's GGUF cannot express
// for the others.
Result<std::string> llamaCppArchitecture(const ModelConfig& config);

// Writes `model` (f32 host tensors) as a llama.cpp GGUF at `path`, in the architecture
// llamaCppArchitecture() names: token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v,
// attn_output, ffn_norm} and, per family,
//   dense layers:   blk.N.{ffn_gate, ffn_up, ffn_down}
//   qwen3*:         blk.N.{attn_q_norm, attn_k_norm} ([head_dim], before RoPE)
//   expert layers:  blk.N.ffn_gate_inp (the router, {hidden, experts}) and the 3-D
//                   blk.N.{ffn_gate_exps, ffn_up_exps} {hidden, expert_ffn, experts} and
//                   blk.N.ffn_down_exps {expert_ffn, hidden, experts}, expert e at ne[2] = e,
//                   with ARCH.expert_count / expert_used_count (and for qwen3moe
//                   expert_feed_forward_length; Mixtral's width is llama.feed_forward_length)
//   deepseek2:      blk.N.{attn_q_a, attn_q_a_norm, attn_q_b} (or attn_q without q_lora_rank),
//                   attn_kv_a_mqa, attn_kv_a_norm, and kv_b_proj split per head as llama.cpp's
//                   converter does: attn_k_b {qk_nope, kv_lora, heads} (each head's k rows
//                   transposed) and attn_v_b {kv_lora, v_head, heads}; the first
//                   leading_dense_block_count layers dense, the others experts with
//                   exp_probs_b.bias (e_score_correction_bias), the shared experts as
//                   ffn_{gate,up,down}_shexp, expert_gating_func sigmoid, expert_group_count /
//                   expert_group_used_count, expert_weights_scale and expert_weights_norm;
//                   key_length_mla / value_length_mla the per-head q.k and v widths; YaRN
//                   as rope.scaling.{type, factor, original_context_length,
//                   yarn_log_multiplier (0.1 x mscale_all_dim)}. The
//                   multi-token-prediction layers are not written (ours never run them).
// then output_norm and output (left out when the embeddings are tied: llama.cpp then reuses
// token_embd), the ARCH.* hyper-parameters and `tokenizer.ggml.model` "no_vocab" with
// ARCH.vocab_size (llama.cpp then runs on token ids alone; no tokenizer is written).
// `llama` models' attn_q / attn_k rows are permuted from Hugging Face's rotate-half RoPE
// layout to ggml's interleaved one (RoPE mode 0), as llama.cpp's convert_hf_to_gguf.py does;
// qwen3 / qwen3moe use ggml's NEOX RoPE, which is the rotate-half layout, and are copied as
// they are; DeepSeek-V3's rope dimensions are stored interleaved already (ggml's mode 0). llama.cpp's MoE graph for
// these architectures is softmax over all experts, top k, the k weights renormalised: the same function as CpuMoe
// (engine/cpu_moe.h). Refused (invalidArgument naming the feature): attention biases (Qwen2, attention_bias), Llama 3
// RoPE scaling, YaRN (DeepSeek-V3's rope_scaling: llama.cpp's deepseek2 folds its magnitude scale differently; not
// written until checked against it), a sliding window, DeepSeek-V3 with moe_layer_freq > 1, no shared expert, or one
// routed expert renormalised (ours keeps its sigmoid weight there, llama.cpp would make it 1), Qwen3-MoE dense layers
// (mlp_only_layers, decoder_sparse_step > 1: llama.cpp's qwen3moe has experts in every layer) and norm_topk_prob false
// (its qwen3moe always renormalises), and a model without host tensors.
Status writeLlamaGguf(const ModelWeights& model, const std::string& path);

}  // namespace pd::engine
