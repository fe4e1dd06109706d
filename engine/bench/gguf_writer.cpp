#include "engine/bench/gguf_writer.h"

#include <cstring>
#include <fstream>

namespace pd::engine {
namespace {

void putU32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void putU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void putString(std::string& out, const std::string& s) {
  putU64(out, s.size());
  out += s;
}
uint64_t alignUp(uint64_t n) { return (n + kGgufAlignment - 1) / kGgufAlignment * kGgufAlignment; }

// Hugging Face stores each head's q/k rows as [two halves][headDim/2] (rotate_half RoPE);
// ggml's RoPE (mode 0, the `llama` architecture) rotates adjacent pairs, so the converter
// interleaves the halves: new row h*hd + 2i + half = old row h*hd + half*hd/2 + i.
std::vector<float> permuteForGgmlRope(const float* w, int heads, int headDim, int cols) {
  std::vector<float> out(size_t(heads) * headDim * cols);
  const int half = headDim / 2;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < half; ++i)
      for (int part = 0; part < 2; ++part)
        std::memcpy(out.data() + (size_t(h) * headDim + 2 * i + part) * cols,
                    w + (size_t(h) * headDim + part * half + i) * cols, sizeof(float) * cols);
  return out;
}

}  // namespace

void GgufWriter::addString(const std::string& key, const std::string& value) {
  std::string v;
  putString(v, value);
  kvs_.push_back({key, kGgufTypeString, std::move(v)});
}

void GgufWriter::addU32(const std::string& key, uint32_t value) {
  std::string v;
  putU32(v, value);
  kvs_.push_back({key, kGgufTypeU32, std::move(v)});
}

void GgufWriter::addF32(const std::string& key, float value) {
  std::string v(reinterpret_cast<const char*>(&value), 4);
  kvs_.push_back({key, kGgufTypeF32, std::move(v)});
}

void GgufWriter::addTensorF32(const std::string& name, std::vector<uint64_t> ne, const float* data) {
  uint64_t count = 1;
  for (uint64_t d : ne) count *= d;
  tensors_.push_back({name, std::move(ne), data, count});
}

Status GgufWriter::write(const std::string& path) const {
  std::string head;
  head += "GGUF";
  putU32(head, kGgufVersion);
  putU64(head, tensors_.size());
  putU64(head, kvs_.size());
  for (const Kv& kv : kvs_) {
    putString(head, kv.key);
    putU32(head, kv.type);
    head += kv.value;
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    putString(head, t.name);
    putU32(head, uint32_t(t.ne.size()));
    for (uint64_t d : t.ne) putU64(head, d);
    putU32(head, kGgmlTypeF32);
    putU64(head, offset);
    offset = alignUp(offset + t.count * sizeof(float));
  }
  head.resize(alignUp(head.size()), '\0');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return notFound(path + ": cannot create");
  out.write(head.data(), std::streamsize(head.size()));
  const char zeros[kGgufAlignment] = {};
  for (const Tensor& t : tensors_) {
    const uint64_t bytes = t.count * sizeof(float);
    out.write(reinterpret_cast<const char*>(t.data), std::streamsize(bytes));
    out.write(zeros, std::streamsize(alignUp(bytes) - bytes));
  }
  out.close();
  if (!out) return dataLoss(path + ": write failed");
  return Status::ok();
}

Status writeLlamaGguf(const ModelWeights& m, const std::string& path) {
  const ModelConfig& c = m.config;
  if (!m.hasHostTensors()) return invalidArgument("gguf: the model has no host tensors");
  if (c.qkvBias || c.oBias) return invalidArgument("gguf: attention biases are not written (qkv/o bias)");
  if (c.qkNorm) return invalidArgument("gguf: per-head q/k RMSNorm (Qwen3) is not written");
  if (c.isMla() || c.isMoe())
    return invalidArgument(std::string("gguf: ") + architectureName(c.architecture) + " (" +
                           (c.isMla() ? "multi-head latent attention" : "mixture of experts") + ") is not written");
  if (c.rope.llama3) return invalidArgument("gguf: llama3 rope_scaling is not written");
  if (c.slidingWindow > 0) return invalidArgument("gguf: sliding_window is not written");
  if (c.headDim % 2 != 0) return invalidArgument("gguf: head_dim must be even");

  const uint64_t h = c.hiddenSize, q = c.qDim(), kv = c.kvDim(), ffn = c.intermediateSize;
  GgufWriter w;
  w.addString("general.architecture", "llama");
  w.addString("general.name", "pdserve " + m.dir);
  w.addU32("general.file_type", 0);  // LLAMA_FTYPE_ALL_F32
  w.addU32("llama.vocab_size", uint32_t(c.vocabSize));
  w.addU32("llama.context_length", uint32_t(c.maxPositionEmbeddings));
  w.addU32("llama.embedding_length", uint32_t(h));
  w.addU32("llama.block_count", uint32_t(c.numLayers));
  w.addU32("llama.feed_forward_length", uint32_t(ffn));
  w.addU32("llama.attention.head_count", uint32_t(c.numHeads));
  w.addU32("llama.attention.head_count_kv", uint32_t(c.numKvHeads));
  w.addU32("llama.attention.key_length", uint32_t(c.headDim));
  w.addU32("llama.attention.value_length", uint32_t(c.headDim));
  w.addU32("llama.rope.dimension_count", uint32_t(c.headDim));
  w.addF32("llama.rope.freq_base", float(c.rope.theta));
  w.addF32("llama.attention.layer_norm_rms_epsilon", c.rmsNormEps);
  w.addString("tokenizer.ggml.model", "no_vocab");

  w.addTensorF32("token_embd.weight", {h, uint64_t(c.vocabSize)}, m.embed.data());
  std::vector<std::vector<float>> permuted;  // q/k copies; alive until write()
  permuted.reserve(2 * c.numLayers);
  for (int l = 0; l < c.numLayers; ++l) {
    const LayerWeights& L = m.layers[size_t(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    const float* qkv = L.qkv.data();
    permuted.push_back(permuteForGgmlRope(qkv, c.numHeads, c.headDim, int(h)));
    permuted.push_back(permuteForGgmlRope(qkv + q * h, c.numKvHeads, c.headDim, int(h)));
    w.addTensorF32(p + "attn_norm.weight", {h}, L.inputNorm.data());
    w.addTensorF32(p + "attn_q.weight", {h, q}, permuted[permuted.size() - 2].data());
    w.addTensorF32(p + "attn_k.weight", {h, kv}, permuted.back().data());
    w.addTensorF32(p + "attn_v.weight", {h, kv}, qkv + (q + kv) * h);
    w.addTensorF32(p + "attn_output.weight", {q, h}, L.o.data());
    w.addTensorF32(p + "ffn_norm.weight", {h}, L.postNorm.data());
    w.addTensorF32(p + "ffn_gate.weight", {h, ffn}, L.gateUp.data());
    w.addTensorF32(p + "ffn_up.weight", {h, ffn}, L.gateUp.data() + ffn * h);
    w.addTensorF32(p + "ffn_down.weight", {ffn, h}, L.down.data());
  }
  w.addTensorF32("output_norm.weight", {h}, m.finalNorm.data());
  if (!m.lmHead.empty()) w.addTensorF32("output.weight", {h, uint64_t(c.vocabSize)}, m.lmHead.data());
  return w.write(path);
}

}  // namespace pd::engine
