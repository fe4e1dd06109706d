// The CPU Backend: f32 compute, OpenBLAS for every linear layer and for GEMM-shaped prefill
// attention, AVX2 kernels (kernels/include/pd/kernels) for everything else.
//
//   PD_ASSIGN_OR_RETURN(auto model, pd::engine::loadModel(dir));
//   auto layout = pd::engine::kvLayoutFor(model->config, numBlocks, 16);
//   // kvBase: layout.totalBytes() bytes owned by the caller (KvCacheManager)
//   PD_ASSIGN_OR_RETURN(auto backend, pd::engine::createCpuBackend(model, layout, kvBase, {}));
//   PD_RETURN_IF_ERROR(backend->forward(chunks, logits));
//
// Threads: numThreads (default: all cores) is the size of the backend's own fork-join pool,
// which splits every linear layer by output columns and attention by (sequence, kv head).
// OpenBLAS is set to ONE thread (process-global, openblas_set_num_threads) and called from
// the pool's threads, so OpenBLAS's own threads never compete with the pool and several
// backends in one process stay independent. Decode batches up to skinnyMaxRows tokens
// stream each weight once through kernels/linear.h; larger batches use OpenBLAS sgemm.
#pragma once

#include <memory>

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
  // (kernels/linear.h); larger batches use OpenBLAS sgemm.
  int skinnyMaxRows = 16;
};

// kvBase: the start of the KV region described by `layout` (f32 only on the CPU); it must
// stay valid for the backend's lifetime. Fails when the layout does not match the model.
Result<std::unique_ptr<Backend>> createCpuBackend(std::shared_ptr<const ModelWeights> model, const KvLayout& layout,
                                                  void* kvBase, const CpuBackendOptions& options = {});

// Sets OpenBLAS's thread count (process-global). The CPU backend sets 1; exposed for
// benchmarks that measure OpenBLAS alone.
void setBlasThreads(int n);

}  // namespace pd::engine
