// The CPU backend against an independent NumPy implementation (tests/reference) on the
// tiny model and its variants: prefill logits for a 37-token prompt, then 5 greedy decode
// steps, each row within 1e-4 relative error, and the same greedy tokens.
#include <nlohmann/json.hpp>

#include "pd/kernels/gemm.h"
#include "tests/test_skip.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd::engine;
using namespace pd::engine::test;

namespace {

void checkDirAgainstNumpy(const std::string& name, const std::string& dir, const CpuBackendOptions& opt = {}) {
  auto model = loadModel(dir);
  REQUIRE(model.status().toString() == "OK");
  TestKv kv((*model)->config, 64);
  auto backend = makeBackend(*model, kv, opt);
  const auto prompt = testPrompt(37, 11);
  std::vector<int32_t> generated;
  const auto engineRows = runGreedy(*backend, kv, prompt, 0, 5, &generated);

  std::vector<int32_t> all = prompt;
  all.insert(all.end(), generated.begin(), generated.end());
  const auto refRows = numpyReference(dir, all, int(prompt.size()), (*model)->config.vocabSize);
  REQUIRE(refRows.size() == engineRows.size());
  for (size_t i = 0; i < refRows.size(); ++i) {
    INFO(name << " row " << i);
    CHECK(relError(engineRows[i], refRows[i]) < 1e-4);
    const int refArgmax = int(std::max_element(refRows[i].begin(), refRows[i].end()) - refRows[i].begin());
    if (i < generated.size()) CHECK(refArgmax == generated[i]);
  }
}

void checkAgainstNumpy(const std::string& name, const MakeModelOptions& o) {
  checkDirAgainstNumpy(name, makeTestModel(name, o));
}

// The 37-token prefill runs its linear layers and attention through the GEMM: each kernel,
// forced, must give the same logits (within the bound above) and greedy tokens. A kernel this
// CPU cannot run skips by name.
void checkGemmKernelAgainstNumpy(const std::string& kernel) {
  bool supported = false;
  for (auto k : {pd::kernels::cpu::GemmKernel::kAvx512, pd::kernels::cpu::GemmKernel::kAvx2,
                 pd::kernels::cpu::GemmKernel::kGeneric})
    if (kernel == pd::kernels::cpu::gemmKernelInfo(k).name) supported = pd::kernels::cpu::gemmKernelSupported(k);
  if (!supported) pd::test::skipTest("this CPU cannot run the " + kernel + " GEMM kernel");
  CpuBackendOptions opt;
  opt.gemmKernel = kernel;
  MakeModelOptions o;
  o.qkvBias = true;  // the bias rides on the GEMM's beta = 1
  o.seed = 21;
  checkDirAgainstNumpy("qwen2_tiny_gemm_" + kernel, makeTestModel("qwen2_tiny_gemm", o), opt);
}

}  // namespace

TEST_CASE("llama tiny (GQA 4 heads / 2 kv heads) matches NumPy") { checkAgainstNumpy("llama_tiny", {}); }

TEST_CASE("the avx512 GEMM kernel matches NumPy") { checkGemmKernelAgainstNumpy("avx512"); }
TEST_CASE("the avx2 GEMM kernel matches NumPy") { checkGemmKernelAgainstNumpy("avx2"); }
TEST_CASE("the generic GEMM kernel matches NumPy") { checkGemmKernelAgainstNumpy("generic"); }

TEST_CASE("llama tiny with MHA and with MQA matches NumPy") {
  MakeModelOptions mha;
  mha.numKvHeads = 4;
  checkAgainstNumpy("llama_tiny_mha", mha);
  MakeModelOptions mqa;
  mqa.numKvHeads = 1;
  mqa.seed = 3;
  checkAgainstNumpy("llama_tiny_mqa", mqa);
}

TEST_CASE("qwen2 tiny (qkv bias) matches NumPy") {
  MakeModelOptions o;
  o.qkvBias = true;
  o.seed = 5;
  checkAgainstNumpy("qwen2_tiny", o);
}

TEST_CASE("tied embeddings (llama and qwen2) match NumPy") {
  MakeModelOptions o;
  o.tieEmbeddings = true;
  o.seed = 9;
  checkAgainstNumpy("llama_tiny_tied", o);
  o.qkvBias = true;
  checkAgainstNumpy("qwen2_tiny_tied", o);
}

TEST_CASE("bf16 weights match NumPy") {
  MakeModelOptions o;
  o.dtype = "bf16";
  o.seed = 13;
  checkAgainstNumpy("llama_tiny_bf16", o);
}

TEST_CASE("sharded safetensors with an index match NumPy") {
  MakeModelOptions o;
  o.shards = 3;
  o.seed = 17;
  checkAgainstNumpy("llama_tiny_sharded", o);
}

TEST_CASE("llama3 rope_scaling matches NumPy and changes the logits") {
  MakeModelOptions o;
  o.ropeLlama3 = true;
  o.seed = 21;
  checkAgainstNumpy("llama_tiny_rope_llama3", o);

  // Same weights without the scaling: the logits must differ, or the test above proved nothing.
  MakeModelOptions plain = o;
  plain.ropeLlama3 = false;
  const std::string a = makeTestModel("llama_tiny_rope_llama3", o);
  const std::string b = makeTestModel("llama_tiny_rope_plain21", plain);
  auto ma = loadModel(a);
  auto mb = loadModel(b);
  REQUIRE(ma.ok());
  REQUIRE(mb.ok());
  REQUIRE(ma->get()->config.rope.llama3);
  TestKv kva(ma->get()->config, 8), kvb(mb->get()->config, 8);
  auto ba = makeBackend(*ma, kva);
  auto bb = makeBackend(*mb, kvb);
  std::vector<int32_t> ga, gb;
  const auto prompt = testPrompt(37, 11);
  const auto ra = runGreedy(*ba, kva, prompt, 0, 0, &ga);
  const auto rb = runGreedy(*bb, kvb, prompt, 0, 0, &gb);
  CHECK(relError(ra[0], rb[0]) > 1e-4);
}

TEST_CASE("MistralForCausalLM matches NumPy and refuses contexts past its sliding window") {
  const std::string src = makeTestModel("llama_tiny", {});
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/mistral_tiny." + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::copy(src, dir);
  auto edit = [&](int window) {
    std::ifstream in(dir + "/config.json");
    auto j = nlohmann::json::parse(in);
    j["architectures"] = {"MistralForCausalLM"};
    j["model_type"] = "mistral";
    j["sliding_window"] = window;
    std::ofstream(dir + "/config.json", std::ios::trunc) << j.dump(2);
  };
  edit(4096);
  checkDirAgainstNumpy("mistral_tiny", dir);

  edit(40);
  auto model = loadModel(dir);
  REQUIRE(model.ok());
  TestKv kv((*model)->config, 8);
  auto backend = makeBackend(*model, kv);
  const auto prompt = testPrompt(41, 3);
  const std::vector<int32_t> table = {0, 1, 2};
  std::vector<float> logits((*model)->config.vocabSize);
  SeqChunk c{prompt.data(), 40, 0, table.data(), 3, true};
  CHECK(backend->forward({&c, 1}, logits.data()).isOk());
  c = SeqChunk{prompt.data() + 40, 1, 40, table.data(), 3, true};
  const pd::Status st = backend->forward({&c, 1}, logits.data());
  CHECK(st.code() == pd::StatusCode::kOutOfRange);
  CHECK_THAT(st.message(), Catch::Contains("sliding_window 40"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("qwen3 tiny (per-head q/k RMSNorm, head_dim 2x hidden/heads) matches NumPy") {
  MakeModelOptions o;
  o.arch = "qwen3";
  o.seed = 23;
  checkAgainstNumpy("qwen3_tiny", o);
  o.tieEmbeddings = true;
  o.dtype = "bf16";
  checkAgainstNumpy("qwen3_tiny_tied_bf16", o);
  // Each forced GEMM kernel on the 37-token prefill too.
  for (auto k : {pd::kernels::cpu::GemmKernel::kAvx512, pd::kernels::cpu::GemmKernel::kAvx2,
                 pd::kernels::cpu::GemmKernel::kGeneric}) {
    if (!pd::kernels::cpu::gemmKernelSupported(k)) continue;
    CpuBackendOptions opt;
    opt.gemmKernel = pd::kernels::cpu::gemmKernelInfo(k).name;
    checkDirAgainstNumpy(std::string("qwen3_tiny_") + opt.gemmKernel, makeTestModel("qwen3_tiny_tied_bf16", o), opt);
  }
}

TEST_CASE("qwen3: the q/k norms change the logits (the reference test above can fail)") {
  MakeModelOptions o;
  o.arch = "qwen3";
  o.seed = 23;
  const std::string dir = makeTestModel("qwen3_tiny", o);
  const std::string flat = std::string(PD_TEST_MODEL_DIR) + "/qwen3_flat_norm." + std::to_string(::getpid());
  std::filesystem::remove_all(flat);
  std::filesystem::copy(dir, flat);
  // Rewrites every q_norm/k_norm weight to 1: with RMSNorm still applied the logits must move.
  auto m = loadModel(dir);
  REQUIRE(m.ok());
  auto ref = loadModel(flat);
  REQUIRE(ref.ok());
  auto* mut = const_cast<ModelWeights*>(ref->get());
  for (auto& l : mut->layers) {
    std::fill(l.qNorm.data(), l.qNorm.data() + l.qNorm.size(), 1.0f);
    std::fill(l.kNorm.data(), l.kNorm.data() + l.kNorm.size(), 1.0f);
  }
  TestKv kva((*m)->config, 8), kvb((*ref)->config, 8);
  auto ba = makeBackend(*m, kva);
  auto bb = makeBackend(*ref, kvb);
  std::vector<int32_t> ga, gb;
  const auto prompt = testPrompt(37, 11);
  CHECK(relError(runGreedy(*ba, kva, prompt, 0, 0, &ga)[0], runGreedy(*bb, kvb, prompt, 0, 0, &gb)[0]) > 1e-3);
  std::filesystem::remove_all(flat);
}

TEST_CASE("mixtral tiny (8 experts, top 2) matches NumPy") {
  MakeModelOptions o;
  o.arch = "mixtral";
  o.seed = 29;
  checkAgainstNumpy("mixtral_tiny", o);
  o.dtype = "bf16";
  o.tieEmbeddings = true;
  checkAgainstNumpy("mixtral_tiny_tied_bf16", o);
}

TEST_CASE("qwen3_moe tiny (16 experts, top 4, norm_topk_prob, dense layer 0) matches NumPy") {
  MakeModelOptions o;
  o.arch = "qwen3_moe";
  o.seed = 31;
  checkAgainstNumpy("qwen3_moe_tiny", o);
  // norm_topk_prob false: the kept probabilities are used as they are.
  const std::string src = makeTestModel("qwen3_moe_tiny", o);
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/qwen3_moe_nonorm." + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::copy(src, dir);
  std::ifstream in(dir + "/config.json");
  auto j = nlohmann::json::parse(in);
  j["norm_topk_prob"] = false;
  std::ofstream(dir + "/config.json", std::ios::trunc) << j.dump(2);
  checkDirAgainstNumpy("qwen3_moe_tiny_nonorm", dir);
  std::filesystem::remove_all(dir);
}
