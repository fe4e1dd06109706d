// Model loading: config.json parsing, safetensors reading/writing and dtype conversion, and
// the errors a person sees for a broken model directory.
#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/safetensors.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd::engine;
using namespace pd::engine::test;
namespace fs = std::filesystem;

namespace {

std::string readText(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void writeText(const std::string& p, const std::string& s) {
  std::ofstream out(p, std::ios::trunc);
  out << s;
}

// A private copy of the tiny model that a test may break.
std::string copyOfTiny(const std::string& name) {
  const std::string src = makeTestModel("llama_tiny", {});
  const std::string dst = std::string(PD_TEST_MODEL_DIR) + "/broken_" + name + "." + std::to_string(::getpid());
  fs::remove_all(dst);
  fs::copy(src, dst);
  return dst;
}

}  // namespace

TEST_CASE("config.json of each architecture parses") {
  const std::string llama3 = R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": false,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]})";
  auto c = parseModelConfig(llama3, "llama3.json");
  REQUIRE(c.ok());
  CHECK(c->headDim == 128);
  CHECK(c->numKvHeads == 8);
  CHECK(c->rope.llama3);
  CHECK(c->rope.theta == 500000.0);
  CHECK(c->eosTokenIds == std::vector<int>{128001, 128008, 128009});
  CHECK(!c->qkvBias);

  const std::string qwen2 = R"({
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": false,
    "tie_word_embeddings": true, "hidden_act": "silu"})";
  c = parseModelConfig(qwen2, "qwen2.json");
  REQUIRE(c.ok());
  CHECK(c->qkvBias);
  CHECK(!c->oBias);
  CHECK(c->tieWordEmbeddings);
  CHECK(c->slidingWindow == 0);
  CHECK(c->headDim == 64);

  const std::string mistral = R"({
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "sliding_window": 4096, "rope_theta": 10000.0})";
  c = parseModelConfig(mistral, "mistral.json");
  REQUIRE(c.ok());
  CHECK(c->architecture == Architecture::kMistral);
  CHECK(c->slidingWindow == 4096);
  CHECK(c->maxPositionEmbeddings == 2048);
}

TEST_CASE("config errors name the problem") {
  auto c = parseModelConfig(R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})", "cfg.json");
  REQUIRE(!c.ok());
  CHECK(c.status().code() == pd::StatusCode::kUnimplemented);
  CHECK_THAT(c.status().message(), Catch::Contains("unsupported architecture \"GPT2LMHeadModel\""));

  c = parseModelConfig(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})", "cfg.json");
  CHECK_THAT(c.status().message(), Catch::Contains("missing required key \"intermediate_size\""));

  c = parseModelConfig(
      R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10,
      "rope_scaling": {"type": "yarn", "factor": 4.0}})",
      "cfg.json");
  CHECK_THAT(c.status().message(), Catch::Contains("rope_scaling type \"yarn\""));

  c = parseModelConfig("{not json", "cfg.json");
  CHECK_THAT(c.status().message(), Catch::Contains("cfg.json: not valid JSON"));

  auto missing = loadModel("/nonexistent/model");
  CHECK(missing.status().code() == pd::StatusCode::kNotFound);
  CHECK_THAT(missing.status().message(), Catch::Contains("/nonexistent/model/config.json"));
}

TEST_CASE("safetensors round trip with F32, F16 and BF16") {
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/st." + std::to_string(::getpid());
  fs::create_directories(dir);
  std::vector<TensorToWrite> ts(3);
  const std::vector<float> vals = {1.0f, -2.5f, 3.140625f, 0.0f, 65536.0f, -0.0009765625f};
  ts[0].name = "a";
  ts[0].shape = {2, 3};
  ts[0].bytes.resize(24);
  std::memcpy(ts[0].bytes.data(), vals.data(), 24);
  ts[1].name = "b";
  ts[1].dtype = TensorDtype::kBF16;
  ts[1].shape = {6};
  for (float v : vals) {
    const uint16_t x = f32ToBf16(v);
    ts[1].bytes.push_back(uint8_t(x));
    ts[1].bytes.push_back(uint8_t(x >> 8));
  }
  ts[2].name = "c";
  ts[2].dtype = TensorDtype::kF16;
  ts[2].shape = {3};
  // f16 1.0 = 0x3c00, -2.0 = 0xc000, smallest subnormal 2^-24 = 0x0001
  ts[2].bytes = {0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00};
  REQUIRE(writeSafetensors(dir + "/t.safetensors", ts, {{"format", "pt"}}).isOk());

  auto f = SafetensorsFile::open(dir + "/t.safetensors");
  REQUIRE(f.status().toString() == "OK");
  CHECK(f->metadata().at("format") == "pt");
  std::vector<float> out(6);
  REQUIRE(f->readF32("a", out.data()).isOk());
  CHECK(out == vals);
  REQUIRE(f->readF32("b", out.data()).isOk());
  CHECK(out == vals);  // every value above is exact in bf16
  REQUIRE(f->readF32("c", out.data()).isOk());
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -2.0f);
  CHECK(out[2] == std::ldexp(1.0f, -24));
  CHECK_THAT(f->readF32("zzz", out.data()).message(), Catch::Contains("no tensor named zzz"));

  // A truncated file is refused, naming the file.
  const std::string full = readText(dir + "/t.safetensors");
  writeText(dir + "/trunc.safetensors", full.substr(0, full.size() - 5));
  auto t = SafetensorsFile::open(dir + "/trunc.safetensors");
  REQUIRE(!t.ok());
  CHECK_THAT(t.status().message(), Catch::Contains("trunc.safetensors"));
  fs::remove_all(dir);
}

TEST_CASE("bf16 rounding is round-to-nearest-even") {
  CHECK(f32ToBf16(1.0f) == 0x3f80);
  CHECK(bf16ToF32(f32ToBf16(1.00390625f)) == 1.0f);       // halfway, rounds to even (down)
  CHECK(bf16ToF32(f32ToBf16(1.01171875f)) == 1.015625f);  // halfway, rounds to even (up)
  CHECK(bf16ToF32(f32ToBf16(-3.0f)) == -3.0f);
}

TEST_CASE("a model directory with a missing weights file is refused") {
  const std::string dir = copyOfTiny("nofile");
  fs::remove(dir + "/model.safetensors");
  auto m = loadModel(dir);
  REQUIRE(!m.ok());
  CHECK(m.status().code() == pd::StatusCode::kNotFound);
  CHECK_THAT(m.status().message(), Catch::Contains("no model.safetensors"));
  fs::remove_all(dir);
}

TEST_CASE("a missing tensor is named") {
  const std::string dir = copyOfTiny("notensor");
  auto f = SafetensorsFile::open(dir + "/model.safetensors");
  REQUIRE(f.ok());
  std::vector<TensorToWrite> ts;
  for (const auto& [name, info] : f->tensors()) {
    if (name == "model.layers.1.mlp.up_proj.weight") continue;
    TensorToWrite t{name, TensorDtype::kF32, info.shape, {}};
    t.bytes.resize(size_t(info.numel()) * 4);
    REQUIRE(f->readF32(name, reinterpret_cast<float*>(t.bytes.data())).isOk());
    ts.push_back(std::move(t));
  }
  REQUIRE(writeSafetensors(dir + "/model.safetensors", ts, {}).isOk());
  auto m = loadModel(dir);
  REQUIRE(!m.ok());
  CHECK(m.status().code() == pd::StatusCode::kNotFound);
  CHECK_THAT(m.status().message(), Catch::Contains("missing tensor model.layers.1.mlp.up_proj.weight"));
  CHECK_THAT(m.status().message(), Catch::Contains("[172, 64]"));
  fs::remove_all(dir);
}

TEST_CASE("a tensor whose shape does not match the config is named with both shapes") {
  const std::string dir = copyOfTiny("shape");
  auto j = nlohmann::json::parse(readText(dir + "/config.json"));
  j["intermediate_size"] = 200;
  writeText(dir + "/config.json", j.dump());
  auto m = loadModel(dir);
  REQUIRE(!m.ok());
  CHECK(m.status().code() == pd::StatusCode::kInvalidArgument);
  CHECK_THAT(m.status().message(), Catch::Contains("model.layers.0.mlp.gate_proj.weight has shape "
                                                   "[172, 64] but the config implies [200, 64]"));
  fs::remove_all(dir);
}

TEST_CASE("an unsupported architecture in a model directory is named") {
  const std::string dir = copyOfTiny("arch");
  auto j = nlohmann::json::parse(readText(dir + "/config.json"));
  j["architectures"] = {"Gemma2ForCausalLM"};
  writeText(dir + "/config.json", j.dump());
  auto m = loadModel(dir);
  REQUIRE(!m.ok());
  CHECK(m.status().code() == pd::StatusCode::kUnimplemented);
  CHECK_THAT(m.status().message(), Catch::Contains("Gemma2ForCausalLM"));
  CHECK_THAT(m.status().message(), Catch::Contains("config.json"));
  fs::remove_all(dir);
}

TEST_CASE("make-model writes an HF tokenizer and configs") {
  const std::string dir = makeTestModel("llama_tiny", {});
  const auto tok = nlohmann::json::parse(readText(dir + "/tokenizer.json"));
  CHECK(tok["model"]["type"] == "BPE");
  CHECK(tok["model"]["vocab"].size() == 256);
  CHECK(tok["model"]["vocab"]["Ġ"] == 32);  // space maps to U+0120 in GPT-2's table
  CHECK(tok["model"]["vocab"]["A"] == 65);
  CHECK(tok["pre_tokenizer"]["type"] == "ByteLevel");
  CHECK(tok["decoder"]["type"] == "ByteLevel");
  CHECK(tok["added_tokens"][0]["content"] == "<|begin_of_text|>");
  CHECK(tok["added_tokens"][0]["id"] == 256);
  CHECK(tok["added_tokens"][1]["content"] == "<|end_of_text|>");
  CHECK(tok["added_tokens"][2]["id"] == 258);
  const auto tc = nlohmann::json::parse(readText(dir + "/tokenizer_config.json"));
  CHECK(tc["add_bos_token"] == true);
  CHECK(tc["chat_template"].get<std::string>().find("add_generation_prompt") != std::string::npos);
  auto cfg = loadModelConfig(dir);
  REQUIRE(cfg.ok());
  CHECK(cfg->hiddenSize == 64);
  CHECK(cfg->numLayers == 2);
  CHECK(cfg->numKvHeads == 2);
  CHECK(cfg->intermediateSize == 172);
  CHECK(cfg->vocabSize == 259);
  CHECK(cfg->eosTokenIds == std::vector<int>{257});
}

TEST_CASE("the weights fingerprint tells checkpoints of one model apart, cheaply") {
  MakeModelOptions a;
  a.preset = "small";
  MakeModelOptions b = a;
  b.seed = 2;
  const std::string dirA = makeTestModel("fingerprint_small_seed1", a);
  const std::string dirB = makeTestModel("fingerprint_small_seed2", b);
  const auto t0 = std::chrono::steady_clock::now();
  auto ckpt = Checkpoint::open(dirA);
  REQUIRE(ckpt.ok());
  auto fa = ckpt->weightsFingerprint();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(fa.ok());
  WARN("weights fingerprint of the small model: " << ms << " ms");  // docs/security.md quotes it
  CHECK(fa->size() == 16);
  // Same name, same shapes, other seed: another fingerprint; the same files: the same one.
  auto mb = describeModel(dirB);
  REQUIRE(mb.ok());
  CHECK((*mb)->weightsFingerprint != *fa);
  auto ma = describeModel(dirA);
  REQUIRE(ma.ok());
  CHECK((*ma)->weightsFingerprint == *fa);
  // One byte changed in the middle of the largest tensor's sample is seen.
  const std::string dirC = std::string(PD_TEST_MODEL_DIR) + "/fingerprint_small_flipped";
  fs::remove_all(dirC);
  fs::copy(dirA, dirC, fs::copy_options::recursive);
  auto file = SafetensorsFile::open(dirC + "/model.safetensors");
  REQUIRE(file.ok());
  const TensorInfo* embed = file->find("model.embed_tokens.weight");
  REQUIRE(embed != nullptr);
  uint64_t dataStart = 0;
  {
    std::ifstream in(dirC + "/model.safetensors", std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    dataStart = 8 + n;
  }
  {
    std::fstream io(dirC + "/model.safetensors", std::ios::binary | std::ios::in | std::ios::out);
    const auto at = std::streamoff(dataStart + embed->begin + (embed->end - embed->begin) / 2);
    io.seekg(at);
    const char was = char(io.get());
    io.seekp(at);
    io.put(char(~was));
  }
  auto mc = describeModel(dirC);
  REQUIRE(mc.ok());
  CHECK((*mc)->weightsFingerprint != *fa);
  fs::remove_all(dirC);
}

TEST_CASE("Qwen3ForCausalLM config parses and unknown or unimplemented keys are refused by name") {
  // Qwen3-0.6B's config.json as published: hidden 1024 with 16 heads of 128, so q is 2048 wide.
  const nlohmann::json qwen3 = nlohmann::json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  auto c = parseModelConfig(qwen3.dump(), "qwen3.json");
  REQUIRE(c.status().toString() == "OK");
  CHECK(c->architecture == Architecture::kQwen3);
  CHECK(c->qkNorm);
  CHECK(!c->qkvBias);
  CHECK(c->headDim == 128);
  CHECK(c->qDim() == 2048);
  CHECK(c->tieWordEmbeddings);
  CHECK(c->rope.theta == 1000000.0);

  auto refused = [&](const nlohmann::json& edit, const std::string& named) {
    nlohmann::json j = qwen3;
    for (auto& [k, v] : edit.items()) j[k] = v;
    auto r = parseModelConfig(j.dump(), "qwen3.json");
    INFO(edit.dump());
    REQUIRE(!r.ok());
    CHECK(r.status().code() == pd::StatusCode::kUnimplemented);
    CHECK_THAT(r.status().message(), Catch::Contains(named));
  };
  refused({{"quantization_config", {{"quant_method", "awq"}}}}, "quantization_config quant_method \"awq\"");
  refused({{"num_experts", 128}}, "config key \"num_experts\"");
  refused({{"use_sliding_window", true}}, "use_sliding_window");
  refused({{"layer_types", {"full_attention", "sliding_attention"}}}, "sliding_attention");
  refused({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}, "rope_scaling type \"yarn\"");
  refused({{"hidden_act", "gelu"}}, "hidden_act");
  refused({{"architectures", {"Gemma3ForCausalLM"}}}, "Gemma3ForCausalLM");

  // The key check is Qwen3's: a Llama config with an extra key still loads as before.
  nlohmann::json llama = qwen3;
  llama["architectures"] = {"LlamaForCausalLM"};
  llama["pretraining_tp"] = 1;
  CHECK(parseModelConfig(llama.dump(), "llama.json").ok());
}

TEST_CASE("a Qwen3 checkpoint without q_norm/k_norm is refused naming the tensor") {
  MakeModelOptions o;
  o.arch = "qwen3";
  const std::string src = makeTestModel("qwen3_tiny", o);
  auto ok = loadModel(src);
  REQUIRE(ok.status().toString() == "OK");
  CHECK(ok->get()->layers[0].qNorm.size() == size_t(ok->get()->config.headDim));
  // Llama weights under a Qwen3 config of the same shape: the norms are missing.
  const std::string dst = copyOfTiny("qwen3_no_norm");
  auto j = nlohmann::json::parse(readText(dst + "/config.json"));
  j["architectures"] = {"Qwen3ForCausalLM"};
  j.erase("mlp_bias");
  writeText(dst + "/config.json", j.dump());
  auto r = loadModel(dst);
  REQUIRE(!r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("self_attn.q_norm.weight"));
  fs::remove_all(dst);
}
