#include "engine/model_maker.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/fp8_blocks.h"
#include "engine/safetensors.h"

namespace pd::engine {
namespace {

using nlohmann::ordered_json;

struct Shape {
  int hidden, layers, heads, kvHeads, ffn, vocab, maxPos;
};

// Deterministic normal samples (Box-Muller over a 64-bit Mersenne twister) so a seed gives
// the same model on every platform and standard library.
class Normal {
 public:
  explicit Normal(uint64_t seed) : rng_(seed) {}
  float next() {
    if (hasSpare_) {
      hasSpare_ = false;
      return spare_;
    }
    double u1, u2;
    do {
      u1 = double(rng_() >> 11) * (1.0 / 9007199254740992.0);
    } while (u1 <= 0.0);
    u2 = double(rng_() >> 11) * (1.0 / 9007199254740992.0);
    const double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * 3.14159265358979323846 * u2;
    spare_ = float(r * std::sin(a));
    hasSpare_ = true;
    return float(r * std::cos(a));
  }

 private:
  std::mt19937_64 rng_;
  bool hasSpare_ = false;
  float spare_ = 0;
};

TensorToWrite makeTensor(const std::string& name, std::vector<int64_t> shape, Normal& rng, float mean, float stddev,
                         bool bf16) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  TensorToWrite t;
  t.name = name;
  t.shape = std::move(shape);
  t.dtype = bf16 ? TensorDtype::kBF16 : TensorDtype::kF32;
  t.bytes.resize(size_t(n) * (bf16 ? 2 : 4));
  for (int64_t i = 0; i < n; ++i) {
    const float v = mean + stddev * rng.next();
    if (bf16) {
      const uint16_t b = f32ToBf16(v);
      std::memcpy(t.bytes.data() + i * 2, &b, 2);
    } else {
      std::memcpy(t.bytes.data() + i * 4, &v, 4);
    }
  }
  return t;
}

// GPT-2's reversible byte -> printable unicode code point mapping.
std::vector<int> bytesToUnicode() {
  std::vector<int> cp(256, -1);
  auto keep = [&](int lo, int hi) {
    for (int b = lo; b <= hi; ++b) cp[b] = b;
  };
  keep('!', '~');
  keep(0xA1, 0xAC);
  keep(0xAE, 0xFF);
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (cp[b] < 0) cp[b] = 256 + n++;
  return cp;
}

std::string utf8(int cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

const char* kSpecial[3] = {"<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"};

ordered_json tokenizerJson() {
  ordered_json added = ordered_json::array();
  for (int i = 0; i < 3; ++i)
    added.push_back({{"id", 256 + i},
                     {"content", kSpecial[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  ordered_json vocab = ordered_json::object();
  const auto cp = bytesToUnicode();
  for (int b = 0; b < 256; ++b) vocab[utf8(cp[b])] = b;
  ordered_json byteLevel = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  ordered_json bos = {{"SpecialToken", {{"id", kSpecial[0]}, {"type_id", 0}}}};
  ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = added;
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = byteLevel;
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {bos, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair",
       {bos, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, bos, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
      {"special_tokens", {{kSpecial[0], {{"id", kSpecial[0]}, {"ids", {256}}, {"tokens", {kSpecial[0]}}}}}}};
  j["decoder"] = byteLevel;
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", ordered_json::array()}};
  return j;
}

// Whether make-model writes tensor `name` as FP8 (a linear projection's weight).
bool fp8Quantized(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends("_proj.weight") || ends("_proj_with_mqa.weight") || ends(".w1.weight") || ends(".w2.weight") ||
         ends(".w3.weight");
}

// Replaces each linear projection of `tensors` by its F8_E4M3 codes followed by its F32
// block scales (name + "_scale_inv"), quantized from the stored values.
void quantizeFp8(std::vector<TensorToWrite>& tensors, const WeightQuantization& q) {
  std::vector<TensorToWrite> out;
  out.reserve(tensors.size() * 2);
  for (auto& t : tensors) {
    if (!fp8Quantized(t.name) || t.shape.size() != 2) {
      out.push_back(std::move(t));
      continue;
    }
    const int64_t rows = t.shape[0], cols = t.shape[1];
    std::vector<float> w(size_t(rows * cols));
    for (size_t i = 0; i < w.size(); ++i) {
      if (t.dtype == TensorDtype::kBF16) {
        uint16_t b;
        std::memcpy(&b, t.bytes.data() + i * 2, 2);
        w[i] = bf16ToF32(b);
      } else {
        std::memcpy(&w[i], t.bytes.data() + i * 4, 4);
      }
    }
    const std::vector<int64_t> scaleShape = fp8ScaleShape(rows, cols, q);
    TensorToWrite codes{t.name, TensorDtype::kF8E4M3, t.shape, std::vector<uint8_t>(w.size())};
    std::vector<float> scales(size_t(scaleShape[0] * scaleShape[1]));
    fp8QuantizeBlocks(w.data(), rows, cols, q, codes.bytes.data(), scales.data());
    TensorToWrite sc{t.name + "_scale_inv", TensorDtype::kF32, scaleShape, std::vector<uint8_t>(scales.size() * 4)};
    std::memcpy(sc.bytes.data(), scales.data(), sc.bytes.size());
    out.push_back(std::move(codes));
    out.push_back(std::move(sc));
  }
  tensors = std::move(out);
}

Status writeText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return notFound(path + ": cannot create");
  out << text << "\n";
  out.close();
  if (!out) return dataLoss(path + ": write failed");
  return Status::ok();
}

// The blocks `--quantization fp8` writes (DeepSeek-V3's and Qwen3-FP8's 128 x 128).
const WeightQuantization kMadeFp8Blocks{true, 128, 128};

// `config.json`'s quantization_config for `o.quantization` (none: nothing added).
void addQuantizationConfig(const MakeModelOptions& o, ordered_json& cfg) {
  if (o.quantization == "fp8")
    cfg["quantization_config"] = {{"activation_scheme", "dynamic"},
                                  {"fmt", "e4m3"},
                                  {"quant_method", "fp8"},
                                  {"weight_block_size", {kMadeFp8Blocks.blockRows, kMadeFp8Blocks.blockCols}}};
}

// Writes `tensors` (FP8-quantized first when `o.quantization` says so) as one safetensors
// file or `o.shards` shards with the index.
Status writeWeights(const MakeModelOptions& o, std::vector<TensorToWrite> tensors, const std::string& dir);
Status writeTokenizerFiles(const std::string& dir, int maxPos);

// DeepseekV3ForCausalLM (MakeModelOptions::arch "deepseek_v3"): MLA shapes scaled from
// DeepSeek-V3's (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, q_lora_rank 1536 at
// hidden 7168) down to the preset's width.
Status makeDeepseek(const MakeModelOptions& o, const Shape& s, const std::string& dir) {
  const bool tiny = o.preset == "tiny";
  const int qLora = o.mlaNoQLora ? 0 : (tiny ? 32 : 192);
  const int kvLora = tiny ? 32 : 128, rope = tiny ? 8 : 32, nope = tiny ? 16 : 64, vDim = tiny ? 16 : 64;
  const int numExperts = tiny ? 16 : 32, topK = 4, expertFfn = s.ffn / 4, shared = 1;
  const int groups = o.moeGroups > 0 ? o.moeGroups : 4, topkGroups = std::max(1, groups / 2);
  const int firstDense = o.firstDenseLayers >= 0 ? o.firstDenseLayers : 1;
  const bool yarn = o.mlaYarn >= 0 ? o.mlaYarn >= 1 : !tiny;
  const double mscaleAllDim = tiny && o.mlaYarn != 2 ? 0.8 : 1.0;
  if (numExperts % groups != 0 || numExperts / groups < 2)
    return invalidArgument("make-model: n_group " + std::to_string(groups) + " must divide the " +
                           std::to_string(numExperts) + " experts into groups of at least 2");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return notFound(dir + ": cannot create directory: " + ec.message());
  const bool bf16 = o.dtype == "bf16";
  const int64_t h = s.hidden, H = s.heads, qh = nope + rope;
  const float inH = 1.0f / std::sqrt(float(h));
  Normal rng(o.seed);
  std::vector<TensorToWrite> t;
  t.push_back(makeTensor("model.embed_tokens.weight", {s.vocab, h}, rng, 0, 1.0f, bf16));
  auto mlp = [&](const std::string& p, int ffn) {
    t.push_back(makeTensor(p + "gate_proj.weight", {ffn, h}, rng, 0, inH, bf16));
    t.push_back(makeTensor(p + "up_proj.weight", {ffn, h}, rng, 0, inH, bf16));
    t.push_back(makeTensor(p + "down_proj.weight", {h, ffn}, rng, 0, 1.0f / std::sqrt(float(ffn)), bf16));
  };
  // The last layer index is the multi-token-prediction layer: written as the published
  // checkpoints carry it (a subset of its tensors), never read.
  for (int l = 0; l <= s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (l == s.layers) {
      t.push_back(makeTensor(p + "enorm.weight", {h}, rng, 1.0f, 0.2f, bf16));
      t.push_back(makeTensor(p + "hnorm.weight", {h}, rng, 1.0f, 0.2f, bf16));
      t.push_back(makeTensor(p + "eh_proj.weight", {h, 2 * h}, rng, 0, inH, bf16));
      break;
    }
    t.push_back(makeTensor(p + "input_layernorm.weight", {h}, rng, 1.0f, 0.2f, bf16));
    if (qLora > 0) {
      t.push_back(makeTensor(p + "self_attn.q_a_proj.weight", {qLora, h}, rng, 0, inH, bf16));
      t.push_back(makeTensor(p + "self_attn.q_a_layernorm.weight", {qLora}, rng, 1.0f, 0.2f, bf16));
      t.push_back(
          makeTensor(p + "self_attn.q_b_proj.weight", {H * qh, qLora}, rng, 0, 1.0f / std::sqrt(float(qLora)), bf16));
    } else {
      t.push_back(makeTensor(p + "self_attn.q_proj.weight", {H * qh, h}, rng, 0, inH, bf16));
    }
    t.push_back(makeTensor(p + "self_attn.kv_a_proj_with_mqa.weight", {kvLora + rope, h}, rng, 0, inH, bf16));
    t.push_back(makeTensor(p + "self_attn.kv_a_layernorm.weight", {kvLora}, rng, 1.0f, 0.2f, bf16));
    t.push_back(makeTensor(p + "self_attn.kv_b_proj.weight", {H * (nope + vDim), kvLora}, rng, 0,
                           1.0f / std::sqrt(float(kvLora)), bf16));
    t.push_back(
        makeTensor(p + "self_attn.o_proj.weight", {h, H * vDim}, rng, 0, 1.0f / std::sqrt(float(H * vDim)), bf16));
    t.push_back(makeTensor(p + "post_attention_layernorm.weight", {h}, rng, 1.0f, 0.2f, bf16));
    if (l < firstDense) {
      mlp(p + "mlp.", s.ffn);
      continue;
    }
    // Router logits ~N(0, 1); the correction bias large enough to change some choices.
    t.push_back(makeTensor(p + "mlp.gate.weight", {numExperts, h}, rng, 0, inH, bf16));
    t.push_back(makeTensor(p + "mlp.gate.e_score_correction_bias", {numExperts}, rng, 0, 0.1f, bf16));
    for (int e = 0; e < numExperts; ++e) mlp(p + "mlp.experts." + std::to_string(e) + ".", expertFfn);
    mlp(p + "mlp.shared_experts.", expertFfn * shared);
  }
  t.push_back(makeTensor("model.norm.weight", {h}, rng, 1.0f, 0.2f, bf16));
  if (!o.tieEmbeddings) t.push_back(makeTensor("lm_head.weight", {s.vocab, h}, rng, 0, inH, bf16));
  PD_RETURN_IF_ERROR(writeWeights(o, std::move(t), dir));

  ordered_json cfg;
  cfg["architectures"] = {"DeepseekV3ForCausalLM"};
  cfg["model_type"] = "deepseek_v3";
  cfg["hidden_size"] = s.hidden;
  cfg["intermediate_size"] = s.ffn;
  cfg["moe_intermediate_size"] = expertFfn;
  cfg["vocab_size"] = s.vocab;
  cfg["num_hidden_layers"] = s.layers;
  cfg["num_nextn_predict_layers"] = 1;
  cfg["num_attention_heads"] = s.heads;
  cfg["num_key_value_heads"] = s.heads;
  cfg["n_shared_experts"] = shared;
  cfg["n_routed_experts"] = numExperts;
  cfg["ep_size"] = 1;
  cfg["routed_scaling_factor"] = 2.5;
  cfg["kv_lora_rank"] = kvLora;
  if (qLora > 0)
    cfg["q_lora_rank"] = qLora;
  else
    cfg["q_lora_rank"] = nullptr;
  cfg["qk_rope_head_dim"] = rope;
  cfg["v_head_dim"] = vDim;
  cfg["qk_nope_head_dim"] = nope;
  cfg["topk_method"] = "noaux_tc";
  cfg["n_group"] = groups;
  cfg["topk_group"] = topkGroups;
  cfg["num_experts_per_tok"] = topK;
  cfg["moe_layer_freq"] = 1;
  cfg["first_k_dense_replace"] = firstDense;
  cfg["norm_topk_prob"] = true;
  cfg["scoring_func"] = "sigmoid";
  cfg["hidden_act"] = "silu";
  cfg["max_position_embeddings"] = s.maxPos;
  cfg["initializer_range"] = 0.02;
  cfg["rms_norm_eps"] = 1e-6;
  cfg["use_cache"] = true;
  cfg["rope_theta"] = 10000.0;
  if (yarn)
    cfg["rope_scaling"] = {{"type", "yarn"},
                           {"factor", 4.0},
                           {"original_max_position_embeddings", s.maxPos / 4},
                           {"beta_fast", 32},
                           {"beta_slow", 1},
                           {"mscale", 1.0},
                           {"mscale_all_dim", mscaleAllDim}};
  else
    cfg["rope_scaling"] = nullptr;
  cfg["attention_bias"] = false;
  cfg["attention_dropout"] = 0.0;
  cfg["tie_word_embeddings"] = o.tieEmbeddings;
  cfg["torch_dtype"] = bf16 ? "bfloat16" : "float32";
  addQuantizationConfig(o, cfg);
  cfg["bos_token_id"] = kMadeBosId;
  cfg["eos_token_id"] = kMadeEosId;
  cfg["pad_token_id"] = kMadePadId;
  PD_RETURN_IF_ERROR(writeText(dir + "/config.json", cfg.dump(2)));
  return writeTokenizerFiles(dir, s.maxPos);
}

}  // namespace

Status makeModel(const MakeModelOptions& o, const std::string& dir) {
  Shape s;
  if (o.preset == "tiny")
    s = {64, 2, 4, 2, 172, 259, 2048};
  else if (o.preset == "small")
    s = {512, 8, 8, 4, 1376, 259, 4096};
  else
    return invalidArgument("make-model: unknown preset \"" + o.preset + "\" (tiny|small)");
  if (o.dtype != "f32" && o.dtype != "bf16")
    return invalidArgument("make-model: unknown dtype \"" + o.dtype + "\" (f32|bf16)");
  if (o.numKvHeads > 0) {
    if (s.heads % o.numKvHeads != 0)
      return invalidArgument("make-model: --kv-heads " + std::to_string(o.numKvHeads) + " must divide the " +
                             std::to_string(s.heads) + " attention heads");
    s.kvHeads = o.numKvHeads;
  }
  if (!o.quantization.empty() && o.quantization != "fp8")
    return invalidArgument("make-model: unknown quantization \"" + o.quantization + "\" (fp8, or none)");
  if (o.shards < 1 || o.shards > 99) return invalidArgument("make-model: shards must be in [1, 99]");
  if (o.arch != "llama" && o.arch != "qwen2" && o.arch != "qwen3" && o.arch != "mixtral" && o.arch != "qwen3_moe" &&
      o.arch != "deepseek_v3")
    return invalidArgument("make-model: unknown arch \"" + o.arch +
                           "\" (llama|qwen2|qwen3|mixtral|qwen3_moe|deepseek_v3)");
  if (o.qkvBias && o.arch != "llama" && o.arch != "qwen2")
    return invalidArgument("make-model: --qkv-bias writes a Qwen2 model; it does not combine with arch " + o.arch);
  if (o.arch == "deepseek_v3") {
    if (o.numKvHeads > 0 || o.ropeLlama3)
      return invalidArgument("make-model: --kv-heads and llama3 rope_scaling do not apply to arch deepseek_v3");
    return makeDeepseek(o, s, dir);
  }
  const std::string arch = o.qkvBias ? "qwen2" : o.arch;
  const bool qwen2 = arch == "qwen2", mixtral = arch == "mixtral", qwen3Moe = arch == "qwen3_moe";
  const bool qwen3 = arch == "qwen3" || qwen3Moe;  // the Qwen3 attention (q/k norms)
  // Experts: mixtral 8 (top 2) of width ffn/2; qwen3_moe 16 (top 4) of width ffn/4 and, on
  // the tiny preset, a dense layer 0 (mlp_only_layers).
  const int numExperts = mixtral ? 8 : qwen3Moe ? 16 : 0;
  const int topK = mixtral ? 2 : 4;
  const int expertFfn = mixtral ? s.ffn / 2 : s.ffn / 4;
  std::vector<int> denseLayers;
  if (qwen3Moe && o.preset == "tiny" && !o.moeAllSparse) denseLayers.push_back(0);
  auto moeLayer = [&](int l) {
    return numExperts > 0 && std::find(denseLayers.begin(), denseLayers.end(), l) == denseLayers.end();
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return notFound(dir + ": cannot create directory: " + ec.message());

  const bool bf16 = o.dtype == "bf16";
  const int headDim = qwen3 ? 2 * s.hidden / s.heads : s.hidden / s.heads;
  const int64_t h = s.hidden, q = int64_t(s.heads) * headDim, kv = int64_t(s.kvHeads) * headDim;
  Normal rng(o.seed);
  std::vector<TensorToWrite> tensors;
  // Unit-variance activations: projections ~ N(0, 1/fan_in); norms ~ 1 with spread so the
  // weights matter; biases large enough to change the logits measurably.
  tensors.push_back(makeTensor("model.embed_tokens.weight", {s.vocab, h}, rng, 0, 1.0f, bf16));
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const float inH = 1.0f / std::sqrt(float(h)), inF = 1.0f / std::sqrt(float(s.ffn));
    tensors.push_back(makeTensor(p + "input_layernorm.weight", {h}, rng, 1.0f, 0.2f, bf16));
    tensors.push_back(makeTensor(p + "self_attn.q_proj.weight", {q, h}, rng, 0, inH, bf16));
    tensors.push_back(makeTensor(p + "self_attn.k_proj.weight", {kv, h}, rng, 0, inH, bf16));
    tensors.push_back(makeTensor(p + "self_attn.v_proj.weight", {kv, h}, rng, 0, inH, bf16));
    if (qwen3) {
      tensors.push_back(makeTensor(p + "self_attn.q_norm.weight", {headDim}, rng, 1.0f, 0.2f, bf16));
      tensors.push_back(makeTensor(p + "self_attn.k_norm.weight", {headDim}, rng, 1.0f, 0.2f, bf16));
    }
    if (qwen2) {
      tensors.push_back(makeTensor(p + "self_attn.q_proj.bias", {q}, rng, 0, 0.3f, bf16));
      tensors.push_back(makeTensor(p + "self_attn.k_proj.bias", {kv}, rng, 0, 0.3f, bf16));
      tensors.push_back(makeTensor(p + "self_attn.v_proj.bias", {kv}, rng, 0, 0.3f, bf16));
    }
    tensors.push_back(makeTensor(p + "self_attn.o_proj.weight", {h, q}, rng, 0, 1.0f / std::sqrt(float(q)), bf16));
    tensors.push_back(makeTensor(p + "post_attention_layernorm.weight", {h}, rng, 1.0f, 0.2f, bf16));
    if (moeLayer(l)) {
      // Router logits spread ~N(0, 1) so routing differs between tokens.
      const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
      tensors.push_back(makeTensor(moe + "gate.weight", {numExperts, h}, rng, 0, inH, bf16));
      const float inE = 1.0f / std::sqrt(float(expertFfn));
      for (int e = 0; e < numExperts; ++e) {
        const std::string ep = moe + "experts." + std::to_string(e) + ".";
        tensors.push_back(
            makeTensor(ep + (mixtral ? "w1.weight" : "gate_proj.weight"), {expertFfn, h}, rng, 0, inH, bf16));
        tensors.push_back(
            makeTensor(ep + (mixtral ? "w3.weight" : "up_proj.weight"), {expertFfn, h}, rng, 0, inH, bf16));
        tensors.push_back(
            makeTensor(ep + (mixtral ? "w2.weight" : "down_proj.weight"), {h, expertFfn}, rng, 0, inE, bf16));
      }
      continue;
    }
    tensors.push_back(makeTensor(p + "mlp.gate_proj.weight", {s.ffn, h}, rng, 0, inH, bf16));
    tensors.push_back(makeTensor(p + "mlp.up_proj.weight", {s.ffn, h}, rng, 0, inH, bf16));
    tensors.push_back(makeTensor(p + "mlp.down_proj.weight", {h, s.ffn}, rng, 0, inF, bf16));
  }
  tensors.push_back(makeTensor("model.norm.weight", {h}, rng, 1.0f, 0.2f, bf16));
  if (!o.tieEmbeddings)
    tensors.push_back(makeTensor("lm_head.weight", {s.vocab, h}, rng, 0, 1.0f / std::sqrt(float(h)), bf16));

  PD_RETURN_IF_ERROR(writeWeights(o, std::move(tensors), dir));

  ordered_json cfg;
  cfg["architectures"] = {qwen3Moe  ? "Qwen3MoeForCausalLM"
                          : mixtral ? "MixtralForCausalLM"
                          : qwen3   ? "Qwen3ForCausalLM"
                          : qwen2   ? "Qwen2ForCausalLM"
                                    : "LlamaForCausalLM"};
  cfg["model_type"] = arch;
  cfg["hidden_size"] = s.hidden;
  cfg["intermediate_size"] = mixtral ? expertFfn : s.ffn;
  cfg["num_hidden_layers"] = s.layers;
  cfg["num_attention_heads"] = s.heads;
  cfg["num_key_value_heads"] = s.kvHeads;
  cfg["head_dim"] = headDim;
  cfg["vocab_size"] = s.vocab;
  cfg["max_position_embeddings"] = s.maxPos;
  cfg["hidden_act"] = "silu";
  cfg["rms_norm_eps"] = 1e-5;
  cfg["rope_theta"] = qwen3 ? 1000000.0 : 10000.0;
  if (o.ropeLlama3)
    cfg["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", 8.0},
                           {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 8192}};
  else
    cfg["rope_scaling"] = nullptr;
  if (qwen2) {
    cfg["use_sliding_window"] = false;
    cfg["sliding_window"] = s.maxPos;
  } else if (qwen3) {
    cfg["attention_bias"] = false;
    cfg["attention_dropout"] = 0.0;
    cfg["use_sliding_window"] = false;
    cfg["sliding_window"] = nullptr;
    cfg["max_window_layers"] = s.layers;
    cfg["use_cache"] = true;
    if (qwen3Moe) {
      cfg["num_experts"] = numExperts;
      cfg["num_experts_per_tok"] = topK;
      cfg["moe_intermediate_size"] = expertFfn;
      cfg["norm_topk_prob"] = true;
      cfg["decoder_sparse_step"] = 1;
      cfg["mlp_only_layers"] = denseLayers;
      cfg["router_aux_loss_coef"] = 0.001;
      cfg["output_router_logits"] = false;
    }
  } else if (mixtral) {
    cfg["num_local_experts"] = numExperts;
    cfg["num_experts_per_tok"] = topK;
    cfg["sliding_window"] = nullptr;
    cfg["attention_dropout"] = 0.0;
    cfg["router_aux_loss_coef"] = 0.02;
    cfg["output_router_logits"] = false;
    cfg["use_cache"] = true;
  } else {
    cfg["attention_bias"] = false;
    cfg["mlp_bias"] = false;
  }
  cfg["tie_word_embeddings"] = o.tieEmbeddings;
  cfg["torch_dtype"] = bf16 ? "bfloat16" : "float32";
  addQuantizationConfig(o, cfg);
  cfg["bos_token_id"] = kMadeBosId;
  cfg["eos_token_id"] = kMadeEosId;
  cfg["pad_token_id"] = kMadePadId;
  cfg["initializer_range"] = 0.02;
  PD_RETURN_IF_ERROR(writeText(dir + "/config.json", cfg.dump(2)));

  return writeTokenizerFiles(dir, s.maxPos);
}

namespace {

Status writeWeights(const MakeModelOptions& o, std::vector<TensorToWrite> tensors, const std::string& dir) {
  if (o.quantization == "fp8") quantizeFp8(tensors, kMadeFp8Blocks);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"generator", "pdserve make-model"}};
  if (o.shards == 1) {
    PD_RETURN_IF_ERROR(writeSafetensors(dir + "/model.safetensors", tensors, meta));
  } else {
    ordered_json weightMap = ordered_json::object();
    size_t totalBytes = 0;
    const size_t per = (tensors.size() + o.shards - 1) / o.shards;
    for (int sh = 0; sh < o.shards; ++sh) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", sh + 1, o.shards);
      std::vector<TensorToWrite> part;
      for (size_t i = sh * per; i < std::min(tensors.size(), (sh + 1) * per); ++i) {
        weightMap[tensors[i].name] = name;
        totalBytes += tensors[i].bytes.size();
        part.push_back(std::move(tensors[i]));
      }
      PD_RETURN_IF_ERROR(writeSafetensors(dir + "/" + name, part, meta));
    }
    ordered_json index = {{"metadata", {{"total_size", totalBytes}}}, {"weight_map", weightMap}};
    PD_RETURN_IF_ERROR(writeText(dir + "/model.safetensors.index.json", index.dump(2)));
  }

  return Status::ok();
}

Status writeTokenizerFiles(const std::string& dir, int maxPos) {
  PD_RETURN_IF_ERROR(writeText(dir + "/tokenizer.json", tokenizerJson().dump(2)));

  ordered_json addedDecoder = ordered_json::object();
  for (int i = 0; i < 3; ++i)
    addedDecoder[std::to_string(256 + i)] = {{"content", kSpecial[i]}, {"lstrip", false},      {"normalized", false},
                                             {"rstrip", false},        {"single_word", false}, {"special", true}};
  ordered_json tc;
  tc["add_bos_token"] = true;
  tc["add_eos_token"] = false;
  tc["added_tokens_decoder"] = addedDecoder;
  tc["bos_token"] = kSpecial[0];
  tc["eos_token"] = kSpecial[1];
  tc["pad_token"] = kSpecial[2];
  tc["clean_up_tokenization_spaces"] = false;
  tc["model_max_length"] = maxPos;
  tc["tokenizer_class"] = "PreTrainedTokenizerFast";
  tc["chat_template"] =
      "{{ bos_token }}{% for message in messages %}"
      "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}";
  PD_RETURN_IF_ERROR(writeText(dir + "/tokenizer_config.json", tc.dump(2)));

  ordered_json gen = {
      {"bos_token_id", kMadeBosId}, {"eos_token_id", kMadeEosId}, {"pad_token_id", kMadePadId}, {"do_sample", false}};
  PD_RETURN_IF_ERROR(writeText(dir + "/generation_config.json", gen.dump(2)));
  return Status::ok();
}

}  // namespace

}  // namespace pd::engine
