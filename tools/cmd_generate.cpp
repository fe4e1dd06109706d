// pdserve generate: runs the engine in one process on token ids and prints the generated ids.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common/engine/cpu_backend.h"
#include "common/engine/model_weights.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

void usage() {
  std::fprintf(stderr,
               "usage: pdserve generate --model DIR --prompt-ids 1,2,3 [--max-tokens N]\n"
               "                        [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed N]\n"
               "                        [--threads N] [--ignore-eos] [--logits-out FILE]\n"
               "  --prompt-ids    comma-separated token ids (text prompts need the tokenizer,\n"
               "                  which is not wired into this command yet: --prompt is not accepted)\n"
               "  --max-tokens    tokens to generate (default 16)\n"
               "  --temperature   0 (default) = greedy; sampling arrives with common/engine/sampling.h\n"
               "  --logits-out    writes each step's raw f32 logits (steps x vocab, little endian)\n"
               "Prints the generated ids, comma-separated, on stdout.\n");
}

struct SamplingArgs {
  float temperature = 0.0f;
  int topK = 0;
  float topP = 1.0f;
  float minP = 0.0f;
  uint64_t seed = 0;
  bool greedy() const { return temperature <= 0.0f; }
};

// The sampling seam: the one place the next token is chosen from a row of logits. Greedy
// (argmax, lowest id on ties) until common/engine/sampling.h's sampler is plugged in here.
int32_t pickNextToken(const float* logits, int vocab, const SamplingArgs& args) {
  (void)args;
  return int32_t(std::max_element(logits, logits + vocab) - logits);
}

bool parseIds(const std::string& s, std::vector<int32_t>* out) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string tok = s.substr(i, j - i);
    char* end = nullptr;
    const long v = std::strtol(tok.c_str(), &end, 10);
    if (tok.empty() || *end != '\0' || v < 0 || v > INT32_MAX) return false;
    out->push_back(int32_t(v));
    i = j + 1;
  }
  return !out->empty();
}

}  // namespace

int runGenerate(int argc, char** argv) {
  std::string modelDir, logitsOut;
  std::vector<int32_t> prompt;
  int maxTokens = 16, threads = 0;
  bool ignoreEos = false;
  SamplingArgs sampling;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "generate: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else if (a == "--model") {
      modelDir = value();
    } else if (a == "--prompt-ids") {
      if (!parseIds(value(), &prompt)) {
        std::fprintf(stderr, "generate: --prompt-ids must be comma-separated non-negative integers\n");
        return 2;
      }
    } else if (a == "--prompt") {
      std::fprintf(stderr, "generate: --prompt TEXT needs the tokenizer, not wired in yet; use --prompt-ids\n");
      return 2;
    } else if (a == "--max-tokens") {
      maxTokens = std::atoi(value());
    } else if (a == "--threads") {
      threads = std::atoi(value());
    } else if (a == "--temperature") {
      sampling.temperature = std::strtof(value(), nullptr);
    } else if (a == "--top-k") {
      sampling.topK = std::atoi(value());
    } else if (a == "--top-p") {
      sampling.topP = std::strtof(value(), nullptr);
    } else if (a == "--min-p") {
      sampling.minP = std::strtof(value(), nullptr);
    } else if (a == "--seed") {
      sampling.seed = std::strtoull(value(), nullptr, 10);
    } else if (a == "--ignore-eos") {
      ignoreEos = true;
    } else if (a == "--logits-out") {
      logitsOut = value();
    } else {
      std::fprintf(stderr, "generate: unknown option '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (modelDir.empty() || prompt.empty()) {
    std::fprintf(stderr, "generate: --model and --prompt-ids are required\n");
    usage();
    return 2;
  }
  if (maxTokens < 1 || threads < 0) {
    std::fprintf(stderr, "generate: --max-tokens must be >= 1 and --threads >= 0\n");
    return 2;
  }
  if (!sampling.greedy()) {
    std::fprintf(stderr, "generate: only greedy decoding (--temperature 0) is available until the "
                         "sampler (common/engine/sampling.h) is plugged in\n");
    return 2;
  }

  auto model = engine::loadModel(modelDir);
  if (!model.ok()) {
    std::fprintf(stderr, "generate: %s\n", model.status().toString().c_str());
    return 1;
  }
  const auto& cfg = (*model)->config;
  const int blockSize = 16;
  const int total = int(prompt.size()) + maxTokens;
  const int numBlocks = (total + blockSize - 1) / blockSize;
  const auto layout = engine::kvLayoutFor(cfg, numBlocks, blockSize);
  std::vector<float> kv(layout.totalBytes() / sizeof(float));
  engine::CpuBackendOptions opt;
  opt.numThreads = threads;
  auto backend = engine::createCpuBackend(*model, layout, kv.data(), opt);
  if (!backend.ok()) {
    std::fprintf(stderr, "generate: %s\n", backend.status().toString().c_str());
    return 1;
  }
  std::vector<int32_t> table(numBlocks);
  for (int b = 0; b < numBlocks; ++b) table[b] = b;

  std::ofstream logitsFile;
  if (!logitsOut.empty()) {
    logitsFile.open(logitsOut, std::ios::binary | std::ios::trunc);
    if (!logitsFile) {
      std::fprintf(stderr, "generate: cannot create %s\n", logitsOut.c_str());
      return 1;
    }
  }
  std::vector<float> logits(cfg.vocabSize);
  std::vector<int32_t> out;
  engine::SeqChunk chunk{prompt.data(), int(prompt.size()), 0, table.data(), numBlocks, true};
  int32_t next = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double prefillS = 0;
  for (int step = 0; step < maxTokens; ++step) {
    const Status st = (*backend)->forward({&chunk, 1}, logits.data());
    if (!st.isOk()) {
      std::fprintf(stderr, "generate: %s\n", st.toString().c_str());
      return 1;
    }
    if (step == 0) prefillS = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (logitsFile) logitsFile.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * 4));
    next = pickNextToken(logits.data(), cfg.vocabSize, sampling);
    out.push_back(next);
    if (!ignoreEos && std::find(cfg.eosTokenIds.begin(), cfg.eosTokenIds.end(), next) != cfg.eosTokenIds.end()) break;
    chunk = engine::SeqChunk{&next, 1, chunk.startPos + chunk.numTokens, table.data(), numBlocks, true};
  }
  const double totalS = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? "," : "", out[i]);
  std::printf("\n");
  std::fprintf(stderr, "generate: prompt %zu tokens in %.1f ms; %zu tokens generated, %.1f tok/s decode\n",
               prompt.size(), prefillS * 1e3, out.size(),
               out.size() > 1 ? double(out.size() - 1) / (totalS - prefillS) : 0.0);
  return 0;
}

}  // namespace pd::tools
