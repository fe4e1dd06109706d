// The CUDA backend's mixture-of-experts block (see cuda_moe.h). Host code (g++): the kernels
// live in kernels/cuda/moe.cu and ops.cu, the GEMMs in cuBLAS.
#include "engine/cuda_moe.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "engine/moe_routing.h"
#include "pd/kernels/cuda/moe.h"
#include "pd/kernels/cuda/ops.h"

namespace pd::engine {

namespace kcu = pd::kernels::cuda;

namespace {

Status cudaFail(const char* call, cudaError_t e) {
  return internalError(std::string("cuda backend: moe: ") + call + ": " + cudaGetErrorName(e) + " (" +
                       cudaGetErrorString(e) + ")");
}

#define PD_MOE_CUDA_TRY(call)                                  \
  do {                                                         \
    const cudaError_t pdErr_ = (call);                         \
    if (pdErr_ != cudaSuccess) return cudaFail(#call, pdErr_); \
  } while (0)

cudaDataType_t cublasTypeOf(kcu::DType d) {
  return d == kcu::DType::kF32 ? CUDA_R_32F : d == kcu::DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

}  // namespace

Status uploadCudaMoeLayer(const LayerWeights& w, const CudaUploadFn& upload, const void* sharedGateUp,
                          const void* sharedDown, CudaMoeLayer* out) {
  void* p = nullptr;
  PD_RETURN_IF_ERROR(upload(w.router.data(), w.router.size(), true, &p));
  out->router = static_cast<const float*>(p);
  out->routerBias.assign(w.routerBias.data(), w.routerBias.data() + w.routerBias.size());
  out->experts.resize(w.experts.size());
  // The host experts are rows8 (model_weights.h); the device GEMMs take them row-major.
  const int hidden = w.experts.empty() ? 0 : int(w.router.size() / w.experts.size());
  for (size_t e = 0; e < w.experts.size(); ++e) {
    const std::vector<float> gateUp = w.experts[e].gateUpRowMajor(hidden);
    PD_RETURN_IF_ERROR(upload(gateUp.data(), gateUp.size(), false, &p));
    out->experts[e].gateUp = p;
    const std::vector<float> down = w.experts[e].downRowMajor(hidden);
    PD_RETURN_IF_ERROR(upload(down.data(), down.size(), false, &p));
    out->experts[e].down = p;
  }
  out->sharedGateUp = w.gateUp.empty() ? nullptr : sharedGateUp;
  out->sharedDown = w.down.empty() ? nullptr : sharedDown;
  return Status::ok();
}

CudaMoeLayer cudaMoeLayerFromStream(const DeviceLayer& d) {
  CudaMoeLayer m;
  m.router = static_cast<const float*>(d.router.data);
  m.routerBias = d.routerBias;
  m.experts.resize(d.experts.size());
  for (size_t e = 0; e < d.experts.size(); ++e) m.experts[e] = {d.experts[e].gateUp.data, d.experts[e].down.data};
  m.sharedGateUp = d.gateUp.data;
  m.sharedDown = d.down.data;
  return m;
}

size_t cudaMoeLayerBytes(const ModelConfig& c, size_t weightBytes) {
  const size_t h = size_t(c.hiddenSize), ne = size_t(c.moe.numExperts), ef = size_t(c.moe.expertFfn);
  return ne * h * 4 + ne * 3 * ef * h * weightBytes;
}

CudaMoe::~CudaMoe() {
  if (stream_) cudaStreamSynchronize(stream_);
  release();
}

void CudaMoe::release() {
  for (void* p : dev_) cudaFree(p);
  for (void* p : host_) cudaFreeHost(p);
  dev_.clear();
  host_.clear();
  cap_ = 0;
}

Status CudaMoe::reserve(int T) { return grow(T); }

Status CudaMoe::grow(int T) {
  if (T <= cap_) return Status::ok();
  // Work enqueued earlier (previous layers, previous steps) may still read the old buffers.
  PD_MOE_CUDA_TRY(cudaStreamSynchronize(stream_));
  release();
  const int cap = std::max(T, 16);
  const size_t h = size_t(cfg_.hiddenSize), ne = size_t(cfg_.moe.numExperts), ef = size_t(cfg_.moe.expertFfn);
  const size_t k = size_t(cfg_.moe.expertsPerToken), sf = size_t(cfg_.moe.sharedFfn());
  const size_t R = size_t(cap) * k, wb = kcu::dtypeBytes(wdt_);
  auto dev = [&](auto** ptr, size_t bytes) -> Status {
    void* raw = nullptr;
    PD_MOE_CUDA_TRY(cudaMalloc(&raw, std::max<size_t>(bytes, 16)));
    dev_.push_back(raw);
    *ptr = static_cast<std::remove_pointer_t<std::remove_reference_t<decltype(*ptr)>>*>(raw);
    return Status::ok();
  };
  auto host = [&](auto** ptr, size_t bytes) -> Status {
    void* raw = nullptr;
    PD_MOE_CUDA_TRY(cudaHostAlloc(&raw, std::max<size_t>(bytes, 16), cudaHostAllocDefault));
    host_.push_back(raw);
    *ptr = static_cast<std::remove_pointer_t<std::remove_reference_t<decltype(*ptr)>>*>(raw);
    return Status::ok();
  };
  if (wdt_ != kcu::DType::kF32) PD_RETURN_IF_ERROR(dev(&xnF32_, size_t(cap) * h * 4));
  PD_RETURN_IF_ERROR(dev(&logits_, size_t(cap) * ne * 4));
  PD_RETURN_IF_ERROR(dev(&xe_, R * h * wb));
  PD_RETURN_IF_ERROR(dev(&gu_, R * 2 * ef * 4));
  PD_RETURN_IF_ERROR(dev(&act_, R * ef * wb));
  PD_RETURN_IF_ERROR(dev(&ye_, R * h * 4));
  if (sf > 0) {
    PD_RETURN_IF_ERROR(dev(&sgu_, size_t(cap) * 2 * sf * 4));
    PD_RETURN_IF_ERROR(dev(&sact_, size_t(cap) * sf * wb));
  }
  PD_RETURN_IF_ERROR(dev(&metaDev_, 3 * R * 4));
  PD_RETURN_IF_ERROR(host(&logitsHost_, size_t(cap) * ne * 4));
  PD_RETURN_IF_ERROR(host(&metaHost_, 3 * R * 4));
  cap_ = cap;
  return Status::ok();
}

Status CudaMoe::gemm(const void* x, int n, int in, const void* w, int out, float* y, float beta, kcu::DType dt) {
  if (n <= 0) return Status::ok();
  // Row-major y[n][out] = x[n][in] * W[out][in]^T is column-major y^T = W^T(op T) * x^T.
  const float alpha = 1.0f;
  const cudaDataType_t t = cublasTypeOf(dt);
  const cublasStatus_t st = cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w, t, in, x, t, in,
                                         &beta, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    return internalError(std::string("cuda backend: moe: cublasGemmEx: ") + cublasGetStatusString(st));
  return Status::ok();
}

Status CudaMoe::forward(const CudaMoeLayer& w, const float* normWeight, float eps, float* x, const void* xn, int T) {
  if (T <= 0) return Status::ok();
  PD_RETURN_IF_ERROR(grow(T));
  const int h = cfg_.hiddenSize, ne = cfg_.moe.numExperts, ef = cfg_.moe.expertFfn;
  const int k = cfg_.moe.expertsPerToken, sf = w.sharedGateUp ? cfg_.moe.sharedFfn() : 0;
  const size_t wb = kcu::dtypeBytes(wdt_);
  const size_t R = size_t(T) * k;

  // 1. Router logits in f32 (x is still this layer's residual: nothing below wrote it yet).
  const void* routerIn = xn;
  if (wdt_ != kcu::DType::kF32) {
    PD_MOE_CUDA_TRY(kcu::rmsNorm(x, h, normWeight, xnF32_, kcu::DType::kF32, h, T, h, eps, stream_));
    routerIn = xnF32_;
  }
  PD_RETURN_IF_ERROR(gemm(routerIn, T, h, w.router, ne, logits_, 0.0f, kcu::DType::kF32));

  // 2. Routing on the host. The sync also means no copy still reads metaHost_ (the previous
  // layer's upload came before it on the stream).
  PD_MOE_CUDA_TRY(cudaMemcpyAsync(logitsHost_, logits_, size_t(T) * ne * 4, cudaMemcpyDeviceToHost, stream_));
  PD_MOE_CUDA_TRY(cudaStreamSynchronize(stream_));
  chosen_.resize(R);
  weights_.resize(R);
  routeMoeTokens(cfg_.moe, logitsHost_, T, w.routerBias.empty() ? nullptr : w.routerBias.data(), chosen_.data(),
                 weights_.data());
  // Rows grouped by expert, tokens ascending within each; each token's slots as rows of that
  // matrix, ascending (moe_routing.h: the CPU backend's plan). Uploaded as srcRows | slotRows |
  // slotWeights.
  planMoeRows(chosen_.data(), weights_.data(), T, k, ne, &plan_);
  std::memcpy(metaHost_, plan_.srcRows.data(), R * 4);
  std::memcpy(metaHost_ + R, plan_.slotRows.data(), R * 4);
  std::memcpy(metaHost_ + 2 * R, plan_.slotWeights.data(), R * 4);
  PD_MOE_CUDA_TRY(cudaMemcpyAsync(metaDev_, metaHost_, 3 * R * 4, cudaMemcpyHostToDevice, stream_));

  // 3. The routed rows, grouped by expert; each chosen expert's gate|up, SwiGLU, its down.
  PD_MOE_CUDA_TRY(kcu::moeGatherRows(xn, wdt_, metaDev_, int(R), h, xe_, stream_));
  for (int e = 0; e < ne; ++e) {
    const int n = plan_.rowsPerExpert[e];
    if (n == 0) continue;  // never read
    const size_t s = size_t(plan_.start[e]);
    PD_RETURN_IF_ERROR(gemm(static_cast<const char*>(xe_) + s * h * wb, n, h, w.experts[e].gateUp, 2 * ef,
                            gu_ + s * 2 * ef, 0.0f, wdt_));
  }
  PD_MOE_CUDA_TRY(kcu::swiGlu(gu_, act_, wdt_, int(R), ef, stream_));
  for (int e = 0; e < ne; ++e) {
    const int n = plan_.rowsPerExpert[e];
    if (n == 0) continue;
    const size_t s = size_t(plan_.start[e]);
    PD_RETURN_IF_ERROR(
        gemm(static_cast<const char*>(act_) + s * ef * wb, n, ef, w.experts[e].down, h, ye_ + s * h, 0.0f, wdt_));
  }

  // 4. Weighted outputs into the residual (ascending expert per token), then shared experts.
  PD_MOE_CUDA_TRY(
      kcu::moeCombine(x, ye_, metaDev_ + R, reinterpret_cast<const float*>(metaDev_ + 2 * R), T, k, h, stream_));
  if (sf > 0) {
    PD_RETURN_IF_ERROR(gemm(xn, T, h, w.sharedGateUp, 2 * sf, sgu_, 0.0f, wdt_));
    PD_MOE_CUDA_TRY(kcu::swiGlu(sgu_, sact_, wdt_, T, sf, stream_));
    PD_RETURN_IF_ERROR(gemm(sact_, T, sf, w.sharedDown, h, x, 1.0f, wdt_));
  }
  return Status::ok();
}

}  // namespace pd::engine
