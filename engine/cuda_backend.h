// The CUDA Backend (docs/design.md §4): weights and the KV cache in device memory, every linear
// layer a cuBLAS GEMM with 16-bit (bf16 default, or f16) inputs and f32 accumulation and
// output, the residual stream / RoPE / softmax in f32, paged attention and the other ops from
// kernels/include/pd/kernels/cuda. Decode steps of the common batch sizes run as CUDA graphs.
//
// Architectures (cudaSupportsModel, docs/models.md): Llama, Mistral, Qwen2; Qwen3 (each q and k
// head RMS-normalised after the projection and bias, before RoPE: headRmsNorm, the CPU
// backend's order); DeepseekV3's latent attention (below); and the mixture-of-experts layers
// of Mixtral, Qwen3-MoE and DeepseekV3 through cuda_moe.h: router GEMM, routing on the host
// after one stream synchronisation per MoE layer, each chosen expert's gate|up and down as
// cuBLAS GEMMs over the rows routed to it (a decode step reads only the chosen experts),
// shared experts.
//
//   PD_ASSIGN_OR_RETURN(auto model, pd::engine::describeModel(dir));  // weights stay on disk
//   auto layout = pd::engine::kvLayoutFor(model->config, numBlocks, 16, KvDtype::kBF16);
//   PD_ASSIGN_OR_RETURN(auto backend, pd::engine::createCudaBackend(model, layout, {}));
//   MemDesc kv = backend->kvRegion();   // device memory, for kvtransfer registration
//                                       // (kvRegions(): one per rank with tensor parallelism)
//   PD_RETURN_IF_ERROR(backend->forward(chunks, logits /* host, f32 */));
//   PD_RETURN_IF_ERROR(backend->forwardAndSample(chunks, rowParams, topN, tokens)); // or this
//
// Weights: a described model (describeModel) is streamed from its safetensors files to each
// rank's device in the stored dtype through a bounded pinned buffer (weight_stream.h; no host
// copy, each rank reads its slices); a loaded one (loadModel, host f32) is uploaded from host
// memory (tests compare the two). weightLoadSeconds() says how long either took.
// A described FP8 block-scaled checkpoint keeps its projections FP8 on the device (codes +
// per-row block scales, weight_stream.h keepFp8) and multiplies with them through
// pd/kernels/cuda/linear_fp8.h: fp8Gemv for up to kFp8GemvMaxRows rows, else the weight
// dequantized in weightDtype into a per-rank scratch buffer for the cuBLAS GEMM; weightDtype
// is then the activations' dtype and that of the other tensors (docs/models.md, "FP8 weights
// on the cuda backend"). An FP8 model from loadModel (host f32) is uploaded in weightDtype.
// Experts of an FP8 checkpoint are dequantized into weightDtype while streaming (cuda_moe.h
// multiplies in weightDtype only); the router is kept in f32.
//
// DeepseekV3ForCausalLM (its MoE layers through cuda_moe.h): multi-head latent attention
// in the absorbed form (cuda_mla.h, pd/kernels/cuda/mla.h), the KV region laid out by the
// latent KvLayout (one [c_kv | k_pe] vector per token and layer; kvRegion() and the layer KV
// events as for any model). TP = 1 only and an f32/f16/bf16 latent cache (TP > 1 and fp8 are
// refused by name); a described model is read into host f32 and uploaded (the streaming loader
// covers q|k|v layouts only), the backend keeping that host copy.
//
// Threads: one host thread drives a backend (as Backend says); it owns one CUDA stream and
// one cuBLAS handle per rank, so backends on different threads/devices are independent.
// forward() returns after the step's logits are on the host (and every rank is idle).
//
// Tensor parallelism (tensorParallelSize 2/4/8, tensor_parallel.h): the same host thread
// drives every rank -- rank r on device `device + r`, with its own stream, cuBLAS handle,
// weight slices, KV cache and scratch. q|k|v and gate|up are column-parallel (rank r owns
// query heads, kv heads and ffn features [r*perRank, (r+1)*perRank)), o_proj and down_proj
// row-parallel; the embedding and the f32 residual stream are replicated, and after o_proj
// and after down_proj an ncclAllReduce(sum) of the [tokens][hidden] f32 partials runs over
// all ranks inside one ncclGroupStart/End (one thread issues every rank's call). The final
// norm and lm_head run on rank 0 only, which alone holds them (other ranks' residual copies
// are identical and unused after the last layer). TP = 1 is the same code with one rank and
// no NCCL call. The KV cache is per rank: kvRegions()[r] holds rank r's kv heads
// [r*kvHeadsPerRank, (r+1)*kvHeadsPerRank) in rankKvLayout() (numKvHeads / tp heads per
// block, the same block ids and slots on every rank), so a KV transfer describes and moves
// one region per rank; kvRegion() is rank 0's.
//
// Layer readiness: with onLayerKvReady set, forward() enqueues the whole step, records a CUDA
// event on every rank after its layer-l KV cache write, then waits for the events in layer
// order and calls onLayerKvReady(l) once every rank's layer-l event completed -- while the
// GPUs compute the later layers. (On the GPU the callback cannot run before layer l's
// attention as on the CPU; what holds is that layer l's K/V are in device memory on every
// rank when it runs.) Such steps are never graphed.
//
// CUDA graphs: a model with mixture-of-experts layers never runs graphs (its routing waits for
// the router logits on the host, which a graph cannot do); every other model: at TP = 1 a
// step in which every chunk is one decode token that wants logits
// runs as an instantiated graph for the smallest configured batch size >= the batch (padding
// rows write nothing and attend to nothing). Graphs are captured on first use of a size and
// dropped when the scratch buffers grow. At TP > 1 graphs are off (steps run eagerly): a
// capture would have to span one stream per device plus the NCCL group calls from one
// thread, which no multi-GPU machine has been available to verify, and a wrong capture only
// shows at launch; the cost is the kernel-launch overhead of decode steps at TP > 1.
//
// Errors: no device -> kUnavailable "cuda backend: no CUDA device found (...)"; fewer
// visible devices than device + tensorParallelSize -> kUnavailable "... requires N GPUs
// (found M)"; a tensor_parallel_size the model's heads / kv heads / ffn do not divide ->
// kInvalidArgument (planTensorParallel); TP > 1 with a mixture-of-experts model ->
// kUnimplemented "... (expert parallelism is not implemented ...)"; TP > 1 in a build
// without NCCL -> kUnimplemented; a build without CUDA -> kUnimplemented; malformed batches
// as Backend says; CUDA / cuBLAS / NCCL failures -> kInternal naming the call.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "engine/backend.h"
#include "engine/cpu_backend.h"
#include "engine/model_weights.h"
#include "engine/sampling.h"

namespace pd::engine {

struct CudaBackendOptions {
  int device = 0;
  // Storage type of the weights and the GEMM inputs: kBF16 (default), kF16, or kF32 (plain
  // f32 GEMMs, used by tests to compare with the CPU backend tightly).
  KvDtype weightDtype = KvDtype::kBF16;
  // Device memory holding layout.totalBytes() for the KV cache (256-byte aligned, on
  // `device`); null = the backend cudaMallocs and owns it. TP = 1 only (with TP the backend
  // allocates one region per rank; a non-null value is refused).
  void* kvDeviceBase = nullptr;
  bool useCudaGraphs = true;
  std::vector<int> graphBatchSizes{1, 2, 4, 8, 16, 32, 64, 128};
  // 1 runs on `device`; 2/4/8 shard the model over that many GPUs, devices
  // [device, device + n), with NCCL all-reduces (see "Tensor parallelism" above). CUDA
  // graphs are off at TP > 1.
  int tensorParallelSize = 1;
  // Test set-up only: every rank on `device`, and the all-reduce done with an add kernel and
  // device copies ordered by events between the ranks' streams instead of NCCL (which refuses
  // two ranks on one GPU). It runs the whole sharded forward pass -- slices, per-rank KV,
  // partial sums -- on a one-GPU machine so tests can compare it with TP = 1. Slower than
  // TP = 1; not for serving.
  bool tpRanksShareDevice = false;
  // Weights: a model with host tensors (loadModel) is uploaded from them; a described one
  // (describeModel: config and dir only) is streamed from its safetensors files in the stored
  // dtype through a pinned staging buffer of this many bytes (weight_stream.h), each rank
  // reading only its slices -- no host copy of the model.
  size_t weightStagingBytes = size_t(64) << 20;
  // > 0 (at most 1): the KV cache is what this fraction of each rank's device leaves after
  // its weights and the measured activation peak (kv_budget.h), and layout.numBlocks must be
  // 0; kvLayout() then holds the block count chosen (the smallest over the ranks). The
  // scratch buffers are allocated up front for reserveTokens tokens in reserveSeqs sequences
  // per step (the engine's max_batch_tokens / max_running_requests), so the peak measured is
  // the one served with. Not with kvDeviceBase or tpRanksShareDevice.
  double gpuMemoryUtilization = 0;
  int reserveTokens = 0;
  int reserveSeqs = 0;
};

class CudaBackend : public Backend {
 public:
  // Rank 0's KV region (kind kCuda, device set): the whole KV cache at TP = 1.
  virtual MemDesc kvRegion() const = 0;
  // One KV region per rank, in rank order (kind kCuda, `device` = that rank's GPU), each
  // rankKvLayout().totalBytes() long, for kvtransfer registration: a block id names the same
  // tokens in every region, rank r's holding kv heads [r*kvHeadsPerRank, (r+1)*...).
  virtual std::vector<MemDesc> kvRegions() const = 0;
  // The layout of one rank's region: kvLayout() with numKvHeads / tensorParallelSize heads
  // (equal to kvLayout() at TP = 1). Its fingerprint() is what transfer peers must agree on.
  virtual const KvLayout& rankKvLayout() const = 0;
  virtual int tensorParallelSize() const = 0;
  // Steps run through a CUDA graph so far (tests and benchmarks read it).
  virtual int64_t graphSteps() const = 0;
  // Seconds the weights took to reach the device (streamed or uploaded), all ranks.
  virtual double weightLoadSeconds() const = 0;
  // Mixture-of-experts models: the token rows each expert got in the last MoE layer of the
  // last step ([numExperts]; empty for a dense model). Tests read it.
  virtual std::vector<int> moeExpertRows() const = 0;

  // Device-side sampling (Backend::forwardAndSample): runs the step exactly as forward()
  // does, then samples every logits row on the device (pd::kernels::cuda::sampleRows) and
  // copies back only ids and logprobs instead of the [rows][vocab] f32 logits (0.5 MiB per
  // row at a 128k vocabulary). The tokens equal pd::engine::sample() on forward()'s logits
  // with the same params and step: both are the same kernel definition with exact integer
  // masses (pd/kernels/sampling.h). The Engine uses it because samplesOnDevice() is true.
  // Errors: as forward(); a params count other than the logits rows, a topN out of range or
  // invalid row params (named by row) -> kInvalidArgument.
  bool samplesOnDevice() const override { return true; }
  Status forwardAndSample(std::span<const SeqChunk> batch, std::span<const pd::kernels::SampleRowParams> params,
                          int topN, SampledToken* out, const LayerKvReadyFn& onLayerKvReady = {}) override = 0;
};

// OK when this build has CUDA and at least one device is visible; otherwise the error a
// worker reports for `backend: cuda`.
Status cudaDeviceAvailable();

// OK when the CUDA backend implements the model's architecture and features: today every
// architecture model_config.h parses (the dense families, Qwen3, Mixtral, Qwen3-MoE,
// DeepseekV3); otherwise it would be kUnimplemented naming the architecture and the feature.
// createCudaBackend checks it before looking for a device, so a refusal is the same with or
// without a GPU; what one path does not implement (tensor parallelism with experts or latent
// attention, an fp8 latent cache) createCudaBackend refuses by name.
Status cudaSupportsModel(const ModelConfig& config);

Result<std::unique_ptr<CudaBackend>> createCudaBackend(std::shared_ptr<const ModelWeights> model,
                                                       const KvLayout& layout, const CudaBackendOptions& options = {});

// The worker's `backend:` setting: "cpu" (hostKvBase: the KV region in host memory) or
// "cuda" (hostKvBase ignored: the KV cache lives in device memory, see kvRegion()).
// Unknown names fail with the allowed values.
Result<std::unique_ptr<Backend>> createBackend(const std::string& kind, std::shared_ptr<const ModelWeights> model,
                                               const KvLayout& layout, void* hostKvBase,
                                               const CpuBackendOptions& cpuOptions = {},
                                               const CudaBackendOptions& cudaOptions = {});

}  // namespace pd::engine
