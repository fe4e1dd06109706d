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

void GgufWriter::addBool(const std::string& key, bool value) {
  kvs_.push_back({key, kGgufTypeBool, std::string(1, value ? '\1' : '\0')});
}

void GgufWriter::addTensorF32(const std::string& name, std::vector<uint64_t> ne, const float* data) {
  addTensorF32Parts(name, std::move(ne), {data});
}

void GgufWriter::addTensorF32Parts(const std::string& name, std::vector<uint64_t> ne, std::vector<const float*> parts) {
  uint64_t count = 1;
  for (uint64_t d : ne) count *= d;
  tensors_.push_back({name, std::move(ne), std::move(parts), count});
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
    const uint64_t bytes = t.count * sizeof(float), partBytes = bytes / t.parts.size();
    for (const float* part : t.parts) out.write(reinterpret_cast<const char*>(part), std::streamsize(partBytes));
    out.write(zeros, std::streamsize(alignUp(bytes) - bytes));
  }
  out.close();
  if (!out) return dataLoss(path + ": write failed");
  return Status::ok();
}

namespace {

// DeepSeek-V3 as llama.cpp's `deepseek2` (gguf_writer.h lists the tensors and keys). The
// caller has checked the shared refusals (biases, rope_scaling, host tensors).
Status writeDeepseek2(const ModelWeights& m, const std::string& path) {
  const ModelConfig& c = m.config;
  const MlaConfig& a = c.mla;
  const MoeConfig& e = c.moe;
  if (!c.isMla() || !c.isMoe()) return invalidArgument("gguf: deepseek2 is written with MLA and experts only");
  if (e.layerFreq != 1) return invalidArgument("gguf: moe_layer_freq > 1 is not written (llama.cpp's deepseek2)");
  if (e.numSharedExperts < 1) return invalidArgument("gguf: n_shared_experts 0 is not written (llama.cpp's deepseek2)");
  if (!e.sigmoidScoring) return invalidArgument("gguf: deepseek2 is written with scoring_func sigmoid only");
  if (e.normTopkProb && e.expertsPerToken == 1)
    return invalidArgument(
        "gguf: norm_topk_prob with one routed expert is not written (llama.cpp renormalises it to 1)");
  const RopeConfig& y = c.rope;
  // llama.cpp's deepseek2 takes mscale to be mscale_all_dim (so cos and sin are unscaled) and
  // reads neither beta: only configs where that holds are the same model there.
  if (y.yarn && (y.mscaleAllDim <= 0 || y.mscale != y.mscaleAllDim))
    return invalidArgument(
        "gguf: yarn with mscale != mscale_all_dim (or no mscale_all_dim) is not written: llama.cpp's deepseek2 takes "
        "them equal");
  if (y.yarn && (y.betaFast != 32.0 || y.betaSlow != 1.0))
    return invalidArgument("gguf: yarn beta_fast / beta_slow other than 32 / 1 are not written (llama.cpp's defaults)");
  if (e.numGroups > 1 && e.topkGroups >= e.numGroups)
    return invalidArgument("gguf: topk_group must be below n_group (llama.cpp's deepseek2)");

  const uint64_t h = c.hiddenSize, nh = c.numHeads, ne = e.numExperts, ef = e.expertFfn, sf = e.sharedFfn();
  const uint64_t ffn = c.intermediateSize, qr = a.qLoraRank, r = a.kvLoraRank, nope = a.qkNopeHeadDim;
  const uint64_t rope = a.qkRopeHeadDim, vd = a.vHeadDim, qh = a.qHeadDim();
  GgufWriter w;
  w.addString("general.architecture", "deepseek2");
  w.addString("general.name", "pdserve " + m.dir);
  w.addU32("general.file_type", 0);  // LLAMA_FTYPE_ALL_F32
  w.addU32("deepseek2.vocab_size", uint32_t(c.vocabSize));
  w.addU32("deepseek2.context_length", uint32_t(c.maxPositionEmbeddings));
  w.addU32("deepseek2.embedding_length", uint32_t(h));
  w.addU32("deepseek2.block_count", uint32_t(c.numLayers));
  w.addU32("deepseek2.feed_forward_length", uint32_t(ffn));
  w.addU32("deepseek2.leading_dense_block_count", uint32_t(e.firstDenseLayers));
  w.addU32("deepseek2.attention.head_count", uint32_t(nh));
  // MLA as llama.cpp's converter writes it: one KV "head" of the latent (MQA), the per-head
  // q.k and v widths in the _mla keys.
  w.addU32("deepseek2.attention.head_count_kv", 1);
  w.addU32("deepseek2.attention.key_length", uint32_t(r + rope));
  w.addU32("deepseek2.attention.value_length", uint32_t(r));
  w.addU32("deepseek2.attention.key_length_mla", uint32_t(qh));
  w.addU32("deepseek2.attention.value_length_mla", uint32_t(vd));
  w.addU32("deepseek2.attention.q_lora_rank", uint32_t(qr));
  w.addU32("deepseek2.attention.kv_lora_rank", uint32_t(r));
  w.addU32("deepseek2.rope.dimension_count", uint32_t(rope));
  w.addF32("deepseek2.rope.freq_base", float(c.rope.theta));
  w.addF32("deepseek2.attention.layer_norm_rms_epsilon", c.rmsNormEps);
  if (y.yarn) {
    w.addString("deepseek2.rope.scaling.type", "yarn");
    w.addF32("deepseek2.rope.scaling.factor", float(y.factor));
    w.addU32("deepseek2.rope.scaling.original_context_length", uint32_t(y.originalMaxPositionEmbeddings));
    // 0.1 x mscale_all_dim, as llama.cpp's converter writes it (its loader divides by 0.1).
    w.addF32("deepseek2.rope.scaling.yarn_log_multiplier", float(0.1 * y.mscaleAllDim));
  }
  w.addU32("deepseek2.expert_feed_forward_length", uint32_t(ef));
  w.addU32("deepseek2.expert_count", uint32_t(ne));
  w.addU32("deepseek2.expert_used_count", uint32_t(e.expertsPerToken));
  w.addU32("deepseek2.expert_shared_count", uint32_t(e.numSharedExperts));
  w.addF32("deepseek2.expert_weights_scale", float(e.routedScalingFactor));
  w.addBool("deepseek2.expert_weights_norm", e.normTopkProb);
  w.addU32("deepseek2.expert_gating_func", 2);  // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
  if (e.numGroups > 1) {
    w.addU32("deepseek2.expert_group_count", uint32_t(e.numGroups));
    w.addU32("deepseek2.expert_group_used_count", uint32_t(e.topkGroups));
  }
  w.addString("tokenizer.ggml.model", "no_vocab");

  w.addTensorF32("token_embd.weight", {h, uint64_t(c.vocabSize)}, m.embed.data());
  std::vector<std::vector<float>> kB;        // transposed copies; alive until write()
  std::vector<std::vector<float>> rowMajor;  // the experts' row-major copies; alive until write()
  kB.reserve(c.numLayers);
  for (int l = 0; l < c.numLayers; ++l) {
    const LayerWeights& L = m.layers[size_t(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    w.addTensorF32(p + "attn_norm.weight", {h}, L.inputNorm.data());
    if (qr > 0) {
      w.addTensorF32(p + "attn_q_a_norm.weight", {qr}, L.qANorm.data());
      w.addTensorF32(p + "attn_q_a.weight", {h, qr}, L.qA.data());
      w.addTensorF32(p + "attn_q_b.weight", {qr, nh * qh}, L.qB.data());
    } else {
      w.addTensorF32(p + "attn_q.weight", {h, nh * qh}, L.qB.data());
    }
    w.addTensorF32(p + "attn_kv_a_norm.weight", {r}, L.kvANorm.data());
    w.addTensorF32(p + "attn_kv_a_mqa.weight", {h, r + rope}, L.kvA.data());
    // kv_b_proj [heads][nope + v][r]: k_b[head][c][i] = kv_b[head][i][c] (transposed), v_b the
    // v rows as they are, one part per head.
    const float* kvb = L.kvB.data();
    std::vector<float>& kb = kB.emplace_back(nh * nope * r);
    std::vector<const float*> vb;
    for (uint64_t hd = 0; hd < nh; ++hd) {
      const float* head = kvb + hd * (nope + vd) * r;
      for (uint64_t i = 0; i < nope; ++i)
        for (uint64_t col = 0; col < r; ++col) kb[(hd * r + col) * nope + i] = head[i * r + col];
      vb.push_back(head + nope * r);
    }
    w.addTensorF32(p + "attn_k_b.weight", {nope, r, nh}, kb.data());
    w.addTensorF32Parts(p + "attn_v_b.weight", {r, vd, nh}, std::move(vb));
    w.addTensorF32(p + "attn_output.weight", {nh * vd, h}, L.o.data());
    w.addTensorF32(p + "ffn_norm.weight", {h}, L.postNorm.data());
    if (!c.isMoeLayer(l)) {
      if (l >= e.firstDenseLayers) return invalidArgument("gguf: a dense layer after the leading ones is not written");
      w.addTensorF32(p + "ffn_gate.weight", {h, ffn}, L.gateUp.data());
      w.addTensorF32(p + "ffn_up.weight", {h, ffn}, L.gateUp.data() + ffn * h);
      w.addTensorF32(p + "ffn_down.weight", {ffn, h}, L.down.data());
      continue;
    }
    std::vector<const float*> gate, up, down;
    for (const ExpertWeights& x : L.experts) {  // rows8 in memory: row-major copies
      const float* gu = rowMajor.emplace_back(x.gateUpRowMajor(int(h))).data();
      gate.push_back(gu);
      up.push_back(gu + ef * h);
      down.push_back(rowMajor.emplace_back(x.downRowMajor(int(h))).data());
    }
    w.addTensorF32(p + "ffn_gate_inp.weight", {h, ne}, L.router.data());
    if (!L.routerBias.empty()) w.addTensorF32(p + "exp_probs_b.bias", {ne}, L.routerBias.data());
    w.addTensorF32Parts(p + "ffn_gate_exps.weight", {h, ef, ne}, std::move(gate));
    w.addTensorF32Parts(p + "ffn_up_exps.weight", {h, ef, ne}, std::move(up));
    w.addTensorF32Parts(p + "ffn_down_exps.weight", {ef, h, ne}, std::move(down));
    w.addTensorF32(p + "ffn_gate_shexp.weight", {h, sf}, L.gateUp.data());
    w.addTensorF32(p + "ffn_up_shexp.weight", {h, sf}, L.gateUp.data() + sf * h);
    w.addTensorF32(p + "ffn_down_shexp.weight", {sf, h}, L.down.data());
  }
  w.addTensorF32("output_norm.weight", {h}, m.finalNorm.data());
  if (!m.lmHead.empty()) w.addTensorF32("output.weight", {h, uint64_t(c.vocabSize)}, m.lmHead.data());
  return w.write(path);
}

}  // namespace

Result<std::string> llamaCppArchitecture(const ModelConfig& c) {
  switch (c.architecture) {
    case Architecture::kLlama:
    case Architecture::kMistral:
    case Architecture::kMixtral:
      return std::string("llama");
    case Architecture::kQwen3:
      return std::string("qwen3");
    case Architecture::kQwen3Moe:
      return std::string("qwen3moe");
    case Architecture::kQwen2:
      return invalidArgument("gguf: Qwen2ForCausalLM (q/k/v bias) is not written");
    case Architecture::kDeepseekV3:
      return std::string("deepseek2");
  }
  return invalidArgument("gguf: unknown architecture");
}

Status writeLlamaGguf(const ModelWeights& m, const std::string& path) {
  const ModelConfig& c = m.config;
  if (!m.hasHostTensors()) return invalidArgument("gguf: the model has no host tensors");
  if (m.weightFormat != "f32")
    return invalidArgument("gguf: weights loaded as " + m.weightFormat + " are not written (load them as f32)");
  PD_ASSIGN_OR_RETURN(const std::string arch, llamaCppArchitecture(c));
  if (c.qkvBias || c.oBias) return invalidArgument("gguf: attention biases are not written (qkv/o bias)");
  if (c.rope.llama3) return invalidArgument("gguf: llama3 rope_scaling is not written");
  if (c.slidingWindow > 0) return invalidArgument("gguf: sliding_window is not written");
  if (arch == "deepseek2") return writeDeepseek2(m, path);
  if (c.rope.yarn) return invalidArgument("gguf: yarn rope_scaling is written for deepseek2 only");
  if (c.headDim % 2 != 0) return invalidArgument("gguf: head_dim must be even");
  const bool qwen3 = arch != "llama", moe = c.isMoe();
  if (c.qkNorm != qwen3) return invalidArgument("gguf: per-head q/k RMSNorm is written for qwen3 / qwen3moe only");
  if (moe) {
    for (int l = 0; l < c.numLayers; ++l)
      if (!c.isMoeLayer(l))
        return invalidArgument("gguf: layer " + std::to_string(l) +
                               " is dense in a mixture-of-experts model (mlp_only_layers / decoder_sparse_step): "
                               "llama.cpp's " +
                               arch + " has experts in every layer");
    if (!c.moe.normTopkProb)
      return invalidArgument("gguf: norm_topk_prob false is not written: llama.cpp's " + arch +
                             " always renormalises the top-k weights");
    if (c.moe.sigmoidScoring || c.moe.numSharedExperts > 0 || c.moe.numGroups > 1 || c.moe.routedScalingFactor != 1.0)
      return invalidArgument("gguf: sigmoid / grouped / shared / scaled experts are not written");
  }

  const uint64_t h = c.hiddenSize, q = c.qDim(), kv = c.kvDim(), ffn = c.intermediateSize;
  const uint64_t ne = uint64_t(c.moe.numExperts), ef = uint64_t(c.moe.expertFfn);
  const std::string a = arch + ".";
  GgufWriter w;
  std::vector<std::vector<float>> rowMajor;  // the experts' row-major copies; alive until write()
  w.addString("general.architecture", arch);
  w.addString("general.name", "pdserve " + m.dir);
  w.addU32("general.file_type", 0);  // LLAMA_FTYPE_ALL_F32
  w.addU32(a + "vocab_size", uint32_t(c.vocabSize));
  w.addU32(a + "context_length", uint32_t(c.maxPositionEmbeddings));
  w.addU32(a + "embedding_length", uint32_t(h));
  w.addU32(a + "block_count", uint32_t(c.numLayers));
  // Mixtral's experts are llama's feed_forward_length wide; qwen3moe has its own key.
  w.addU32(a + "feed_forward_length", uint32_t(moe && arch == "llama" ? ef : ffn));
  w.addU32(a + "attention.head_count", uint32_t(c.numHeads));
  w.addU32(a + "attention.head_count_kv", uint32_t(c.numKvHeads));
  w.addU32(a + "attention.key_length", uint32_t(c.headDim));
  w.addU32(a + "attention.value_length", uint32_t(c.headDim));
  w.addU32(a + "rope.dimension_count", uint32_t(c.headDim));
  w.addF32(a + "rope.freq_base", float(c.rope.theta));
  w.addF32(a + "attention.layer_norm_rms_epsilon", c.rmsNormEps);
  if (moe) {
    w.addU32(a + "expert_count", uint32_t(ne));
    w.addU32(a + "expert_used_count", uint32_t(c.moe.expertsPerToken));
    if (arch == "qwen3moe") w.addU32(a + "expert_feed_forward_length", uint32_t(ef));
  }
  w.addString("tokenizer.ggml.model", "no_vocab");

  w.addTensorF32("token_embd.weight", {h, uint64_t(c.vocabSize)}, m.embed.data());
  std::vector<std::vector<float>> permuted;  // q/k copies; alive until write()
  permuted.reserve(2 * c.numLayers);
  for (int l = 0; l < c.numLayers; ++l) {
    const LayerWeights& L = m.layers[size_t(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    const float* qkv = L.qkv.data();
    const float *wq = qkv, *wk = qkv + q * h;
    if (!qwen3) {  // ggml's RoPE mode 0 rotates adjacent pairs
      permuted.push_back(permuteForGgmlRope(qkv, c.numHeads, c.headDim, int(h)));
      permuted.push_back(permuteForGgmlRope(qkv + q * h, c.numKvHeads, c.headDim, int(h)));
      wq = permuted[permuted.size() - 2].data();
      wk = permuted.back().data();
    }
    w.addTensorF32(p + "attn_norm.weight", {h}, L.inputNorm.data());
    w.addTensorF32(p + "attn_q.weight", {h, q}, wq);
    w.addTensorF32(p + "attn_k.weight", {h, kv}, wk);
    w.addTensorF32(p + "attn_v.weight", {h, kv}, qkv + (q + kv) * h);
    if (qwen3) {
      w.addTensorF32(p + "attn_q_norm.weight", {uint64_t(c.headDim)}, L.qNorm.data());
      w.addTensorF32(p + "attn_k_norm.weight", {uint64_t(c.headDim)}, L.kNorm.data());
    }
    w.addTensorF32(p + "attn_output.weight", {q, h}, L.o.data());
    w.addTensorF32(p + "ffn_norm.weight", {h}, L.postNorm.data());
    if (moe) {
      // Each expert's gate|up is [2*ef][hidden], gate rows first; down [hidden][ef].
      std::vector<const float*> gate, up, down;
      for (const ExpertWeights& e : L.experts) {  // rows8 in memory: row-major copies
        const float* gu = rowMajor.emplace_back(e.gateUpRowMajor(int(h))).data();
        gate.push_back(gu);
        up.push_back(gu + ef * h);
        down.push_back(rowMajor.emplace_back(e.downRowMajor(int(h))).data());
      }
      w.addTensorF32(p + "ffn_gate_inp.weight", {h, ne}, L.router.data());
      w.addTensorF32Parts(p + "ffn_gate_exps.weight", {h, ef, ne}, std::move(gate));
      w.addTensorF32Parts(p + "ffn_up_exps.weight", {h, ef, ne}, std::move(up));
      w.addTensorF32Parts(p + "ffn_down_exps.weight", {ef, h, ne}, std::move(down));
    } else {
      w.addTensorF32(p + "ffn_gate.weight", {h, ffn}, L.gateUp.data());
      w.addTensorF32(p + "ffn_up.weight", {h, ffn}, L.gateUp.data() + ffn * h);
      w.addTensorF32(p + "ffn_down.weight", {ffn, h}, L.down.data());
    }
  }
  w.addTensorF32("output_norm.weight", {h}, m.finalNorm.data());
  if (!m.lmHead.empty()) w.addTensorF32("output.weight", {h, uint64_t(c.vocabSize)}, m.lmHead.data());
  return w.write(path);
}

}  // namespace pd::engine
