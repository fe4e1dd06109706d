#include "engine/model_weights.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "common/base/log.h"
#include "engine/checkpoint.h"
#include "pd/kernels/linear.h"
#include "pd/kernels/linear_bf16.h"
#include "pd/kernels/linear_q8.h"

namespace pd::engine {

WeightBuffer::WeightBuffer(size_t count) : count_(count) {
  if (count == 0) return;
  const size_t bytes = count * sizeof(float);
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded) != 0) throw std::bad_alloc();
  // Transparent huge pages cut TLB misses when decode streams every weight once per token.
  if (align == kHuge) ::madvise(p, rounded, MADV_HUGEPAGE);
  std::memset(p, 0, rounded);
  data_ = static_cast<float*>(p);
}
WeightBuffer::~WeightBuffer() { std::free(data_); }
WeightBuffer::WeightBuffer(WeightBuffer&& o) noexcept { *this = std::move(o); }
WeightBuffer& WeightBuffer::operator=(WeightBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = o.data_;
    count_ = o.count_;
    o.data_ = nullptr;
    o.count_ = 0;
  }
  return *this;
}

CompactWeight CompactWeight::convert(const float* w, int n, int k, const std::string& format) {
  namespace kc = pd::kernels::cpu;
  CompactWeight c;
  const size_t count = size_t(n) * k;
  if (count == 0) return c;
  if (format == "bf16") {
    c.bf16.resize(count);
    kc::f32ToBf16(w, c.bf16.data(), count);
  } else if (format == "q8_0") {
    c.q8.resize(count);
    c.scales.resize(size_t(n) * kc::q8BlocksPerRow(k));
    kc::q8Quantize(w, n, k, c.q8.data(), c.scales.data());
  }
  return c;
}

size_t ModelWeights::totalBytes() const {
  size_t compact = 0;
  for (const auto& l : layers)
    compact += l.qkvCompact.bytes() + l.oCompact.bytes() + l.gateUpCompact.bytes() + l.downCompact.bytes();
  return compact + f32Bytes();
}

size_t ModelWeights::f32Bytes() const {
  size_t n = embed.size() + finalNorm.size() + lmHead.size();
  for (const auto& l : layers)
    n += l.inputNorm.size() + l.qkv.size() + l.qkvBias.size() + l.qNorm.size() + l.kNorm.size() + l.o.size() +
         l.oBias.size() + l.postNorm.size() + l.gateUp.size() + l.down.size() + l.router.size() + l.qA.size() +
         l.qANorm.size() + l.qB.size() + l.kvA.size() + l.kvANorm.size() + l.kvB.size() + l.routerBias.size();
  for (const auto& l : layers)
    for (const auto& e : l.experts) n += e.gateUp.size() + e.down.size();
  return n * sizeof(float);
}

std::vector<float> ExpertWeights::gateUpRowMajor(int hidden) const {
  std::vector<float> out(gateUp.size());
  pd::kernels::cpu::rows8Deinterleave(gateUp.data(), int(gateUp.size() / size_t(hidden)), hidden, out.data());
  return out;
}

std::vector<float> ExpertWeights::downRowMajor(int hidden) const {
  std::vector<float> out(down.size());
  pd::kernels::cpu::rows8Deinterleave(down.data(), hidden, int(down.size() / size_t(hidden)), out.data());
  return out;
}

namespace {

// An expert's weight [n][k] rearranged into the rows8 GEMV layout (ExpertWeights).
void toRows8(WeightBuffer& w, int64_t n, int64_t k) {
  WeightBuffer out(w.size());
  pd::kernels::cpu::rows8Interleave(w.data(), int(n), int(k), out.data());
  w = std::move(out);
}

// DeepseekV3ForCausalLM: MLA attention; dense MLP in the first layers, then routed experts
// with e_score_correction_bias and shared experts. The multi-token-prediction layers after
// the last one (num_nextn_predict_layers) are not read.
Status loadDeepseekLayers(const Checkpoint& src, const ModelConfig& c, ModelWeights* m) {
  const int64_t h = c.hiddenSize, nh = c.numHeads, qr = c.mla.qLoraRank, r = c.mla.kvLoraRank;
  const int64_t qRows = nh * c.mla.qHeadDim(), kvbRows = nh * (c.mla.qkNopeHeadDim + c.mla.vHeadDim);
  auto read = [&](WeightBuffer& b, const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    b = WeightBuffer(size_t(n));
    return src.readF32(name, shape, b.data());
  };
  if (c.mtpLayers > 0) {
    PD_LOG(kInfo, "engine") << m->dir << ": " << c.mtpLayers
                            << " multi-token-prediction layer(s) (num_nextn_predict_layers) ignored: decoding "
                               "runs one token per step without them";
  }
  m->layers.resize(c.numLayers);
  for (int l = 0; l < c.numLayers; ++l) {
    LayerWeights& w = m->layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    PD_RETURN_IF_ERROR(read(w.inputNorm, p + "input_layernorm.weight", {h}));
    PD_RETURN_IF_ERROR(read(w.postNorm, p + "post_attention_layernorm.weight", {h}));
    if (qr > 0) {
      PD_RETURN_IF_ERROR(read(w.qA, p + "self_attn.q_a_proj.weight", {qr, h}));
      PD_RETURN_IF_ERROR(read(w.qANorm, p + "self_attn.q_a_layernorm.weight", {qr}));
      PD_RETURN_IF_ERROR(read(w.qB, p + "self_attn.q_b_proj.weight", {qRows, qr}));
    } else {
      PD_RETURN_IF_ERROR(read(w.qB, p + "self_attn.q_proj.weight", {qRows, h}));
    }
    PD_RETURN_IF_ERROR(read(w.kvA, p + "self_attn.kv_a_proj_with_mqa.weight", {c.mla.latentDim(), h}));
    PD_RETURN_IF_ERROR(read(w.kvANorm, p + "self_attn.kv_a_layernorm.weight", {r}));
    PD_RETURN_IF_ERROR(read(w.kvB, p + "self_attn.kv_b_proj.weight", {kvbRows, r}));
    PD_RETURN_IF_ERROR(read(w.o, p + "self_attn.o_proj.weight", {h, nh * c.mla.vHeadDim}));
    if (!c.isMoeLayer(l)) {
      const int64_t ffn = c.intermediateSize;
      w.gateUp = WeightBuffer(size_t(2 * ffn * h));
      PD_RETURN_IF_ERROR(src.readF32(p + "mlp.gate_proj.weight", {ffn, h}, w.gateUp.data()));
      PD_RETURN_IF_ERROR(src.readF32(p + "mlp.up_proj.weight", {ffn, h}, w.gateUp.data() + ffn * h));
      PD_RETURN_IF_ERROR(read(w.down, p + "mlp.down_proj.weight", {h, ffn}));
      continue;
    }
    const int64_t ne = c.moe.numExperts, ef = c.moe.expertFfn;
    PD_RETURN_IF_ERROR(read(w.router, p + "mlp.gate.weight", {ne, h}));
    PD_RETURN_IF_ERROR(read(w.routerBias, p + "mlp.gate.e_score_correction_bias", {ne}));
    w.experts.resize(ne);
    for (int64_t e = 0; e < ne; ++e) {
      ExpertWeights& x = w.experts[e];
      const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
      x.gateUp = WeightBuffer(size_t(2 * ef * h));
      PD_RETURN_IF_ERROR(src.readF32(ep + "gate_proj.weight", {ef, h}, x.gateUp.data()));
      PD_RETURN_IF_ERROR(src.readF32(ep + "up_proj.weight", {ef, h}, x.gateUp.data() + ef * h));
      PD_RETURN_IF_ERROR(read(x.down, ep + "down_proj.weight", {h, ef}));
      toRows8(x.gateUp, 2 * ef, h);
      toRows8(x.down, h, ef);
    }
    if (c.moe.numSharedExperts > 0) {
      const int64_t sf = c.moe.sharedFfn();
      w.gateUp = WeightBuffer(size_t(2 * sf * h));
      PD_RETURN_IF_ERROR(src.readF32(p + "mlp.shared_experts.gate_proj.weight", {sf, h}, w.gateUp.data()));
      PD_RETURN_IF_ERROR(src.readF32(p + "mlp.shared_experts.up_proj.weight", {sf, h}, w.gateUp.data() + sf * h));
      PD_RETURN_IF_ERROR(read(w.down, p + "mlp.shared_experts.down_proj.weight", {h, sf}));
    }
  }
  return Status::ok();
}

}  // namespace

Result<std::shared_ptr<const ModelWeights>> loadModelWeights(const std::string& dir, const ModelConfig& c) {
  // An FP8 checkpoint's F8_E4M3 weights are dequantized to f32 here (fp8_blocks.h); the
  // backend then holds them as engine.weight_format says, as for any f32 checkpoint.
  PD_ASSIGN_OR_RETURN(const Checkpoint src, Checkpoint::open(dir, c.quantization));

  auto m = std::make_shared<ModelWeights>();
  m->config = c;
  m->dir = dir;
  PD_ASSIGN_OR_RETURN(m->weightsFingerprint, src.weightsFingerprint());
  const int64_t h = c.hiddenSize, q = c.qDim(), kv = c.kvDim(), ffn = c.intermediateSize;
  const int64_t qkvRows = q + 2 * kv;

  m->embed = WeightBuffer(size_t(c.vocabSize) * h);
  PD_RETURN_IF_ERROR(src.readF32("model.embed_tokens.weight", {c.vocabSize, h}, m->embed.data()));
  m->finalNorm = WeightBuffer(h);
  PD_RETURN_IF_ERROR(src.readF32("model.norm.weight", {h}, m->finalNorm.data()));
  if (!c.tieWordEmbeddings) {
    m->lmHead = WeightBuffer(size_t(c.vocabSize) * h);
    PD_RETURN_IF_ERROR(src.readF32("lm_head.weight", {c.vocabSize, h}, m->lmHead.data()));
  }

  if (c.isMla()) {
    PD_RETURN_IF_ERROR(loadDeepseekLayers(src, c, m.get()));
    return std::shared_ptr<const ModelWeights>(std::move(m));
  }
  m->layers.resize(c.numLayers);
  for (int l = 0; l < c.numLayers; ++l) {
    LayerWeights& w = m->layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    w.inputNorm = WeightBuffer(h);
    PD_RETURN_IF_ERROR(src.readF32(p + "input_layernorm.weight", {h}, w.inputNorm.data()));
    w.postNorm = WeightBuffer(h);
    PD_RETURN_IF_ERROR(src.readF32(p + "post_attention_layernorm.weight", {h}, w.postNorm.data()));

    w.qkv = WeightBuffer(size_t(qkvRows * h));
    PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.q_proj.weight", {q, h}, w.qkv.data()));
    PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.k_proj.weight", {kv, h}, w.qkv.data() + q * h));
    PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.v_proj.weight", {kv, h}, w.qkv.data() + (q + kv) * h));
    if (c.qkvBias) {
      w.qkvBias = WeightBuffer(size_t(qkvRows));
      PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.q_proj.bias", {q}, w.qkvBias.data()));
      PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.k_proj.bias", {kv}, w.qkvBias.data() + q));
      PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.v_proj.bias", {kv}, w.qkvBias.data() + q + kv));
    }
    if (c.qkNorm) {
      w.qNorm = WeightBuffer(size_t(c.headDim));
      PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.q_norm.weight", {c.headDim}, w.qNorm.data()));
      w.kNorm = WeightBuffer(size_t(c.headDim));
      PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.k_norm.weight", {c.headDim}, w.kNorm.data()));
    }
    w.o = WeightBuffer(size_t(h * q));
    PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.o_proj.weight", {h, q}, w.o.data()));
    if (c.oBias) {
      w.oBias = WeightBuffer(size_t(h));
      PD_RETURN_IF_ERROR(src.readF32(p + "self_attn.o_proj.bias", {h}, w.oBias.data()));
    }
    if (c.isMoeLayer(l)) {
      // Mixtral: block_sparse_moe.{gate, experts.E.w1 (gate), w3 (up), w2 (down)};
      // Qwen3-MoE: mlp.{gate, experts.E.gate_proj, up_proj, down_proj}.
      const bool mixtral = c.architecture == Architecture::kMixtral;
      const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
      const int64_t ne = c.moe.numExperts, ef = c.moe.expertFfn;
      w.router = WeightBuffer(size_t(ne * h));
      PD_RETURN_IF_ERROR(src.readF32(moe + "gate.weight", {ne, h}, w.router.data()));
      w.experts.resize(ne);
      for (int64_t e = 0; e < ne; ++e) {
        ExpertWeights& x = w.experts[e];
        const std::string ep = moe + "experts." + std::to_string(e) + ".";
        x.gateUp = WeightBuffer(size_t(2 * ef * h));
        PD_RETURN_IF_ERROR(src.readF32(ep + (mixtral ? "w1.weight" : "gate_proj.weight"), {ef, h}, x.gateUp.data()));
        PD_RETURN_IF_ERROR(
            src.readF32(ep + (mixtral ? "w3.weight" : "up_proj.weight"), {ef, h}, x.gateUp.data() + ef * h));
        x.down = WeightBuffer(size_t(h * ef));
        PD_RETURN_IF_ERROR(src.readF32(ep + (mixtral ? "w2.weight" : "down_proj.weight"), {h, ef}, x.down.data()));
        toRows8(x.gateUp, 2 * ef, h);
        toRows8(x.down, h, ef);
      }
      continue;
    }
    w.gateUp = WeightBuffer(size_t(2 * ffn * h));
    PD_RETURN_IF_ERROR(src.readF32(p + "mlp.gate_proj.weight", {ffn, h}, w.gateUp.data()));
    PD_RETURN_IF_ERROR(src.readF32(p + "mlp.up_proj.weight", {ffn, h}, w.gateUp.data() + ffn * h));
    w.down = WeightBuffer(size_t(h * ffn));
    PD_RETURN_IF_ERROR(src.readF32(p + "mlp.down_proj.weight", {h, ffn}, w.down.data()));
  }
  return std::shared_ptr<const ModelWeights>(std::move(m));
}

Result<std::shared_ptr<const ModelWeights>> describeModel(const std::string& dir) {
  PD_ASSIGN_OR_RETURN(ModelConfig c, loadModelConfig(dir));
  auto m = std::make_shared<ModelWeights>();
  m->config = std::move(c);
  m->dir = dir;
  // Opening reads the headers only; the fingerprint reads a few KiB per tensor.
  PD_ASSIGN_OR_RETURN(const Checkpoint src, Checkpoint::open(dir));
  PD_ASSIGN_OR_RETURN(m->weightsFingerprint, src.weightsFingerprint());
  return std::shared_ptr<const ModelWeights>(std::move(m));
}

Result<std::shared_ptr<const ModelWeights>> loadModel(const std::string& dir) {
  PD_ASSIGN_OR_RETURN(ModelConfig c, loadModelConfig(dir));
  return loadModelWeights(dir, c);
}

Result<std::shared_ptr<const ModelWeights>> loadModel(const std::string& dir, const std::string& weightFormat) {
  if (weightFormat != "f32" && weightFormat != "bf16" && weightFormat != "q8_0")
    return invalidArgument("loadModel: unknown weightFormat \"" + weightFormat + "\" (f32|bf16|q8_0)");
  PD_ASSIGN_OR_RETURN(auto loaded, loadModel(dir));
  if (weightFormat == "f32") return loaded;
  if (loaded->config.isMla())  // its layers hold other projections than the four below
    return unimplemented("loadModel: weight_format " + weightFormat + " is not implemented for " +
                         architectureName(loaded->config.architecture) +
                         " (multi-head latent attention runs with f32 weights)");
  // The only reference: converted in place, each f32 buffer freed once its layer is converted.
  auto m = std::const_pointer_cast<ModelWeights>(std::move(loaded));
  const ModelConfig& c = m->config;
  const int h = c.hiddenSize, q = c.qDim(), ffn = c.intermediateSize, qkvRows = c.qDim() + 2 * c.kvDim();
  for (LayerWeights& w : m->layers) {
    auto convert = [&](WeightBuffer& f32, int n, int k, CompactWeight& out) {
      if (f32.empty()) return;  // a mixture-of-experts layer's dense MLP: none
      out = CompactWeight::convert(f32.data(), n, k, weightFormat);
      f32 = WeightBuffer();
    };
    convert(w.qkv, qkvRows, h, w.qkvCompact);
    convert(w.o, h, q, w.oCompact);
    convert(w.gateUp, 2 * ffn, h, w.gateUpCompact);
    convert(w.down, h, ffn, w.downCompact);
  }
  m->weightFormat = weightFormat;
  return std::shared_ptr<const ModelWeights>(std::move(m));
}

}  // namespace pd::engine
