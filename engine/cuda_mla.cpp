// Multi-head latent attention on the CUDA backend (see cuda_mla.h). Host code: the kernels are
// in kernels/cuda/mla.cu, the GEMMs in cuBLAS.
#include "engine/cuda_mla.h"

#include <string>

#include "engine/cpu_mla.h"
#include "pd/kernels/cuda/mla.h"
#include "pd/kernels/cuda/ops.h"

namespace pd::engine {

namespace kcu = pd::kernels::cuda;

namespace {

Status cudaCallError(const char* call, cudaError_t e) {
  return internalError(std::string("cuda backend (mla): ") + call + ": " + cudaGetErrorName(e) + " (" +
                       cudaGetErrorString(e) + ")");
}

#define PD_MLA_CUDA_TRY(call)                                       \
  do {                                                              \
    const cudaError_t pdErr_ = (call);                              \
    if (pdErr_ != cudaSuccess) return cudaCallError(#call, pdErr_); \
  } while (0)

#define PD_MLA_CUBLAS_TRY(call)                                                                                \
  do {                                                                                                         \
    const cublasStatus_t pdSt_ = (call);                                                                       \
    if (pdSt_ != CUBLAS_STATUS_SUCCESS)                                                                        \
      return internalError(std::string("cuda backend (mla): ") + #call + ": " + cublasGetStatusString(pdSt_)); \
  } while (0)

cudaDataType_t cublasTypeOf(kcu::DType d) {
  return d == kcu::DType::kF32 ? CUDA_R_32F : d == kcu::DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

}  // namespace

CudaMla::CudaMla(const ModelConfig& config, kcu::DType weightDtype, kcu::DType kvDtype)
    : cfg_(config),
      wdt_(weightDtype),
      kvdt_(kvDtype),
      scale_(float(config.softmaxScale())),
      mscale_(float(mlaRopeMscale(config))) {
  for (double f : mlaRopeInvFreq(config)) invFreq_.push_back(float(f));
}

int CudaMla::qRows() const {
  const MlaConfig& m = cfg_.mla;
  return m.qLoraRank > 0 ? m.qLoraRank : cfg_.numHeads * m.qHeadDim();
}

Status CudaMla::uploadWeights(const ModelWeights& model, const UploadFn& upload) {
  const MlaConfig& m = cfg_.mla;
  layers_.assign(cfg_.numLayers, {});
  for (int l = 0; l < cfg_.numLayers; ++l) {
    const LayerWeights& w = model.layers[l];
    Layer& d = layers_[l];
    // q_a (or q_proj) and kv_a stacked: one GEMM of the normalised input per layer.
    const WeightBuffer& q = m.qLoraRank > 0 ? w.qA : w.qB;
    std::vector<float> stacked(q.size() + w.kvA.size());
    std::copy(q.data(), q.data() + q.size(), stacked.begin());
    std::copy(w.kvA.data(), w.kvA.data() + w.kvA.size(), stacked.begin() + ptrdiff_t(q.size()));
    PD_RETURN_IF_ERROR(upload(stacked.data(), stacked.size(), false, &d.a));
    if (m.qLoraRank > 0) {
      void* p = nullptr;
      PD_RETURN_IF_ERROR(upload(w.qANorm.data(), w.qANorm.size(), true, &p));
      d.qANorm = static_cast<float*>(p);
      PD_RETURN_IF_ERROR(upload(w.qB.data(), w.qB.size(), false, &d.qB));
    }
    void* p = nullptr;
    PD_RETURN_IF_ERROR(upload(w.kvANorm.data(), w.kvANorm.size(), true, &p));
    d.kvANorm = static_cast<float*>(p);
    PD_RETURN_IF_ERROR(upload(w.kvB.data(), w.kvB.size(), false, &d.kvB));
  }
  return Status::ok();
}

Status CudaMla::allocScratch(int capT, const AllocFn& alloc) {
  const MlaConfig& m = cfg_.mla;
  const size_t T = size_t(capT), H = size_t(cfg_.numHeads), wb = kcu::dtypeBytes(wdt_);
  void* p = nullptr;
  PD_RETURN_IF_ERROR(alloc(&p, T * size_t(qRows() + m.latentDim()) * 4));
  stacked_ = static_cast<float*>(p);
  if (m.qLoraRank > 0) {
    PD_RETURN_IF_ERROR(alloc(&qa_, T * size_t(m.qLoraRank) * wb));
    PD_RETURN_IF_ERROR(alloc(&p, T * H * size_t(m.qHeadDim()) * 4));
    q_ = static_cast<float*>(p);
  }
  PD_RETURN_IF_ERROR(alloc(&qNope_, T * H * size_t(m.qkNopeHeadDim) * wb));
  PD_RETURN_IF_ERROR(alloc(&p, T * H * size_t(m.latentDim()) * 4));
  qLat_ = static_cast<float*>(p);
  PD_RETURN_IF_ERROR(alloc(&oLat_, T * H * size_t(m.kvLoraRank) * wb));
  return Status::ok();
}

Status CudaMla::project(int layer, const void* xn, const Step& step, void* layerKv, const GemmFn& gemm,
                        cudaStream_t stream) {
  const MlaConfig& m = cfg_.mla;
  const Layer& w = layers_[layer];
  const int T = step.numTokens, h = cfg_.hiddenSize, H = cfg_.numHeads;
  const int qr = qRows(), rows = qr + m.latentDim();
  PD_RETURN_IF_ERROR(gemm(xn, T, h, w.a, rows, stacked_, 0.0f));
  if (m.qLoraRank > 0) {
    PD_MLA_CUDA_TRY(
        kcu::rmsNorm(stacked_, rows, w.qANorm, qa_, wdt_, m.qLoraRank, T, m.qLoraRank, cfg_.rmsNormEps, stream));
    PD_RETURN_IF_ERROR(gemm(qa_, T, m.qLoraRank, w.qB, H * m.qHeadDim(), q_, 0.0f));
  }
  PD_MLA_CUDA_TRY(kcu::mlaKvWrite(stacked_ + qr, rows, w.kvANorm, cfg_.rmsNormEps, m.kvLoraRank, m.qkRopeHeadDim,
                                  step.cos, step.sin, mscale_, step.slots, T, layerKv, kvdt_, stream));
  return Status::ok();
}

Status CudaMla::attend(int layer, const Step& step, const void* layerKv, void* attnOut, cublasHandle_t cublas,
                       cudaStream_t stream) {
  const MlaConfig& m = cfg_.mla;
  const Layer& w = layers_[layer];
  const int T = step.numTokens, H = cfg_.numHeads;
  const int R = m.kvLoraRank, L = m.latentDim(), nope = m.qkNopeHeadDim, v = m.vHeadDim;
  const float* q = m.qLoraRank > 0 ? q_ : stacked_;
  const int qStride = m.qLoraRank > 0 ? H * m.qHeadDim() : qRows() + L;
  PD_MLA_CUDA_TRY(kcu::mlaQSplit(q, qStride, T, H, nope, m.qkRopeHeadDim, step.cos, step.sin, mscale_, qNope_, wdt_,
                                 qLat_, R, stream));

  // Absorption, per head hd: q_lat[t][hd][0, R) = q_nope[t][hd] . W_UK[hd], W_UK[hd] the [nope][R]
  // rows of kv_b_proj at hd * (nope + v). Column-major view: C (R x T, ld H*L) = W_UK^T
  // (R x nope, ld R) * q_nope^T (nope x T, ld H*nope).
  const cudaDataType_t t = cublasTypeOf(wdt_);
  const size_t wb = kcu::dtypeBytes(wdt_);
  const long long headStride = (long long)(nope + v) * R;  // kv_b_proj elements per head
  const float one = 1.0f, zero = 0.0f;
  PD_MLA_CUBLAS_TRY(cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, R, T, nope, &one, w.kvB, t, R,
                                               headStride, qNope_, t, H * nope, nope, &zero, qLat_, CUDA_R_32F, H * L,
                                               L, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));

  PD_MLA_CUDA_TRY(kcu::mlaAttention(qLat_, layerKv, kvdt_, step.blockTables, step.seqs, step.work, step.numWork,
                                    step.blockSize, H, R, m.qkRopeHeadDim, scale_, oLat_, wdt_, stream));

  // Per head: out[t][hd][0, v) = o_lat[t][hd] . W_UV[hd]^T, W_UV[hd] the [v][R] rows after W_UK.
  // Column-major: C (v x T, ld H*v) = W_UV (v x R: the R x v column-major view, transposed)
  // * o_lat^T (R x T, ld H*R).
  const void* wuv = static_cast<const char*>(w.kvB) + size_t(nope) * R * wb;
  PD_MLA_CUBLAS_TRY(cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, v, T, R, &one, wuv, t, R, headStride,
                                               oLat_, t, H * R, R, &zero, attnOut, t, H * v, v, H, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
  return Status::ok();
}

}  // namespace pd::engine
