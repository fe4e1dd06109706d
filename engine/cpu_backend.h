// The CPU Backend: f32 compute; the project's own GEMM micro-kernels (pd/kernels/gemm.h,
// AVX-512 / AVX2+FMA / portable, chosen from CPUID) for every prefill linear layer and for
// GEMM-shaped prefill attention, AVX2 kernels (kernels/include/pd/kernels) for the rest.
//
//   PD_ASSIGN_OR_RETURN(auto model, pd::engine::loadModel(dir));
//   auto layout = pd::engine::kvLayoutFor(model->config, numBlocks, 16);
//   // kvBase: layout.totalBytes() bytes owned by the caller (KvCacheManager)
//   PD_ASSIGN_OR_RETURN(auto backend, pd::engine::createCpuBackend(model, layout, kvBase, {}));
//   PD_RETURN_IF_ERROR(backend->forward(chunks, logits));
//
// Threads: numThreads (default: all cores) is the size of the backend's own fork-join pool,
// which splits every linear layer by output columns and attention by (sequence, kv head); each
// pool thread has its own GEMM packing workspace. No BLAS library is involved, so several
// backends in one process stay independent. Decode batches up to skinnyMaxRows tokens stream
// each weight once through kernels/linear.h; larger batches use the GEMM.
// Creating a backend logs the GEMM kernel in use once per process (docs/engine-cpu.md,
// "GEMM kernels"), as a warning when the CPU supports a better one than the one forced.
#pragma once

#include <memory>
#include <string>

#include "common/base/status.h"
#include "engine/backend.h"
#include "engine/model_weights.h"

namespace pd::engine {

struct CpuBackendOptions {
  int numThreads = 0;  // 0 = std::thread::hardware_concurrency()
  // Prefill chunks with at least this many tokens use GEMM tiles for attention; shorter
  // chunks and decode tokens use the paged online-softmax kernel.
  int gemmAttentionMinTokens = 16;
  // Linear layers over at most this many token rows use the weight-streaming kernel
  // (kernels/linear.h); larger batches use the GEMM.
  // 32: the streaming kernel took 60 CPU-ms per batch-32 decode step of the small model where
  // the GEMM took 73 (it packs every weight for only 32 rows); the GEMM wins from ~48 rows.
  int skinnyMaxRows = 32;
  // "" = the best GEMM kernel this CPU supports (CPUID). "avx512", "avx2" or "generic" forces
  // one (tests, benchmarks); createCpuBackend refuses an unknown name or one the CPU lacks.
  std::string gemmKernel = "";
  // How the linear layers' weights are held (config engine.weight_format; docs/engine-cpu.md,
  // "Quantized weights"): "f32", "bf16" (rounded once at creation, half the bytes per decode step)
  // or "q8_0" (int8 in blocks of 32 with an f32 scale each, 1.125 bytes a weight); norms,
  // biases, embeddings and lm_head stay f32. Anything else is refused.
  std::string weightFormat = "f32";
  // "" = the best bf16 decode kernel this CPU supports; "avx512bf16" or "avx2" forces one.
  std::string bf16Kernel = "";
  // "" = the best q8_0 decode kernel this CPU supports; "avx512vnni", "avx2" or "generic"
  // forces one (tests, benchmarks); an unknown name or one the CPU lacks is refused.
  std::string q8Kernel = "";
};

// kvBase: the start of the KV region described by `layout` (f32 only on the CPU); it must
// stay valid for the backend's lifetime. Fails when the layout does not match the model.
Result<std::unique_ptr<Backend>> createCpuBackend(std::shared_ptr<const ModelWeights> model, const KvLayout& layout,
                                                  void* kvBase, const CpuBackendOptions& options = {});

}  // namespace pd::engine
