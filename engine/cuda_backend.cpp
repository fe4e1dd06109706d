// The CUDA Backend (see cuda_backend.h). Host code only (compiled by the host compiler): the
// kernels live in kernels/cuda, the GEMMs in cuBLAS, the tensor-parallel all-reduce in NCCL.
#include "engine/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#if defined(PD_HAVE_NCCL)
#include <nccl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "common/base/log.h"
#include "engine/cuda_mla.h"
#include "engine/cuda_moe.h"
#include "engine/kv_budget.h"
#include "engine/tensor_parallel.h"
#include "engine/weight_stream.h"
#include "pd/kernels/cuda/attention.h"
#include "pd/kernels/cuda/linear_fp8.h"
#include "pd/kernels/cuda/mla.h"
#include "pd/kernels/cuda/ops.h"
#include "pd/kernels/cuda/sampling.h"
#include "pd/kernels/rope.h"

namespace pd::engine {

namespace kcu = pd::kernels::cuda;

namespace {

Status cudaError(const char* call, cudaError_t e) {
  return internalError(std::string("cuda backend: ") + call + ": " + cudaGetErrorName(e) + " (" +
                       cudaGetErrorString(e) + ")");
}

#define PD_CUDA_TRY(call)                                       \
  do {                                                          \
    const cudaError_t pdErr_ = (call);                          \
    if (pdErr_ != cudaSuccess) return cudaError(#call, pdErr_); \
  } while (0)

#define PD_CUBLAS_TRY(call)                                                                              \
  do {                                                                                                   \
    const cublasStatus_t pdSt_ = (call);                                                                 \
    if (pdSt_ != CUBLAS_STATUS_SUCCESS)                                                                  \
      return internalError(std::string("cuda backend: ") + #call + ": " + cublasGetStatusString(pdSt_)); \
  } while (0)

#if defined(PD_HAVE_NCCL)
#define PD_NCCL_TRY(call)                                                                             \
  do {                                                                                                \
    const ncclResult_t pdNr_ = (call);                                                                \
    if (pdNr_ != ncclSuccess)                                                                         \
      return internalError(std::string("cuda backend: ") + #call + ": " + ncclGetErrorString(pdNr_)); \
  } while (0)
#endif

kcu::DType toKernelDtype(KvDtype d) { return static_cast<kcu::DType>(static_cast<uint8_t>(d)); }

cudaDataType_t cublasType(KvDtype d) {
  return d == KvDtype::kF32 ? CUDA_R_32F : d == KvDtype::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

std::string gib(size_t bytes) { return formatGiB(bytes); }

TensorDtype toTensorDtype(KvDtype d) {
  return d == KvDtype::kF32 ? TensorDtype::kF32 : d == KvDtype::kF16 ? TensorDtype::kF16 : TensorDtype::kBF16;
}

// A projection held as FP8 codes (the void* beside it) with row-expanded block scales
// (fp8_blocks.h, "the device layout"); scales null: the projection is in the weight dtype.
struct Fp8Scales {
  const float* scales = nullptr;
  int colOffset = 0;
};

// One rank's slice of a layer (TP = 1: the whole layer).
struct DevLayer {
  float* inputNorm = nullptr;
  void* qkv = nullptr;       // [rankQkvRows][hidden]
  float* qkvBias = nullptr;  // [rankQkvRows] or null
  void* o = nullptr;         // [hidden][rankQDim]
  float* oBias = nullptr;    // [hidden], rank 0 only (added once before the all-reduce)
  float* postNorm = nullptr;
  void* gateUp = nullptr;              // [2*ffnPerRank][hidden]
  void* down = nullptr;                // [hidden][ffnPerRank]
  Fp8Scales qkv8, o8, gateUp8, down8;  // FP8 checkpoints streamed (docs/models.md)
  float* qNorm = nullptr;              // [headDim], Qwen3 (config.qkNorm) only
  float* kNorm = nullptr;
  CudaMoeLayer moe;  // a mixture-of-experts layer (cuda_moe.h); gateUp/down then the shared experts
};

// Per-step metadata (int32 words), laid out at fixed offsets derived from the capacities so
// that device addresses stay put between steps (graphs capture them).
struct MetaLayout {
  int capT = 0, capS = 0, capW = 0, capTab = 0;
  size_t ids() const { return 0; }
  size_t pos() const { return size_t(capT); }
  size_t slots() const { return 2 * size_t(capT); }
  size_t logitRows() const { return 3 * size_t(capT); }
  size_t seqs() const { return 3 * size_t(capT) + capS; }
  size_t work() const { return seqs() + 4 * size_t(capS); }
  size_t tables() const { return work() + 2 * size_t(capW); }
  size_t words() const { return tables() + capTab; }
};

// Everything one tensor-parallel rank owns on its device. TP = 1 is one Rank.
struct Rank {
  int index = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  std::vector<void*> allocations;  // weights, KV (when owned), workspace: freed at the end
  size_t weightBytes = 0;          // device bytes of this rank's weights
  size_t freeBeforeInit = 0;       // cudaMemGetInfo free before this rank's set-up (gpu_memory_utilization)
  std::vector<DevLayer> layers;
  void* embed = nullptr;         // replicated on every rank
  const void* lmHead = nullptr;  // rank 0 only
  float* finalNorm = nullptr;    // rank 0 only
  float* invFreq = nullptr;
  void* kv = nullptr;  // this rank's KV region (perRankKvLayout)
  // FP8 projections: the largest one dequantized in the weight dtype, reused by every GEMM
  // of more rows than fp8Gemv takes (stream-ordered, so one buffer serves all layers).
  void* fp8Scratch = nullptr;
  std::vector<cudaEvent_t> layerEvents;
  cudaEvent_t reduceEvent = nullptr;  // ranks sharing a device: orders the local all-reduce
#if defined(PD_HAVE_NCCL)
  ncclComm_t comm = nullptr;
#endif
  // Scratch, sized by the backend's capacities.
  std::vector<void*> scratch;
  float *x = nullptr, *qkvOut = nullptr, *gu = nullptr, *cos = nullptr, *sin = nullptr;
  float *lastX = nullptr, *logitsDev = nullptr;  // rank 0 only
  void *xn = nullptr, *attn = nullptr, *act = nullptr;
  int32_t* metaDev = nullptr;
};

// forwardAndSample's buffers: one device block [cap] params | [cap] ids | [cap] logprobs |
// [cap][20] top ids | [cap][20] top logprobs, and its pinned host mirror (params copied in,
// everything after them copied out with one copy). Grown on demand, freed with the backend.
struct DeviceSampling {
  using Params = pd::kernels::SampleRowParams;
  static constexpr int kTop = pd::kernels::kSamplingMaxTopN;
  int cap = 0;
  char* dev = nullptr;
  char* host = nullptr;
  bool active = false;  // forward() samples instead of copying logits out
  int topN = 0;

  size_t idsOff() const { return size_t(cap) * sizeof(Params); }
  size_t lpOff() const { return idsOff() + size_t(cap) * 4; }
  size_t topIdsOff() const { return lpOff() + size_t(cap) * 4; }
  size_t topLpOff() const { return topIdsOff() + size_t(cap) * kTop * 4; }
  size_t bytes() const { return topLpOff() + size_t(cap) * kTop * 4; }
  template <typename T>
  T* at(char* base, size_t off) const {
    return reinterpret_cast<T*>(base + off);
  }
  void release() {
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
    dev = host = nullptr;
    cap = 0;
  }
};

// streamWeightsToDevice's copier for one rank: pinned staging, cudaMalloc'ed images kept in
// the rank's allocations (freed with the backend, also after a failed load), copies on the
// rank's stream. The rank's device is current.
class CudaWeightCopier final : public DeviceWeightCopier {
 public:
  explicit CudaWeightCopier(Rank& r) : r_(r) {}
  Result<void*> allocStaging(size_t bytes) override {
    void* p = nullptr;
    PD_CUDA_TRY(cudaHostAlloc(&p, std::max<size_t>(bytes, 16), cudaHostAllocDefault));
    return p;
  }
  void freeStaging(void* p) override { cudaFreeHost(p); }
  Result<void*> allocDevice(size_t bytes) override {
    void* p = nullptr;
    PD_CUDA_TRY(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
    r_.allocations.push_back(p);
    r_.weightBytes += bytes;
    return p;
  }
  Status copyAsync(void* dst, const void* src, size_t bytes) override {
    PD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, r_.stream));
    return Status::ok();
  }
  Status waitCopies() override {
    PD_CUDA_TRY(cudaStreamSynchronize(r_.stream));
    return Status::ok();
  }

 private:
  Rank& r_;
};

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(std::shared_ptr<const ModelWeights> model, const KvLayout& layout, const CudaBackendOptions& opt,
                  const TensorParallelPlan& plan)
      : model_(std::move(model)),
        cfg_(model_->config),
        layout_(layout),
        rankLayout_(perRankKvLayout(layout, plan)),
        opt_(opt),
        plan_(plan) {}
  ~CudaBackendImpl() override;

  Status init();

  const ModelConfig& config() const override { return cfg_; }
  const KvLayout& kvLayout() const override { return layout_; }
  const KvLayout& rankKvLayout() const override { return rankLayout_; }
  int tensorParallelSize() const override { return plan_.size; }
  MemDesc kvRegion() const override { return regionOf(ranks_[0]); }
  std::vector<MemDesc> kvRegions() const override {
    std::vector<MemDesc> v;
    for (const Rank& r : ranks_) v.push_back(regionOf(r));
    return v;
  }
  int64_t graphSteps() const override { return graphSteps_; }
  double weightLoadSeconds() const override { return loadSeconds_; }
  std::vector<int> moeExpertRows() const override { return moe_ ? moe_->lastExpertRows() : std::vector<int>{}; }

  Status forward(std::span<const SeqChunk> batch, float* logits, const LayerKvReadyFn& onLayerKvReady) override;
  Status forwardAndSample(std::span<const SeqChunk> batch, std::span<const pd::kernels::SampleRowParams> params,
                          int topN, SampledToken* out, const LayerKvReadyFn& onLayerKvReady) override;

 private:
  MemDesc regionOf(const Rank& r) const {
    MemDesc d;
    d.addr = reinterpret_cast<uintptr_t>(r.kv);
    d.len = rankLayout_.totalBytes();
    d.device = r.device;
    d.kind = MemKind::kCuda;
    return d;
  }
  // Makes rank r's device current; a no-op at TP = 1 (forward() set it once).
  Status use(const Rank& r) {
    if (ranks_.size() > 1) PD_CUDA_TRY(cudaSetDevice(r.device));
    return Status::ok();
  }
  // Enqueues the sampling of logits rows [0, L) and the copy of the results to sampling_.host.
  Status enqueueSampling(int L);
  template <typename T>
  Status deviceAlloc(Rank& r, T** p, size_t bytes) {
    void* raw = nullptr;
    PD_CUDA_TRY(cudaMalloc(&raw, std::max<size_t>(bytes, 16)));
    r.allocations.push_back(raw);
    *p = static_cast<T*>(raw);
    return Status::ok();
  }
  // Copies n host f32 values to new device memory of rank r in the weight dtype (asF32: keep
  // f32). Rank r's device must be current.
  Status uploadWeight(Rank& r, const float* src, size_t n, bool asF32, void** out);
  // Rank r's weights from the model's host f32 tensors (loadModel) or, for a described model,
  // streamed from its checkpoint (weight_stream.h).
  Status uploadRankWeights(Rank& r);
  Status streamRankWeights(Rank& r);
  // gpu_memory_utilization: sizes layout_ from what the ranks' devices have left, then
  // allocates every rank's KV region.
  Status sizeKvByUtilization();
  Status allocRankKv(Rank& r);
  Status initRank(Rank& r);
  Status allocScratch(int capT, int capS, int capW, int capTab);
  void freeScratch();
  void dropGraphs();
  Status syncAll();
  // y[n][out] (f32) = x[n][in] (weight dtype) * W^T + beta * y, on rank r's handle. With w8's
  // scales set, w holds FP8 codes: up to kFp8GemvMaxRows rows run fp8Gemv on the codes,
  // more dequantize W into r.fp8Scratch for the same cuBLAS GEMM.
  Status gemm(const Rank& r, const void* x, int n, int in, const void* w, int out, float* y, float beta,
              const Fp8Scales& w8 = {});
  // Sums every rank's x[0 .. n) and leaves the sum in each (in place).
  Status allReduceX(size_t n);
  Status enqueueStep(int T, int W, int L, bool recordEvents);
  // Layer l's attention block through multi-head latent attention (cuda_mla.h), from r.xn to
  // the residual in r.x (TP = 1 only).
  Status enqueueMlaAttention(Rank& r, int l, int T, int W, bool recordEvents);
  void* layerKv(const Rank& r, int l) const { return static_cast<char*>(r.kv) + size_t(l) * rankLayout_.layerBytes(); }
  const int32_t* meta(const Rank& r, size_t off) const { return r.metaDev + off; }

  std::shared_ptr<const ModelWeights> model_;
  const ModelConfig& cfg_;
  KvLayout layout_;      // the whole model's (what the engine and validateBatch see)
  KvLayout rankLayout_;  // one rank's: numKvHeads / tp heads
  CudaBackendOptions opt_;
  TensorParallelPlan plan_;
  kcu::DType wdt_ = kcu::DType::kBF16;
  kcu::DType kvdt_ = kcu::DType::kBF16;
  // The projections stay FP8 on the device: a described (streamed) FP8 block-scaled model.
  bool fp8Weights_ = false;
  int group_ = 1;
  bool graphsOn_ = true;  // opt_.useCudaGraphs && TP == 1

  std::vector<Rank> ranks_;
  MetaLayout ml_;
  int32_t* metaHost_ = nullptr;  // pinned (portable), uploaded to every rank
  float* logitsHost_ = nullptr;  // pinned, [capS][vocab]

  std::map<int, cudaGraphExec_t> graphs_;  // TP = 1: batch size -> instantiated decode step
  int64_t graphSteps_ = 0;
  double loadSeconds_ = 0;
  DeviceSampling sampling_;
  std::unique_ptr<CudaMla> mla_;  // DeepseekV3: multi-head latent attention; else null
  std::unique_ptr<CudaMoe> moe_;  // MoE models (TP = 1): rank 0's stream and cuBLAS handle
};

CudaBackendImpl::~CudaBackendImpl() {
  (void)syncAll();
  if (!ranks_.empty()) cudaSetDevice(ranks_[0].device);
  moe_.reset();  // before the stream it uses is destroyed
  dropGraphs();
  freeScratch();
  for (Rank& r : ranks_) {
    cudaSetDevice(r.device);
#if defined(PD_HAVE_NCCL)
    if (r.comm) ncclCommDestroy(r.comm);
#endif
    for (cudaEvent_t e : r.layerEvents) cudaEventDestroy(e);
    if (r.reduceEvent) cudaEventDestroy(r.reduceEvent);
    for (void* p : r.allocations) cudaFree(p);
    if (r.cublas) cublasDestroy(r.cublas);
    if (r.stream) cudaStreamDestroy(r.stream);
  }
  if (!ranks_.empty()) cudaSetDevice(ranks_[0].device);
}

Status CudaBackendImpl::syncAll() {
  Status first = Status::ok();
  for (Rank& r : ranks_) {
    if (!r.stream) continue;
    if (ranks_.size() > 1) cudaSetDevice(r.device);
    const cudaError_t e = cudaStreamSynchronize(r.stream);
    if (e != cudaSuccess && first.isOk()) first = cudaError("cudaStreamSynchronize", e);
  }
  if (ranks_.size() > 1) cudaSetDevice(ranks_[0].device);
  return first;
}

void CudaBackendImpl::dropGraphs() {
  for (auto& [size, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
}

void CudaBackendImpl::freeScratch() {
  for (Rank& r : ranks_) {
    if (ranks_.size() > 1) cudaSetDevice(r.device);
    for (void* p : r.scratch) cudaFree(p);
    r.scratch.clear();
  }
  if (ranks_.size() > 1) cudaSetDevice(ranks_[0].device);
  if (metaHost_) cudaFreeHost(metaHost_);
  sampling_.release();
  if (logitsHost_) cudaFreeHost(logitsHost_);
  metaHost_ = nullptr;
  logitsHost_ = nullptr;
}

Status CudaBackendImpl::uploadWeight(Rank& r, const float* src, size_t n, bool asF32, void** out) {
  const kcu::DType dt = asF32 ? kcu::DType::kF32 : wdt_;
  void* dst = nullptr;
  PD_RETURN_IF_ERROR(deviceAlloc(r, &dst, n * kcu::dtypeBytes(dt)));
  r.weightBytes += n * kcu::dtypeBytes(dt);
  *out = dst;
  if (dt == kcu::DType::kF32) {
    PD_CUDA_TRY(cudaMemcpy(dst, src, n * sizeof(float), cudaMemcpyHostToDevice));
    return Status::ok();
  }
  // Stage f32 slices through one device buffer and convert on the device.
  constexpr size_t kSlice = size_t(16) << 20;  // floats
  float* staging = nullptr;
  PD_CUDA_TRY(cudaMalloc(&staging, std::max<size_t>(std::min(n, kSlice), 1) * sizeof(float)));
  Status st = Status::ok();
  for (size_t off = 0; off < n && st.isOk(); off += kSlice) {
    const size_t m = std::min(kSlice, n - off);
    cudaError_t e = cudaMemcpy(staging, src + off, m * sizeof(float), cudaMemcpyHostToDevice);
    if (e == cudaSuccess)
      e = kcu::convertFromF32(staging, static_cast<char*>(dst) + off * kcu::dtypeBytes(dt), dt, m, r.stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(r.stream);
    if (e != cudaSuccess) st = cudaError("uploading weights", e);
  }
  cudaFree(staging);
  return st;
}

Status CudaBackendImpl::uploadRankWeights(Rank& r) {
  const int R = plan_.size;
  const size_t h = size_t(cfg_.hiddenSize);
  auto put = [&](const float* src, size_t n, bool asF32, auto** out) -> Status {
    void* p = nullptr;
    PD_RETURN_IF_ERROR(uploadWeight(r, src, n, asF32, &p));
    *out = static_cast<std::remove_pointer_t<std::remove_reference_t<decltype(*out)>>*>(p);
    return Status::ok();
  };
  auto putVec = [&](const std::vector<float>& v, bool asF32, auto** out) {
    return put(v.data(), v.size(), asF32, out);
  };
  PD_RETURN_IF_ERROR(put(model_->embed.data(), model_->embed.size(), false, &r.embed));
  if (r.index == 0) {
    r.lmHead = r.embed;
    if (!model_->lmHead.empty()) {
      void* p = nullptr;
      PD_RETURN_IF_ERROR(put(model_->lmHead.data(), model_->lmHead.size(), false, &p));
      r.lmHead = p;
    }
    PD_RETURN_IF_ERROR(put(model_->finalNorm.data(), model_->finalNorm.size(), true, &r.finalNorm));
  }
  r.layers.resize(cfg_.numLayers);
  for (int l = 0; l < cfg_.numLayers; ++l) {
    const LayerWeights& w = model_->layers[l];
    DevLayer& d = r.layers[l];
    PD_RETURN_IF_ERROR(put(w.inputNorm.data(), w.inputNorm.size(), true, &d.inputNorm));
    PD_RETURN_IF_ERROR(put(w.postNorm.data(), w.postNorm.size(), true, &d.postNorm));
    if (R == 1) {  // the whole layer, straight from the host buffers
      if (!w.qkv.empty()) PD_RETURN_IF_ERROR(put(w.qkv.data(), w.qkv.size(), false, &d.qkv));  // none under MLA
      PD_RETURN_IF_ERROR(put(w.o.data(), w.o.size(), false, &d.o));
      if (!w.gateUp.empty()) {  // a MoE layer without shared experts has no dense MLP
        PD_RETURN_IF_ERROR(put(w.gateUp.data(), w.gateUp.size(), false, &d.gateUp));
        PD_RETURN_IF_ERROR(put(w.down.data(), w.down.size(), false, &d.down));
      }
      if (!w.qkvBias.empty()) PD_RETURN_IF_ERROR(put(w.qkvBias.data(), w.qkvBias.size(), true, &d.qkvBias));
    } else {  // column-parallel q|k|v, gate|up; row-parallel o, down (tensor_parallel.h)
      const auto qkvRows = plan_.qkvRows(r.index);
      const auto guRows = plan_.gateUpRows(r.index);
      PD_RETURN_IF_ERROR(putVec(sliceRows(w.qkv.data(), h, qkvRows), false, &d.qkv));
      PD_RETURN_IF_ERROR(putVec(sliceColumns(w.o.data(), h, plan_.qDim(), plan_.oColumns(r.index)), false, &d.o));
      PD_RETURN_IF_ERROR(putVec(sliceRows(w.gateUp.data(), h, guRows), false, &d.gateUp));
      PD_RETURN_IF_ERROR(
          putVec(sliceColumns(w.down.data(), h, plan_.ffn(), plan_.downColumns(r.index)), false, &d.down));
      if (!w.qkvBias.empty()) PD_RETURN_IF_ERROR(putVec(sliceRows(w.qkvBias.data(), 1, qkvRows), true, &d.qkvBias));
    }
    // The o_proj bias is added once: by rank 0, before the all-reduce sums the partials.
    if (!w.oBias.empty() && r.index == 0) PD_RETURN_IF_ERROR(put(w.oBias.data(), w.oBias.size(), true, &d.oBias));
    if (cfg_.qkNorm) {  // every rank normalises its own heads with the same weights
      PD_RETURN_IF_ERROR(put(w.qNorm.data(), w.qNorm.size(), true, &d.qNorm));
      PD_RETURN_IF_ERROR(put(w.kNorm.data(), w.kNorm.size(), true, &d.kNorm));
    }
    if (cfg_.isMoeLayer(l)) {  // TP = 1 only (createCudaBackend)
      auto upload = [&](const float* src, size_t n, bool asF32, void** out) {
        return uploadWeight(r, src, n, asF32, out);
      };
      PD_RETURN_IF_ERROR(uploadCudaMoeLayer(w, upload, d.gateUp, d.down, &d.moe));
    }
  }
  if (mla_)  // the latent attention's projections (cuda_mla.h; TP = 1)
    PD_RETURN_IF_ERROR(mla_->uploadWeights(*model_, [&](const float* src, size_t n, bool asF32, void** out) {
      return uploadWeight(r, src, n, asF32, out);
    }));

  return Status::ok();
}

Status CudaBackendImpl::streamRankWeights(Rank& r) {
  CudaWeightCopier copier(r);
  WeightStreamOptions o;
  o.matrixDtype = toTensorDtype(opt_.weightDtype);
  o.stagingBytes = opt_.weightStagingBytes;
  o.tensorParallelSize = plan_.size;
  o.rank = r.index;
  o.keepFp8 = fp8Weights_;
  WeightLoadStats st;
  PD_ASSIGN_OR_RETURN(DeviceModel m, streamWeightsToDevice(model_->dir, cfg_, o, copier, &st));
  auto f32 = [](const DeviceTensor& t) { return static_cast<float*>(t.data); };
  size_t fp8ScratchBytes = 0;
  r.embed = m.embed.data;
  if (r.index == 0) {
    r.lmHead = m.lmHead.data ? m.lmHead.data : r.embed;
    r.finalNorm = f32(m.finalNorm);
  }
  r.layers.resize(cfg_.numLayers);
  for (int l = 0; l < cfg_.numLayers; ++l) {
    const DeviceLayer& s = m.layers[l];
    DevLayer& d = r.layers[l];
    d.inputNorm = f32(s.inputNorm);
    d.postNorm = f32(s.postNorm);
    d.qkv = s.qkv.data;
    d.qkvBias = f32(s.qkvBias);
    d.o = s.o.data;
    d.oBias = f32(s.oBias);
    d.gateUp = s.gateUp.data;
    d.down = s.down.data;
    auto fp8 = [](const DeviceTensor& t) {
      return t.dtype == TensorDtype::kF8E4M3 ? Fp8Scales{static_cast<const float*>(t.scales), t.scaleColOffset}
                                             : Fp8Scales{};
    };
    d.qkv8 = fp8(s.qkv);
    d.o8 = fp8(s.o);
    d.gateUp8 = fp8(s.gateUp);
    d.down8 = fp8(s.down);
    d.qNorm = f32(s.qNorm);
    d.kNorm = f32(s.kNorm);
    if (cfg_.isMoeLayer(l)) d.moe = cudaMoeLayerFromStream(s);
    for (const DeviceTensor* t : {&s.qkv, &s.o, &s.gateUp, &s.down})
      if (t->dtype == TensorDtype::kF8E4M3) fp8ScratchBytes = std::max(fp8ScratchBytes, t->bytes);
  }
  size_t fp8Bytes = 0;
  if (fp8ScratchBytes > 0) {  // bytes of codes = elements of the largest FP8 projection
    fp8Bytes = fp8ScratchBytes * kcu::dtypeBytes(wdt_);
    PD_RETURN_IF_ERROR(deviceAlloc(r, &r.fp8Scratch, fp8Bytes));
  }
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.2f s (%.2f GiB/s)", st.seconds,
                st.seconds > 0 ? double(st.deviceBytes) / double(1ull << 30) / st.seconds : 0.0);
  PD_LOG(kInfo, "engine") << "cuda backend: rank " << r.index << " streamed " << gib(st.deviceBytes) << " of weights ("
                          << (fp8Bytes ? "fp8 projections with f32 block scales, " : "") << kcu::dtypeName(wdt_)
                          << (fp8Bytes ? " embedding/lm_head" : " matrices") << ", f32 norms) from " << model_->dir
                          << " in " << rate << ", read " << gib(st.fileBytesRead) << " through "
                          << (st.stagingBytes >> 20) << " MiB of pinned staging"
                          << (fp8Bytes ? ", " + gib(fp8Bytes) + " of " + kcu::dtypeName(wdt_) + " dequant scratch"
                                       : "");
  return Status::ok();
}

Status CudaBackendImpl::allocRankKv(Rank& r) {
  PD_CUDA_TRY(cudaSetDevice(r.device));
  PD_RETURN_IF_ERROR(deviceAlloc(r, &r.kv, rankLayout_.totalBytes()));
  PD_CUDA_TRY(cudaMemset(r.kv, 0, rankLayout_.totalBytes()));
  return Status::ok();
}

Status CudaBackendImpl::sizeKvByUtilization() {
  KvLayout one = rankLayout_;
  one.numBlocks = 1;
  int64_t blocks = kMaxKvBlocks;
  std::string detail;
  for (Rank& r : ranks_) {
    PD_CUDA_TRY(cudaSetDevice(r.device));
    size_t freeMem = 0, totalMem = 0;
    PD_CUDA_TRY(cudaMemGetInfo(&freeMem, &totalMem));
    // Everything this rank's set-up took beyond its weights: scratch for the reserved step,
    // the cuBLAS workspace, pinned-mapping and context growth -- the activation peak.
    const size_t used = r.freeBeforeInit > freeMem ? r.freeBeforeInit - freeMem : 0;
    KvBudgetInput in;
    in.deviceTotalBytes = totalMem;
    in.utilization = opt_.gpuMemoryUtilization;
    in.weightBytes = r.weightBytes;
    in.activationBytes = used > r.weightBytes ? used - r.weightBytes : 0;
    in.bytesPerBlock = one.totalBytes();
    in.blockSize = layout_.blockSize;
    auto b = kvBudgetFromUtilization(in);
    if (!b.ok())
      return Status(b.status().code(),
                    "cuda backend: device " + std::to_string(r.device) + ": " + b.status().message());
    if (b->kvBytes > freeMem)
      return resourceExhausted("cuda backend: engine.gpu_memory_utilization gives device " + std::to_string(r.device) +
                               " a KV cache of " + gib(b->kvBytes) + " but only " + gib(freeMem) +
                               " is free (other processes use the device): lower it");
    blocks = std::min(blocks, b->numBlocks);
    if (r.index == 0)
      detail = "share " + gib(b->shareBytes) + " of " + gib(totalMem) + ", weights " + gib(in.weightBytes) +
               ", activation peak " + gib(in.activationBytes);
  }
  layout_.numBlocks = int(blocks);
  rankLayout_ = perRankKvLayout(layout_, plan_);
  for (Rank& r : ranks_) PD_RETURN_IF_ERROR(allocRankKv(r));
  PD_CUDA_TRY(cudaSetDevice(ranks_[0].device));
  PD_LOG(kInfo, "engine") << "cuda backend: KV cache by gpu_memory_utilization " << opt_.gpuMemoryUtilization << " ("
                          << detail << "): " << blocks << " blocks of " << layout_.blockSize
                          << " tokens = " << blocks * layout_.blockSize << " tokens of context, "
                          << gib(rankLayout_.totalBytes()) << (plan_.size > 1 ? " per rank" : "");
  return Status::ok();
}

Status CudaBackendImpl::initRank(Rank& r) {
  PD_CUDA_TRY(cudaSetDevice(r.device));
  const int R = plan_.size;
  PD_CUDA_TRY(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
  PD_CUBLAS_TRY(cublasCreate(&r.cublas));
  PD_CUBLAS_TRY(cublasSetStream(r.cublas, r.stream));
  // A fixed workspace keeps cuBLAS from allocating during graph capture.
  constexpr size_t kWorkspace = size_t(32) << 20;
  void* workspace = nullptr;
  PD_RETURN_IF_ERROR(deviceAlloc(r, &workspace, kWorkspace));
  PD_CUBLAS_TRY(cublasSetWorkspace(r.cublas, workspace, kWorkspace));
  PD_CUDA_TRY(kcu::pagedAttentionInit());
  if (mla_) PD_CUDA_TRY(kcu::mlaAttentionInit());

  const auto t0 = std::chrono::steady_clock::now();
  PD_RETURN_IF_ERROR(model_->hasHostTensors() ? uploadRankWeights(r) : streamRankWeights(r));
  loadSeconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::vector<float> invFreq(cfg_.headDim / 2);
  pd::kernels::cpu::RopeLlama3Scaling s;
  s.factor = float(cfg_.rope.factor);
  s.lowFreqFactor = float(cfg_.rope.lowFreqFactor);
  s.highFreqFactor = float(cfg_.rope.highFreqFactor);
  s.originalMaxPositionEmbeddings = cfg_.rope.originalMaxPositionEmbeddings;
  pd::kernels::cpu::ropeInvFreq(invFreq.data(), cfg_.headDim, cfg_.rope.theta, cfg_.rope.llama3 ? &s : nullptr);
  if (mla_) invFreq = mla_->invFreq();  // the rope part's, YaRN applied (the tables hold ropeHalf() columns)
  void* invFreqDev = nullptr;
  PD_RETURN_IF_ERROR(uploadWeight(r, invFreq.data(), invFreq.size(), true, &invFreqDev));
  r.invFreq = static_cast<float*>(invFreqDev);

  if (opt_.kvDeviceBase) {  // TP = 1 only (createCudaBackend checks)
    r.kv = opt_.kvDeviceBase;
  } else if (opt_.gpuMemoryUtilization <= 0) {  // otherwise sizeKvByUtilization, after scratch
    PD_RETURN_IF_ERROR(allocRankKv(r));
  }
  r.layerEvents.resize(cfg_.numLayers, nullptr);
  for (cudaEvent_t& e : r.layerEvents) PD_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  if (R > 1) PD_CUDA_TRY(cudaEventCreateWithFlags(&r.reduceEvent, cudaEventDisableTiming));
  return Status::ok();
}

Status CudaBackendImpl::init() {
  wdt_ = toKernelDtype(opt_.weightDtype);
  kvdt_ = toKernelDtype(layout_.dtype);
  fp8Weights_ = !model_->hasHostTensors() && cfg_.quantization.fp8;
  group_ = cfg_.numHeads / cfg_.numKvHeads;
  if (cfg_.isMla()) mla_ = std::make_unique<CudaMla>(cfg_, wdt_, kvdt_);
  const int R = plan_.size;
  // A MoE layer synchronises the stream to route on the host (cuda_moe.h): no graphs.
  graphsOn_ = opt_.useCudaGraphs && R == 1 && !cfg_.isMoe();
  ranks_.resize(R);
  for (int i = 0; i < R; ++i) {
    ranks_[i].index = i;
    ranks_[i].device = opt_.tpRanksShareDevice ? opt_.device : opt_.device + i;
  }

  // Memory check before any large allocation, so the error says what does not fit: per rank
  // the replicated embedding, 1/R of every layer's matrices, 1/R of the KV cache, and on
  // rank 0 the lm_head; summed per device (ranks may share one).
  // Sizes from the config, so a described model (nothing in host memory) is checked as well.
  const size_t h = size_t(cfg_.hiddenSize), ffn = size_t(cfg_.intermediateSize);
  const size_t attnElems = cfg_.isMla()
                               ? size_t(cfg_.attentionParams())
                               : (size_t(cfg_.qDim()) + 2 * size_t(cfg_.kvDim())) * h + h * size_t(cfg_.qDim());
  // A MoE layer's dense MLP is its shared experts' (DeepseekV3's; none elsewhere); its experts below.
  size_t layerElems = 0;
  for (int l = 0; l < cfg_.numLayers; ++l)
    layerElems += attnElems + 3 * (cfg_.isMoeLayer(l) ? size_t(cfg_.moe.sharedFfn()) : ffn) * h;
  const size_t embedElems = size_t(cfg_.vocabSize) * h;
  const size_t wb = kcu::dtypeBytes(wdt_);
  // FP8 projections: one byte a weight plus 4 bytes per row per block of columns, and the
  // dequant scratch of the largest one (gate|up) in the weight dtype.
  const size_t bc = size_t(cfg_.quantization.blockCols);
  size_t layerBytes =
      fp8Weights_ ? layerElems / R + layerElems / R / bc * 4 + 2 * ffn / R * h * wb : layerElems / R * wb;
  for (int l = 0; l < cfg_.numLayers; ++l)  // routers and experts (TP = 1), experts in wdt_ also from FP8
    if (cfg_.isMoeLayer(l)) layerBytes += cudaMoeLayerBytes(cfg_, wb);
  std::map<int, size_t> need;
  size_t weightBytesRank0 = 0;
  for (const Rank& r : ranks_) {
    size_t w = embedElems * wb + layerBytes;
    if (r.index == 0) {
      w += (cfg_.tieWordEmbeddings ? 0 : embedElems) * wb;
      weightBytesRank0 = w;
    }
    const size_t kv = opt_.kvDeviceBase || opt_.gpuMemoryUtilization > 0 ? 0 : rankLayout_.totalBytes();
    need[r.device] += w + kv + (size_t(512) << 20);
  }
  for (const auto& [dev, bytes] : need) {
    PD_CUDA_TRY(cudaSetDevice(dev));
    size_t freeMem = 0, totalMem = 0;
    PD_CUDA_TRY(cudaMemGetInfo(&freeMem, &totalMem));
    if (bytes > freeMem)
      return resourceExhausted("cuda backend: weights (in " + std::string(kcu::dtypeName(wdt_)) +
                               ") + KV cache + 0.5 GiB scratch per rank need " + gib(bytes) + " on device " +
                               std::to_string(dev) + ", " + gib(freeMem) + " free");
  }

  for (Rank& r : ranks_) {
    PD_CUDA_TRY(cudaSetDevice(r.device));
    size_t totalMem = 0;
    PD_CUDA_TRY(cudaMemGetInfo(&r.freeBeforeInit, &totalMem));
    PD_RETURN_IF_ERROR(initRank(r));
  }
  PD_CUDA_TRY(cudaSetDevice(ranks_[0].device));

  if (R > 1 && !opt_.tpRanksShareDevice) {
#if defined(PD_HAVE_NCCL)
    std::vector<ncclComm_t> comms(R, nullptr);
    std::vector<int> devs(R);
    for (int i = 0; i < R; ++i) devs[i] = ranks_[i].device;
    const ncclResult_t nr = ncclCommInitAll(comms.data(), R, devs.data());
    if (nr != ncclSuccess)
      return internalError("cuda backend: ncclCommInitAll over " + std::to_string(R) + " devices from " +
                           std::to_string(opt_.device) + ": " + ncclGetErrorString(nr));
    for (int i = 0; i < R; ++i) ranks_[i].comm = comms[i];
    PD_CUDA_TRY(cudaSetDevice(ranks_[0].device));
#else
    return unimplemented("cuda backend: tensor_parallel_size " + std::to_string(R) +
                         " needs NCCL, which this build did not find (libnccl)");
#endif
  }

  int maxGraph = 1;
  for (int b : opt_.graphBatchSizes) maxGraph = std::max(maxGraph, b);
  // The reserved step (gpu_memory_utilization): its scratch now, so the peak is measured.
  const int capT = std::max({256, maxGraph, opt_.reserveTokens});
  const int capS = std::max({16, maxGraph, opt_.reserveSeqs});
  const int capW = std::max({256, maxGraph * kcu::attnWorkItems(1, group_),
                             kcu::attnWorkItems(opt_.reserveTokens, group_) + opt_.reserveSeqs});
  PD_RETURN_IF_ERROR(allocScratch(capT, capS, capW, 4096));
  if (cfg_.isMoe()) {  // TP = 1 (createCudaBackend): rank 0 runs every MoE layer
    moe_ = std::make_unique<CudaMoe>(cfg_, wdt_, ranks_[0].cublas, ranks_[0].stream);
    PD_RETURN_IF_ERROR(moe_->reserve(capT));
  }
  if (opt_.gpuMemoryUtilization > 0) PD_RETURN_IF_ERROR(sizeKvByUtilization());
  std::string where = "device " + std::to_string(opt_.device);
  if (R > 1)
    where = "tensor_parallel_size " + std::to_string(R) +
            (opt_.tpRanksShareDevice
                 ? " with every rank on device " + std::to_string(opt_.device) + " (local all-reduce: a test set-up)"
                 : " on devices " + std::to_string(ranks_.front().device) + ".." +
                       std::to_string(ranks_.back().device) + " (NCCL all-reduce)");
  const char* graphs = graphsOn_             ? ", CUDA graphs on"
                       : !opt_.useCudaGraphs ? ", CUDA graphs off"
                       : cfg_.isMoe()        ? ", CUDA graphs off (mixture-of-experts routing syncs per layer)"
                                             : ", CUDA graphs off (tensor_parallel_size > 1)";
  PD_LOG(kInfo, "engine") << "cuda backend: " << where << ", weights " << gib(weightBytesRank0) << " "
                          << (fp8Weights_ ? "fp8 projections (W8A16 kernels), " : "") << kcu::dtypeName(wdt_)
                          << (fp8Weights_ ? " embedding" : "") << (R > 1 ? " on rank 0" : "") << ", KV "
                          << gib(rankLayout_.totalBytes()) << " " << kvDtypeName(layout_.dtype)
                          << (R > 1 ? " per rank" : "") << graphs;
  return Status::ok();
}

Status CudaBackendImpl::allocScratch(int capT, int capS, int capW, int capTab) {
  PD_RETURN_IF_ERROR(syncAll());
  dropGraphs();
  freeScratch();
  const int h = cfg_.hiddenSize, half = cfg_.headDim / 2;
  const int qkvRows = plan_.rankQkvRows(), ffn = plan_.ffnPerRank;
  const size_t wb = kcu::dtypeBytes(wdt_);
  ml_ = {capT, capS, capW, capTab};
  for (Rank& r : ranks_) {
    PD_RETURN_IF_ERROR(use(r));
    auto alloc = [&](auto** ptr, size_t bytes) -> Status {
      void* raw = nullptr;
      PD_CUDA_TRY(cudaMalloc(&raw, std::max<size_t>(bytes, 16)));
      r.scratch.push_back(raw);
      // Zeroed so padding rows of a graph never hold NaN bit patterns.
      PD_CUDA_TRY(cudaMemset(raw, 0, std::max<size_t>(bytes, 16)));
      *ptr = static_cast<std::remove_pointer_t<std::remove_reference_t<decltype(*ptr)>>*>(raw);
      return Status::ok();
    };
    PD_RETURN_IF_ERROR(alloc(&r.x, size_t(capT) * h * 4));
    // Under MLA q|k|v is never formed (cuda_mla.h keeps its own buffers) and o_proj's input is
    // heads * vHeadDim wide, not numHeads * headDim (headDim being the latent's width there).
    PD_RETURN_IF_ERROR(alloc(&r.qkvOut, mla_ ? 0 : size_t(capT) * qkvRows * 4));
    PD_RETURN_IF_ERROR(alloc(&r.gu, size_t(capT) * 2 * ffn * 4));
    PD_RETURN_IF_ERROR(alloc(&r.cos, size_t(capT) * half * 4));
    PD_RETURN_IF_ERROR(alloc(&r.sin, size_t(capT) * half * 4));
    if (r.index == 0) {
      PD_RETURN_IF_ERROR(alloc(&r.lastX, size_t(capS) * h * 4));
      PD_RETURN_IF_ERROR(alloc(&r.logitsDev, size_t(capS) * cfg_.vocabSize * 4));
    }
    PD_RETURN_IF_ERROR(alloc(&r.xn, size_t(capT) * h * wb));
    PD_RETURN_IF_ERROR(alloc(&r.attn, size_t(capT) * (mla_ ? mla_->outDim() : plan_.rankQDim()) * wb));
    PD_RETURN_IF_ERROR(alloc(&r.act, size_t(capT) * ffn * wb));
    PD_RETURN_IF_ERROR(alloc(&r.metaDev, ml_.words() * 4));
    if (mla_) PD_RETURN_IF_ERROR(mla_->allocScratch(capT, [&](void** p, size_t bytes) { return alloc(p, bytes); }));
  }
  PD_RETURN_IF_ERROR(use(ranks_[0]));
  // Portable: every rank's device copies from these.
  PD_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&metaHost_), ml_.words() * 4, cudaHostAllocPortable));
  PD_CUDA_TRY(
      cudaHostAlloc(reinterpret_cast<void**>(&logitsHost_), size_t(capS) * cfg_.vocabSize * 4, cudaHostAllocPortable));
  std::memset(metaHost_, 0, ml_.words() * 4);
  return Status::ok();
}

Status CudaBackendImpl::gemm(const Rank& r, const void* x, int n, int in, const void* w, int out, float* y, float beta,
                             const Fp8Scales& w8) {
  if (w8.scales) {
    const auto* codes = static_cast<const uint8_t*>(w);
    const int bc = cfg_.quantization.blockCols;
    if (n <= kcu::kFp8GemvMaxRows) {
      PD_CUDA_TRY(kcu::fp8Gemv(x, wdt_, n, codes, w8.scales, out, in, w8.colOffset, bc, y, beta, r.stream));
      return Status::ok();
    }
    PD_CUDA_TRY(kcu::fp8Dequantize(codes, w8.scales, out, in, w8.colOffset, bc, r.fp8Scratch, wdt_, r.stream));
    w = r.fp8Scratch;
  }
  // Row-major y[n][out] = x[n][in] * W[out][in]^T is column-major y^T = W^T(op T) * x^T.
  const float alpha = 1.0f;
  const cudaDataType_t t = cublasType(opt_.weightDtype);
  PD_CUBLAS_TRY(cublasGemmEx(r.cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w, t, in, x, t, in, &beta, y,
                             CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::ok();
}

Status CudaBackendImpl::allReduceX(size_t n) {
  if (ranks_.size() == 1) return Status::ok();
  if (!opt_.tpRanksShareDevice) {
#if defined(PD_HAVE_NCCL)
    // One thread drives every rank, so the per-rank calls must be one NCCL group (otherwise
    // the first call would wait for peers that are never launched).
    PD_NCCL_TRY(ncclGroupStart());
    for (Rank& r : ranks_) {
      const ncclResult_t nr = ncclAllReduce(r.x, r.x, n, ncclFloat, ncclSum, r.comm, r.stream);
      if (nr != ncclSuccess) {
        ncclGroupEnd();
        return internalError(std::string("cuda backend: ncclAllReduce: ") + ncclGetErrorString(nr));
      }
    }
    PD_NCCL_TRY(ncclGroupEnd());
    return Status::ok();
#else
    return unimplemented("cuda backend: tensor parallelism needs NCCL");
#endif
  }
  // Ranks on one device (tests): rank 0 adds the others' partials once they are written, then
  // every other rank copies the sum back; rank 0 waits for those copies before it writes x
  // again. Same result as the NCCL sum up to the order of the additions.
  Rank& r0 = ranks_[0];
  if (n > size_t(std::numeric_limits<int>::max())) return invalidArgument("cuda backend: all-reduce too large");
  for (size_t i = 1; i < ranks_.size(); ++i) PD_CUDA_TRY(cudaEventRecord(ranks_[i].reduceEvent, ranks_[i].stream));
  for (size_t i = 1; i < ranks_.size(); ++i) {
    PD_CUDA_TRY(cudaStreamWaitEvent(r0.stream, ranks_[i].reduceEvent, 0));
    PD_CUDA_TRY(kcu::addRows(r0.x, ranks_[i].x, 1, int(n), r0.stream));  // elementwise add
  }
  PD_CUDA_TRY(cudaEventRecord(r0.reduceEvent, r0.stream));
  for (size_t i = 1; i < ranks_.size(); ++i) {
    Rank& r = ranks_[i];
    PD_CUDA_TRY(cudaStreamWaitEvent(r.stream, r0.reduceEvent, 0));
    PD_CUDA_TRY(cudaMemcpyAsync(r.x, r0.x, n * 4, cudaMemcpyDeviceToDevice, r.stream));
    PD_CUDA_TRY(cudaEventRecord(r.reduceEvent, r.stream));
    PD_CUDA_TRY(cudaStreamWaitEvent(r0.stream, r.reduceEvent, 0));
  }
  return Status::ok();
}

Status CudaBackendImpl::enqueueMlaAttention(Rank& r, int l, int T, int W, bool recordEvents) {
  CudaMla::Step st;
  st.numTokens = T;
  st.slots = meta(r, ml_.slots());
  st.blockTables = meta(r, ml_.tables());
  st.seqs = reinterpret_cast<const kcu::AttnSeq*>(meta(r, ml_.seqs()));
  st.work = reinterpret_cast<const kcu::AttnWork*>(meta(r, ml_.work()));
  st.numWork = W;
  st.blockSize = rankLayout_.blockSize;
  st.cos = r.cos;
  st.sin = r.sin;
  const CudaMla::GemmFn gemmFn = [&](const void* x, int n, int in, const void* w, int out, float* y, float beta) {
    return gemm(r, x, n, in, w, out, y, beta);
  };
  PD_RETURN_IF_ERROR(mla_->project(l, r.xn, st, layerKv(r, l), gemmFn, r.stream));
  if (recordEvents) PD_CUDA_TRY(cudaEventRecord(r.layerEvents[l], r.stream));
  PD_RETURN_IF_ERROR(mla_->attend(l, st, layerKv(r, l), r.attn, r.cublas, r.stream));
  return gemm(r, r.attn, T, mla_->outDim(), r.layers[l].o, cfg_.hiddenSize, r.x, 1.0f);
}

// Enqueues one step over T token rows, W attention work items and L logits rows whose
// metadata is already in every rank's metaDev. recordEvents: record each rank's
// layerEvents[l] after its layer-l KV write (not during graph capture).
//
// Every rank holds the whole residual stream x. Per layer: each rank computes its heads'
// q|k|v, writes its kv heads' K/V, attends, and multiplies its attention output by its o_proj
// columns -- rank 0 into x with beta = 1 (residual, plus the o bias), the others into x with
// beta = 0 (their partial) -- and the all-reduce leaves x + sum of partials in every rank's x.
// The MLP does the same with gate|up rows and down_proj columns. At TP = 1 the all-reduce is
// a no-op and this is the single-GPU step.
Status CudaBackendImpl::enqueueStep(int T, int W, int L, bool recordEvents) {
  const int h = cfg_.hiddenSize, hd = cfg_.headDim, half = hd / 2;
  const int nh = plan_.headsPerRank, nkv = plan_.kvHeadsPerRank;
  const int qDim = plan_.rankQDim(), kvDim = plan_.rankKvDim(), qkvRows = plan_.rankQkvRows();
  const int ffn = plan_.ffnPerRank;
  const float eps = cfg_.rmsNormEps, scale = 1.0f / std::sqrt(float(hd));
  const size_t xElems = size_t(T) * h;

  for (Rank& r : ranks_) {
    PD_RETURN_IF_ERROR(use(r));
    PD_CUDA_TRY(kcu::embeddingGather(r.embed, wdt_, meta(r, ml_.ids()), T, h, r.x, r.stream));
    PD_CUDA_TRY(
        kcu::ropeCosSin(meta(r, ml_.pos()), T, r.invFreq, mla_ ? mla_->ropeHalf() : half, r.cos, r.sin, r.stream));
  }
  for (int l = 0; l < cfg_.numLayers; ++l) {
    for (Rank& r : ranks_) {
      PD_RETURN_IF_ERROR(use(r));
      const DevLayer& w = r.layers[l];
      const auto* seqs = reinterpret_cast<const kcu::AttnSeq*>(meta(r, ml_.seqs()));
      const auto* work = reinterpret_cast<const kcu::AttnWork*>(meta(r, ml_.work()));
      cudaStream_t s = r.stream;
      PD_CUDA_TRY(kcu::rmsNorm(r.x, h, w.inputNorm, r.xn, wdt_, h, T, h, eps, s));
      if (mla_) {  // DeepseekV3's attention block (cuda_mla.h), o_proj and residual included
        PD_RETURN_IF_ERROR(enqueueMlaAttention(r, l, T, W, recordEvents));
        continue;
      }
      if (w.qkvBias) PD_CUDA_TRY(kcu::broadcastRows(r.qkvOut, w.qkvBias, T, qkvRows, s));
      PD_RETURN_IF_ERROR(gemm(r, r.xn, T, h, w.qkv, qkvRows, r.qkvOut, w.qkvBias ? 1.0f : 0.0f, w.qkv8));
      if (w.qNorm) {  // Qwen3: each q and k head RMS-normalised after the bias, before RoPE (as the CPU)
        PD_CUDA_TRY(kcu::headRmsNorm(r.qkvOut, qkvRows, T, nh, hd, w.qNorm, eps, s));
        PD_CUDA_TRY(kcu::headRmsNorm(r.qkvOut + qDim, qkvRows, T, nkv, hd, w.kNorm, eps, s));
      }
      PD_CUDA_TRY(kcu::applyRope(r.qkvOut, qkvRows, T, nh, hd, r.cos, r.sin, s));
      PD_CUDA_TRY(kcu::applyRope(r.qkvOut + qDim, qkvRows, T, nkv, hd, r.cos, r.sin, s));
      PD_CUDA_TRY(kcu::kvCacheWrite(layerKv(r, l), kvdt_, r.qkvOut + qDim, r.qkvOut + qDim + kvDim, qkvRows,
                                    meta(r, ml_.slots()), T, rankLayout_.blockSize, nkv, hd, s));
      if (recordEvents) PD_CUDA_TRY(cudaEventRecord(r.layerEvents[l], s));
      PD_CUDA_TRY(kcu::pagedAttention(r.qkvOut, qkvRows, layerKv(r, l), kvdt_, meta(r, ml_.tables()), seqs, work, W,
                                      rankLayout_.blockSize, nh, nkv, hd, scale, r.attn, wdt_, qDim, s));
      const bool carriesResidual = r.index == 0;
      if (w.oBias) PD_CUDA_TRY(kcu::addRows(r.x, w.oBias, T, h, s));  // rank 0 only
      PD_RETURN_IF_ERROR(gemm(r, r.attn, T, qDim, w.o, h, r.x, carriesResidual ? 1.0f : 0.0f, w.o8));
    }
    PD_RETURN_IF_ERROR(allReduceX(xElems));
    for (Rank& r : ranks_) {
      PD_RETURN_IF_ERROR(use(r));
      const DevLayer& w = r.layers[l];
      cudaStream_t s = r.stream;
      PD_CUDA_TRY(kcu::rmsNorm(r.x, h, w.postNorm, r.xn, wdt_, h, T, h, eps, s));
      if (cfg_.isMoeLayer(l)) {  // routed + shared experts (cuda_moe.h); TP = 1, so no all-reduce
        PD_RETURN_IF_ERROR(moe_->forward(w.moe, w.postNorm, eps, r.x, r.xn, T));
        continue;
      }
      PD_RETURN_IF_ERROR(gemm(r, r.xn, T, h, w.gateUp, 2 * ffn, r.gu, 0.0f, w.gateUp8));
      PD_CUDA_TRY(kcu::swiGlu(r.gu, r.act, wdt_, T, ffn, s));
      PD_RETURN_IF_ERROR(gemm(r, r.act, T, ffn, w.down, h, r.x, r.index == 0 ? 1.0f : 0.0f, w.down8));
    }
    PD_RETURN_IF_ERROR(allReduceX(xElems));
  }
  // The final norm and lm_head run on rank 0 alone (its x is the whole residual stream).
  Rank& r0 = ranks_[0];
  PD_RETURN_IF_ERROR(use(r0));
  if (L > 0) {
    PD_CUDA_TRY(kcu::gatherRows(r0.x, h, meta(r0, ml_.logitRows()), L, h, r0.lastX, r0.stream));
    PD_CUDA_TRY(kcu::rmsNorm(r0.lastX, h, r0.finalNorm, r0.xn, wdt_, h, L, h, eps, r0.stream));
    PD_RETURN_IF_ERROR(gemm(r0, r0.xn, L, h, r0.lmHead, cfg_.vocabSize, r0.logitsDev, 0.0f));
  }
  return Status::ok();
}

Status CudaBackendImpl::forward(std::span<const SeqChunk> batch, float* logits, const LayerKvReadyFn& onLayerKvReady) {
  PD_ASSIGN_OR_RETURN(const BatchShape shape, validateBatch(batch, cfg_, layout_));
  const int T = shape.totalTokens, L = shape.numLogits, tab = shape.tableEntries;
  if (T == 0) return Status::ok();
  if (L > 0 && !logits && !sampling_.active) return invalidArgument("forward: logits is null but chunks want logits");
  PD_CUDA_TRY(cudaSetDevice(ranks_[0].device));
  // Normally idle already; after a failed step they may still be reading metaHost_.
  PD_RETURN_IF_ERROR(syncAll());
  const int S = int(batch.size());
  Rank& r0 = ranks_[0];

  // A graph step: all chunks are single decode tokens that want logits, no layer callback.
  int graphSize = 0;
  if (graphsOn_ && !onLayerKvReady) {
    bool decodeOnly = true;
    for (const SeqChunk& s : batch) decodeOnly = decodeOnly && s.numTokens == 1 && s.wantLogits;
    if (decodeOnly) {
      for (int b : opt_.graphBatchSizes)
        if (b >= S && (graphSize == 0 || b < graphSize)) graphSize = b;
    }
  }
  const int rowsT = graphSize > 0 ? graphSize : T;
  const int rowsS = graphSize > 0 ? graphSize : S;
  int W = 0;
  for (const SeqChunk& s : batch) W += kcu::attnWorkItems(s.numTokens, group_);
  if (graphSize > 0) W = graphSize * kcu::attnWorkItems(1, group_);

  if (rowsT > ml_.capT || rowsS > ml_.capS || W > ml_.capW || tab > ml_.capTab) {
    auto grow = [](int need, int have) { return std::max(need, have * 2); };
    PD_RETURN_IF_ERROR(
        allocScratch(grow(rowsT, ml_.capT), grow(rowsS, ml_.capS), grow(W, ml_.capW), grow(tab, ml_.capTab)));
  }

  // Per-step metadata, built in pinned memory and uploaded with one copy per rank (every
  // rank has the same tokens, slots and tables; its KV holds other heads of the same slots).
  int32_t* ids = metaHost_ + ml_.ids();
  int32_t* pos = metaHost_ + ml_.pos();
  int32_t* slots = metaHost_ + ml_.slots();
  int32_t* logitRows = metaHost_ + ml_.logitRows();
  auto* seqs = reinterpret_cast<kcu::AttnSeq*>(metaHost_ + ml_.seqs());
  auto* work = reinterpret_cast<kcu::AttnWork*>(metaHost_ + ml_.work());
  int32_t* tables = metaHost_ + ml_.tables();
  int t = 0, nl = 0, w = 0, to = 0;
  for (int c = 0; c < S; ++c) {
    const SeqChunk& s = batch[c];
    const int need = (s.startPos + s.numTokens + layout_.blockSize - 1) / layout_.blockSize;
    seqs[c] = {t, s.numTokens, s.startPos, to};
    std::memcpy(tables + to, s.blockTable, size_t(need) * 4);
    to += need;
    const int items = kcu::attnWorkItems(s.numTokens, group_);
    for (int i = 0; i < items; ++i) work[w++] = {c, i * kcu::kAttnRowsPerBlock};
    for (int i = 0; i < s.numTokens; ++i, ++t) {
      const int p = s.startPos + i;
      ids[t] = s.tokens[i];
      pos[t] = p;
      slots[t] = s.blockTable[p / layout_.blockSize] * layout_.blockSize + p % layout_.blockSize;
    }
    if (s.wantLogits) logitRows[nl++] = t - 1;
  }
  for (int c = S; c < rowsS; ++c) {  // graph padding: write nothing, attend to nothing
    seqs[c] = {c, 0, 0, 0};
    for (int i = 0; i < kcu::attnWorkItems(1, group_); ++i) work[w++] = {c, i * kcu::kAttnRowsPerBlock};
    ids[c] = 0;
    pos[c] = 0;
    slots[c] = -1;
    logitRows[c] = c;
  }
  for (Rank& r : ranks_) {
    PD_RETURN_IF_ERROR(use(r));
    PD_CUDA_TRY(cudaMemcpyAsync(r.metaDev, metaHost_, (ml_.tables() + to) * 4, cudaMemcpyHostToDevice, r.stream));
  }
  PD_RETURN_IF_ERROR(use(r0));

  if (graphSize > 0) {  // TP = 1 only
    auto it = graphs_.find(graphSize);
    if (it == graphs_.end()) {
      cudaGraph_t graph = nullptr;
      PD_CUDA_TRY(cudaStreamBeginCapture(r0.stream, cudaStreamCaptureModeThreadLocal));
      const Status st = enqueueStep(graphSize, W, graphSize, false);
      const cudaError_t endErr = cudaStreamEndCapture(r0.stream, &graph);
      if (!st.isOk()) {
        if (graph) cudaGraphDestroy(graph);
        return st;
      }
      if (endErr != cudaSuccess) return cudaError("cudaStreamEndCapture", endErr);
      cudaGraphExec_t exec = nullptr;
      const cudaError_t instErr = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      if (instErr != cudaSuccess) return cudaError("cudaGraphInstantiate", instErr);
      it = graphs_.emplace(graphSize, exec).first;
    }
    PD_CUDA_TRY(cudaGraphLaunch(it->second, r0.stream));
    ++graphSteps_;
  } else {
    PD_RETURN_IF_ERROR(enqueueStep(T, W, L, bool(onLayerKvReady)));
  }
  if (L > 0 && sampling_.active) {
    PD_RETURN_IF_ERROR(enqueueSampling(L));
  } else if (L > 0) {
    PD_CUDA_TRY(
        cudaMemcpyAsync(logitsHost_, r0.logitsDev, size_t(L) * cfg_.vocabSize * 4, cudaMemcpyDeviceToHost, r0.stream));
  }
  if (onLayerKvReady) {
    // Layer l is ready when every rank has written its kv heads of layer l.
    for (int l = 0; l < cfg_.numLayers; ++l) {
      for (const Rank& r : ranks_) PD_CUDA_TRY(cudaEventSynchronize(r.layerEvents[l]));
      onLayerKvReady(l);
    }
  }
  PD_RETURN_IF_ERROR(syncAll());
  if (L > 0 && !sampling_.active) std::memcpy(logits, logitsHost_, size_t(L) * cfg_.vocabSize * 4);
  return Status::ok();
}

Status CudaBackendImpl::enqueueSampling(int L) {
  DeviceSampling& ds = sampling_;
  Rank& r0 = ranks_[0];  // the logits are on rank 0
  PD_CUDA_TRY(
      cudaMemcpyAsync(ds.dev, ds.host, size_t(L) * sizeof(DeviceSampling::Params), cudaMemcpyHostToDevice, r0.stream));
  const int vocab = cfg_.vocabSize;
  PD_CUDA_TRY(kcu::sampleRows(r0.logitsDev, vocab, L, vocab, ds.at<DeviceSampling::Params>(ds.dev, 0), ds.topN,
                              ds.at<int32_t>(ds.dev, ds.idsOff()), ds.at<float>(ds.dev, ds.lpOff()),
                              ds.at<int32_t>(ds.dev, ds.topIdsOff()), ds.at<float>(ds.dev, ds.topLpOff()), r0.stream));
  PD_CUDA_TRY(cudaMemcpyAsync(ds.host + ds.idsOff(), ds.dev + ds.idsOff(), ds.bytes() - ds.idsOff(),
                              cudaMemcpyDeviceToHost, r0.stream));
  return Status::ok();
}

Status CudaBackendImpl::forwardAndSample(std::span<const SeqChunk> batch,
                                         std::span<const pd::kernels::SampleRowParams> params, int topN,
                                         SampledToken* out, const LayerKvReadyFn& onLayerKvReady) {
  int L = 0;
  for (const SeqChunk& c : batch) L += c.wantLogits ? 1 : 0;
  if (params.size() != size_t(L))
    return invalidArgument("forwardAndSample: " + std::to_string(params.size()) + " sampling params for " +
                           std::to_string(L) + " logits rows");
  if (topN < 0 || topN > kMaxLogprobs || topN > cfg_.vocabSize)
    return invalidArgument("forwardAndSample: topN " + std::to_string(topN) + " must be in [0, " +
                           std::to_string(std::min(kMaxLogprobs, cfg_.vocabSize)) + "]");
  if (L > 0 && !out) return invalidArgument("forwardAndSample: out is null but chunks want logits");
  for (size_t r = 0; r < params.size(); ++r) {
    const auto& p = params[r];
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature) || !(p.topP > 0.0f) || !(p.topP <= 1.0f) ||
        !(p.minP >= 0.0f) || !(p.minP <= 1.0f) || !(p.u >= 0.0) || !(p.u < 1.0))
      return invalidArgument("forwardAndSample: row " + std::to_string(r) +
                             ": temperature must be finite >= 0, top_p in (0, 1], min_p in "
                             "[0, 1] and u in [0, 1)");
  }
  PD_CUDA_TRY(cudaSetDevice(ranks_[0].device));
  DeviceSampling& ds = sampling_;
  if (L > ds.cap) {
    PD_RETURN_IF_ERROR(syncAll());  // nothing in flight reads the old buffers
    ds.release();
    DeviceSampling grown;
    grown.cap = std::max(L, 16);
    cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&grown.dev), grown.bytes());
    if (e == cudaSuccess) e = cudaMallocHost(reinterpret_cast<void**>(&grown.host), grown.bytes());
    if (e != cudaSuccess) {
      grown.release();
      return cudaError("forwardAndSample: sampling buffers", e);
    }
    ds = grown;
  }
  if (L > 0) std::memcpy(ds.host, params.data(), params.size_bytes());
  ds.topN = topN;
  ds.active = true;
  const Status st = forward(batch, nullptr, onLayerKvReady);
  ds.active = false;
  PD_RETURN_IF_ERROR(st);
  for (int r = 0; r < L; ++r) {
    SampledToken& t = out[r];
    t.id = ds.at<int32_t>(ds.host, ds.idsOff())[r];
    t.logprob = ds.at<float>(ds.host, ds.lpOff())[r];
    t.topLogprobs.clear();
    for (int j = 0; j < topN; ++j)
      t.topLogprobs.emplace_back(ds.at<int32_t>(ds.host, ds.topIdsOff())[size_t(r) * topN + j],
                                 ds.at<float>(ds.host, ds.topLpOff())[size_t(r) * topN + j]);
  }
  return Status::ok();
}

}  // namespace

Status cudaDeviceAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return unavailable(std::string("cuda backend: no CUDA device found (cudaGetDeviceCount: ") + cudaGetErrorName(e) +
                       ": " + cudaGetErrorString(e) + ")");
  if (count == 0) return unavailable("cuda backend: no CUDA device found (cudaGetDeviceCount: 0 devices)");
  return Status::ok();
}

Result<std::unique_ptr<CudaBackend>> createCudaBackend(std::shared_ptr<const ModelWeights> model,
                                                       const KvLayout& layout, const CudaBackendOptions& options) {
  // Before the device probe, so the refusal names the dtype on any machine.
  if (layout.dtype == KvDtype::kInt8)
    return unimplemented(std::string("createCudaBackend: KV dtype ") + kvDtypeName(layout.dtype) +
                         " (the CUDA kernels keep K/V in f32, f16, bf16 or fp8; int8 KV runs on the cpu backend: "
                         "docs/kv_cache.md, \"Quantized KV cache\")");
  if (model) PD_RETURN_IF_ERROR(cudaSupportsModel(model->config));
  if (model && model->config.isMla()) {  // multi-head latent attention: what cuda_mla.h implements
    const ModelConfig& c = model->config;
    const char* arch = architectureName(c.architecture);
    if (options.tensorParallelSize != 1)
      return unimplemented("createCudaBackend: tensor_parallel_size " + std::to_string(options.tensorParallelSize) +
                           " with " + arch +
                           " (multi-head latent attention runs on one GPU; its latent KV has no heads to shard)");
    if (layout.dtype == KvDtype::kFp8)
      return unimplemented(std::string("createCudaBackend: KV dtype fp8 for ") + arch +
                           " (the latent KV is kept in f32, f16 or bf16 on CUDA)");
    if (!kcu::mlaShapeSupported(c.mla.kvLoraRank, c.mla.qkRopeHeadDim) || c.mla.qkNopeHeadDim <= 0)
      return unimplemented(
          "createCudaBackend: kv_lora_rank " + std::to_string(c.mla.kvLoraRank) + ", qk_rope_head_dim " +
          std::to_string(c.mla.qkRopeHeadDim) + ", qk_nope_head_dim " + std::to_string(c.mla.qkNopeHeadDim) +
          " (the MLA kernels take kv_lora_rank <= " + std::to_string(kcu::kMlaMaxKvLoraRank) +
          ", an even qk_rope_head_dim <= " + std::to_string(kcu::kMlaMaxRopeDim) + " and qk_nope_head_dim > 0)");
  }
  PD_RETURN_IF_ERROR(cudaDeviceAvailable());
  if (!model) return invalidArgument("createCudaBackend: no model");
  if (model->config.isMla() && !model->hasHostTensors()) {
    // The weight streamer knows the q|k|v layouts only: a described MLA model is read into
    // host f32 (loadModelWeights, FP8 dequantized) and uploaded from there; the backend keeps
    // that host copy for its life (docs/models.md, "DeepSeek-V3").
    PD_LOG(kInfo, "engine") << "cuda backend: " << model->dir
                            << ": multi-head latent attention weights are read into host memory and uploaded (the "
                               "streaming loader covers q|k|v models only)";
    PD_ASSIGN_OR_RETURN(model, loadModelWeights(model->dir, model->config));
  }
  const ModelConfig& c = model->config;
  if (layout.numLayers != c.numLayers || layout.numKvHeads != c.numKvHeads || layout.headDim != c.headDim ||
      layout.latent != c.isMla())
    return invalidArgument("createCudaBackend: KV layout " + layout.fingerprint() +
                           " does not match the model (layers " + std::to_string(c.numLayers) + ", kv heads " +
                           std::to_string(c.numKvHeads) + ", head dim " + std::to_string(c.headDim) +
                           (c.isMla() ? ", latent" : "") + ")");
  if (options.gpuMemoryUtilization != 0) {
    if (!(options.gpuMemoryUtilization > 0 && options.gpuMemoryUtilization <= 1))
      return invalidArgument("createCudaBackend: gpuMemoryUtilization " + std::to_string(options.gpuMemoryUtilization) +
                             " is outside (0, 1]");
    if (layout.blockSize <= 0 || layout.numBlocks != 0)
      return invalidArgument(
          "createCudaBackend: with gpuMemoryUtilization the KV layout needs blockSize > 0 and "
          "numBlocks 0 (the backend sizes it)");
    if (options.kvDeviceBase || options.tpRanksShareDevice)
      return invalidArgument(
          "createCudaBackend: gpuMemoryUtilization sizes a KV cache the backend allocates on "
          "devices of its own: not with kvDeviceBase or tpRanksShareDevice");
  } else if (layout.blockSize <= 0 || layout.numBlocks <= 0) {
    return invalidArgument("createCudaBackend: KV layout needs blockSize > 0 and numBlocks > 0");
  }
  if (!c.isMla() && (c.headDim > kcu::kAttnMaxHeadDim || c.headDim % 2 != 0))
    return unimplemented("createCudaBackend: head_dim " + std::to_string(c.headDim) +
                         " (the attention kernel supports even head dims up to " +
                         std::to_string(kcu::kAttnMaxHeadDim) + ")");
  if (reinterpret_cast<uintptr_t>(options.kvDeviceBase) % 256 != 0)
    return invalidArgument(
        "createCudaBackend: kvDeviceBase must be 256-byte aligned (as cudaMalloc returns): the "
        "attention kernel reads K/V with 16-byte loads");
  for (int b : options.graphBatchSizes)
    if (b <= 0) return invalidArgument("createCudaBackend: graph batch size " + std::to_string(b) + " <= 0");
  int count = 0;
  cudaGetDeviceCount(&count);
  PD_ASSIGN_OR_RETURN(const TensorParallelPlan plan, planTensorParallel(c, options.tensorParallelSize));
  if (plan.size > 1 && c.isMoe())
    return unimplemented("createCudaBackend: tensor_parallel_size " + std::to_string(plan.size) + " with " +
                         architectureName(c.architecture) +
                         "'s mixture of experts (expert parallelism is not implemented on CUDA; use "
                         "tensor_parallel_size 1 or backend: cpu)");
  if (plan.size > 1 && options.kvDeviceBase)
    return invalidArgument("createCudaBackend: kvDeviceBase is for tensor_parallel_size 1; with " +
                           std::to_string(plan.size) +
                           " ranks the backend allocates one KV region per rank (kvRegions())");
#if !defined(PD_HAVE_NCCL)
  if (plan.size > 1 && !options.tpRanksShareDevice)
    return unimplemented("createCudaBackend: tensor_parallel_size " + std::to_string(plan.size) +
                         " needs NCCL, which this build did not find (libnccl)");
#endif
  const int devicesNeeded = options.tpRanksShareDevice ? 1 : plan.size;
  if (options.device < 0 || options.device + devicesNeeded > count)
    return unavailable("createCudaBackend: tensor_parallel_size " + std::to_string(plan.size) + " on device " +
                       std::to_string(options.device) + " requires " + std::to_string(options.device + devicesNeeded) +
                       " GPUs (found " + std::to_string(count) + ")");
  auto b = std::make_unique<CudaBackendImpl>(std::move(model), layout, options, plan);
  PD_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<CudaBackend>(std::move(b));
}

}  // namespace pd::engine
