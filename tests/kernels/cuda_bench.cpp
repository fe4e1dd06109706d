// cuda_bench: the CUDA backend's short benchmark (run by kernels/check-gpu.sh), one table:
//   - ceilings measured in this run: cuBLAS bf16 GEMM TFLOP/s (f32 accumulate) and
//     device-to-device cudaMemcpy GB/s;
//   - paged decode attention's achieved HBM bandwidth (bytes of K/V read / time) against the
//     memcpy;
//   - decode tokens/s at batch 1, 8, 32, 128 (CUDA graphs, context 512) against the bandwidth
//     bound (weights + KV bytes per step at memcpy speed);
//   - prefill tokens/s for one 2,048-token chunk against the GEMM bound;
//   - the device sampler (temperature + top-p + 5 logprobs) at 1/32/128 rows of a 128k
//     vocabulary, us per call, against the device-to-host copy of the logits it replaces;
//   - FP8 weights (pd/kernels/cuda/linear_fp8.h) on a Llama-3-8B-shaped gate|up (28672 x
//     4096): fp8Gemv at 1 and 8 rows and cuBLAS's bf16 GEMM of the same rows, GB/s of weight
//     bytes read, and fp8Dequantize's GB/s (1 byte read + 2 written a weight), each against
//     the memcpy.
// The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32/8 heads, head dim 64, ffn 8192,
// vocab 128256, tied embeddings) with seeded random weights made in memory: no download.
//   cuda_bench [--model 1b|tiny] [--steps N]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/base/cli.h"
#include "engine/cuda_backend.h"
#include "pd/kernels/cuda/attention.h"
#include "pd/kernels/cuda/linear_fp8.h"
#include "pd/kernels/cuda/ops.h"
#include "pd/kernels/cuda/sampling.h"

using namespace pd;
using namespace pd::engine;
namespace kcu = pd::kernels::cuda;

namespace {

#define CHECK_CUDA(call)                                                           \
  do {                                                                             \
    const cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "cuda_bench: %s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void fillRandom(WeightBuffer& w, uint64_t seed, float scale) {
  const size_t n = w.size();
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      uint64_t s = seed * 0x9e3779b97f4a7c15ull + uint64_t(t) * 0xbf58476d1ce4e5b9ull + 1;
      for (size_t i = n * t / threads; i < n * (t + 1) / threads; ++i) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        w.data()[i] = scale * (float(s >> 40) / float(1 << 24) * 2.0f - 1.0f);
      }
    });
  }
  for (auto& th : pool) th.join();
}

std::shared_ptr<const ModelWeights> makeModelInMemory(const std::string& preset) {
  auto m = std::make_shared<ModelWeights>();
  ModelConfig& c = m->config;
  if (preset == "tiny") {
    c.hiddenSize = 64;
    c.intermediateSize = 172;
    c.numLayers = 2;
    c.numHeads = 4;
    c.numKvHeads = 2;
    c.headDim = 16;
    c.vocabSize = 259;
  } else {
    c.hiddenSize = 2048;
    c.intermediateSize = 8192;
    c.numLayers = 16;
    c.numHeads = 32;
    c.numKvHeads = 8;
    c.headDim = 64;
    c.vocabSize = 128256;
  }
  c.maxPositionEmbeddings = 8192;
  c.rmsNormEps = 1e-5f;
  c.rope.theta = 500000.0;
  c.tieWordEmbeddings = true;
  const size_t h = c.hiddenSize, qkv = c.qDim() + 2 * c.kvDim(), ffn = c.intermediateSize;
  const float ws = 1.0f / std::sqrt(float(h));
  m->embed = WeightBuffer(size_t(c.vocabSize) * h);
  fillRandom(m->embed, 1, 1.0f);
  m->finalNorm = WeightBuffer(h);
  fillRandom(m->finalNorm, 2, 1.0f);
  m->layers.resize(c.numLayers);
  uint64_t seed = 10;
  for (LayerWeights& l : m->layers) {
    l.inputNorm = WeightBuffer(h);
    l.postNorm = WeightBuffer(h);
    l.qkv = WeightBuffer(qkv * h);
    l.o = WeightBuffer(h * c.qDim());
    l.gateUp = WeightBuffer(2 * ffn * h);
    l.down = WeightBuffer(h * ffn);
    fillRandom(l.inputNorm, seed++, 1.0f);
    fillRandom(l.postNorm, seed++, 1.0f);
    fillRandom(l.qkv, seed++, ws);
    fillRandom(l.o, seed++, ws);
    fillRandom(l.gateUp, seed++, ws);
    fillRandom(l.down, seed++, 1.0f / std::sqrt(float(ffn)));
  }
  return m;
}

struct Row {
  std::string what, value, ceiling, ratio;
};

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// cuBLAS bf16 x bf16 -> f32 GEMM, m = n = k = size.
double gemmTflops(int size) {
  cublasHandle_t h;
  cublasCreate(&h);
  void *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, size_t(size) * size * 2));
  CHECK_CUDA(cudaMalloc(&b, size_t(size) * size * 2));
  CHECK_CUDA(cudaMalloc(&c, size_t(size) * size * 4));
  CHECK_CUDA(cudaMemset(a, 0x3c, size_t(size) * size * 2));
  CHECK_CUDA(cudaMemset(b, 0x3c, size_t(size) * size * 2));
  const float alpha = 1, beta = 0;
  auto run = [&] {
    const cublasStatus_t s =
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, size, size, size, &alpha, a, CUDA_R_16BF, size, b, CUDA_R_16BF, size,
                     &beta, c, CUDA_R_32F, size, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cuda_bench: cublasGemmEx: %s\n", cublasGetStatusString(s));
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) run();
  CHECK_CUDA(cudaDeviceSynchronize());
  const int reps = 20;
  const double t0 = now();
  for (int i = 0; i < reps; ++i) run();
  CHECK_CUDA(cudaDeviceSynchronize());
  const double dt = now() - t0;
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cublasDestroy(h);
  return 2.0 * double(size) * size * size * reps / dt / 1e12;
}

// Device-to-device copy: GB/s counting bytes read + bytes written.
double memcpyGBs(size_t bytes) {
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaDeviceSynchronize());
  const int reps = 10;
  const double t0 = now();
  for (int i = 0; i < reps; ++i) CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaDeviceSynchronize());
  const double dt = now() - t0;
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) * reps / dt / 1e9;
}

// Paged decode attention alone: numSeqs decode tokens over ctx positions each (bf16 KV,
// Llama-3-8B head shape), GB/s of K/V bytes read.
double attentionGBs(int numSeqs, int ctx, double* bytesOut) {
  const int heads = 32, kvHeads = 8, hd = 128, bs = 16;
  const int blocksPerSeq = (ctx + bs - 1) / bs;
  const int numBlocks = numSeqs * blocksPerSeq;
  const size_t poolBytes = size_t(numBlocks) * 2 * bs * kvHeads * hd * 2;
  void* pool;
  float *q, *out;
  CHECK_CUDA(cudaMalloc(&pool, poolBytes));
  CHECK_CUDA(cudaMemset(pool, 0x3c, poolBytes));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&q), size_t(numSeqs) * heads * hd * 4));
  CHECK_CUDA(cudaMemset(q, 0, size_t(numSeqs) * heads * hd * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&out), size_t(numSeqs) * heads * hd * 2));
  std::vector<int32_t> tables(numBlocks);
  for (int i = 0; i < numBlocks; ++i) tables[i] = int32_t((size_t(i) * 7919) % numBlocks);  // scattered
  std::vector<kcu::AttnSeq> seqs;
  std::vector<kcu::AttnWork> work;
  for (int s = 0; s < numSeqs; ++s) {
    seqs.push_back({s, 1, ctx - 1, s * blocksPerSeq});
    kcu::appendAttnWork(work, s, 1, heads / kvHeads);
  }
  int32_t* dtab;
  kcu::AttnSeq* dseqs;
  kcu::AttnWork* dwork;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&dtab), tables.size() * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&dseqs), seqs.size() * sizeof(kcu::AttnSeq)));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&dwork), work.size() * sizeof(kcu::AttnWork)));
  CHECK_CUDA(cudaMemcpy(dtab, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dseqs, seqs.data(), seqs.size() * sizeof(kcu::AttnSeq), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dwork, work.data(), work.size() * sizeof(kcu::AttnWork), cudaMemcpyHostToDevice));
  CHECK_CUDA(kcu::pagedAttentionInit());
  auto run = [&] {
    CHECK_CUDA(kcu::pagedAttention(q, heads * hd, pool, kcu::DType::kBF16, dtab, dseqs, dwork, int(work.size()), bs,
                                   heads, kvHeads, hd, 1.0f / std::sqrt(float(hd)), out, kcu::DType::kBF16, heads * hd,
                                   nullptr));
  };
  run();
  CHECK_CUDA(cudaDeviceSynchronize());
  const int reps = 20;
  const double t0 = now();
  for (int i = 0; i < reps; ++i) run();
  CHECK_CUDA(cudaDeviceSynchronize());
  const double dt = now() - t0;
  const double bytes = double(numSeqs) * ctx * 2.0 * kvHeads * hd * 2.0;
  *bytesOut = bytes;
  cudaFree(pool);
  cudaFree(q);
  cudaFree(out);
  cudaFree(dtab);
  cudaFree(dseqs);
  cudaFree(dwork);
  return bytes * reps / dt / 1e9;
}

// pd::kernels::cuda::sampleRows alone over rows x vocab f32 logits (normal-ish, sd ~2):
// temperature 0.8, top-p 0.9, 5 logprobs, us per call; *copyUs: the device-to-host copy
// (pinned) of the same logits, what a host sampler would need first.
double samplingUs(int rows, int vocab, double* copyUs) {
  const size_t n = size_t(rows) * vocab;
  std::vector<float> host(n);
  uint64_t s = 88172645463325252ull;
  for (float& x : host) {  // sum of 4 uniforms: bell-shaped, sd ~2
    float acc = 0;
    for (int k = 0; k < 4; ++k) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      acc += float(s >> 40) / float(1 << 24) * 2.0f - 1.0f;
    }
    x = acc * 3.5f;
  }
  std::vector<pd::kernels::SampleRowParams> params(rows);
  for (int r = 0; r < rows; ++r) {
    params[r].temperature = 0.8f;
    params[r].topP = 0.9f;
    params[r].u = (r + 0.5) / rows;
  }
  float *logits, *lp, *topLp, *pinned;
  int32_t *ids, *topIds;
  pd::kernels::SampleRowParams* dparams;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&logits), n * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&dparams), rows * sizeof(params[0])));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ids), rows * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&lp), rows * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&topIds), rows * 5 * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&topLp), rows * 5 * 4));
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&pinned), n * 4));
  CHECK_CUDA(cudaMemcpy(logits, host.data(), n * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dparams, params.data(), rows * sizeof(params[0]), cudaMemcpyHostToDevice));
  auto run = [&] {
    CHECK_CUDA(kcu::sampleRows(logits, vocab, rows, vocab, dparams, 5, ids, lp, topIds, topLp, nullptr));
  };
  run();
  CHECK_CUDA(cudaDeviceSynchronize());
  const int reps = 50;
  double t0 = now();
  for (int i = 0; i < reps; ++i) run();
  CHECK_CUDA(cudaDeviceSynchronize());
  const double us = (now() - t0) / reps * 1e6;
  CHECK_CUDA(cudaMemcpy(pinned, logits, n * 4, cudaMemcpyDeviceToHost));
  t0 = now();
  for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaMemcpy(pinned, logits, n * 4, cudaMemcpyDeviceToHost));
  *copyUs = (now() - t0) / 10 * 1e6;
  cudaFree(logits);
  cudaFree(dparams);
  cudaFree(ids);
  cudaFree(lp);
  cudaFree(topIds);
  cudaFree(topLp);
  cudaFreeHost(pinned);
  return us;
}

// FP8-weight kernels against cuBLAS bf16 on one [rows][cols] weight, n activation rows:
// seconds per call of fp8Gemv (codes read directly), of cuBLAS's bf16 GEMM (n rows), and of
// fp8Dequantize (to bf16). Codes 0x38 (1.0) and scales 1: the timing does not depend on them.
struct Fp8Times {
  double gemv = 0, gemm = 0, dequant = 0;
};
Fp8Times fp8Times(int rows, int cols, int n) {
  const int bc = 128, scaleCols = (cols + bc - 1) / bc;
  uint8_t* codes;
  float *scales, *y;
  void *x, *wbf16;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&codes), size_t(rows) * cols));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&scales), size_t(rows) * scaleCols * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&y), size_t(n) * rows * 4));
  CHECK_CUDA(cudaMalloc(&x, size_t(n) * cols * 2));
  CHECK_CUDA(cudaMalloc(&wbf16, size_t(rows) * cols * 2));
  CHECK_CUDA(cudaMemset(codes, 0x38, size_t(rows) * cols));
  std::vector<float> ones(size_t(rows) * scaleCols, 1.0f);
  CHECK_CUDA(cudaMemcpy(scales, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(x, 0x3c, size_t(n) * cols * 2));
  cublasHandle_t h;
  cublasCreate(&h);
  const float alpha = 1, beta = 0;
  auto time = [&](auto&& fn) {
    fn();
    CHECK_CUDA(cudaDeviceSynchronize());
    const int reps = 50;
    const double t0 = now();
    for (int i = 0; i < reps; ++i) fn();
    CHECK_CUDA(cudaDeviceSynchronize());
    return (now() - t0) / reps;
  };
  Fp8Times t;
  t.gemv = time(
      [&] { CHECK_CUDA(kcu::fp8Gemv(x, kcu::DType::kBF16, n, codes, scales, rows, cols, 0, bc, y, 0.0f, nullptr)); });
  t.dequant = time(
      [&] { CHECK_CUDA(kcu::fp8Dequantize(codes, scales, rows, cols, 0, bc, wbf16, kcu::DType::kBF16, nullptr)); });
  t.gemm = time([&] {
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha, wbf16, CUDA_R_16BF, cols, x, CUDA_R_16BF, cols,
                     &beta, y, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cuda_bench: cublasGemmEx (fp8 comparison) failed\n");
      std::exit(1);
    }
  });
  cublasDestroy(h);
  cudaFree(codes);
  cudaFree(scales);
  cudaFree(y);
  cudaFree(x);
  cudaFree(wbf16);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "1b";
  int steps = 30;
  CLI::App app{"cuda_bench: the CUDA backend's steps on a made model", "cuda_bench"};
  pd::cli::configure(app);
  app.add_option("--model", preset, "1b|tiny: the made model's preset")->capture_default_str();
  app.add_option_function<int>(
      "--steps", [&steps](int n) { steps = std::max(1, n); }, "decode steps to time (default 30)");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  const Status avail = cudaDeviceAvailable();
  if (!avail.isOk()) {
    std::fprintf(stderr, "cuda_bench: %s\n", avail.message().c_str());
    return 3;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %.0f GiB)\n", prop.name, prop.major, prop.minor,
              double(prop.totalGlobalMem) / double(1ull << 30));

  std::vector<Row> rows;
  const double tflops = gemmTflops(8192);
  rows.push_back({"cuBLAS GEMM bf16->f32, 8192^3", fmt("%.1f TFLOP/s", tflops), "(ceiling)", ""});
  const double bw = memcpyGBs(size_t(2) << 30);
  rows.push_back({"cudaMemcpy D2D 2 GiB (read+write)", fmt("%.0f GB/s", bw), "(ceiling)", ""});
  double attnBytes = 0;
  const double attnBw = attentionGBs(64, 4096, &attnBytes);
  rows.push_back({"paged decode attention, 64 seqs x 4096 ctx, bf16 KV, 32/8 heads x 128", fmt("%.0f GB/s", attnBw),
                  fmt("%.0f GB/s", bw), fmt("%.0f%%", 100 * attnBw / bw)});

  for (int sampleRowsN : {1, 32, 128}) {
    double copyUs = 0;
    const double us = samplingUs(sampleRowsN, 128256, &copyUs);
    rows.push_back(
        {"device sampling, " + std::to_string(sampleRowsN) + " rows x 128256 vocab (T 0.8, top-p 0.9, 5 logprobs)",
         fmt("%.1f us", us), fmt("%.1f us (D2H copy of the logits)", copyUs), fmt("%.0f%%", 100 * us / copyUs)});
  }

  {
    const int fr = 28672, fc = 4096;
    const double fp8Bytes = double(fr) * fc * (1.0 + 4.0 / 128), bf16Bytes = double(fr) * fc * 2;
    for (int n : {1, 8}) {
      const Fp8Times t = fp8Times(fr, fc, n);
      const double g8 = fp8Bytes / t.gemv / 1e9, g16 = bf16Bytes / t.gemm / 1e9;
      rows.push_back({"fp8Gemv 28672x4096, " + std::to_string(n) + " rows (GB/s of codes+scales; us)",
                      fmt("%.0f GB/s", g8) + fmt(" %.0f us", t.gemv * 1e6), fmt("%.0f GB/s", bw),
                      fmt("%.0f%%", 100 * g8 / bw)});
      rows.push_back({"cuBLAS bf16 GEMM 28672x4096, " + std::to_string(n) + " rows (GB/s of weights; us)",
                      fmt("%.0f GB/s", g16) + fmt(" %.0f us", t.gemm * 1e6), fmt("%.0f GB/s", bw),
                      fmt("%.0f%%", 100 * g16 / bw)});
      if (n == 1) {
        const double gd = double(fr) * fc * 3 / t.dequant / 1e9;
        rows.push_back({"fp8Dequantize 28672x4096 to bf16 (GB/s read+write; us)",
                        fmt("%.0f GB/s", gd) + fmt(" %.0f us", t.dequant * 1e6), fmt("%.0f GB/s", bw),
                        fmt("%.0f%%", 100 * gd / bw)});
      }
    }
  }

  std::printf("making the %s model in memory...\n", preset.c_str());
  auto model = makeModelInMemory(preset);
  const ModelConfig& c = model->config;
  const int ctx = 512, bs = 16, maxBatch = 128;
  const int blocksPerSeq = (ctx + steps + 8 + bs - 1) / bs;
  const KvLayout layout = kvLayoutFor(c, maxBatch * blocksPerSeq + 2048 / bs + 1, bs, KvDtype::kBF16);
  CudaBackendOptions opt;
  opt.weightDtype = KvDtype::kBF16;
  auto backendR = createCudaBackend(model, layout, opt);
  if (!backendR.ok()) {
    std::fprintf(stderr, "cuda_bench: %s\n", backendR.status().toString().c_str());
    return 1;
  }
  CudaBackend& b = **backendR;
  const double weightBytes = double(c.decodeWeightParams()) * 2.0;
  const double layerParams = double(c.decodeWeightParams()) - double(c.vocabSize) * c.hiddenSize;
  std::vector<float> logits(size_t(maxBatch) * c.vocabSize);

  for (int batch : {1, 8, 32, 128}) {
    std::vector<std::vector<int32_t>> tables(batch, std::vector<int32_t>(blocksPerSeq));
    for (int s = 0; s < batch; ++s)
      for (int i = 0; i < blocksPerSeq; ++i) tables[s][i] = s * blocksPerSeq + i;
    std::vector<int32_t> toks(batch, 65);
    auto step = [&](int pos) {
      std::vector<SeqChunk> chunks(batch);
      for (int s = 0; s < batch; ++s) chunks[s] = {&toks[s], 1, pos, tables[s].data(), blocksPerSeq, true};
      const Status st = b.forward(chunks, logits.data());
      if (!st.isOk()) {
        std::fprintf(stderr, "cuda_bench: decode: %s\n", st.toString().c_str());
        std::exit(1);
      }
    };
    for (int i = 0; i < 3; ++i) step(ctx + i);  // captures the graph
    const double t0 = now();
    for (int i = 0; i < steps; ++i) step(ctx + 3 + i);
    const double dt = now() - t0;
    const double tokS = double(batch) * steps / dt;
    const double kvBytes = double(batch) * (ctx + 3 + steps / 2) * 2.0 * c.numLayers * c.kvDim() * 2.0;
    const double bound = double(batch) / ((weightBytes + kvBytes) / (bw * 1e9));
    rows.push_back(
        {"decode batch " + std::to_string(batch) + ", ctx 512 (" + fmt("%.2f ms/step", 1000 * dt / steps) + ")",
         fmt("%.0f tok/s", tokS), fmt("%.0f tok/s (bytes @ memcpy BW)", bound), fmt("%.0f%%", 100 * tokS / bound)});
  }

  {
    const int n = 2048;
    std::vector<int32_t> toks(n);
    for (int i = 0; i < n; ++i) toks[i] = int32_t((i * 31) % 256);
    std::vector<int32_t> table(n / bs);
    for (int i = 0; i < n / bs; ++i) table[i] = maxBatch * blocksPerSeq + i;
    SeqChunk chunk{toks.data(), n, 0, table.data(), int(table.size()), true};
    auto run = [&] {
      const Status st = b.forward({&chunk, 1}, logits.data());
      if (!st.isOk()) {
        std::fprintf(stderr, "cuda_bench: prefill: %s\n", st.toString().c_str());
        std::exit(1);
      }
    };
    run();
    const int reps = 5;
    const double t0 = now();
    for (int i = 0; i < reps; ++i) run();
    const double dt = now() - t0;
    const double tokS = double(n) * reps / dt;
    const double bound = tflops * 1e12 / (2.0 * layerParams);
    rows.push_back({"prefill 2048 tokens (" + fmt("%.1f ms", 1000 * dt / reps) + ")", fmt("%.0f tok/s", tokS),
                    fmt("%.0f tok/s (linear FLOPs @ GEMM)", bound), fmt("%.0f%%", 100 * tokS / bound)});
  }

  std::printf("\n| %-72s | %-16s | %-40s | %-6s |\n", "measurement", "value", "ceiling (same run)", "ratio");
  std::printf("|%s|%s|%s|%s|\n", std::string(74, '-').c_str(), std::string(18, '-').c_str(),
              std::string(42, '-').c_str(), std::string(8, '-').c_str());
  for (const Row& r : rows)
    std::printf("| %-72s | %-16s | %-40s | %-6s |\n", r.what.c_str(), r.value.c_str(), r.ceiling.c_str(),
                r.ratio.c_str());
  std::printf("\nmodel: %s-shaped, bf16 weights, bf16 KV; decode graphs: %lld steps\n",
              preset == "tiny" ? "tiny" : "Llama-3.2-1B", (long long)b.graphSteps());
  return 0;
}
