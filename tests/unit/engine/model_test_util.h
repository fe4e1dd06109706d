// Helpers shared by the engine-core tests: make model variants into the build tree, run the
// CPU backend over a prompt + greedy decode, and call the NumPy reference.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/cpu_backend.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"

namespace pd::engine::test {

// Makes (once) a model variant under the build tree. Written to a private temp directory and
// renamed into place, so parallel test processes never see a half-written model.
inline std::string makeTestModel(const std::string& name, const MakeModelOptions& o) {
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/" + name;
  if (std::filesystem::exists(dir + "/config.json")) return dir;
  std::filesystem::create_directories(PD_TEST_MODEL_DIR);
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  const Status st = makeModel(o, tmp);
  REQUIRE(st.toString() == "OK");
  std::error_code ec;
  std::filesystem::rename(tmp, dir, ec);
  if (ec) std::filesystem::remove_all(tmp);  // another process won the race
  REQUIRE(std::filesystem::exists(dir + "/config.json"));
  return dir;
}

inline std::vector<int32_t> testPrompt(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> p{kMadeBosId};
  while (int(p.size()) < n) p.push_back(int32_t(rng() % 256));
  return p;
}

// A KV pool whose block ids are handed out in a shuffled order, so tests catch any code that
// assumes a sequence's blocks are contiguous.
struct TestKv {
  KvLayout layout;
  std::vector<float> data;
  std::vector<int32_t> freeBlocks;
  TestKv(const ModelConfig& c, int numBlocks, int blockSize = 16, uint64_t seed = 7, KvDtype dtype = KvDtype::kF32) {
    layout = kvLayoutFor(c, numBlocks, blockSize, dtype);
    data.assign((layout.totalBytes() + sizeof(float) - 1) / sizeof(float), 0.0f);
    for (int b = 0; b < numBlocks; ++b) freeBlocks.push_back(b);
    std::shuffle(freeBlocks.begin(), freeBlocks.end(), std::mt19937_64(seed));
  }
  std::vector<int32_t> take(int n) {
    REQUIRE(int(freeBlocks.size()) >= n);
    std::vector<int32_t> t(freeBlocks.end() - n, freeBlocks.end());
    freeBlocks.resize(freeBlocks.size() - n);
    return t;
  }
};

inline std::unique_ptr<Backend> makeBackend(std::shared_ptr<const ModelWeights> m, TestKv& kv,
                                            CpuBackendOptions opt = {}) {
  auto b = createCpuBackend(std::move(m), kv.layout, kv.data.data(), opt);
  REQUIRE(b.status().toString() == "OK");
  return std::move(b).value();
}

// Prefill `prompt` in chunks of `chunk` tokens (0 = one step) then `decodeSteps` greedy
// steps. Returns the logits rows (1 + decodeSteps) and appends generated ids to *generated.
inline std::vector<std::vector<float>> runGreedy(Backend& backend, TestKv& kv, const std::vector<int32_t>& prompt,
                                                 int chunk, int decodeSteps, std::vector<int32_t>* generated) {
  const int vocab = backend.config().vocabSize;
  const int total = int(prompt.size()) + decodeSteps;
  auto table = kv.take((total + kv.layout.blockSize - 1) / kv.layout.blockSize);
  std::vector<std::vector<float>> rows;
  std::vector<float> logits(vocab);
  const int step = chunk > 0 ? chunk : int(prompt.size());
  for (int s = 0; s < int(prompt.size()); s += step) {
    const int n = std::min(step, int(prompt.size()) - s);
    const bool last = s + n == int(prompt.size());
    SeqChunk c{prompt.data() + s, n, s, table.data(), int(table.size()), last};
    REQUIRE(backend.forward({&c, 1}, logits.data()).toString() == "OK");
  }
  rows.push_back(logits);
  int pos = int(prompt.size());
  for (int i = 0; i < decodeSteps; ++i) {
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    generated->push_back(next);
    SeqChunk c{&next, 1, pos++, table.data(), int(table.size()), true};
    REQUIRE(backend.forward({&c, 1}, logits.data()).toString() == "OK");
    rows.push_back(logits);
  }
  return rows;
}

// max |a - b| / max |b|: the error measure for logits rows (element-wise relative error is
// meaningless near zero).
inline double relError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::abs(a[i] - b[i])));
    den = std::max(den, double(std::abs(b[i])));
  }
  return num / den;
}

// Runs tests/reference/llama_reference.py over `tokens` and returns the logits rows for
// positions [first - 1, tokens.size()).
inline std::vector<std::vector<float>> numpyReference(const std::string& modelDir, const std::vector<int32_t>& tokens,
                                                      int first, int vocab) {
  const std::string out = modelDir + "/ref." + std::to_string(::getpid()) + ".bin";
  std::string ids;
  for (size_t i = 0; i < tokens.size(); ++i) ids += (i ? "," : "") + std::to_string(tokens[i]);
  const std::string cmd = "/usr/bin/python3 " + std::string(PD_SOURCE_DIR) +
                          "/tests/reference/llama_reference.py --model " + modelDir + " --tokens " + ids + " --first " +
                          std::to_string(first) + " --out " + out;
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream in(out, std::ios::binary);
  std::vector<std::vector<float>> rows;
  std::vector<float> row(vocab);
  while (in.read(reinterpret_cast<char*>(row.data()), std::streamsize(vocab * sizeof(float)))) rows.push_back(row);
  std::filesystem::remove(out);
  return rows;
}

}  // namespace pd::engine::test
