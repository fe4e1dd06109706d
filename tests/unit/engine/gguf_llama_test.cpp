// The GGUF writer (engine/bench/gguf_writer.h) against llama.cpp itself: for a tiny model of
// each family it writes (llama, qwen3, mixtral, qwen3_moe, deepseek_v3; f32 weights), llama.cpp's greedy
// continuation of a prompt must be ours token for token, and its logits after the prompt and
// after every generated token must match ours (max |diff| / max |ours| under 1e-5: both f32
// with an f32 KV cache and llama.cpp's flash attention off, so only the summation order
// differs; measured 2-4e-7). llama.cpp runs through
// pd_llama_greedy (llama_greedy_main.cpp), built only when the configure step is given
// -DPD_LLAMA_CPP_DIR=<llama.cpp source tree with build/bin/libllama.so>; without it every
// case is a ctest skip saying so.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/bench/gguf_writer.h"
#include "model_test_util.h"
#include "tests/test_skip.h"

namespace pd::engine {
namespace {

constexpr int kPromptTokens = 12;
constexpr int kSteps = 10;

struct LlamaRun {
  std::vector<int32_t> generated;
  std::vector<std::vector<float>> logits;  // kSteps + 1 rows
};

// pd_llama_greedy's path; skips the case (before any model is made) when it was not built.
std::string llamaGreedy() {
  const std::string driver = PD_LLAMA_GREEDY;
  if (driver.empty())
    pd::test::skipTest(
        "pd_llama_greedy was not built: configure with -DPD_LLAMA_CPP_DIR=<llama.cpp source tree with "
        "build/bin/libllama.so> (or that in the PD_LLAMA_CPP_DIR environment variable) to compare with llama.cpp");
  return driver;
}

LlamaRun runLlamaCpp(const std::string& driver, const std::string& gguf, const std::vector<int32_t>& prompt,
                     int vocab) {
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  const std::string logitsPath = gguf + ".logits", outPath = gguf + ".ids";
  const std::string cmd = "'" + driver + "' '" + gguf + "' " + std::to_string(kSteps) + " '" + logitsPath + "' " + ids +
                          " >'" + outPath + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  LlamaRun r;
  std::ifstream out(outPath);
  for (int32_t id; out >> id;) r.generated.push_back(id);
  std::ifstream in(logitsPath, std::ios::binary);
  std::vector<float> row(vocab);
  while (in.read(reinterpret_cast<char*>(row.data()), std::streamsize(vocab * sizeof(float)))) r.logits.push_back(row);
  return r;
}

void compareWithLlamaCpp(const std::string& name, const MakeModelOptions& o, const std::string& arch) {
  const std::string driver = llamaGreedy();
  auto loaded = loadModel(test::makeTestModel(name, o));
  REQUIRE(loaded.status().toString() == "OK");
  const std::shared_ptr<const ModelWeights> m = *loaded;
  const ModelConfig& c = m->config;
  REQUIRE(llamaCppArchitecture(c).value() == arch);

  test::TestKv kv(c, 8);
  auto backend = test::makeBackend(m, kv);
  const std::vector<int32_t> prompt = test::testPrompt(kPromptTokens, 11);
  std::vector<int32_t> ours;
  const auto ourLogits = test::runGreedy(*backend, kv, prompt, 0, kSteps, &ours);

  const std::string gguf = std::string(PD_TEST_MODEL_DIR) + "/" + name + ".gguf";
  REQUIRE(writeLlamaGguf(*m, gguf).toString() == "OK");
  const LlamaRun theirs = runLlamaCpp(driver, gguf, prompt, c.vocabSize);
  std::filesystem::remove(gguf);

  CHECK(theirs.generated == ours);
  REQUIRE(theirs.logits.size() == ourLogits.size());
  for (size_t i = 0; i < ourLogits.size(); ++i) {
    INFO(name << " logits row " << i);
    CHECK(test::relError(theirs.logits[i], ourLogits[i]) < 1e-5);
  }
}

TEST_CASE("gguf vs llama.cpp: llama greedy continuation and logits match") {
  compareWithLlamaCpp("gguf_llama_llama", MakeModelOptions{}, "llama");
}

TEST_CASE("gguf vs llama.cpp: qwen3 greedy continuation and logits match") {
  MakeModelOptions o;
  o.arch = "qwen3";
  compareWithLlamaCpp("gguf_llama_qwen3", o, "qwen3");
}

TEST_CASE("gguf vs llama.cpp: mixtral greedy continuation and logits match") {
  MakeModelOptions o;
  o.arch = "mixtral";
  compareWithLlamaCpp("gguf_llama_mixtral", o, "llama");
}

TEST_CASE("gguf vs llama.cpp: qwen3_moe greedy continuation and logits match") {
  MakeModelOptions o;
  o.arch = "qwen3_moe";
  o.moeAllSparse = true;  // llama.cpp's qwen3moe has experts in every layer
  compareWithLlamaCpp("gguf_llama_qwen3moe", o, "qwen3moe");
}

TEST_CASE("gguf vs llama.cpp: deepseek_v3 greedy continuation and logits match") {
  MakeModelOptions o;  // tiny: MLA with q and kv LoRA, 16 experts in 4 groups, layer 0 dense
  o.arch = "deepseek_v3";
  compareWithLlamaCpp("gguf_llama_deepseek", o, "deepseek2");
}

TEST_CASE("gguf vs llama.cpp: deepseek_v3 without q_lora_rank and with one group matches") {
  MakeModelOptions o;
  o.arch = "deepseek_v3";
  o.mlaNoQLora = true;
  o.moeGroups = 1;
  compareWithLlamaCpp("gguf_llama_deepseek_noqlora", o, "deepseek2");
}

TEST_CASE("gguf vs llama.cpp: deepseek_v3 with yarn rope_scaling matches") {
  MakeModelOptions o;
  o.arch = "deepseek_v3";
  o.mlaYarn = 2;  // factor 4, mscale = mscale_all_dim = 1, as DeepSeek-V3's config
  compareWithLlamaCpp("gguf_llama_deepseek_yarn", o, "deepseek2");
}

}  // namespace
}  // namespace pd::engine
