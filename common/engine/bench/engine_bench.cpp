// engine_bench: CPU backend throughput on the `small` preset next to this machine's ceilings
// measured in the same run (STREAM-like triad bandwidth, OpenBLAS sgemm GFLOP/s).
//
//   build/common/engine/bench/engine_bench [--model DIR] [--threads N] [--quick]
//                                          [--only prefill|decode]
//
// Without --model it makes the small preset (seed 1) under /tmp. Not a test: prints figures.
#include <cblas.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/engine/cpu_backend.h"
#include "common/engine/model_maker.h"
#include "common/engine/model_weights.h"

using namespace pd::engine;
using Clock = std::chrono::steady_clock;

namespace {

// CPU seconds used by the whole process (all threads): on a shared machine, wall time
// includes time other processes held the cores; CPU time shows what the work itself cost.
double processCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

double secondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// STREAM triad a = b + s*c over `bytesPerArray`, split across `threads`; best of `reps`.
// Counts 3 arrays of traffic per pass, as STREAM does.
double triadGBs(size_t bytesPerArray, int threads, int reps) {
  const size_t n = bytesPerArray / sizeof(float);
  WeightBuffer a(n), b(n), c(n);
  for (size_t i = 0; i < n; ++i) {
    b.data()[i] = 1.0f;
    c.data()[i] = 2.0f;
  }
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        float* __restrict pa = a.data();
        const float* __restrict pb = b.data();
        const float* __restrict pc = c.data();
        for (size_t i = lo; i < hi; ++i) pa[i] = pb[i] + 3.0f * pc[i];
      });
    for (auto& t : ts) t.join();
    best = std::min(best, secondsSince(t0));
  }
  volatile float sink = a.data()[n / 2];
  (void)sink;
  return 3.0 * double(bytesPerArray) / best / 1e9;
}

double sgemmGflops(int m, int n, int k, int reps) {
  std::vector<float> a(size_t(m) * k, 0.5f), b(size_t(n) * k, 0.25f), c(size_t(m) * n);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k,
                0.0f, c.data(), n);
    best = std::min(best, secondsSince(t0));
  }
  return 2.0 * m * n * double(k) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::string modelDir;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool quick = false;
  std::string only;  // "", "prefill" or "decode"
  int skinnyMaxRows = CpuBackendOptions().skinnyMaxRows;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc)
      modelDir = argv[++i];
    else if (a == "--threads" && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (a == "--quick")
      quick = true;
    else if (a == "--only" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--skinny-max-rows" && i + 1 < argc)
      skinnyMaxRows = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: engine_bench [--model DIR] [--threads N] [--quick] [--only "
                   "prefill|decode] [--skinny-max-rows N]\n");
      return 2;
    }
  }
  if (modelDir.empty()) {
    modelDir = "/tmp/pdserve_bench_small";
    if (!std::filesystem::exists(modelDir + "/config.json")) {
      MakeModelOptions o;
      o.preset = "small";
      if (auto st = makeModel(o, modelDir); !st.isOk()) {
        std::fprintf(stderr, "engine_bench: %s\n", st.toString().c_str());
        return 1;
      }
    }
  }
  auto model = loadModel(modelDir);
  if (!model.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", model.status().toString().c_str());
    return 1;
  }
  const ModelConfig& cfg = (*model)->config;
  setBlasThreads(threads);

  std::printf(
      "engine_bench: model %s (hidden %d, layers %d, heads %d/%d, ffn %d, vocab %d), "
      "%.1f MB f32 weights, %d threads\n",
      modelDir.c_str(), cfg.hiddenSize, cfg.numLayers, cfg.numHeads, cfg.numKvHeads,
      cfg.intermediateSize, cfg.vocabSize, (*model)->totalBytes() / 1e6, threads);
  std::printf("OpenBLAS: core %s; config %s\n", openblas_get_corename(), openblas_get_config());

  // ---- Ceilings ---------------------------------------------------------------------------
  const double weightBytes = double(cfg.decodeWeightParams()) * 4;
  const double bwModelSized = triadGBs(size_t(weightBytes / 3) & ~size_t(63), threads, 10);
  const double bwLarge = triadGBs(size_t(256) << 20, threads, quick ? 2 : 4);
  std::printf(
      "memory bandwidth (triad, %d threads): %.1f GB/s at a model-sized working set "
      "(%.0f MB), %.1f GB/s at 768 MB (3 x 256 MB)\n",
      threads, bwModelSized, weightBytes / 1e6, bwLarge);
  const double gemmSquare = sgemmGflops(2048, 2048, 2048, quick ? 2 : 3);
  const double gemmPrefill =
      sgemmGflops(2048, 2 * cfg.intermediateSize, cfg.hiddenSize, quick ? 2 : 3);
  const double gemmPeak = std::max(gemmSquare, gemmPrefill);
  std::printf("sgemm: %.1f GFLOP/s (2048^3), %.1f GFLOP/s (2048x%dx%d, the gate|up shape)\n",
              gemmSquare, gemmPrefill, 2 * cfg.intermediateSize, cfg.hiddenSize);

  // ---- Prefill ------------------------------------------------------------------------------
  const int blockSize = 16;
  std::mt19937_64 rng(1);
  std::printf("\nprefill (one sequence, one forward step, logits of the last token):\n");
  for (int p : {128, 512, 2048}) {
    if (only == "decode") break;
    const int blocks = (p + blockSize - 1) / blockSize;
    const auto layout = kvLayoutFor(cfg, blocks, blockSize);
    WeightBuffer kv(layout.totalBytes() / sizeof(float));
    CpuBackendOptions opt;
    opt.numThreads = threads;
    opt.skinnyMaxRows = skinnyMaxRows;
    auto backend = createCpuBackend(*model, layout, kv.data(), opt);
    if (!backend.ok()) return 1;
    std::vector<int32_t> tokens(p), table(blocks);
    for (auto& t : tokens) t = int32_t(rng() % 256);
    for (int b = 0; b < blocks; ++b) table[b] = b;
    std::vector<float> logits(cfg.vocabSize);
    SeqChunk c{tokens.data(), p, 0, table.data(), blocks, true};
    double best = 1e30, bestCpu = 1e30;
    const int reps = quick ? 1 : (p >= 2048 ? 2 : 3);
    for (int r = 0; r < reps + 1; ++r) {  // first run warms up
      const auto t0 = Clock::now();
      const double c0 = processCpuSeconds();
      if (!(*backend)->forward({&c, 1}, logits.data()).isOk()) return 1;
      if (r > 0) {
        best = std::min(best, secondsSince(t0));
        bestCpu = std::min(bestCpu, processCpuSeconds() - c0);
      }
    }
    const double linearFlops = 2.0 * double(cfg.decodeWeightParams() - cfg.hiddenSize) * p -
                               2.0 * double(cfg.vocabSize) * cfg.hiddenSize * (p - 1);
    const double attnFlops =
        4.0 * cfg.headDim * cfg.numHeads * double(p) * (p + 1) / 2 * cfg.numLayers;
    const double gflops = (linearFlops + attnFlops) / best / 1e9;
    std::printf(
        "  %5d tokens: %8.0f tok/s  (%.1f ms, %.1f GFLOP/s = %.0f%% of sgemm peak; %.1f CPU-ms)\n",
        p, p / best, best * 1e3, gflops, 100.0 * gflops / gemmPeak, bestCpu * 1e3);
  }

  // ---- Decode -------------------------------------------------------------------------------
  const int ctx = 512;
  std::printf("\ndecode (%d tokens of context per sequence, one token per sequence per step):\n",
              ctx);
  for (int batch : {1, 8, 32}) {
    if (only == "prefill") break;
    // Batch 1 steps take ~3 ms: many of them, and the median, so a noisy neighbour's burst
    // does not decide the figure.
    const int steps = quick ? 16 : (batch == 1 ? 256 : 32);
    const int perSeq = (ctx + steps + blockSize - 1) / blockSize;
    const auto layout = kvLayoutFor(cfg, perSeq * batch, blockSize);
    WeightBuffer kv(layout.totalBytes() / sizeof(float));
    // The cache contents do not change the work: fill it with noise instead of prefilling.
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t i = 0; i < kv.size(); ++i) kv.data()[i] = nd(rng);
    CpuBackendOptions opt;
    opt.numThreads = threads;
    opt.skinnyMaxRows = skinnyMaxRows;
    auto backend = createCpuBackend(*model, layout, kv.data(), opt);
    if (!backend.ok()) return 1;
    std::vector<std::vector<int32_t>> tables(batch, std::vector<int32_t>(perSeq));
    for (int s = 0; s < batch; ++s)
      for (int b = 0; b < perSeq; ++b) tables[s][b] = s * perSeq + b;
    std::vector<int32_t> next(batch, 65);
    std::vector<float> logits(size_t(batch) * cfg.vocabSize);
    std::vector<SeqChunk> chunks(batch);
    double total = 0, cpu = 0;
    std::vector<double> stepSeconds;
    for (int step = -2; step < steps; ++step) {  // two warm-up steps
      const int pos = ctx + std::max(step, 0);
      for (int s = 0; s < batch; ++s)
        chunks[s] = SeqChunk{&next[s], 1, pos, tables[s].data(), perSeq, true};
      const auto t0 = Clock::now();
      const double c0 = processCpuSeconds();
      if (!(*backend)->forward(chunks, logits.data()).isOk()) return 1;
      if (step >= 0) {
        stepSeconds.push_back(secondsSince(t0));
        total += stepSeconds.back();
        cpu += processCpuSeconds() - c0;
      }
      for (int s = 0; s < batch; ++s)
        next[s] = int32_t(std::max_element(logits.begin() + size_t(s) * cfg.vocabSize,
                                           logits.begin() + size_t(s + 1) * cfg.vocabSize) -
                          (logits.begin() + size_t(s) * cfg.vocabSize));
    }
    std::nth_element(stepSeconds.begin(), stepSeconds.begin() + steps / 2, stepSeconds.end());
    const double medianStep = stepSeconds[size_t(steps / 2)];
    const double tokS = batch / medianStep;
    std::printf(
        "  batch %2d: %8.1f tok/s  (median step %.2f ms, mean %.2f ms; %.2f CPU-ms per step over "
        "all threads)",
        batch, tokS, medianStep * 1e3, total / steps * 1e3, cpu / steps * 1e3);
    if (batch == 1) {
      const double kvBytes = 2.0 * ctx * cfg.kvDim() * 4 * cfg.numLayers;
      const double floorModel = weightBytes / (bwModelSized * 1e9);
      const double floorLarge = weightBytes / (bwLarge * 1e9);
      const double stepS = medianStep;
      std::printf(
          "\n    bandwidth floor (%.1f MB weights / token): %.3f ms at %.1f GB/s -> %.0f%% of "
          "floor; %.3f ms at %.1f GB/s -> %.0f%%\n    (the %.1f MB of KV read per token at "
          "ctx %d is on top of the weights)",
          weightBytes / 1e6, floorModel * 1e3, bwModelSized, 100.0 * floorModel / stepS,
          floorLarge * 1e3, bwLarge, 100.0 * floorLarge / stepS, kvBytes / 1e6, ctx);
    }
    std::printf("\n");
  }
  return 0;
}
