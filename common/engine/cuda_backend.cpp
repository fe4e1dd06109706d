// The CUDA Backend (see cuda_backend.h). Host code only (compiled by the host compiler): the
// kernels live in kernels/cuda, the GEMMs in cuBLAS.
#include "common/engine/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#if defined(PD_HAVE_NCCL)
#include <nccl.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "common/base/log.h"
#include "common/engine/tensor_parallel.h"
#include "pd/kernels/cuda/attention.h"
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

#define PD_CUBLAS_TRY(call)                                               \
  do {                                                                    \
    const cublasStatus_t pdSt_ = (call);                                  \
    if (pdSt_ != CUBLAS_STATUS_SUCCESS)                                   \
      return internalError(std::string("cuda backend: ") + #call + ": " + \
                           cublasGetStatusString(pdSt_));                 \
  } while (0)

kcu::DType toKernelDtype(KvDtype d) { return static_cast<kcu::DType>(static_cast<uint8_t>(d)); }

cudaDataType_t cublasType(KvDtype d) {
  return d == KvDtype::kF32 ? CUDA_R_32F : d == KvDtype::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

std::string gib(size_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GiB", double(bytes) / double(1ull << 30));
  return b;
}

struct DevLayer {
  float* inputNorm = nullptr;
  void* qkv = nullptr;
  float* qkvBias = nullptr;
  void* o = nullptr;
  float* oBias = nullptr;
  float* postNorm = nullptr;
  void* gateUp = nullptr;
  void* down = nullptr;
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

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(std::shared_ptr<const ModelWeights> model, const KvLayout& layout,
                  const CudaBackendOptions& opt)
      : model_(std::move(model)), cfg_(model_->config), layout_(layout), opt_(opt) {}
  ~CudaBackendImpl() override;

  Status init();

  const ModelConfig& config() const override { return cfg_; }
  const KvLayout& kvLayout() const override { return layout_; }
  MemDesc kvRegion() const override {
    MemDesc d;
    d.addr = reinterpret_cast<uintptr_t>(kv_);
    d.len = layout_.totalBytes();
    d.device = opt_.device;
    d.kind = MemKind::kCuda;
    return d;
  }
  int64_t graphSteps() const override { return graphSteps_; }

  Status forward(std::span<const SeqChunk> batch, float* logits,
                 const LayerKvReadyFn& onLayerKvReady) override;
  Status forwardAndSample(std::span<const SeqChunk> batch,
                          std::span<const pd::kernels::SampleRowParams> params, int topN,
                          SampledToken* out, const LayerKvReadyFn& onLayerKvReady) override;

 private:
  // Enqueues the sampling of logits rows [0, L) and the copy of the results to sampling_.host.
  Status enqueueSampling(int L);
  template <typename T>
  Status deviceAlloc(T** p, size_t bytes) {
    void* raw = nullptr;
    PD_CUDA_TRY(cudaMalloc(&raw, std::max<size_t>(bytes, 16)));
    allocations_.push_back(raw);
    *p = static_cast<T*>(raw);
    return Status::ok();
  }
  // Copies a host f32 tensor to new device memory in the weight dtype (asF32: keep f32).
  Status uploadWeight(const WeightBuffer& w, bool asF32, void** out);
  Status allocScratch(int capT, int capS, int capW, int capTab);
  void freeScratch();
  void dropGraphs();
  // y[n][out] (f32) = x[n][in] (weight dtype) * W^T + beta * y
  Status gemm(const void* x, int n, int in, const void* w, int out, float* y, float beta);
  Status enqueueStep(int T, int W, int L, bool recordEvents);
  void* layerKv(int l) const { return static_cast<char*>(kv_) + size_t(l) * layout_.layerBytes(); }
  int32_t* meta(size_t off) const { return metaDev_ + off; }

  std::shared_ptr<const ModelWeights> model_;
  const ModelConfig& cfg_;
  KvLayout layout_;
  CudaBackendOptions opt_;
  kcu::DType wdt_ = kcu::DType::kBF16;
  kcu::DType kvdt_ = kcu::DType::kBF16;
  int group_ = 1;

  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* cublasWorkspace_ = nullptr;
  std::vector<void*> allocations_;  // weights, KV (when owned), workspace: freed at the end
  std::vector<DevLayer> layers_;
  void* embed_ = nullptr;
  const void* lmHead_ = nullptr;
  float* finalNorm_ = nullptr;
  float* invFreq_ = nullptr;
  void* kv_ = nullptr;
  std::vector<cudaEvent_t> layerEvents_;

  // Scratch, sized by capacity (tokens capT, chunks capS, attention work capW, table capTab).
  MetaLayout ml_;
  std::vector<void*> scratch_;
  float *x_ = nullptr, *qkvOut_ = nullptr, *gu_ = nullptr, *cos_ = nullptr, *sin_ = nullptr;
  float *lastX_ = nullptr, *logitsDev_ = nullptr;
  void *xn_ = nullptr, *attn_ = nullptr, *act_ = nullptr;
  int32_t* metaDev_ = nullptr;
  int32_t* metaHost_ = nullptr;  // pinned
  float* logitsHost_ = nullptr;  // pinned, [capS][vocab]

  std::map<int, cudaGraphExec_t> graphs_;  // batch size -> instantiated decode step
  int64_t graphSteps_ = 0;
  DeviceSampling sampling_;
};

CudaBackendImpl::~CudaBackendImpl() {
  if (stream_) cudaStreamSynchronize(stream_);
  dropGraphs();
  freeScratch();
  for (cudaEvent_t e : layerEvents_) cudaEventDestroy(e);
  for (void* p : allocations_) cudaFree(p);
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaBackendImpl::dropGraphs() {
  for (auto& [size, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
}

void CudaBackendImpl::freeScratch() {
  for (void* p : scratch_) cudaFree(p);
  scratch_.clear();
  if (metaHost_) cudaFreeHost(metaHost_);
  sampling_.release();
  if (logitsHost_) cudaFreeHost(logitsHost_);
  metaHost_ = nullptr;
  logitsHost_ = nullptr;
}

Status CudaBackendImpl::uploadWeight(const WeightBuffer& w, bool asF32, void** out) {
  const kcu::DType dt = asF32 ? kcu::DType::kF32 : wdt_;
  void* dst = nullptr;
  PD_RETURN_IF_ERROR(deviceAlloc(&dst, w.size() * kcu::dtypeBytes(dt)));
  *out = dst;
  if (dt == kcu::DType::kF32) {
    PD_CUDA_TRY(cudaMemcpy(dst, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice));
    return Status::ok();
  }
  // Stage f32 slices through one device buffer and convert on the device.
  constexpr size_t kSlice = size_t(16) << 20;  // floats
  float* staging = nullptr;
  PD_CUDA_TRY(cudaMalloc(&staging, std::min(w.size(), kSlice) * sizeof(float)));
  Status st = Status::ok();
  for (size_t off = 0; off < w.size() && st.isOk(); off += kSlice) {
    const size_t n = std::min(kSlice, w.size() - off);
    cudaError_t e = cudaMemcpy(staging, w.data() + off, n * sizeof(float), cudaMemcpyHostToDevice);
    if (e == cudaSuccess)
      e = kcu::convertFromF32(staging, static_cast<char*>(dst) + off * kcu::dtypeBytes(dt), dt, n,
                              stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) st = cudaError("uploading weights", e);
  }
  cudaFree(staging);
  return st;
}

Status CudaBackendImpl::init() {
  wdt_ = toKernelDtype(opt_.weightDtype);
  kvdt_ = toKernelDtype(layout_.dtype);
  group_ = cfg_.numHeads / cfg_.numKvHeads;
  PD_CUDA_TRY(cudaSetDevice(opt_.device));

  // Memory check before any large allocation, so the error says what does not fit.
  size_t weightElems = model_->embed.size() + model_->lmHead.size();
  for (const LayerWeights& l : model_->layers)
    weightElems += l.qkv.size() + l.o.size() + l.gateUp.size() + l.down.size();
  const size_t weightBytes = weightElems * kcu::dtypeBytes(wdt_);
  const size_t kvBytes = opt_.kvDeviceBase ? 0 : layout_.totalBytes();
  size_t freeMem = 0, totalMem = 0;
  PD_CUDA_TRY(cudaMemGetInfo(&freeMem, &totalMem));
  if (weightBytes + kvBytes + (size_t(512) << 20) > freeMem)
    return resourceExhausted("cuda backend: weights (" + gib(weightBytes) + " in " +
                             kcu::dtypeName(wdt_) + ") + KV cache (" + gib(kvBytes) +
                             ") + 0.5 GiB scratch do not fit in the " + gib(freeMem) +
                             " free on device " + std::to_string(opt_.device));

  PD_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  PD_CUBLAS_TRY(cublasCreate(&cublas_));
  PD_CUBLAS_TRY(cublasSetStream(cublas_, stream_));
  // A fixed workspace keeps cuBLAS from allocating during graph capture.
  constexpr size_t kWorkspace = size_t(32) << 20;
  PD_RETURN_IF_ERROR(deviceAlloc(&cublasWorkspace_, kWorkspace));
  PD_CUBLAS_TRY(cublasSetWorkspace(cublas_, cublasWorkspace_, kWorkspace));
  PD_CUDA_TRY(kcu::pagedAttentionInit());

  PD_RETURN_IF_ERROR(uploadWeight(model_->embed, false, &embed_));
  lmHead_ = embed_;
  if (!model_->lmHead.empty()) {
    void* p = nullptr;
    PD_RETURN_IF_ERROR(uploadWeight(model_->lmHead, false, &p));
    lmHead_ = p;
  }
  void* p = nullptr;
  PD_RETURN_IF_ERROR(uploadWeight(model_->finalNorm, true, &p));
  finalNorm_ = static_cast<float*>(p);
  layers_.resize(cfg_.numLayers);
  for (int l = 0; l < cfg_.numLayers; ++l) {
    const LayerWeights& w = model_->layers[l];
    DevLayer& d = layers_[l];
    PD_RETURN_IF_ERROR(uploadWeight(w.inputNorm, true, &p));
    d.inputNorm = static_cast<float*>(p);
    PD_RETURN_IF_ERROR(uploadWeight(w.postNorm, true, &p));
    d.postNorm = static_cast<float*>(p);
    PD_RETURN_IF_ERROR(uploadWeight(w.qkv, false, &d.qkv));
    PD_RETURN_IF_ERROR(uploadWeight(w.o, false, &d.o));
    PD_RETURN_IF_ERROR(uploadWeight(w.gateUp, false, &d.gateUp));
    PD_RETURN_IF_ERROR(uploadWeight(w.down, false, &d.down));
    if (!w.qkvBias.empty()) {
      PD_RETURN_IF_ERROR(uploadWeight(w.qkvBias, true, &p));
      d.qkvBias = static_cast<float*>(p);
    }
    if (!w.oBias.empty()) {
      PD_RETURN_IF_ERROR(uploadWeight(w.oBias, true, &p));
      d.oBias = static_cast<float*>(p);
    }
  }

  std::vector<float> invFreq(cfg_.headDim / 2);
  pd::kernels::cpu::RopeLlama3Scaling s;
  s.factor = float(cfg_.rope.factor);
  s.lowFreqFactor = float(cfg_.rope.lowFreqFactor);
  s.highFreqFactor = float(cfg_.rope.highFreqFactor);
  s.originalMaxPositionEmbeddings = cfg_.rope.originalMaxPositionEmbeddings;
  pd::kernels::cpu::ropeInvFreq(invFreq.data(), cfg_.headDim, cfg_.rope.theta,
                                cfg_.rope.llama3 ? &s : nullptr);
  PD_RETURN_IF_ERROR(deviceAlloc(&invFreq_, invFreq.size() * sizeof(float)));
  PD_CUDA_TRY(
      cudaMemcpy(invFreq_, invFreq.data(), invFreq.size() * sizeof(float), cudaMemcpyHostToDevice));

  if (opt_.kvDeviceBase) {
    kv_ = opt_.kvDeviceBase;
  } else {
    PD_RETURN_IF_ERROR(deviceAlloc(&kv_, layout_.totalBytes()));
    PD_CUDA_TRY(cudaMemset(kv_, 0, layout_.totalBytes()));
  }
  layerEvents_.resize(cfg_.numLayers, nullptr);
  for (cudaEvent_t& e : layerEvents_)
    PD_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  int maxGraph = 1;
  for (int b : opt_.graphBatchSizes) maxGraph = std::max(maxGraph, b);
  PD_RETURN_IF_ERROR(allocScratch(std::max(256, maxGraph), std::max(16, maxGraph),
                                  std::max(256, maxGraph * kcu::attnWorkItems(1, group_)), 4096));
  PD_LOG(kInfo, "engine") << "cuda backend: device " << opt_.device << ", weights "
                          << gib(weightBytes) << " " << kcu::dtypeName(wdt_) << ", KV "
                          << gib(layout_.totalBytes()) << " " << kvDtypeName(layout_.dtype)
                          << (opt_.useCudaGraphs ? ", CUDA graphs on" : ", CUDA graphs off");
  return Status::ok();
}

Status CudaBackendImpl::allocScratch(int capT, int capS, int capW, int capTab) {
  PD_CUDA_TRY(cudaStreamSynchronize(stream_));
  dropGraphs();
  freeScratch();
  const int h = cfg_.hiddenSize, qkvRows = cfg_.qDim() + 2 * cfg_.kvDim();
  const int ffn = cfg_.intermediateSize, half = cfg_.headDim / 2;
  const size_t wb = kcu::dtypeBytes(wdt_);
  auto alloc = [&](auto** ptr, size_t bytes) -> Status {
    void* raw = nullptr;
    PD_CUDA_TRY(cudaMalloc(&raw, std::max<size_t>(bytes, 16)));
    scratch_.push_back(raw);
    // Zeroed so padding rows of a graph never hold NaN bit patterns.
    PD_CUDA_TRY(cudaMemset(raw, 0, std::max<size_t>(bytes, 16)));
    *ptr = static_cast<std::remove_pointer_t<std::remove_reference_t<decltype(*ptr)>>*>(raw);
    return Status::ok();
  };
  ml_ = {capT, capS, capW, capTab};
  PD_RETURN_IF_ERROR(alloc(&x_, size_t(capT) * h * 4));
  PD_RETURN_IF_ERROR(alloc(&qkvOut_, size_t(capT) * qkvRows * 4));
  PD_RETURN_IF_ERROR(alloc(&gu_, size_t(capT) * 2 * ffn * 4));
  PD_RETURN_IF_ERROR(alloc(&cos_, size_t(capT) * half * 4));
  PD_RETURN_IF_ERROR(alloc(&sin_, size_t(capT) * half * 4));
  PD_RETURN_IF_ERROR(alloc(&lastX_, size_t(capS) * h * 4));
  PD_RETURN_IF_ERROR(alloc(&logitsDev_, size_t(capS) * cfg_.vocabSize * 4));
  PD_RETURN_IF_ERROR(alloc(&xn_, size_t(capT) * h * wb));
  PD_RETURN_IF_ERROR(alloc(&attn_, size_t(capT) * cfg_.qDim() * wb));
  PD_RETURN_IF_ERROR(alloc(&act_, size_t(capT) * ffn * wb));
  PD_RETURN_IF_ERROR(alloc(&metaDev_, ml_.words() * 4));
  PD_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&metaHost_), ml_.words() * 4));
  PD_CUDA_TRY(
      cudaMallocHost(reinterpret_cast<void**>(&logitsHost_), size_t(capS) * cfg_.vocabSize * 4));
  std::memset(metaHost_, 0, ml_.words() * 4);
  return Status::ok();
}

Status CudaBackendImpl::gemm(const void* x, int n, int in, const void* w, int out, float* y,
                             float beta) {
  // Row-major y[n][out] = x[n][in] * W[out][in]^T is column-major y^T = W^T(op T) * x^T.
  const float alpha = 1.0f;
  const cudaDataType_t t = cublasType(opt_.weightDtype);
  PD_CUBLAS_TRY(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w, t, in, x, t,
                             in, &beta, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
  return Status::ok();
}

// Enqueues one step over T token rows, W attention work items and L logits rows whose
// metadata is already in metaDev_. recordEvents: record layerEvents_[l] after layer l's KV
// write (not during graph capture).
Status CudaBackendImpl::enqueueStep(int T, int W, int L, bool recordEvents) {
  const int h = cfg_.hiddenSize, hd = cfg_.headDim, half = hd / 2;
  const int nh = cfg_.numHeads, nkv = cfg_.numKvHeads;
  const int qDim = cfg_.qDim(), kvDim = cfg_.kvDim(), qkvRows = qDim + 2 * kvDim;
  const int ffn = cfg_.intermediateSize;
  const float eps = cfg_.rmsNormEps, scale = 1.0f / std::sqrt(float(hd));
  const auto* seqs = reinterpret_cast<const kcu::AttnSeq*>(meta(ml_.seqs()));
  const auto* work = reinterpret_cast<const kcu::AttnWork*>(meta(ml_.work()));

  PD_CUDA_TRY(kcu::embeddingGather(embed_, wdt_, meta(ml_.ids()), T, h, x_, stream_));
  PD_CUDA_TRY(kcu::ropeCosSin(meta(ml_.pos()), T, invFreq_, half, cos_, sin_, stream_));
  for (int l = 0; l < cfg_.numLayers; ++l) {
    const DevLayer& w = layers_[l];
    PD_CUDA_TRY(kcu::rmsNorm(x_, h, w.inputNorm, xn_, wdt_, h, T, h, eps, stream_));
    if (w.qkvBias) PD_CUDA_TRY(kcu::broadcastRows(qkvOut_, w.qkvBias, T, qkvRows, stream_));
    PD_RETURN_IF_ERROR(gemm(xn_, T, h, w.qkv, qkvRows, qkvOut_, w.qkvBias ? 1.0f : 0.0f));
    PD_CUDA_TRY(kcu::applyRope(qkvOut_, qkvRows, T, nh, hd, cos_, sin_, stream_));
    PD_CUDA_TRY(kcu::applyRope(qkvOut_ + qDim, qkvRows, T, nkv, hd, cos_, sin_, stream_));
    PD_CUDA_TRY(kcu::kvCacheWrite(layerKv(l), kvdt_, qkvOut_ + qDim, qkvOut_ + qDim + kvDim,
                                  qkvRows, meta(ml_.slots()), T, layout_.blockSize, nkv, hd,
                                  stream_));
    if (recordEvents) PD_CUDA_TRY(cudaEventRecord(layerEvents_[l], stream_));
    PD_CUDA_TRY(kcu::pagedAttention(qkvOut_, qkvRows, layerKv(l), kvdt_, meta(ml_.tables()), seqs,
                                    work, W, layout_.blockSize, nh, nkv, hd, scale, attn_, wdt_,
                                    qDim, stream_));
    if (w.oBias) PD_CUDA_TRY(kcu::addRows(x_, w.oBias, T, h, stream_));
    PD_RETURN_IF_ERROR(gemm(attn_, T, qDim, w.o, h, x_, 1.0f));  // residual via beta = 1
    PD_CUDA_TRY(kcu::rmsNorm(x_, h, w.postNorm, xn_, wdt_, h, T, h, eps, stream_));
    PD_RETURN_IF_ERROR(gemm(xn_, T, h, w.gateUp, 2 * ffn, gu_, 0.0f));
    PD_CUDA_TRY(kcu::swiGlu(gu_, act_, wdt_, T, ffn, stream_));
    PD_RETURN_IF_ERROR(gemm(act_, T, ffn, w.down, h, x_, 1.0f));
  }
  if (L > 0) {
    PD_CUDA_TRY(kcu::gatherRows(x_, h, meta(ml_.logitRows()), L, h, lastX_, stream_));
    PD_CUDA_TRY(kcu::rmsNorm(lastX_, h, finalNorm_, xn_, wdt_, h, L, h, eps, stream_));
    PD_RETURN_IF_ERROR(gemm(xn_, L, h, lmHead_, cfg_.vocabSize, logitsDev_, 0.0f));
  }
  return Status::ok();
}

Status CudaBackendImpl::forward(std::span<const SeqChunk> batch, float* logits,
                                const LayerKvReadyFn& onLayerKvReady) {
  PD_ASSIGN_OR_RETURN(const BatchShape shape, validateBatch(batch, cfg_, layout_));
  const int T = shape.totalTokens, L = shape.numLogits, tab = shape.tableEntries;
  if (T == 0) return Status::ok();
  if (L > 0 && !logits && !sampling_.active)
    return invalidArgument("forward: logits is null but chunks want logits");
  PD_CUDA_TRY(cudaSetDevice(opt_.device));
  // Normally idle already; after a failed step it may still be reading metaHost_.
  PD_CUDA_TRY(cudaStreamSynchronize(stream_));
  const int S = int(batch.size());

  // A graph step: all chunks are single decode tokens that want logits, no layer callback.
  int graphSize = 0;
  if (opt_.useCudaGraphs && !onLayerKvReady) {
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
    PD_RETURN_IF_ERROR(allocScratch(grow(rowsT, ml_.capT), grow(rowsS, ml_.capS), grow(W, ml_.capW),
                                    grow(tab, ml_.capTab)));
  }

  // Per-step metadata, built in pinned memory and uploaded with one copy.
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
    for (int i = 0; i < kcu::attnWorkItems(1, group_); ++i)
      work[w++] = {c, i * kcu::kAttnRowsPerBlock};
    ids[c] = 0;
    pos[c] = 0;
    slots[c] = -1;
    logitRows[c] = c;
  }
  PD_CUDA_TRY(cudaMemcpyAsync(metaDev_, metaHost_, (ml_.tables() + to) * 4, cudaMemcpyHostToDevice,
                              stream_));

  if (graphSize > 0) {
    auto it = graphs_.find(graphSize);
    if (it == graphs_.end()) {
      cudaGraph_t graph = nullptr;
      PD_CUDA_TRY(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      const Status st = enqueueStep(graphSize, W, graphSize, false);
      const cudaError_t endErr = cudaStreamEndCapture(stream_, &graph);
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
    PD_CUDA_TRY(cudaGraphLaunch(it->second, stream_));
    ++graphSteps_;
  } else {
    PD_RETURN_IF_ERROR(enqueueStep(T, W, L, bool(onLayerKvReady)));
  }
  if (L > 0 && sampling_.active) {
    PD_RETURN_IF_ERROR(enqueueSampling(L));
  } else if (L > 0) {
    PD_CUDA_TRY(cudaMemcpyAsync(logitsHost_, logitsDev_, size_t(L) * cfg_.vocabSize * 4,
                                cudaMemcpyDeviceToHost, stream_));
  }
  if (onLayerKvReady) {
    for (int l = 0; l < cfg_.numLayers; ++l) {
      PD_CUDA_TRY(cudaEventSynchronize(layerEvents_[l]));
      onLayerKvReady(l);
    }
  }
  PD_CUDA_TRY(cudaStreamSynchronize(stream_));
  if (L > 0 && !sampling_.active) std::memcpy(logits, logitsHost_, size_t(L) * cfg_.vocabSize * 4);
  return Status::ok();
}

Status CudaBackendImpl::enqueueSampling(int L) {
  DeviceSampling& ds = sampling_;
  PD_CUDA_TRY(cudaMemcpyAsync(ds.dev, ds.host, size_t(L) * sizeof(DeviceSampling::Params),
                              cudaMemcpyHostToDevice, stream_));
  const int vocab = cfg_.vocabSize;
  PD_CUDA_TRY(kcu::sampleRows(logitsDev_, vocab, L, vocab, ds.at<DeviceSampling::Params>(ds.dev, 0),
                              ds.topN, ds.at<int32_t>(ds.dev, ds.idsOff()),
                              ds.at<float>(ds.dev, ds.lpOff()),
                              ds.at<int32_t>(ds.dev, ds.topIdsOff()),
                              ds.at<float>(ds.dev, ds.topLpOff()), stream_));
  PD_CUDA_TRY(cudaMemcpyAsync(ds.host + ds.idsOff(), ds.dev + ds.idsOff(),
                              ds.bytes() - ds.idsOff(), cudaMemcpyDeviceToHost, stream_));
  return Status::ok();
}

Status CudaBackendImpl::forwardAndSample(std::span<const SeqChunk> batch,
                                         std::span<const pd::kernels::SampleRowParams> params,
                                         int topN, SampledToken* out,
                                         const LayerKvReadyFn& onLayerKvReady) {
  int L = 0;
  for (const SeqChunk& c : batch) L += c.wantLogits ? 1 : 0;
  if (params.size() != size_t(L))
    return invalidArgument("forwardAndSample: " + std::to_string(params.size()) +
                           " sampling params for " + std::to_string(L) + " logits rows");
  if (topN < 0 || topN > kMaxLogprobs || topN > cfg_.vocabSize)
    return invalidArgument("forwardAndSample: topN " + std::to_string(topN) + " must be in [0, " +
                           std::to_string(std::min(kMaxLogprobs, cfg_.vocabSize)) + "]");
  if (L > 0 && !out) return invalidArgument("forwardAndSample: out is null but chunks want logits");
  for (size_t r = 0; r < params.size(); ++r) {
    const auto& p = params[r];
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature) || !(p.topP > 0.0f) ||
        !(p.topP <= 1.0f) || !(p.minP >= 0.0f) || !(p.minP <= 1.0f) || !(p.u >= 0.0) ||
        !(p.u < 1.0))
      return invalidArgument("forwardAndSample: row " + std::to_string(r) +
                             ": temperature must be finite >= 0, top_p in (0, 1], min_p in "
                             "[0, 1] and u in [0, 1)");
  }
  PD_CUDA_TRY(cudaSetDevice(opt_.device));
  DeviceSampling& ds = sampling_;
  if (L > ds.cap) {
    PD_CUDA_TRY(cudaStreamSynchronize(stream_));  // nothing in flight reads the old buffers
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

// NCCL communicators for a tensor-parallel group on devices [first, first + size): the set-up
// the sharded forward pass will use (one communicator per rank, all-reduce after the
// row-parallel o_proj / down_proj).
Status setUpNcclGroup(int first, int size) {
#if defined(PD_HAVE_NCCL)
  std::vector<ncclComm_t> comms(size, nullptr);
  std::vector<int> devs(size);
  for (int i = 0; i < size; ++i) devs[i] = first + i;
  const ncclResult_t r = ncclCommInitAll(comms.data(), size, devs.data());
  if (r != ncclSuccess)
    return internalError("cuda backend: ncclCommInitAll over " + std::to_string(size) +
                         " devices: " + ncclGetErrorString(r));
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  return Status::ok();
#else
  return unimplemented("cuda backend: tensor_parallel_size " + std::to_string(size) +
                       " needs NCCL, which this build did not find (libnccl)");
#endif
}

}  // namespace

Status cudaDeviceAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return unavailable(std::string("cuda backend: no CUDA device found (cudaGetDeviceCount: ") +
                       cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")");
  if (count == 0)
    return unavailable("cuda backend: no CUDA device found (cudaGetDeviceCount: 0 devices)");
  return Status::ok();
}

Result<std::unique_ptr<CudaBackend>> createCudaBackend(std::shared_ptr<const ModelWeights> model,
                                                       const KvLayout& layout,
                                                       const CudaBackendOptions& options) {
  PD_RETURN_IF_ERROR(cudaDeviceAvailable());
  if (!model) return invalidArgument("createCudaBackend: no model");
  const ModelConfig& c = model->config;
  if (layout.numLayers != c.numLayers || layout.numKvHeads != c.numKvHeads ||
      layout.headDim != c.headDim)
    return invalidArgument("createCudaBackend: KV layout " + layout.fingerprint() +
                           " does not match the model (layers " + std::to_string(c.numLayers) +
                           ", kv heads " + std::to_string(c.numKvHeads) + ", head dim " +
                           std::to_string(c.headDim) + ")");
  if (layout.blockSize <= 0 || layout.numBlocks <= 0)
    return invalidArgument("createCudaBackend: KV layout needs blockSize > 0 and numBlocks > 0");
  if (c.headDim > kcu::kAttnMaxHeadDim || c.headDim % 2 != 0)
    return unimplemented("createCudaBackend: head_dim " + std::to_string(c.headDim) +
                         " (the attention kernel supports even head dims up to " +
                         std::to_string(kcu::kAttnMaxHeadDim) + ")");
  if (reinterpret_cast<uintptr_t>(options.kvDeviceBase) % 256 != 0)
    return invalidArgument(
        "createCudaBackend: kvDeviceBase must be 256-byte aligned (as cudaMalloc returns): the "
        "attention kernel reads K/V with 16-byte loads");
  for (int b : options.graphBatchSizes)
    if (b <= 0)
      return invalidArgument("createCudaBackend: graph batch size " + std::to_string(b) + " <= 0");
  int count = 0;
  cudaGetDeviceCount(&count);
  PD_ASSIGN_OR_RETURN(const TensorParallelPlan plan,
                      planTensorParallel(c, options.tensorParallelSize));
  if (options.device < 0 || options.device + plan.size > count)
    return invalidArgument("createCudaBackend: tensor_parallel_size " + std::to_string(plan.size) +
                           " on device " + std::to_string(options.device) + " requires " +
                           std::to_string(options.device + plan.size) + " GPUs (found " +
                           std::to_string(count) + ")");
  if (plan.size > 1) {
    PD_RETURN_IF_ERROR(setUpNcclGroup(options.device, plan.size));
    return unimplemented("createCudaBackend: tensor_parallel_size " + std::to_string(plan.size) +
                         ": the NCCL group sets up, but the sharded forward pass is not "
                         "implemented yet (use tensor_parallel_size 1)");
  }
  auto b = std::make_unique<CudaBackendImpl>(std::move(model), layout, options);
  PD_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<CudaBackend>(std::move(b));
}

}  // namespace pd::engine
