// Streaming weight load: a checkpoint's tensors go from the safetensors files to a device's
// memory in their stored dtype (or converted chunk by chunk when the device wants another;
// an FP8 block-scaled checkpoint's F8_E4M3 weights are dequantized with their scales,
// fp8_blocks.h, and stored in matrixDtype: f32 * scale rounded once -- or, with keepFp8, the
// projections stay codes with row-expanded scales),
// through a bounded staging buffer, without a host copy of the model. The CUDA backend loads
// this way (its copier: pinned staging, cudaMemcpyAsync); tests load through a host-memory
// copier and compare the bytes that arrive with the file's.
//
//   CudaWeightCopier copier(...);                  // a DeviceWeightCopier
//   WeightStreamOptions o;                         // bf16 matrices, 64 MiB staging, rank 0 of 1
//   WeightLoadStats stats;
//   PD_ASSIGN_OR_RETURN(DeviceModel dev, streamWeightsToDevice(dir, config, o, copier, &stats));
//
// What lands on the device (per tensor-parallel rank r of tensorParallelSize, plan as
// tensor_parallel.h): the same fused layouts as model_weights.h -- q|k|v rows stacked, gate|up
// rows stacked -- restricted to rank r's rows (column-parallel q|k|v, gate|up) and columns
// (row-parallel o_proj, down_proj), so a rank reads and copies its slices only. The embedding
// is on every rank; model.norm, lm_head (untied) and the o_proj bias on rank 0 only. Matrices
// (embedding, lm_head, projections) are stored in matrixDtype; norms and biases in f32 (the
// kernels read them so).
//
// Memory: the loader's own host memory is the staging buffer (two halves: one is filled with
// pread() -- and converted, when the dtypes differ -- while the copier moves the other) plus
// O(layers) bookkeeping, plus, for an F8_E4M3 tensor, its block scales in f32 (one float per
// block: 1/16384 of its elements at 128x128); it never holds a whole tensor. Device memory comes from the copier
// and belongs to whoever owns the copier's allocations (the backend), also on error.
//
// Architectures: the dense ones, Qwen3 (q_norm/k_norm), and the mixture-of-experts layers of
// Mixtral, Qwen3-MoE and DeepseekV3 (DeviceLayer's MoE fields; at tensor_parallel_size 1: a
// larger size with a MoE model -> kUnimplemented).
// Threads: one call at a time per copier. Errors: missing tensors and shape mismatches as
// Checkpoint says (naming file, tensor and shapes); a plan the model does not divide
// (planTensorParallel); matrixDtype F8_E4M3 -> kUnimplemented; stagingBytes too small for one row of a sliced matrix ->
// kInvalidArgument naming both; the copier's errors as it returns them.
//
// keepFp8: a projection whose pieces are all F8_E4M3 is copied as codes (1 byte a weight)
// followed by its row-expanded block scales (fp8_blocks.h: 4 bytes per row per 128 columns,
// built on the host from the tensor's scales and sent through the same staging buffer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace pd::engine {

// Where streamed weights go. The CUDA backend's copier allocates device memory and pinned
// staging; tests' copiers use host memory (HostWeightCopier).
class DeviceWeightCopier {
 public:
  virtual ~DeviceWeightCopier() = default;
  // Host memory the copier copies from (pinned for a GPU); freed with freeStaging.
  virtual Result<void*> allocStaging(size_t bytes) = 0;
  virtual void freeStaging(void* p) = 0;
  // Device memory for one tensor image; its owner is the copier's owner.
  virtual Result<void*> allocDevice(size_t bytes) = 0;
  // Starts copying bytes from staging memory to device memory at dst. The staging bytes must
  // stay untouched until waitCopies() returned.
  virtual Status copyAsync(void* dst, const void* src, size_t bytes) = 0;
  // Returns once every copy started so far is complete.
  virtual Status waitCopies() = 0;
};

// The "device" is host memory: allocDevice is an aligned malloc the copier owns (freed with
// it), copies are memcpy. For tests of the loader, and to see what a device would hold.
class HostWeightCopier final : public DeviceWeightCopier {
 public:
  ~HostWeightCopier() override;
  Result<void*> allocStaging(size_t bytes) override;
  void freeStaging(void* p) override;
  Result<void*> allocDevice(size_t bytes) override;
  Status copyAsync(void* dst, const void* src, size_t bytes) override;
  Status waitCopies() override { return Status::ok(); }

  size_t stagingBytesAllocated() const { return stagingBytes_; }  // over the copier's life
  size_t deviceBytesAllocated() const { return deviceBytes_; }
  uint64_t bytesCopied() const { return bytesCopied_; }

 private:
  std::vector<void*> device_;
  size_t stagingBytes_ = 0, deviceBytes_ = 0;
  uint64_t bytesCopied_ = 0;
};

struct DeviceTensor {
  void* data = nullptr;  // null: this rank holds no such tensor
  size_t bytes = 0;      // data's bytes (without the scales)
  TensorDtype dtype = TensorDtype::kF32;
  // dtype kF8E4M3 (WeightStreamOptions::keepFp8 only): data holds the e4m3 codes of the
  // [rows][cols] slice and scales its row-expanded block scales, f32
  // [rows][fp8RowScaleCols(scaleColOffset, cols, blockCols)] (fp8_blocks.h), owned as data is.
  void* scales = nullptr;
  size_t scaleBytes = 0;
  int scaleColOffset = 0;  // the slice's first column % blockCols
};

struct DeviceLayer {
  DeviceTensor inputNorm, postNorm;  // [hidden] f32
  DeviceTensor qkv;                  // [rankQkvRows][hidden]
  DeviceTensor qkvBias;              // [rankQkvRows] f32, when the model has it
  DeviceTensor o;                    // [hidden][rankQDim]
  DeviceTensor oBias;                // [hidden] f32, rank 0, when the model has it
  DeviceTensor gateUp;               // [2 * ffnPerRank][hidden]; a MoE layer: the shared experts' or none
  DeviceTensor down;                 // [hidden][ffnPerRank]; likewise
  DeviceTensor qNorm, kNorm;         // [headDim] f32, Qwen3 (config.qkNorm) only
  // Mixture-of-experts layers (config.isMoeLayer; tensor_parallel_size 1 only): the router in
  // f32, each expert's gate|up [2*expertFfn][hidden] and down [hidden][expertFfn] in
  // matrixDtype (an FP8 checkpoint's experts dequantized: keepFp8 covers the dense
  // projections only), DeepseekV3's correction bias in host memory (routing runs on the host).
  struct Expert {
    DeviceTensor gateUp, down;
  };
  DeviceTensor router;            // [numExperts][hidden] f32
  std::vector<float> routerBias;  // host [numExperts], DeepseekV3; else empty
  std::vector<Expert> experts;
};

struct DeviceModel {
  DeviceTensor embed;      // [vocab][hidden], every rank
  DeviceTensor finalNorm;  // [hidden] f32, rank 0
  DeviceTensor lmHead;     // [vocab][hidden], rank 0, untied models only
  std::vector<DeviceLayer> layers;
  size_t deviceBytes = 0;  // sum of the images' bytes
};

struct WeightStreamOptions {
  TensorDtype matrixDtype = TensorDtype::kBF16;
  size_t stagingBytes = size_t(64) << 20;  // the loader's whole host buffer (>= 64 KiB)
  int tensorParallelSize = 1;
  int rank = 0;
  // The projections (q|k|v, o, gate|up, down) of an FP8 block-scaled checkpoint stay FP8:
  // when every piece of a fused matrix is F8_E4M3, its image is the codes as stored plus
  // row-expanded scales (DeviceTensor, dtype kF8E4M3) instead of matrixDtype values -- half
  // the bytes of bf16. Any other tensor is loaded as without it. The CUDA backend sets it.
  bool keepFp8 = false;
};

struct WeightLoadStats {
  double seconds = 0;          // wall time of the whole load
  uint64_t fileBytesRead = 0;  // stored bytes read from the checkpoint (this rank's slices)
  uint64_t deviceBytes = 0;    // bytes copied to the device
  size_t stagingBytes = 0;     // the loader's host memory (staging buffer)
  int64_t copies = 0;          // copier calls
};

Result<DeviceModel> streamWeightsToDevice(const std::string& modelDir, const ModelConfig& config,
                                          const WeightStreamOptions& options, DeviceWeightCopier& copier,
                                          WeightLoadStats* stats);

}  // namespace pd::engine
