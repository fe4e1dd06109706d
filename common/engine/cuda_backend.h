// The CUDA Backend (DESIGN.md §4): weights and the KV cache in device memory, every linear
// layer a cuBLAS GEMM with 16-bit (bf16 default, or f16) inputs and f32 accumulation and
// output, the residual stream / RoPE / softmax in f32, paged attention and the other ops from
// kernels/include/pd/kernels/cuda. Decode steps of the common batch sizes run as CUDA graphs.
//
//   PD_ASSIGN_OR_RETURN(auto model, pd::engine::loadModel(dir));
//   auto layout = pd::engine::kvLayoutFor(model->config, numBlocks, 16, KvDtype::kBF16);
//   PD_ASSIGN_OR_RETURN(auto backend, pd::engine::createCudaBackend(model, layout, {}));
//   MemDesc kv = backend->kvRegion();   // device memory, for kvtransfer registration
//   PD_RETURN_IF_ERROR(backend->forward(chunks, logits /* host, f32 */));
//   PD_RETURN_IF_ERROR(backend->forwardAndSample(chunks, rowParams, topN, tokens)); // or this
//
// Threads: one host thread drives a backend (as Backend says); it owns one CUDA stream and
// one cuBLAS handle, so backends on different threads/devices are independent. forward()
// returns after the step's logits are on the host.
//
// Layer readiness: with onLayerKvReady set, forward() enqueues the whole step, records a CUDA
// event after each layer's KV cache write, then waits for the events in layer order and
// calls onLayerKvReady(l) as each completes -- while the GPU computes the later layers. (On
// the GPU the callback cannot run before layer l's attention as on the CPU; what holds is
// that layer l's K/V are in device memory when it runs.) Such steps are never graphed.
//
// CUDA graphs: a step in which every chunk is one decode token that wants logits runs as
// an instantiated graph for the smallest configured batch size >= the batch (padding rows
// write nothing and attend to nothing). Graphs are captured on first use of a size and
// dropped when the scratch buffers grow.
//
// Errors: no device -> kUnavailable "cuda backend: no CUDA device found (...)"; a build
// without CUDA -> kUnimplemented; malformed batches as Backend says; CUDA / cuBLAS failures
// -> kInternal naming the call.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "common/engine/backend.h"
#include "common/engine/cpu_backend.h"
#include "common/engine/model_weights.h"
#include "common/engine/sampling.h"

namespace pd::engine {

struct CudaBackendOptions {
  int device = 0;
  // Storage type of the weights and the GEMM inputs: kBF16 (default), kF16, or kF32 (plain
  // f32 GEMMs, used by tests to compare with the CPU backend tightly).
  KvDtype weightDtype = KvDtype::kBF16;
  // Device memory holding layout.totalBytes() for the KV cache (256-byte aligned, on
  // `device`); null = the backend cudaMallocs and owns it.
  void* kvDeviceBase = nullptr;
  bool useCudaGraphs = true;
  std::vector<int> graphBatchSizes{1, 2, 4, 8, 16, 32, 64, 128};
  // 1 runs on `device`; 2/4/8 need that many GPUs (devices [device, device + n)) -- see
  // tensor_parallel.h. The sharded forward pass is not implemented yet (kUnimplemented after
  // the device check and the NCCL communicator set-up).
  int tensorParallelSize = 1;
};

class CudaBackend : public Backend {
 public:
  // The device memory of the KV cache (kind kCuda), for kvtransfer registration.
  virtual MemDesc kvRegion() const = 0;
  // Steps run through a CUDA graph so far (tests and benchmarks read it).
  virtual int64_t graphSteps() const = 0;

  // Device-side sampling (Backend::forwardAndSample): runs the step exactly as forward()
  // does, then samples every logits row on the device (pd::kernels::cuda::sampleRows) and
  // copies back only ids and logprobs instead of the [rows][vocab] f32 logits (0.5 MiB per
  // row at a 128k vocabulary). The tokens equal pd::engine::sample() on forward()'s logits
  // with the same params and step: both are the same kernel definition with exact integer
  // masses (pd/kernels/sampling.h). The Engine uses it because samplesOnDevice() is true.
  // Errors: as forward(); a params count other than the logits rows, a topN out of range or
  // invalid row params (named by row) -> kInvalidArgument.
  bool samplesOnDevice() const override { return true; }
  Status forwardAndSample(std::span<const SeqChunk> batch,
                          std::span<const pd::kernels::SampleRowParams> params, int topN,
                          SampledToken* out,
                          const LayerKvReadyFn& onLayerKvReady = {}) override = 0;
};

// OK when this build has CUDA and at least one device is visible; otherwise the error a
// worker reports for `backend: cuda`.
Status cudaDeviceAvailable();

Result<std::unique_ptr<CudaBackend>> createCudaBackend(std::shared_ptr<const ModelWeights> model,
                                                       const KvLayout& layout,
                                                       const CudaBackendOptions& options = {});

// The worker's `backend:` setting: "cpu" (hostKvBase: the KV region in host memory) or
// "cuda" (hostKvBase ignored: the KV cache lives in device memory, see kvRegion()).
// Unknown names fail with the allowed values.
Result<std::unique_ptr<Backend>> createBackend(const std::string& kind,
                                               std::shared_ptr<const ModelWeights> model,
                                               const KvLayout& layout, void* hostKvBase,
                                               const CpuBackendOptions& cpuOptions = {},
                                               const CudaBackendOptions& cudaOptions = {});

}  // namespace pd::engine
