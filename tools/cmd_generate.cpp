// pdserve generate: runs the engine in one process on token ids and prints the generated ids.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "engine/cpu_backend.h"
#include "engine/model_weights.h"
#include "engine/sampling.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

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

struct GenerateArgs {
  std::string modelDir, logitsOut, promptText;
  std::vector<int32_t> prompt;
  int maxTokens = 16, threads = 0;
  std::string weightFormat = "f32";
  bool ignoreEos = false;
  engine::SamplingParams sampling;
  GenerateArgs() { sampling.temperature = 0.0f; }
};

int runGenerate(GenerateArgs& args) {
  const std::string& modelDir = args.modelDir;
  const std::string& logitsOut = args.logitsOut;
  const std::string& promptText = args.promptText;
  std::vector<int32_t>& prompt = args.prompt;
  const int maxTokens = args.maxTokens, threads = args.threads;
  const bool ignoreEos = args.ignoreEos;
  engine::SamplingParams& sampling = args.sampling;
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  if (!modelDir.empty() && !promptText.empty()) {
    auto t = tok::Tokenizer::loadDir(modelDir);
    auto ids = t.ok() ? t.value()->encode(promptText) : Result<std::vector<int32_t>>(t.status());
    if (!ids.ok()) {
      std::fprintf(stderr, "generate: %s\n", ids.status().toString().c_str());
      return 1;
    }
    tokenizer = t.value();
    prompt = ids.value();
  }
  if (modelDir.empty() || prompt.empty()) {
    std::fprintf(stderr,
                 "generate: --model and --prompt-ids or --prompt are required "
                 "(see pdserve generate --help)\n");
    return 2;
  }
  if (maxTokens < 1 || threads < 0) {
    std::fprintf(stderr, "generate: --max-tokens must be >= 1 and --threads >= 0\n");
    return 2;
  }
  sampling.maxTokens = maxTokens;
  if (!sampling.seed) sampling.seed = engine::randomSeed();
  if (Status s = sampling.validate(); !s.isOk()) {
    std::fprintf(stderr, "generate: %s\n", s.message().c_str());
    return 2;
  }

  auto model = engine::loadModel(modelDir, args.weightFormat);
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
  opt.weightFormat = args.weightFormat;
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
    // Step-indexed sampling: the same (seed, step) draws what a worker draws.
    next = engine::sample(logits.data(), cfg.vocabSize, sampling, uint64_t(step)).id;
    out.push_back(next);
    if (!ignoreEos && std::find(cfg.eosTokenIds.begin(), cfg.eosTokenIds.end(), next) != cfg.eosTokenIds.end()) break;
    chunk = engine::SeqChunk{&next, 1, chunk.startPos + chunk.numTokens, table.data(), numBlocks, true};
  }
  const double totalS = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? "," : "", out[i]);
  std::printf("\n");
  if (tokenizer) std::fprintf(stderr, "text: %s\n", tokenizer->decode(out).c_str());
  std::fprintf(stderr, "generate: prompt %zu tokens in %.1f ms; %zu tokens generated, %.1f tok/s decode\n",
               prompt.size(), prefillS * 1e3, out.size(),
               out.size() > 1 ? double(out.size() - 1) / (totalS - prefillS) : 0.0);
  return 0;
}

}  // namespace

void addGenerateCommand(CLI::App& pdserve, CommandRun& run) {
  CLI::App* cmd = pdserve.add_subcommand("generate", "run the engine in-process on token ids (greedy)");
  cmd->footer(
      "Prints the generated ids, comma-separated, on stdout (and with --prompt the text on "
      "stderr).");
  auto args = std::make_shared<GenerateArgs>();
  engine::SamplingParams& sampling = args->sampling;
  cmd->add_option("--model", args->modelDir, "the model directory");
  cmd->add_option_function<std::string>(
         "--prompt-ids", [args](const std::string& v) { parseIds(v, &args->prompt); }, "comma-separated token ids")
      ->check([](const std::string& v) {
        std::vector<int32_t> ids;
        return parseIds(v, &ids) ? std::string() : std::string("must be comma-separated non-negative integers");
      });
  cmd->add_option("--prompt", args->promptText, "text, encoded with the model's tokenizer (special tokens added)");
  cmd->add_option("--max-tokens", args->maxTokens, "tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", sampling.temperature,
                  "0 (default) = greedy; with --seed the same seed gives the same tokens");
  cmd->add_option("--top-k", sampling.topK, "top-k sampling");
  cmd->add_option("--top-p", sampling.topP, "top-p sampling");
  cmd->add_option("--min-p", sampling.minP, "min-p sampling");
  cmd->add_option_function<uint64_t>(
      "--seed", [&sampling](uint64_t seed) { sampling.seed = seed; }, "sampling seed (default: a random one)");
  cmd->add_option("--threads", args->threads, "CPU threads (0: the backend's default)");
  cmd->add_option("--weight-format", args->weightFormat,
                  "how the linear weights are held: f32, bf16 or q8_0 (engine.weight_format)")
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", args->ignoreEos, "generate --max-tokens even past EOS");
  cmd->add_option("--logits-out", args->logitsOut, "writes each step's raw f32 logits (steps x vocab, little endian)");
  cmd->callback([args, &run] { run = [args] { return runGenerate(*args); }; });
}

}  // namespace pd::tools
