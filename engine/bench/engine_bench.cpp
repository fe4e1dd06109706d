// engine_bench: CPU backend throughput on the `small` preset next to this machine's ceilings
// measured from the hardware in the same run: the FMA peak of the same number of threads
// (independent FMA chains, widest vector unit the CPU has) for prefill, and read bandwidth over
// a working set the size of the weights for decode. OpenBLAS's sgemm is printed beside our
// GEMM as a comparison, never as a ceiling (it is only as fast as its CPU detection).
//
//   build/engine/bench/engine_bench [--model DIR | --arch ARCH] [--threads N] [--quick]
//                                          [--only prefill|decode|context|llama] [--batch 1|8|32]
//                                          [--llama-bench PATH] [--rounds N]
//                                          [--write-gguf PATH] [--gemm-kernel avx512|avx2|generic]
//                                          [--weight-format f32|bf16|q8_0] [--llama-quantize PATH]
//                                          [--kv-dtype f32|bf16|int8|fp8]
//
// Without --model it makes the small preset (seed 1) under /tmp. Not a test: prints figures.
// Batch-1 decode is also reported per CPU-second, beside a ceiling measured the same way: a
// read pass over a buffer of the step's weight bytes, on the same threads, runs before every
// 16 steps and after the last (17 passes for 256 steps); the share printed is the median
// pass's CPU time over the median step's CPU time (process CPU time, all threads). Time the
// process was descheduled counts in neither, and passes and steps meet the same neighbours'
// memory traffic, so on a shared machine this share moves far less than the wall-clock one.
// --only context: prompt chunks after 0-2,048 cached tokens, their time a token against the
// price SLO-sized chunks give them (1 + position / ModelConfig::attentionSpanTokens).
// --llama-bench PATH: also runs that llama-bench binary on the same weights (written as an f32
// GGUF to a temporary file by writeLlamaGguf: Llama, Mistral, Mixtral, Qwen3, Qwen3-MoE and
// DeepSeek-V3, each as the llama.cpp architecture gguf_writer.h names) and prints its
// `tg128 @ d512` and `pp2048` next to ours, measured the same way (mean over 5 repetitions of
// tokens / wall time), interleaved ours, theirs, ours, theirs so the machine's noise hits
// both, each next to the same run's ceiling (read bandwidth over the bytes a decode step
// reads; the FMA peak for the prefill's FLOPs).
// --weight-format bf16|q8_0 with --llama-quantize PATH: llama.cpp gets the same weights
// converted by that llama-quantize to BF16 / Q8_0 (token_embd, output and a mixture of
// experts' experts kept F32, as ours stay f32), so both read the same bytes a step.
// --write-gguf PATH writes the GGUF (converted the same way when --llama-quantize is given)
// and exits.
#include <cblas.h>
#include <immintrin.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/cli.h"
#include "engine/bench/gguf_writer.h"
#include "engine/cpu_backend.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"
#include "engine/scheduler.h"
#include "pd/kernels/gemm.h"

using namespace pd::engine;
namespace kc = pd::kernels::cpu;
using Clock = std::chrono::steady_clock;

namespace {

// CPU seconds used by the whole process (all threads): on a shared machine, wall time
// includes time other processes held the cores; CPU time shows what the work itself cost.
double processCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

double secondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs fn(t) on `threads` threads at once; wall seconds of the slowest.
template <typename Fn>
double onThreads(int threads, Fn&& fn) {
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { fn(t); });
  for (auto& t : ts) t.join();
  return secondsSince(t0);
}

// The read loop of the bandwidth ceilings: sums p[lo, hi) (hi - lo a multiple of 32) with
// loads only, 4 independent AVX accumulators; the result keeps the loads from being dropped.
float readSum(const float* p, size_t lo, size_t hi) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = lo; i < hi; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return out[0] + out[7];
}

// Read bandwidth: `threads` threads each sum their share of a `bytes` buffer (readSum); best
// of `reps` passes, GB/s.
double readGBs(size_t bytes, int threads, int reps) {
  const size_t n = bytes / sizeof(float) / 32 * 32;
  WeightBuffer buf(n);
  for (size_t i = 0; i < n; ++i) buf.data()[i] = float(i & 7);
  std::vector<float> sums(static_cast<size_t>(threads));
  double best = 1e30;
  for (int r = 0; r < reps; ++r)
    best = std::min(best, onThreads(threads, [&](int t) {
                      const size_t lo = n * t / threads / 32 * 32, hi = n * (t + 1) / threads / 32 * 32;
                      sums[size_t(t)] = readSum(buf.data(), lo, hi);
                    }));
  volatile float sink = sums[0];
  (void)sink;
  return double(n) * sizeof(float) / best / 1e9;
}

// The decode's ceiling measured beside it: one read pass (readGBs's loads) over a buffer of
// the bytes a decode step reads, on the decode's thread count, run between groups of decode
// steps so that both see the same load from other processes. Each pass records its wall time
// and the CPU time its threads used: on a shared machine a pass that was descheduled is slow
// on the wall clock but not in CPU time, as a decode step is.
class InterleavedReadPasses {
 public:
  InterleavedReadPasses(size_t bytes, int threads) : n_(bytes / sizeof(float) / 32 * 32), threads_(threads), buf_(n_) {
    for (size_t i = 0; i < n_; ++i) buf_.data()[i] = float(i & 7);
  }
  void pass() {
    std::vector<float> sums(static_cast<size_t>(threads_));
    std::vector<double> threadCpu(static_cast<size_t>(threads_));
    wall_.push_back(onThreads(threads_, [&](int t) {
      // Each thread's own CPU clock: a joined thread's time may not be in the process clock
      // yet when join returns.
      timespec c0, c1;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
      const size_t lo = n_ * t / threads_ / 32 * 32, hi = n_ * (t + 1) / threads_ / 32 * 32;
      sums[size_t(t)] = readSum(buf_.data(), lo, hi);
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
      threadCpu[size_t(t)] = double(c1.tv_sec - c0.tv_sec) + (c1.tv_nsec - c0.tv_nsec) * 1e-9;
    }));
    double cpu = 0;
    for (double c : threadCpu) cpu += c;
    cpu_.push_back(cpu);
    volatile float sink = sums[0];
    (void)sink;
  }
  double bytes() const { return double(n_) * sizeof(float); }
  int passes() const { return int(wall_.size()); }
  // GB/s of the best and the median pass, on the wall clock and per CPU-second.
  double bestWallGBs() const { return bytes() / *std::min_element(wall_.begin(), wall_.end()) / 1e9; }
  double bestCpuGBs() const { return bytes() / *std::min_element(cpu_.begin(), cpu_.end()) / 1e9; }
  double medianWallGBs() const { return bytes() / median(wall_) / 1e9; }
  double medianCpuGBs() const { return bytes() / median(cpu_) / 1e9; }
  static double median(std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + ptrdiff_t(v.size() / 2), v.end());
    return v[v.size() / 2];
  }

 private:
  size_t n_;
  int threads_;
  WeightBuffer buf_;
  std::vector<double> wall_, cpu_;
};

// FMA peak of `threads` threads running `kernel`'s instructions at once; best of `reps`.
double fmaPeakGflops(kc::GemmKernel kernel, int threads, int reps) {
  const long iters = 20000000;  // ~0.1-0.3 s per thread
  double flops = 0, best = 1e30;
  for (int r = 0; r < reps; ++r)
    best = std::min(best, onThreads(threads, [&](int t) {
                      const double f = kc::gemmFmaProbe(kernel, iters);
                      if (t == 0) flops = f;
                    }));
  return flops * threads / best / 1e9;
}

// One GEMM y = x * w^T at the given shape on `threads` threads, best of `reps`: ours (columns
// split over threads, as the backend does) and OpenBLAS's (its own threads).
double oursGemmGflops(kc::GemmKernel kernel, int m, int n, int k, int threads, int reps) {
  std::vector<float> a(size_t(m) * k, 0.5f), b(size_t(n) * k, 0.25f), c(size_t(m) * n);
  std::vector<kc::GemmWorkspace> ws(static_cast<size_t>(threads));
  const int nr = kc::gemmKernelInfo(kernel).nr, units = (n + nr - 1) / nr;
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // the first run grows the workspaces
    const double s = onThreads(threads, [&](int t) {
      const int lo = std::min(n, units * t / threads * nr), hi = std::min(n, units * (t + 1) / threads * nr);
      kc::gemm(kernel, m, lo, hi, k, a.data(), k, b.data(), k, kc::GemmB::kNK, 0.0f, c.data(), n, ws[size_t(t)]);
    });
    if (r > 0) best = std::min(best, s);
  }
  return 2.0 * m * n * double(k) / best / 1e9;
}

double sgemmGflops(int m, int n, int k, int reps) {
  std::vector<float> a(size_t(m) * k, 0.5f), b(size_t(n) * k, 0.25f), c(size_t(m) * n);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
    best = std::min(best, secondsSince(t0));
  }
  return 2.0 * m * n * double(k) / best / 1e9;
}

// --kv-dtype: the KV cache of every measured backend (engine.kv_cache_dtype).
KvDtype gKvDtype = KvDtype::kF32;

int fail(const pd::Status& st) {
  std::fprintf(stderr, "engine_bench: %s\n", st.toString().c_str());
  return 1;
}

// One forward of a p-token prompt chunk from position `start` (the cache before it is zeros:
// its contents do not change the work), `reps` times after one
// warm-up; wall seconds per repetition. The backend (and its pool) lives only for the
// measurement.
pd::Result<std::vector<double>> prefillSeconds(const std::shared_ptr<const ModelWeights>& model, int p,
                                               const CpuBackendOptions& opt, int reps, std::mt19937_64& rng,
                                               double* bestCpu, int start = 0) {
  const ModelConfig& cfg = model->config;
  const int blockSize = 16;
  const int blocks = (start + p + blockSize - 1) / blockSize;
  const auto layout = kvLayoutFor(cfg, blocks, blockSize, gKvDtype);
  WeightBuffer kv((layout.totalBytes() + sizeof(float) - 1) / sizeof(float));
  auto backend = createCpuBackend(model, layout, kv.data(), opt);
  if (!backend.ok()) return backend.status();
  std::vector<int32_t> tokens(p), table(blocks);
  for (auto& t : tokens) t = int32_t(rng() % 256);
  for (int b = 0; b < blocks; ++b) table[b] = b;
  std::vector<float> logits(cfg.vocabSize);
  SeqChunk c{tokens.data(), p, start, table.data(), blocks, true};
  std::vector<double> out;
  for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
    const auto t0 = Clock::now();
    const double c0 = processCpuSeconds();
    PD_RETURN_IF_ERROR((*backend)->forward({&c, 1}, logits.data()));
    if (r > 0) {
      out.push_back(secondsSince(t0));
      if (bestCpu) *bestCpu = std::min(*bestCpu, processCpuSeconds() - c0);
    }
  }
  return out;
}

// Greedy decode of `batch` sequences that each hold `ctx` tokens of context. The cache is
// filled with noise instead of prefilled: its contents do not change the work.
class DecodeBench {
 public:
  static pd::Result<std::unique_ptr<DecodeBench>> create(const std::shared_ptr<const ModelWeights>& model, int batch,
                                                         int ctx, int maxSteps, const CpuBackendOptions& opt,
                                                         std::mt19937_64& rng) {
    auto b = std::unique_ptr<DecodeBench>(new DecodeBench);
    const ModelConfig& cfg = model->config;
    const int blockSize = 16;
    b->cfg_ = cfg;
    b->batch_ = batch;
    b->ctx_ = ctx;
    b->perSeq_ = (ctx + maxSteps + blockSize - 1) / blockSize;
    const auto layout = kvLayoutFor(cfg, b->perSeq_ * batch, blockSize, gKvDtype);
    b->kv_ = WeightBuffer((layout.totalBytes() + sizeof(float) - 1) / sizeof(float));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    // A narrower cache stays zeros (f32 noise would be NaN codes and scales there).
    if (gKvDtype == KvDtype::kF32)
      for (size_t i = 0; i < b->kv_.size(); ++i) b->kv_.data()[i] = nd(rng);
    auto backend = createCpuBackend(model, layout, b->kv_.data(), opt);
    if (!backend.ok()) return backend.status();
    b->backend_ = std::move(*backend);
    b->tables_.assign(batch, std::vector<int32_t>(b->perSeq_));
    for (int s = 0; s < batch; ++s)
      for (int k = 0; k < b->perSeq_; ++k) b->tables_[s][k] = s * b->perSeq_ + k;
    return b;
  }

  // `steps` steps from position ctx (each call starts there again). stepSeconds (optional):
  // wall seconds of each forward; cpuSeconds (optional): process CPU time of the forwards;
  // stepCpuSeconds (optional): the process CPU time of each forward.
  pd::Status run(int steps, std::vector<double>* stepSeconds, double* cpuSeconds,
                 std::vector<double>* stepCpuSeconds = nullptr) {
    std::vector<int32_t> next(batch_, 65);
    std::vector<float> logits(size_t(batch_) * cfg_.vocabSize);
    std::vector<SeqChunk> chunks(batch_);
    for (int step = 0; step < steps; ++step) {
      for (int s = 0; s < batch_; ++s) chunks[s] = SeqChunk{&next[s], 1, ctx_ + step, tables_[s].data(), perSeq_, true};
      const auto t0 = Clock::now();
      const double c0 = processCpuSeconds();
      PD_RETURN_IF_ERROR(backend_->forward(chunks, logits.data()));
      if (stepSeconds) stepSeconds->push_back(secondsSince(t0));
      if (cpuSeconds) *cpuSeconds += processCpuSeconds() - c0;
      if (stepCpuSeconds) stepCpuSeconds->push_back(processCpuSeconds() - c0);
      for (int s = 0; s < batch_; ++s) {
        const auto row = logits.begin() + ptrdiff_t(s) * cfg_.vocabSize;
        next[s] = int32_t(std::max_element(row, row + cfg_.vocabSize) - row);
      }
    }
    return pd::Status::ok();
  }

 private:
  DecodeBench() = default;
  ModelConfig cfg_;
  int batch_ = 0, ctx_ = 0, perSeq_ = 0;
  WeightBuffer kv_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::vector<int32_t>> tables_;
};

// Runs `llamaBench args -o json` and returns the first result's avg_ts (tokens/s, the mean
// over its repetitions). Its stderr goes to `logPath`, named in the error when it fails.
pd::Result<double> llamaBenchTokensPerSecond(const std::string& llamaBench, const std::string& args,
                                             const std::string& logPath) {
  const std::string cmd = "'" + llamaBench + "' " + args + " -o json 2>'" + logPath + "'";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return pd::internalError("cannot run " + cmd);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  const int rc = pclose(f);
  if (rc != 0)
    return pd::internalError("llama-bench failed (status " + std::to_string(rc) + "): " + cmd +
                             " (its log: " + logPath + ")");
  const auto j = nlohmann::json::parse(out, nullptr, false);
  if (!j.is_array() || j.empty() || !j[0].contains("avg_ts") || !j[0]["avg_ts"].is_number())
    return pd::internalError("llama-bench printed no avg_ts: " + cmd + " (its log: " + logPath + ")");
  return j[0]["avg_ts"].get<double>();
}

// The process's resident set (VmRSS), MB; 0 when /proc cannot be read.
double residentMB() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmRSS: %lf kB", &kb) == 1) break;
  std::fclose(f);
  return kb / 1e3;
}

// The bytes the model would take held all in f32.
double f32EquivalentBytes(const ModelWeights& m) {
  double n = double(m.f32Bytes());
  for (const LayerWeights& l : m.layers)
    for (const CompactWeight* c : {&l.qkvCompact, &l.oCompact, &l.gateUpCompact, &l.downCompact})
      n += 4.0 * double(c->bf16.size() + c->q8.size());
  return n;
}

const char* ggufTypeName(const std::string& weightFormat) {
  return weightFormat == "bf16" ? "BF16" : weightFormat == "q8_0" ? "Q8_0" : "F32";
}

// The model as llama.cpp's GGUF at `path`: f32 as written by writeLlamaGguf; bf16 / q8_0
// converted from it by llama-quantize to BF16 / Q8_0 with token_embd, output and any experts
// kept F32 (ours keep the embedding, lm_head and experts in f32 too, so both read the same
// bytes per step).
pd::Status writeBenchGguf(const std::string& modelDir, const std::string& weightFormat,
                          const std::string& llamaQuantize, const std::string& path) {
  PD_ASSIGN_OR_RETURN(auto f32Model, loadModel(modelDir));
  const ModelWeights& model = *f32Model;
  if (weightFormat == "f32") return writeLlamaGguf(model, path);
  if (llamaQuantize.empty())
    return pd::invalidArgument("--weight-format " + weightFormat +
                               " with llama.cpp needs --llama-quantize PATH (llama.cpp's llama-quantize) to "
                               "convert the F32 GGUF to " +
                               ggufTypeName(weightFormat));
  if (llamaQuantize.find('\'') != std::string::npos || path.find('\'') != std::string::npos)
    return pd::invalidArgument("--llama-quantize: a path with a single quote is not supported");
  const std::string f32 = path + ".f32.gguf";
  PD_RETURN_IF_ERROR(writeLlamaGguf(model, f32));
  // Ours converts only the attention and dense-MLP projections (loadModel with a weight
  // format): a mixture of experts keeps its experts (and router) in f32, so llama.cpp's do too.
  const std::string keepExperts =
      model.config.isMoe()
          ? " --tensor-type ffn_gate_exps=f32 --tensor-type ffn_up_exps=f32 --tensor-type ffn_down_exps=f32"
          : "";
  const std::string cmd = "'" + llamaQuantize + "' --output-tensor-type f32 --token-embedding-type f32" + keepExperts +
                          " '" + f32 + "' '" + path + "' " + ggufTypeName(weightFormat) + " >'" + path +
                          ".quantize.log' 2>&1";
  const int rc = std::system(cmd.c_str());
  std::error_code ec;
  std::filesystem::remove(f32, ec);
  if (rc != 0) return pd::internalError("llama-quantize failed (status " + std::to_string(rc) + "): " + cmd);
  return pd::Status::ok();
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / double(v.size());
}

// Decode tg128 @ d512 and prefill pp2048, ours and llama.cpp's, `rounds` times interleaved.
// Ours is measured as llama-bench measures: 5 repetitions after a warm-up, each repetition's
// tokens / wall seconds (decode: the whole 128-token loop, not per-step medians), averaged.
// The ceilings of this run: decode tok/s = read bandwidth / bytes a step reads; prefill tok/s =
// FMA peak / FLOPs a prompt token costs (at 2,048 tokens).
struct Ceilings {
  double decodeTokS = 0, prefillTokS = 0;
};

pd::Status compareWithLlamaBench(const std::shared_ptr<const ModelWeights>& model, const std::string& llamaBench,
                                 const std::string& llamaQuantize, const CpuBackendOptions& opt, int rounds,
                                 const Ceilings& ceil, std::mt19937_64& rng) {
  if (llamaBench.find('\'') != std::string::npos)
    return pd::invalidArgument("--llama-bench: a path with a single quote is not supported");
  char dir[] = "/tmp/pdserve_llama_XXXXXX";
  if (!mkdtemp(dir)) return pd::internalError("mkdtemp failed");
  const std::string gguf = std::string(dir) + "/model.gguf", log = std::string(dir) + "/log";
  PD_RETURN_IF_ERROR(writeBenchGguf(model->dir, opt.weightFormat, llamaQuantize, gguf));
  // -lm none: weights read into anonymous memory, as ours are (no file-backed pages).
  const std::string common = "-m '" + gguf + "' -t " + std::to_string(opt.numThreads) + " -r 5 -lm none";
  const int ctx = 512, gen = 128, prompt = 2048, reps = 5;
  std::printf(
      "\nllama.cpp (%s) on the same weights (%s, %s; its defaults otherwise), %d threads; ceilings of this run: "
      "decode %.0f tok/s, prefill %.0f tok/s:\n",
      llamaBench.c_str(), gguf.c_str(), ggufTypeName(opt.weightFormat), opt.numThreads, ceil.decodeTokS,
      ceil.prefillTokS);
  std::vector<double> oursTg, theirsTg, oursPp, theirsPp;
  for (int r = 0; r < rounds; ++r) {
    {
      auto bench = DecodeBench::create(model, 1, ctx, gen, opt, rng);
      if (!bench.ok()) return bench.status();
      PD_RETURN_IF_ERROR((*bench)->run(1, nullptr, nullptr));  // warm-up, as llama-bench
      std::vector<double> ts;
      for (int i = 0; i < reps; ++i) {
        const auto t0 = Clock::now();
        PD_RETURN_IF_ERROR((*bench)->run(gen, nullptr, nullptr));
        ts.push_back(gen / secondsSince(t0));
      }
      oursTg.push_back(mean(ts));
    }
    PD_ASSIGN_OR_RETURN(const double tg, llamaBenchTokensPerSecond(llamaBench, common + " -p 0 -n 128 -d 512", log));
    theirsTg.push_back(tg);
    PD_ASSIGN_OR_RETURN(auto secs, prefillSeconds(model, prompt, opt, reps, rng, nullptr));
    std::vector<double> ts;
    for (double s : secs) ts.push_back(prompt / s);
    oursPp.push_back(mean(ts));
    PD_ASSIGN_OR_RETURN(const double pp, llamaBenchTokensPerSecond(llamaBench, common + " -p 2048 -n 0", log));
    theirsPp.push_back(pp);
    std::printf(
        "  round %d: tg128 @ d512 ours %7.1f (%.0f%%)  llama.cpp %7.1f (%.0f%%) tok/s (%.2fx) | pp2048 ours "
        "%7.1f (%.0f%%)  llama.cpp %7.1f (%.0f%%) tok/s (%.2fx)\n",
        r + 1, oursTg.back(), 100 * oursTg.back() / ceil.decodeTokS, tg, 100 * tg / ceil.decodeTokS, oursTg.back() / tg,
        oursPp.back(), 100 * oursPp.back() / ceil.prefillTokS, pp, 100 * pp / ceil.prefillTokS, oursPp.back() / pp);
    std::fflush(stdout);
  }
  std::printf(
      "  mean:    tg128 @ d512 ours %7.1f (%.0f%%)  llama.cpp %7.1f (%.0f%%) tok/s (%.2fx) | pp2048 ours %7.1f "
      "(%.0f%%)  llama.cpp %7.1f (%.0f%%) tok/s (%.2fx)\n",
      mean(oursTg), 100 * mean(oursTg) / ceil.decodeTokS, mean(theirsTg), 100 * mean(theirsTg) / ceil.decodeTokS,
      mean(oursTg) / mean(theirsTg), mean(oursPp), 100 * mean(oursPp) / ceil.prefillTokS, mean(theirsPp),
      100 * mean(theirsPp) / ceil.prefillTokS, mean(oursPp) / mean(theirsPp));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return pd::Status::ok();
}

}  // namespace

int main(int argc, char** argv) {
  std::string modelDir, arch = "llama";
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool quick = false;
  std::string only;  // "", "prefill", "decode", "context" or "llama"
  int skinnyMaxRows = CpuBackendOptions().skinnyMaxRows;
  std::string llamaBench, llamaQuantize, writeGguf, gemmKernel, weightFormat = "f32", bf16Kernel, q8Kernel;
  int onlyBatch = 0;  // decode: 0 = batches 1, 8 and 32
  int rounds = 0;     // llama.cpp comparison rounds: 0 = 3 (1 with --quick)
  CLI::App app{"engine_bench: the CPU engine's prefill, decode and context steps (and llama.cpp's)", "engine_bench"};
  pd::cli::configure(app);
  app.add_option("--model", modelDir, "model directory (default: a small made model in /tmp/pdserve_bench_small)");
  app.add_option("--arch", arch,
                 "without --model: the made small model's architecture (make-model's: llama, qwen3, mixtral, "
                 "qwen3_moe)")
      ->capture_default_str();
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_flag("--quick", quick, "fewer shapes and rounds");
  app.add_option("--only", only, "prefill|decode|context|llama: run only this part");
  app.add_option("--batch", onlyBatch, "decode: only this batch (default: 1, 8 and 32)");
  app.add_option("--skinny-max-rows", skinnyMaxRows, "CpuBackendOptions::skinnyMaxRows")->capture_default_str();
  app.add_option("--llama-bench", llamaBench, "llama.cpp's llama-bench, to compare against");
  app.add_option("--rounds", rounds, "llama.cpp comparison rounds (default 3, 1 with --quick)");
  app.add_option("--write-gguf", writeGguf, "write the model as GGUF to PATH");
  app.add_option("--gemm-kernel", gemmKernel, "force a GEMM kernel: avx512|avx2|generic (default: CPUID's best)");
  app.add_option("--weight-format", weightFormat, "CpuBackendOptions::weightFormat: f32|bf16|q8_0")
      ->capture_default_str();
  std::string kvDtype = "f32";
  app.add_option("--kv-dtype", kvDtype, "the KV cache's dtype: f32|bf16|int8|fp8 (engine.kv_cache_dtype)")
      ->capture_default_str();
  app.add_option("--bf16-kernel", bf16Kernel, "force a bf16 decode kernel: avx512bf16|avx2 (default: CPUID's best)");
  app.add_option("--q8-kernel", q8Kernel,
                 "force a q8_0 decode kernel: avx512vnni|avx2|generic (default: CPUID's best)");
  app.add_option("--llama-quantize", llamaQuantize,
                 "llama.cpp's llama-quantize: converts the GGUF for llama.cpp to --weight-format (BF16, Q8_0)");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  if (auto d = pd::enumFromName(kKvDtypeNames, kvDtype); d && *d != KvDtype::kF16) {
    gKvDtype = *d;
  } else {
    std::fprintf(stderr, "engine_bench: --kv-dtype must be f32, bf16, int8 or fp8\n");
    return 2;
  }
  if (weightFormat != "f32" && weightFormat != "bf16" && weightFormat != "q8_0") {
    std::fprintf(stderr, "engine_bench: --weight-format must be f32, bf16 or q8_0\n");
    return 2;
  }
  if (modelDir.empty()) {
    modelDir = "/tmp/pdserve_bench_small" + (arch == "llama" ? std::string() : "_" + arch);
    if (!std::filesystem::exists(modelDir + "/config.json")) {
      MakeModelOptions o;
      o.preset = "small";
      o.arch = arch;
      if (auto st = makeModel(o, modelDir); !st.isOk()) {
        std::fprintf(stderr, "engine_bench: %s\n", st.toString().c_str());
        return 1;
      }
    }
  }
  // The weights held as the backend computes from them (bf16 / q8_0: the f32 copies of the
  // linear weights freed); the GGUF for llama.cpp is written from an f32 load.
  auto model = loadModel(modelDir, weightFormat);
  if (!model.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", model.status().toString().c_str());
    return 1;
  }
  const ModelConfig& cfg = (*model)->config;
  openblas_set_num_threads(threads);  // the OpenBLAS comparison only: the backend does not use it
  if (!writeGguf.empty()) {
    if (auto st = writeBenchGguf(modelDir, weightFormat, llamaQuantize, writeGguf); !st.isOk()) return fail(st);
    std::printf("engine_bench: wrote %s\n", writeGguf.c_str());
    return 0;
  }
  if (!only.empty() && only != "prefill" && only != "decode" && only != "context" && only != "llama") {
    std::fprintf(stderr, "engine_bench: --only must be prefill, decode, context or llama\n");
    return 2;
  }
  if (only == "llama" && llamaBench.empty()) {
    std::fprintf(stderr, "engine_bench: --only llama needs --llama-bench PATH\n");
    return 2;
  }

  std::printf(
      "engine_bench: model %s (hidden %d, layers %d, heads %d/%d, ffn %d, vocab %d), "
      "%.1f MB of weights resident (%s; f32 would be %.1f MB; process VmRSS %.1f MB), %d threads\n",
      modelDir.c_str(), cfg.hiddenSize, cfg.numLayers, cfg.numHeads, cfg.numKvHeads, cfg.intermediateSize,
      cfg.vocabSize, (*model)->totalBytes() / 1e6, weightFormat.c_str(), f32EquivalentBytes(**model) / 1e6,
      residentMB(), threads);
  if (cfg.isMoe())
    std::printf(
        "mixture of experts: %d experts of width %d, top %d: a decode token reads %.1f MB (the active "
        "parameters; the floor below) of the %.1f MB\n",
        cfg.moe.numExperts, cfg.moe.expertFfn, cfg.moe.expertsPerToken, double(cfg.decodeWeightParams()) * 4 / 1e6,
        (*model)->totalBytes() / 1e6);
  // KV per token: what the cache holds, the prefix cache keeps and a remote prefill moves.
  std::printf("KV cache per token: %lld values per layer (%s) x %d layers = %lld bytes in f32, %lld in bf16\n",
              static_cast<long long>(cfg.kvElemsPerTokenLayer()),
              cfg.isMla() ? "latent: kv_lora_rank + qk_rope_head_dim, no V" : "K and V of every kv head", cfg.numLayers,
              static_cast<long long>(cfg.kvElemsPerTokenLayer() * cfg.numLayers * 4),
              static_cast<long long>(cfg.kvElemsPerTokenLayer() * cfg.numLayers * 2));
  std::printf("OpenBLAS: core %s; config %s\n", openblas_get_corename(), openblas_get_config());

  // ---- Ceilings (from the hardware, this run) ---------------------------------------------
  // The bytes a decode step reads: the linear layers' 2 bytes a weight with bf16, 1.125 with
  // q8_0 (an f32 scale per 32), the norms and lm_head 4 (they stay f32).
  const double linearParams =
      double(cfg.numLayers) * (double(cfg.hiddenSize) * (cfg.qDim() + 2 * cfg.kvDim()) +
                               double(cfg.qDim()) * cfg.hiddenSize + 3.0 * cfg.hiddenSize * cfg.intermediateSize);
  const double weightBytes = double(cfg.decodeWeightParams()) * 4 - (weightFormat == "bf16"   ? linearParams * 2
                                                                     : weightFormat == "q8_0" ? linearParams * 2.875
                                                                                              : 0.0);
  std::printf("weight format %s: %.1f MB read per decode step\n", weightFormat.c_str(), weightBytes / 1e6);
  const kc::GemmKernel kernel = [&] {
    for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric})
      if (gemmKernel == kc::gemmKernelInfo(k).name) return k;
    return kc::gemmBestKernel();
  }();
  if (!gemmKernel.empty() && (gemmKernel != kc::gemmKernelInfo(kernel).name || !kc::gemmKernelSupported(kernel))) {
    std::fprintf(stderr, "engine_bench: --gemm-kernel %s is unknown or unsupported on this CPU\n", gemmKernel.c_str());
    return 2;
  }
  double readBw = 0, fmaPeak = 0, fmaPeakOne = 0;
  if (only != "context") {
    readBw = readGBs(size_t(weightBytes), threads, quick ? 4 : 10);
    std::printf("read bandwidth (%d threads, loads only): %.1f GB/s over %.0f MB (the weights' size)\n", threads,
                readBw, weightBytes / 1e6);
    std::string peaks;
    for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric}) {
      if (!kc::gemmKernelSupported(k)) continue;
      const double g = fmaPeakGflops(k, threads, quick ? 2 : 3);
      fmaPeak = std::max(fmaPeak, g);
      peaks += std::string(peaks.empty() ? "" : ", ") + kc::gemmKernelInfo(k).name + " " +
               std::to_string(int(g + 0.5)) + " GFLOP/s";
    }
    // One thread's peak too: on a shared machine the other threads' cores may be busy, and work
    // per CPU-second against one thread's peak is the ratio that noise does not move.
    for (kc::GemmKernel k : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric})
      if (kc::gemmKernelSupported(k)) fmaPeakOne = std::max(fmaPeakOne, fmaPeakGflops(k, 1, quick ? 2 : 3));
    std::printf("FMA peak (%d threads, independent FMA chains): %.1f GFLOP/s (%s); one thread %.1f GFLOP/s\n", threads,
                fmaPeak, peaks.c_str(), fmaPeakOne);
    const int gm = 2048, gn = 2 * cfg.intermediateSize, gk = cfg.hiddenSize;  // the gate|up shape
    const double ours = oursGemmGflops(kernel, gm, gn, gk, threads, quick ? 2 : 3);
    const double blas = sgemmGflops(gm, gn, gk, quick ? 2 : 3);
    std::printf(
        "GEMM %dx%dx%d (the gate|up shape): ours (%s) %.1f GFLOP/s = %.0f%% of FMA peak; OpenBLAS (core %s) "
        "%.1f GFLOP/s = %.0f%%\n",
        gm, gn, gk, kc::gemmKernelInfo(kernel).name, ours, 100 * ours / fmaPeak, openblas_get_corename(), blas,
        100 * blas / fmaPeak);
  }

  // ---- Prefill ------------------------------------------------------------------------------
  CpuBackendOptions opt;
  opt.numThreads = threads;
  opt.skinnyMaxRows = skinnyMaxRows;
  opt.gemmKernel = gemmKernel;
  opt.weightFormat = weightFormat;
  opt.bf16Kernel = bf16Kernel;
  opt.q8Kernel = q8Kernel;
  std::mt19937_64 rng(1);
  if (only.empty() || only == "prefill")
    std::printf("\nprefill (one sequence, one forward step, logits of the last token):\n");
  for (int p : {128, 512, 2048}) {
    if (only == "decode" || only == "context" || only == "llama") break;
    const int reps = quick ? 1 : (p >= 2048 ? 2 : 3);
    double bestCpu = 1e30;
    auto secs = prefillSeconds(*model, p, opt, reps, rng, &bestCpu);
    if (!secs.ok()) return fail(secs.status());
    const double best = *std::min_element(secs->begin(), secs->end());
    const double linearFlops = 2.0 * double(cfg.decodeWeightParams() - cfg.hiddenSize) * p -
                               2.0 * double(cfg.vocabSize) * cfg.hiddenSize * (p - 1);
    // Per (query, key) pair and layer: QK and AV; MLA's absorbed form scores over the latent
    // and sums kv_lora_rank values per head.
    const double pairFlops = cfg.isMla() ? 2.0 * cfg.numHeads * (cfg.mla.latentDim() + cfg.mla.kvLoraRank)
                                         : 4.0 * cfg.headDim * cfg.numHeads;
    const double attnFlops = pairFlops * double(p) * (p + 1) / 2 * cfg.numLayers;
    const double gflops = (linearFlops + attnFlops) / best / 1e9;
    const double perCpuSecond = (linearFlops + attnFlops) / bestCpu / 1e9;
    std::printf(
        "  %5d tokens: %8.0f tok/s  (%.1f ms, %.1f GFLOP/s = %.0f%% of FMA peak; %.1f CPU-ms, %.1f GFLOP per "
        "CPU-second = %.0f%% of one thread's peak)\n",
        p, p / best, best * 1e3, gflops, 100.0 * gflops / fmaPeak, bestCpu * 1e3, perCpuSecond,
        100.0 * perCpuSecond / fmaPeakOne);
  }

  // ---- Decode -------------------------------------------------------------------------------
  const int ctx = 512;
  if (only.empty() || only == "decode")
    std::printf("\ndecode (%d tokens of context per sequence, one token per sequence per step):\n", ctx);
  for (int batch : {1, 8, 32}) {
    if (only == "prefill" || only == "context" || only == "llama") break;
    if (onlyBatch > 0 && batch != onlyBatch) continue;
    // Batch 1 steps take ~3 ms: many of them, and the median, so a noisy neighbour's burst
    // does not decide the figure.
    const int steps = quick ? 16 : (batch == 1 ? 256 : 32);
    auto bench = DecodeBench::create(*model, batch, ctx, steps, opt, rng);
    if (!bench.ok()) return fail(bench.status());
    std::vector<double> stepSeconds, stepCpu;
    double cpu = 0;
    if (auto st = (*bench)->run(2, nullptr, nullptr); !st.isOk()) return fail(st);  // warm-up
    // Batch 1: the decode's ceiling is measured again between groups of steps (the same
    // threads, the same moments of load); see InterleavedReadPasses.
    std::unique_ptr<InterleavedReadPasses> passes;
    if (batch == 1) passes = std::make_unique<InterleavedReadPasses>(size_t(weightBytes), threads);
    const int group = batch == 1 ? 16 : steps;
    for (int done = 0; done < steps; done += group) {
      if (passes) passes->pass();
      if (auto st = (*bench)->run(std::min(group, steps - done), &stepSeconds, &cpu, &stepCpu); !st.isOk())
        return fail(st);
    }
    if (passes) passes->pass();
    double total = 0;
    for (double x : stepSeconds) total += x;
    std::nth_element(stepSeconds.begin(), stepSeconds.begin() + steps / 2, stepSeconds.end());
    const double medianStep = stepSeconds[size_t(steps / 2)];
    const double tokS = batch / medianStep;
    std::printf(
        "  batch %2d: %8.1f tok/s  (median step %.2f ms, mean %.2f ms; %.2f CPU-ms per step over "
        "all threads)",
        batch, tokS, medianStep * 1e3, total / steps * 1e3, cpu / steps * 1e3);
    if (batch == 1) {
      const double kvBytes = double(kvLayoutFor(cfg, 1, 16, gKvDtype).totalBytes()) / 16 * ctx;
      const double floor = weightBytes / (readBw * 1e9);
      std::printf(
          "\n    read-bandwidth floor (%.1f MB weights / token at %.1f GB/s): %.3f ms -> %.0f tok/s ceiling, "
          "%.0f%% of it\n    (the %.1f MB of KV read per token at ctx %d is on top of the weights)",
          weightBytes / 1e6, readBw, floor * 1e3, 1.0 / floor, 100.0 * floor / medianStep, kvBytes / 1e6, ctx);
      // Per CPU-second: the median step's CPU time against the median interleaved read pass's
      // CPU time for the same bytes. Time this process was descheduled counts in neither, and
      // both met the same neighbours' memory traffic; at one thread CPU time is the step's
      // running time.
      const double medianStepCpu = InterleavedReadPasses::median(stepCpu);
      const double floorCpu = weightBytes / (passes->medianCpuGBs() * 1e9);
      std::printf(
          "\n    per CPU-second: median step %.2f CPU-ms; %d read passes interleaved with the steps: median %.1f GB/s "
          "per CPU-second (best %.1f; on the wall clock median %.1f, best %.1f) -> floor %.3f CPU-ms, %.0f%% of it",
          medianStepCpu * 1e3, passes->passes(), passes->medianCpuGBs(), passes->bestCpuGBs(), passes->medianWallGBs(),
          passes->bestWallGBs(), floorCpu * 1e3, 100.0 * floorCpu / medianStepCpu);
    }
    std::printf("\n");
  }

  // ---- Prompt chunks deep in a prompt --------------------------------------------------------
  if (only == "context") {
    const double span = cfg.attentionSpanTokens();
    std::printf("\nprompt chunks after cached context (best of %d; priced: 1 + position / %.0f, the attention span):\n",
                quick ? 1 : 3, span);
    for (int n : {64, 256, 512}) {
      double atZero = 0;
      for (int start : {0, 1024, 2048}) {
        auto secs = prefillSeconds(*model, n, opt, quick ? 1 : 3, rng, nullptr, start);
        if (!secs.ok()) return fail(secs.status());
        const double msPerToken = *std::min_element(secs->begin(), secs->end()) * 1e3 / n;
        if (start == 0) atZero = msPerToken;
        const double priced =
            atZero * pd::engine::promptChunkCost(start, n, span) / pd::engine::promptChunkCost(0, n, span);
        std::printf("  %3d tokens after %4d: %.3f ms a token, priced %.3f (%+.0f%%)\n", n, start, msPerToken, priced,
                    100 * (priced / msPerToken - 1));
      }
    }
  }

  if (!llamaBench.empty()) {
    Ceilings ceil;
    ceil.decodeTokS = readBw * 1e9 / weightBytes;
    const int p = 2048;  // the prefill's FLOPs a token at pp2048, as the prefill section counts them
    const double flops = 2.0 * double(cfg.decodeWeightParams() - cfg.hiddenSize) * p -
                         2.0 * double(cfg.vocabSize) * cfg.hiddenSize * (p - 1) +
                         4.0 * cfg.headDim * cfg.numHeads * double(p) * (p + 1) / 2 * cfg.numLayers;
    ceil.prefillTokS = fmaPeak * 1e9 / (flops / p);
    if (auto st = compareWithLlamaBench(*model, llamaBench, llamaQuantize, opt, rounds > 0 ? rounds : (quick ? 1 : 3),
                                        ceil, rng);
        !st.isOk())
      return fail(st);
  }
  return 0;
}
