// engine_core_bench: per-token host costs of the engine's core logic, each next to a
// ceiling measured in the same run. Not a ctest test (docs/design.md §9: benchmarks are separate
// executables). Usage: engine_core_bench [vocab=128256] [iterations=200]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/base/cli.h"
#include "engine/kv_cache_manager.h"
#include "engine/logits_processors.h"
#include "engine/sampling.h"
#include "engine/scheduler.h"

using namespace pd;
using namespace pd::engine;

namespace {

double microsPer(int iters, const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  int vocab = 128256, iters = 200;
  CLI::App app{
      "engine_core_bench: per-token host costs of the engine's core logic, each next to "
      "a ceiling measured in the same run",
      "engine_core_bench"};
  pd::cli::configure(app);
  app.add_option("vocab", vocab, "vocabulary size")->check(CLI::Range(2, 1 << 30))->capture_default_str();
  app.add_option("iterations", iters, "iterations per measurement")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;

  // Logits shaped like a language model's: most mass on a few hundred tokens.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (auto& x : logits) x = 2.5f * normal(rng);

  // Ceiling: one scalar libm exp pass over the vocabulary (what any exact softmax pays).
  {
    volatile double sink = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      double s = 0;
      for (int i = 0; i < vocab; ++i) s += std::exp(double(logits[size_t(i)]) - 10.0);
      sink = sink + s;
    }
    std::printf("ceiling  scalar exp pass over vocab %d: %8.1f us\n", vocab, microsPer(iters, t0));
  }
  struct Case {
    const char* name;
    float temperature;
    int topK;
    float topP;
    float minP;
    int logprobs;
    // The logits processors on top (logits_processors.h): a row copy, the penalties and two
    // logit_bias entries over a 2k-token history (1k prompt, 1k output), and the greedy pass
    // over the raw row for the logprobs.
    bool processors = false;
  };
  const Case cases[] = {
      {"greedy", 0.0f, 0, 1.0f, 0.0f, 0},
      {"temperature 0.8", 0.8f, 0, 1.0f, 0.0f, 0},
      {"top_k 50", 0.8f, 50, 1.0f, 0.0f, 0},
      {"top_p 0.9", 0.8f, 0, 0.9f, 0.0f, 0},
      {"top_k 50 + top_p 0.9", 0.8f, 50, 0.9f, 0.0f, 0},
      {"min_p 0.05", 0.8f, 0, 1.0f, 0.05f, 0},
      {"temperature 1 + 5 logprobs", 1.0f, 0, 1.0f, 0.0f, 5},
      {"t 0.8 + penalties, 2k history", 0.8f, 0, 1.0f, 0.0f, 0, true},
  };
  std::vector<int32_t> history(2048);
  for (size_t i = 0; i < history.size(); ++i) history[i] = int32_t((i * 7919) % size_t(vocab));
  for (const Case& c : cases) {
    SamplingParams p;
    p.temperature = c.temperature;
    p.topK = c.topK;
    p.topP = c.topP;
    p.minP = c.minP;
    p.logprobs = c.logprobs;
    p.seed = 1;
    if (c.processors) {
      p.presencePenalty = p.frequencyPenalty = 0.5f;
      p.repetitionPenalty = 1.1f;
      p.logitBias = {{1, 5.0f}, {2, -5.0f}};
    }
    long sum = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      sum += c.processors ? sampleWithProcessors(logits.data(), vocab, p, uint64_t(it), history, 1024, -1).id
                          : sample(logits.data(), vocab, p, uint64_t(it)).id;
    }
    std::printf("sample   %-28s        %8.1f us/token (checksum %ld)\n", c.name, microsPer(iters, t0), sum % 1000);
  }

  // KV allocator: allocate 1k-token sequences, extend them token by token, free.
  {
    KvLayout l;
    l.numLayers = 32;
    l.numBlocks = 8192;
    l.blockSize = 16;
    l.numKvHeads = 8;
    l.headDim = 128;
    l.dtype = KvDtype::kBF16;
    auto kv = KvCacheManager::create(l, KvCacheManager::Backing::kAccountingOnly);
    if (!kv.ok()) {
      std::fprintf(stderr, "%s\n", kv.status().toString().c_str());
      return 1;
    }
    const int seqs = 64;
    long ops = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int round = 0; round < 20; ++round) {
      for (int s = 0; s < seqs; ++s) {
        if (!(*kv)->allocate(SeqId(s), 1000).isOk()) return 1;
        ++ops;
      }
      for (int t = 1001; t <= 1064; ++t) {
        for (int s = 0; s < seqs; ++s) {
          if (!(*kv)->extend(SeqId(s), t).isOk()) return 1;
          ++ops;
        }
      }
      for (int s = 0; s < seqs; ++s) {
        if (!(*kv)->free(SeqId(s)).isOk()) return 1;
        ++ops;
      }
    }
    const double us = microsPer(int(ops), t0);
    std::printf("kv       allocate/extend/free (64 seqs, bs 16)  %8.3f us/op (%ld ops)\n", us, ops);

    // Scheduler: one decode-heavy step with 64 running and 256 waiting sequences.
    std::vector<std::vector<TokenId>> toks(320);
    std::vector<SeqView> running, waiting;
    for (int s = 0; s < 320; ++s) {
      toks[size_t(s)].assign(512, TokenId(s));
      SeqView v;
      v.id = SeqId(s);
      v.numTokens = 513;
      v.numPromptTokens = 512;
      v.tokens = toks[size_t(s)];
      if (s < 64) {
        if (!(*kv)->allocate(v.id, 512).isOk()) return 1;
        v.numComputed = 512;
        running.push_back(v);
      } else {
        v.numTokens = 512;
        waiting.push_back(v);
      }
    }
    SchedulerConfig cfg;
    cfg.maxBatchTokens = 2048;
    cfg.maxNumSeqs = 128;
    Scheduler sched(cfg);
    SchedulerView view;
    view.running = running;
    view.waiting = waiting;
    view.kv = kv->get();
    size_t entries = 0;
    auto t1 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) entries += sched.schedule(view).entries.size();
    std::printf("schedule 64 decoding + 256 waiting (prefix lookups) %8.1f us/step (%zu entries)\n",
                microsPer(iters, t1), entries / size_t(iters));
  }
  return 0;
}
