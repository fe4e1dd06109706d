// The GGUF writer (engine/bench/gguf_writer.h) read back by a small independent parser:
// header, key/values, tensor infos (ggml dimension order, f32 type, aligned offsets) and the
// tensor bytes against the loaded model, including the q/k RoPE row permutation, the qwen3
// q/k norms and the 3-D expert tensors. llama.cpp computing the same function from the file is
// gguf_llama_test.cpp (test_engine_gguf_llama), which needs a llama.cpp build.
#include "engine/bench/gguf_writer.h"

#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "model_test_util.h"

namespace pd::engine {
namespace {

struct ParsedTensor {
  std::vector<uint64_t> ne;
  uint32_t type = 0;
  uint64_t offset = 0;
};

struct ParsedGguf {
  uint32_t version = 0;
  std::map<std::string, std::pair<uint32_t, std::string>> kv;  // key -> (type, raw value)
  std::vector<std::string> order;                              // tensor names in file order
  std::map<std::string, ParsedTensor> tensors;
  uint64_t dataStart = 0;
  std::string bytes;

  template <typename T>
  T number(const std::string& key, uint32_t type) const {
    const auto& v = kv.at(key);
    REQUIRE(v.first == type);
    T x;
    std::memcpy(&x, v.second.data(), sizeof x);
    return x;
  }
  uint32_t u32(const std::string& key) const { return number<uint32_t>(key, kGgufTypeU32); }
  float f32(const std::string& key) const { return number<float>(key, kGgufTypeF32); }
  std::string str(const std::string& key) const {
    const auto& v = kv.at(key);
    REQUIRE(v.first == kGgufTypeString);
    return v.second;
  }
  // Row `row` of a 2-D tensor (ne = {cols, rows}).
  std::vector<float> row(const std::string& name, uint64_t r) const {
    const ParsedTensor& t = tensors.at(name);
    const uint64_t cols = t.ne[0];
    std::vector<float> out(cols);
    std::memcpy(out.data(), bytes.data() + dataStart + t.offset + r * cols * 4, cols * 4);
    return out;
  }
};

ParsedGguf parse(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  ParsedGguf g;
  g.bytes = ss.str();
  size_t at = 0;
  auto take = [&](size_t n) {
    REQUIRE(at + n <= g.bytes.size());
    const std::string s = g.bytes.substr(at, n);
    at += n;
    return s;
  };
  auto u32 = [&] {
    uint32_t v;
    std::memcpy(&v, take(4).data(), 4);
    return v;
  };
  auto u64 = [&] {
    uint64_t v;
    std::memcpy(&v, take(8).data(), 8);
    return v;
  };
  auto str = [&] { return take(size_t(u64())); };
  REQUIRE(take(4) == "GGUF");
  g.version = u32();
  const uint64_t nTensors = u64(), nKv = u64();
  for (uint64_t i = 0; i < nKv; ++i) {
    const std::string key = str();
    const uint32_t type = u32();
    std::string value;
    if (type == kGgufTypeString)
      value = str();
    else if (type == kGgufTypeU32 || type == kGgufTypeF32)
      value = take(4);
    else
      FAIL("unexpected gguf type " << type << " for " << key);
    REQUIRE(g.kv.count(key) == 0);
    g.kv[key] = {type, value};
  }
  for (uint64_t i = 0; i < nTensors; ++i) {
    const std::string name = str();
    ParsedTensor t;
    const uint32_t dims = u32();
    for (uint32_t d = 0; d < dims; ++d) t.ne.push_back(u64());
    t.type = u32();
    t.offset = u64();
    REQUIRE(g.tensors.count(name) == 0);
    g.order.push_back(name);
    g.tensors[name] = t;
  }
  g.dataStart = (at + kGgufAlignment - 1) / kGgufAlignment * kGgufAlignment;
  for (size_t i = at; i < g.dataStart; ++i) REQUIRE(g.bytes[i] == '\0');
  return g;
}

std::vector<float> modelRow(const float* base, uint64_t cols, uint64_t r) {
  return std::vector<float>(base + r * cols, base + (r + 1) * cols);
}

std::shared_ptr<const ModelWeights> loadTiny(const std::string& name, const MakeModelOptions& o) {
  auto m = loadModel(test::makeTestModel(name, o));
  REQUIRE(m.status().toString() == "OK");
  return *m;
}

TEST_CASE("gguf: the tiny preset reads back as a llama.cpp `llama` model") {
  MakeModelOptions o;  // tiny: hidden 64, 2 layers, 4 heads / 2 kv heads, ffn 172, vocab 259
  const auto m = loadTiny("gguf_tiny", o);
  const ModelConfig& c = m->config;
  const std::string path = std::string(PD_TEST_MODEL_DIR) + "/gguf_tiny.gguf";
  REQUIRE(writeLlamaGguf(*m, path).toString() == "OK");
  const ParsedGguf g = parse(path);

  CHECK(g.version == 3);
  CHECK(g.str("general.architecture") == "llama");
  CHECK(g.str("tokenizer.ggml.model") == "no_vocab");
  CHECK(g.u32("general.file_type") == 0);
  CHECK(g.u32("llama.vocab_size") == uint32_t(c.vocabSize));
  CHECK(g.u32("llama.context_length") == uint32_t(c.maxPositionEmbeddings));
  CHECK(g.u32("llama.embedding_length") == uint32_t(c.hiddenSize));
  CHECK(g.u32("llama.block_count") == uint32_t(c.numLayers));
  CHECK(g.u32("llama.feed_forward_length") == uint32_t(c.intermediateSize));
  CHECK(g.u32("llama.attention.head_count") == uint32_t(c.numHeads));
  CHECK(g.u32("llama.attention.head_count_kv") == uint32_t(c.numKvHeads));
  CHECK(g.u32("llama.attention.key_length") == uint32_t(c.headDim));
  CHECK(g.u32("llama.rope.dimension_count") == uint32_t(c.headDim));
  CHECK(g.f32("llama.rope.freq_base") == float(c.rope.theta));
  CHECK(g.f32("llama.attention.layer_norm_rms_epsilon") == c.rmsNormEps);

  // Every tensor: f32, ggml dimension order, offsets aligned, in order and not overlapping,
  // and the file ends at the last (padded) tensor.
  REQUIRE(g.tensors.size() == size_t(3 + 9 * c.numLayers));
  uint64_t end = 0;
  for (const std::string& name : g.order) {
    const ParsedTensor& t = g.tensors.at(name);
    INFO(name);
    CHECK(t.type == kGgmlTypeF32);
    CHECK(t.offset % kGgufAlignment == 0);
    CHECK(t.offset >= end);
    uint64_t n = 1;
    for (uint64_t d : t.ne) n *= d;
    end = t.offset + n * 4;
  }
  CHECK(g.bytes.size() == g.dataStart + (end + kGgufAlignment - 1) / kGgufAlignment * kGgufAlignment);
  const uint64_t h = uint64_t(c.hiddenSize), q = uint64_t(c.qDim()), kv = uint64_t(c.kvDim());
  const uint64_t ffn = uint64_t(c.intermediateSize), vocab = uint64_t(c.vocabSize);
  CHECK(g.tensors.at("token_embd.weight").ne == std::vector<uint64_t>{h, vocab});
  CHECK(g.tensors.at("output.weight").ne == std::vector<uint64_t>{h, vocab});
  CHECK(g.tensors.at("output_norm.weight").ne == std::vector<uint64_t>{h});
  CHECK(g.tensors.at("blk.1.attn_q.weight").ne == std::vector<uint64_t>{h, q});
  CHECK(g.tensors.at("blk.1.attn_k.weight").ne == std::vector<uint64_t>{h, kv});
  CHECK(g.tensors.at("blk.1.attn_output.weight").ne == std::vector<uint64_t>{q, h});
  CHECK(g.tensors.at("blk.1.ffn_gate.weight").ne == std::vector<uint64_t>{h, ffn});
  CHECK(g.tensors.at("blk.1.ffn_down.weight").ne == std::vector<uint64_t>{ffn, h});

  // The bytes: copies of the loaded tensors (split out of the fused qkv / gate|up), with q and
  // k rows interleaved per head: GGUF row h*hd + 2i + half = HF row h*hd + half*hd/2 + i.
  const LayerWeights& L = m->layers[1];
  const uint64_t hd = uint64_t(c.headDim);
  CHECK(g.row("token_embd.weight", 7) == modelRow(m->embed.data(), h, 7));
  CHECK(g.row("output.weight", vocab - 1) == modelRow(m->lmHead.data(), h, vocab - 1));
  CHECK(g.row("blk.1.attn_norm.weight", 0) == modelRow(L.inputNorm.data(), h, 0));
  CHECK(g.row("blk.1.attn_v.weight", 3) == modelRow(L.qkv.data(), h, q + kv + 3));
  CHECK(g.row("blk.1.ffn_up.weight", 5) == modelRow(L.gateUp.data(), h, ffn + 5));
  CHECK(g.row("blk.1.ffn_down.weight", 2) == modelRow(L.down.data(), ffn, 2));
  for (uint64_t head : {uint64_t(0), uint64_t(c.numHeads - 1)})
    for (uint64_t i : {uint64_t(0), uint64_t(1), hd / 2 - 1}) {
      CHECK(g.row("blk.1.attn_q.weight", head * hd + 2 * i) == modelRow(L.qkv.data(), h, head * hd + i));
      CHECK(g.row("blk.1.attn_q.weight", head * hd + 2 * i + 1) == modelRow(L.qkv.data(), h, head * hd + hd / 2 + i));
    }
  const uint64_t lastKv = uint64_t(c.numKvHeads - 1) * hd;
  CHECK(g.row("blk.1.attn_k.weight", lastKv + 1) == modelRow(L.qkv.data(), h, q + lastKv + hd / 2));
}

TEST_CASE("gguf: tied embeddings leave out output.weight (llama.cpp reuses token_embd)") {
  MakeModelOptions o;
  o.tieEmbeddings = true;
  const auto m = loadTiny("gguf_tiny_tied", o);
  const std::string path = std::string(PD_TEST_MODEL_DIR) + "/gguf_tiny_tied.gguf";
  REQUIRE(writeLlamaGguf(*m, path).toString() == "OK");
  const ParsedGguf g = parse(path);
  CHECK(g.tensors.count("output.weight") == 0);
  CHECK(g.tensors.count("token_embd.weight") == 1);
}

TEST_CASE("gguf: a model with attention biases is refused by name") {
  MakeModelOptions o;
  o.qkvBias = true;
  const auto m = loadTiny("gguf_tiny_bias", o);
  const Status st = writeLlamaGguf(*m, std::string(PD_TEST_MODEL_DIR) + "/gguf_bias.gguf");
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.toString(), Catch::Contains("bias"));
}

TEST_CASE("gguf: qwen3_moe is written as qwen3moe with q/k norms and 3-D expert tensors") {
  MakeModelOptions o;
  o.arch = "qwen3_moe";
  o.moeAllSparse = true;
  const auto m = loadTiny("gguf_tiny_qwen3moe", o);
  const ModelConfig& c = m->config;
  const std::string path = std::string(PD_TEST_MODEL_DIR) + "/gguf_tiny_qwen3moe.gguf";
  REQUIRE(writeLlamaGguf(*m, path).toString() == "OK");
  const ParsedGguf g = parse(path);
  CHECK(g.str("general.architecture") == "qwen3moe");
  CHECK(g.u32("qwen3moe.expert_count") == uint32_t(c.moe.numExperts));
  CHECK(g.u32("qwen3moe.expert_used_count") == uint32_t(c.moe.expertsPerToken));
  CHECK(g.u32("qwen3moe.expert_feed_forward_length") == uint32_t(c.moe.expertFfn));
  CHECK(g.u32("qwen3moe.attention.key_length") == uint32_t(c.headDim));
  CHECK(g.f32("qwen3moe.rope.freq_base") == float(c.rope.theta));
  CHECK(g.tensors.count("blk.0.ffn_gate.weight") == 0);
  const uint64_t h = uint64_t(c.hiddenSize), ne = uint64_t(c.moe.numExperts), ef = uint64_t(c.moe.expertFfn);
  const uint64_t hd = uint64_t(c.headDim);
  CHECK(g.tensors.at("blk.1.ffn_gate_inp.weight").ne == std::vector<uint64_t>{h, ne});
  CHECK(g.tensors.at("blk.1.ffn_gate_exps.weight").ne == std::vector<uint64_t>{h, ef, ne});
  CHECK(g.tensors.at("blk.1.ffn_up_exps.weight").ne == std::vector<uint64_t>{h, ef, ne});
  CHECK(g.tensors.at("blk.1.ffn_down_exps.weight").ne == std::vector<uint64_t>{ef, h, ne});
  CHECK(g.tensors.at("blk.1.attn_q_norm.weight").ne == std::vector<uint64_t>{hd});
  const LayerWeights& L = m->layers[1];
  // NEOX RoPE: q/k rows as they are; expert e's rows at e * rows-per-expert.
  CHECK(g.row("blk.1.attn_q.weight", 1) == modelRow(L.qkv.data(), h, 1));
  CHECK(g.row("blk.1.attn_q_norm.weight", 0) == modelRow(L.qNorm.data(), hd, 0));
  CHECK(g.row("blk.1.attn_k_norm.weight", 0) == modelRow(L.kNorm.data(), hd, 0));
  CHECK(g.row("blk.1.ffn_gate_inp.weight", ne - 1) == modelRow(L.router.data(), h, ne - 1));
  const uint64_t e = ne - 1;
  const std::vector<float> gateUp = L.experts[e].gateUpRowMajor(int(h)), down = L.experts[e].downRowMajor(int(h));
  CHECK(g.row("blk.1.ffn_gate_exps.weight", e * ef + 2) == modelRow(gateUp.data(), h, 2));
  CHECK(g.row("blk.1.ffn_up_exps.weight", e * ef + 2) == modelRow(gateUp.data(), h, ef + 2));
  CHECK(g.row("blk.1.ffn_down_exps.weight", e * h + 3) == modelRow(down.data(), ef, 3));
  CHECK(g.row("blk.1.ffn_down_exps.weight", 3) == modelRow(L.experts[0].downRowMajor(int(h)).data(), ef, 3));
}

TEST_CASE("gguf: mixtral is written as llama with experts of feed_forward_length") {
  MakeModelOptions o;
  o.arch = "mixtral";
  const auto m = loadTiny("gguf_tiny_mixtral", o);
  const ModelConfig& c = m->config;
  const std::string path = std::string(PD_TEST_MODEL_DIR) + "/gguf_tiny_mixtral.gguf";
  REQUIRE(writeLlamaGguf(*m, path).toString() == "OK");
  const ParsedGguf g = parse(path);
  CHECK(g.str("general.architecture") == "llama");
  CHECK(g.u32("llama.expert_count") == uint32_t(c.moe.numExperts));
  CHECK(g.u32("llama.expert_used_count") == uint32_t(c.moe.expertsPerToken));
  CHECK(g.u32("llama.feed_forward_length") == uint32_t(c.moe.expertFfn));
  CHECK(g.tensors.count("blk.0.attn_q_norm.weight") == 0);
  const uint64_t h = uint64_t(c.hiddenSize), hd = uint64_t(c.headDim);
  // llama: q rows interleaved per head, as for the dense model.
  CHECK(g.row("blk.0.attn_q.weight", 1) == modelRow(m->layers[0].qkv.data(), h, hd / 2));
}

TEST_CASE("gguf: what llama.cpp cannot express is refused by name") {
  auto refused = [](const std::string& name, const MakeModelOptions& o) {
    const auto m = loadTiny(name, o);
    const Status st = writeLlamaGguf(*m, std::string(PD_TEST_MODEL_DIR) + "/" + name + ".gguf");
    CHECK(st.code() == StatusCode::kInvalidArgument);
    return st.toString();
  };
  MakeModelOptions qwen3Moe;
  qwen3Moe.arch = "qwen3_moe";  // the tiny preset's layer 0 is dense (mlp_only_layers)
  CHECK_THAT(refused("gguf_tiny_qwen3moe_dense0", qwen3Moe), Catch::Contains("mlp_only_layers"));
  MakeModelOptions deepseek;
  deepseek.arch = "deepseek_v3";
  deepseek.mlaYarn = 1;
  CHECK_THAT(refused("gguf_tiny_deepseek_yarn", deepseek), Catch::Contains("mscale_all_dim"));
  MakeModelOptions qwen2;
  qwen2.arch = "qwen2";
  CHECK_THAT(refused("gguf_tiny_qwen2", qwen2), Catch::Contains("Qwen2ForCausalLM"));
  MakeModelOptions llama3;
  llama3.ropeLlama3 = true;
  CHECK_THAT(refused("gguf_tiny_llama3rope", llama3), Catch::Contains("llama3 rope_scaling"));
}

}  // namespace
}  // namespace pd::engine
