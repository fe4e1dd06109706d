#include "engine/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "common/base/log.h"
#include "engine/cpu_mla.h"
#include "engine/cpu_moe.h"
#include "engine/cpu_thread_pool.h"
#include "pd/kernels/activation.h"
#include "pd/kernels/attention.h"
#include "pd/kernels/embedding.h"
#include "pd/kernels/gemm.h"
#include "pd/kernels/kv_cache.h"
#include "pd/kernels/linear.h"
#include "pd/kernels/linear_bf16.h"
#include "pd/kernels/linear_q8.h"
#include "pd/kernels/norm.h"
#include "pd/kernels/rope.h"

namespace pd::engine {

namespace kc = pd::kernels::cpu;

namespace {

constexpr int kQueryTile = 128;  // query rows per GEMM attention tile
// The kernels' KV formats are engine::KvDtype by value (f16 has none: refused at creation).
static_assert(uint8_t(kc::KvFormat::kF32) == uint8_t(KvDtype::kF32) &&
              uint8_t(kc::KvFormat::kBf16) == uint8_t(KvDtype::kBF16) &&
              uint8_t(kc::KvFormat::kInt8) == uint8_t(KvDtype::kInt8) &&
              uint8_t(kc::KvFormat::kFp8) == uint8_t(KvDtype::kFp8));

enum class WeightFormat { kF32, kBf16, kQ8 };

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::shared_ptr<const ModelWeights> model, const KvLayout& layout, void* kv, const CpuBackendOptions& opt,
             kc::GemmKernel gemmKernel, WeightFormat format, kc::Bf16Kernel bf16Kernel, kc::Q8Kernel q8Kernel)
      : model_(std::move(model)),
        cfg_(model_->config),
        layout_(layout),
        kv_(static_cast<uint8_t*>(kv)),
        opt_(opt),
        threads_(opt.numThreads > 0 ? opt.numThreads : int(std::max(1u, std::thread::hardware_concurrency()))),
        pool_(threads_),
        gemmKernel_(gemmKernel),
        gemmNr_(kc::gemmKernelInfo(gemmKernel).nr),
        bf16Kernel_(bf16Kernel),
        q8Kernel_(q8Kernel),
        moe_(cfg_) {
    if (cfg_.isMla()) mla_ = std::make_unique<CpuMla>(*model_, layout_, gemmKernel_, threads_);
    if (format != WeightFormat::kF32) {
      // A model loaded in this format holds the compact weights itself (its f32 copies freed);
      // an f32 model's are converted once here and kept by the backend (the f32 copies stay in
      // the shared ModelWeights: other backends and the loader's callers may use them).
      const std::string name = format == WeightFormat::kBf16 ? "bf16" : "q8_0";
      const int h = cfg_.hiddenSize, ffn = cfg_.intermediateSize;
      const int qkvRows = cfg_.qDim() + 2 * cfg_.kvDim();
      if (model_->weightFormat == "f32") {
        auto convert = [&name](const WeightBuffer& w, int n, int k) {
          // A mixture-of-experts layer has no dense MLP (its experts stay f32).
          return w.empty() ? CompactWeight{} : CompactWeight::convert(w.data(), n, k, name);
        };
        owned_.reserve(model_->layers.size());
        for (const LayerWeights& w : model_->layers)
          owned_.push_back({convert(w.qkv, qkvRows, h), convert(w.o, h, cfg_.qDim()), convert(w.gateUp, 2 * ffn, h),
                            convert(w.down, h, ffn)});
        for (const CompactLayer& c : owned_) compact_.push_back({&c.qkv, &c.o, &c.gateUp, &c.down});
      } else {
        for (const LayerWeights& w : model_->layers)
          compact_.push_back({&w.qkvCompact, &w.oCompact, &w.gateUpCompact, &w.downCompact});
      }
    }
    invFreq_.resize(cfg_.headDim / 2);
    kc::RopeLlama3Scaling s;
    s.factor = float(cfg_.rope.factor);
    s.lowFreqFactor = float(cfg_.rope.lowFreqFactor);
    s.highFreqFactor = float(cfg_.rope.highFreqFactor);
    s.originalMaxPositionEmbeddings = cfg_.rope.originalMaxPositionEmbeddings;
    kc::ropeInvFreq(invFreq_.data(), cfg_.headDim, cfg_.rope.theta, cfg_.rope.llama3 ? &s : nullptr);
    threadScratch_.resize(threads_);
  }

  const ModelConfig& config() const override { return cfg_; }
  const KvLayout& kvLayout() const override { return layout_; }

  Status forward(std::span<const SeqChunk> batch, float* logits, const LayerKvReadyFn& onLayerKvReady) override;

 private:
  using Compact = CompactWeight;  // bf16 set, or q8 and scales set
  // y[n][out] = x[n][in] * W^T (+ beta * y); W is cw when not null, else w (f32; in the rows8
  // layout of pd/kernels/linear.h when rows8, as the experts' weights are).
  void linear(const float* x, int n, int in, const float* w, const Compact* cw, int out, float* y, float beta,
              bool rows8 = false);
  // Several products (beta 0): when every one has at most skinnyMaxRows rows, one fork-join
  // round streams all their weights (the chosen experts of a decode step); else one by one.
  void linearMany(const std::vector<CpuMoe::LinearJob>& jobs);
  // Splits [0, n) rows over the pool when the work is worth waking threads for.
  template <typename Fn>
  void forRows(int n, int64_t workPerRow, Fn&& fn);
  void attention(std::span<const SeqChunk> batch, int layer);

  // One layer's pool as the kernels see it (engine.kv_cache_dtype: f32, bf16, int8 or fp8).
  kc::PagedKv layerKv(int layer) const {
    kc::PagedKv p;
    p.layer = kv_ + size_t(layer) * layout_.layerBytes();
    p.format = static_cast<kc::KvFormat>(static_cast<uint8_t>(layout_.dtype));
    p.blockSize = layout_.blockSize;
    p.numKvHeads = layout_.numKvHeads;
    p.headDim = layout_.headDim;
    return p;
  }

  std::shared_ptr<const ModelWeights> model_;
  const ModelConfig& cfg_;
  KvLayout layout_;
  uint8_t* kv_;
  CpuBackendOptions opt_;
  int threads_;
  CpuThreadPool pool_;
  kc::GemmKernel gemmKernel_;
  int gemmNr_;  // the kernel's panel width: column splits are multiples of it
  kc::Bf16Kernel bf16Kernel_;
  kc::Q8Kernel q8Kernel_;
  // engine.weight_format bf16 or q8_0: the four linear weights of each layer converted (empty
  // for f32). Norms, biases, embeddings and lm_head stay f32.
  struct CompactLayer {
    Compact qkv, o, gateUp, down;
  };
  std::vector<CompactLayer> owned_;  // converted here from an f32 model
  struct CompactRefs {
    const Compact *qkv, *o, *gateUp, *down;
  };
  std::vector<CompactRefs> compact_;  // per layer: owned_'s or the model's own
  std::vector<float> invFreq_;

  // Per-step scratch, grown on demand and reused.
  std::vector<int32_t> ids_, pos_, slots_, tokenStart_, logitRows_;
  std::vector<float> x_, xn_, qkv_, attn_, gu_, act_, cos_, sin_;
  struct Scratch {
    std::vector<float> scores, k, v, kPacked, vPacked;
    kc::GemmWorkspace gemm;
  };
  std::vector<Scratch> threadScratch_;
  CpuMoe moe_;                   // mixture-of-experts layers (cpu_moe.h)
  std::unique_ptr<CpuMla> mla_;  // multi-head latent attention (cpu_mla.h); DeepseekV3 only
};

template <typename Fn>
void CpuBackend::forRows(int n, int64_t workPerRow, Fn&& fn) {
  // Below ~64k element-operations a wake-up of the pool costs more than it saves.
  if (threads_ == 1 || int64_t(n) * workPerRow < 65536 || n < 2) {
    fn(0, n);
    return;
  }
  const int tasks = std::min(n, threads_ * 4);
  pool_.run(tasks, [&](int t, int) {
    const int b = int(int64_t(n) * t / tasks), e = int(int64_t(n) * (t + 1) / tasks);
    if (b < e) fn(b, e);
  });
}

void CpuBackend::linear(const float* x, int n, int in, const float* w, const Compact* cw, int out, float* y, float beta,
                        bool rows8) {
  // Output columns are split over the pool; each task runs the GEMM on its own columns with
  // its thread's packing workspace. A few tasks per thread: tasks are claimed dynamically, so
  // when a worker is descheduled (a busy machine) the others absorb its share instead of
  // waiting for it.
  const int64_t work = int64_t(n) * out * in;
  const bool serial = threads_ == 1 || work < 262144;
  if (n > opt_.skinnyMaxRows) {
    const int tasks = serial ? 1 : threads_ * 2;
    const int units = (out + gemmNr_ - 1) / gemmNr_;  // column slices in whole kernel panels
    pool_.run(tasks, [&](int t, int thread) {
      const int b = std::min(out, int(int64_t(units) * t / tasks) * gemmNr_);
      const int e = std::min(out, int(int64_t(units) * (t + 1) / tasks) * gemmNr_);
      if (b >= e) return;
      if (cw && !cw->bf16.empty())
        kc::gemmBf16(gemmKernel_, n, b, e, in, x, in, cw->bf16.data(), in, beta, y, out, threadScratch_[thread].gemm);
      else if (cw)
        kc::gemmQ8(gemmKernel_, n, b, e, in, x, in, cw->q8.data(), cw->scales.data(), beta, y, out,
                   threadScratch_[thread].gemm);
      else if (rows8)
        kc::gemmRows8(gemmKernel_, n, b, e, out, in, x, in, w, beta, y, out, threadScratch_[thread].gemm);
      else
        kc::gemm(gemmKernel_, n, b, e, in, x, in, w, in, kc::GemmB::kNK, beta, y, out, threadScratch_[thread].gemm);
    });
    return;
  }
  // Few rows (decode): stream W once, output columns split in multiples of 4 (8 for rows8: one
  // group of rows per unit).
  const int tasks = serial ? 1 : threads_ * 4;
  const int unit = rows8 ? 8 : 4;
  const int units = (out + unit - 1) / unit;
  pool_.run(tasks, [&](int t, int) {
    const int b = std::min(out, int(int64_t(units) * t / tasks) * unit);
    const int e = std::min(out, int(int64_t(units) * (t + 1) / tasks) * unit);
    if (b >= e) return;
    if (rows8)
      kc::linearSkinnyRows8(x, in, w, y, out, n, out, in, b, e, beta);
    else if (cw && !cw->bf16.empty())
      kc::linearSkinnyBf16(bf16Kernel_, x, in, cw->bf16.data(), y, out, n, in, b, e, beta);
    else if (cw)
      kc::linearSkinnyQ8(q8Kernel_, x, in, cw->q8.data(), cw->scales.data(), y, out, n, in, b, e, beta);
    else
      kc::linearSkinny(x, in, w, y, out, n, in, b, e, beta);
  });
}

void CpuBackend::linearMany(const std::vector<CpuMoe::LinearJob>& jobs) {
  bool skinny = threads_ > 1;
  for (const auto& j : jobs) skinny = skinny && j.n <= opt_.skinnyMaxRows;
  if (!skinny) {
    for (const auto& j : jobs) linear(j.x, j.n, j.in, j.w, nullptr, j.out, j.y, 0.0f, j.rows8);
    return;
  }
  const int perJob = threads_ * 4;  // column slices of each job, multiples of 4 (8 for rows8)
  pool_.run(int(jobs.size()) * perJob, [&](int t, int) {
    const CpuMoe::LinearJob& j = jobs[t / perJob];
    const int unit = j.rows8 ? 8 : 4;
    const int s = t % perJob, units = (j.out + unit - 1) / unit;
    const int b = std::min(j.out, int(int64_t(units) * s / perJob) * unit);
    const int e = std::min(j.out, int(int64_t(units) * (s + 1) / perJob) * unit);
    if (b >= e) return;
    if (j.rows8)
      kc::linearSkinnyRows8(j.x, j.in, j.w, j.y, j.out, j.n, j.out, j.in, b, e, 0.0f);
    else
      kc::linearSkinny(j.x, j.in, j.w, j.y, j.out, j.n, j.in, b, e, 0.0f);
  });
}

void CpuBackend::attention(std::span<const SeqChunk> batch, int layer) {
  const int hd = cfg_.headDim, nh = cfg_.numHeads, nkv = cfg_.numKvHeads, group = nh / nkv;
  const int qkvRows = cfg_.qDim() + 2 * cfg_.kvDim();
  const int qDim = cfg_.qDim();
  const float scale = 1.0f / std::sqrt(float(hd));
  const kc::PagedKv lkv = layerKv(layer);

  // Work items: (chunk, range of kv heads) for the paged kernel, which reads a tile of keys
  // once for every kv head of its range (contiguous in the pool): one range per chunk unless
  // the batch has fewer chunks than the pool has threads, then kv heads split so that each
  // thread gets about two items. For GEMM chunks (chunk, kv head) items that gather K/V once
  // and then run every query tile of the group's heads.
  struct Item {
    int chunk;
    int kvHead, kvHeadEnd;
  };
  const int parts = std::clamp(threads_ == 1 ? 1 : 2 * threads_ / int(batch.size()), 1, nkv);
  std::vector<Item> items;
  items.reserve(batch.size() * nkv);
  for (size_t c = 0; c < batch.size(); ++c) {
    if (batch[c].numTokens < opt_.gemmAttentionMinTokens) {
      for (int p = 0; p < parts; ++p) items.push_back({int(c), nkv * p / parts, nkv * (p + 1) / parts});
    } else {
      for (int g = 0; g < nkv; ++g) items.push_back({int(c), g, g + 1});
    }
  }
  auto runItem = [&](int i, int thread) {
    const Item it = items[i];
    const SeqChunk& s = batch[it.chunk];
    const int t0 = tokenStart_[it.chunk];
    const float* q = qkv_.data() + size_t(t0) * qkvRows;
    float* out = attn_.data() + size_t(t0) * qDim;
    if (s.numTokens < opt_.gemmAttentionMinTokens) {
      kc::pagedAttention(q, qkvRows, lkv, s.blockTable, s.numTokens, s.startPos, nh, it.kvHead, it.kvHeadEnd, scale,
                         out, qDim);
      return;
    }
    Scratch& sc = threadScratch_[thread];
    const int ctx = s.startPos + s.numTokens;
    if (sc.k.size() < size_t(ctx) * hd) {
      sc.k.resize(size_t(ctx) * hd);
      sc.v.resize(size_t(ctx) * hd);
    }
    if (sc.scores.size() < size_t(kQueryTile) * ctx) sc.scores.resize(size_t(kQueryTile) * ctx);
    kc::kvGatherHead(lkv, s.blockTable, ctx, it.kvHead, sc.k.data(), sc.v.data());
    // Keys and values packed once into the GEMM's panels, then shared by every query tile of
    // every head of the group (each tile multiplies a prefix of them).
    sc.kPacked.resize(kc::gemmPackedBFloats(gemmKernel_, ctx, hd));
    sc.vPacked.resize(kc::gemmPackedBFloats(gemmKernel_, hd, ctx));
    kc::gemmPackB(gemmKernel_, ctx, hd, sc.k.data(), hd, kc::GemmB::kNK, sc.kPacked.data());
    kc::gemmPackB(gemmKernel_, hd, ctx, sc.v.data(), hd, kc::GemmB::kKN, sc.vPacked.data());
    for (int j = 0; j < group; ++j) {
      const int h = it.kvHead * group + j;
      for (int r0 = 0; r0 < s.numTokens; r0 += kQueryTile) {
        const int rows = std::min(kQueryTile, s.numTokens - r0);
        const int keyEnd = s.startPos + r0 + rows;  // keys the tile's last query can see
        const float* qt = q + size_t(r0) * qkvRows + size_t(h) * hd;
        kc::gemmPrepacked(gemmKernel_, rows, keyEnd, hd, qt, qkvRows, sc.kPacked.data(), hd, 0.0f, sc.scores.data(),
                          keyEnd);
        kc::causalSoftmaxRows(sc.scores.data(), keyEnd, rows, keyEnd, s.startPos + r0, scale);
        kc::gemmPrepacked(gemmKernel_, rows, hd, keyEnd, sc.scores.data(), keyEnd, sc.vPacked.data(), ctx, 0.0f,
                          out + size_t(r0) * qDim + size_t(h) * hd, qDim);
      }
    }
  };
  // A single decode token with few heads is cheaper inline than waking the pool.
  int64_t work = 0;
  for (const auto& s : batch) work += int64_t(s.numTokens) * (s.startPos + s.numTokens);
  if (work * nh * hd < 200000) {
    for (size_t i = 0; i < items.size(); ++i) runItem(int(i), 0);
  } else {
    pool_.run(int(items.size()), runItem);
  }
}

Status CpuBackend::forward(std::span<const SeqChunk> batch, float* logits, const LayerKvReadyFn& onLayerKvReady) {
  PD_ASSIGN_OR_RETURN(const BatchShape shape, validateBatch(batch, cfg_, layout_));
  const int T = shape.totalTokens, numLogits = shape.numLogits;
  if (T == 0) return Status::ok();
  if (numLogits > 0 && !logits) return invalidArgument("forward: logits is null but chunks want logits");

  const int h = cfg_.hiddenSize, hd = cfg_.headDim, half = hd / 2;
  const int qDim = cfg_.qDim(), kvDim = cfg_.kvDim(), qkvRows = qDim + 2 * kvDim;
  const int ffn = cfg_.intermediateSize;
  const bool mla = cfg_.isMla();
  const int attnDim = mla ? cfg_.numHeads * cfg_.mla.vHeadDim : qDim;  // o_proj's input width

  ids_.resize(T);
  pos_.resize(T);
  slots_.resize(T);
  tokenStart_.resize(batch.size());
  logitRows_.clear();
  int t = 0;
  for (size_t c = 0; c < batch.size(); ++c) {
    const SeqChunk& s = batch[c];
    tokenStart_[c] = t;
    for (int i = 0; i < s.numTokens; ++i, ++t) {
      const int p = s.startPos + i;
      ids_[t] = s.tokens[i];
      pos_[t] = p;
      slots_[t] = s.blockTable[p / layout_.blockSize] * layout_.blockSize + p % layout_.blockSize;
    }
    if (s.wantLogits) logitRows_.push_back(t - 1);
  }
  auto grow = [](std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  };
  grow(x_, size_t(T) * h);
  grow(xn_, size_t(T) * h);
  if (!mla) grow(qkv_, size_t(T) * qkvRows);
  grow(attn_, size_t(T) * attnDim);
  grow(gu_, size_t(T) * 2 * ffn);
  grow(act_, size_t(T) * ffn);
  grow(cos_, size_t(T) * half);
  grow(sin_, size_t(T) * half);

  kc::embeddingGather(model_->embed.data(), ids_.data(), T, h, x_.data());
  kc::ropeCosSin(pos_.data(), T, invFreq_.data(), half, cos_.data(), sin_.data());

  const CpuMla::LinearFn mlaLinear = [this](const float* in, int n, int k, const float* wt, int out, float* y,
                                            float beta) { linear(in, n, k, wt, nullptr, out, y, beta); };
  const CpuMla::ParallelFn parallel = [this](int n, const std::function<void(int, int)>& fn) {
    if (n == 1 || threads_ == 1) {
      for (int i = 0; i < n; ++i) fn(i, 0);
    } else {
      pool_.run(n, fn);
    }
  };
  for (int l = 0; l < cfg_.numLayers; ++l) {
    const LayerWeights& w = model_->layers[l];
    const CompactRefs* wb = compact_.empty() ? nullptr : &compact_[l];
    forRows(T, h, [&](int b, int e) {
      kc::rmsNorm(x_.data() + size_t(b) * h, h, w.inputNorm.data(), xn_.data() + size_t(b) * h, h, e - b, h,
                  cfg_.rmsNormEps);
    });
    if (mla) {
      // Latent KV is f32 only (createCpuBackend refuses the other dtypes for it).
      float* latentKv = static_cast<float*>(layerKv(l).layer);
      mla_->project(l, xn_.data(), T, pos_.data(), slots_.data(), latentKv, mlaLinear, parallel);
      if (onLayerKvReady) onLayerKvReady(l);
      mla_->attend(w, batch, tokenStart_.data(), latentKv, attn_.data(), parallel);
      linear(attn_.data(), T, attnDim, w.o.data(), nullptr, h, x_.data(), 1.0f);
      forRows(T, h, [&](int b, int e) {
        kc::rmsNorm(x_.data() + size_t(b) * h, h, w.postNorm.data(), xn_.data() + size_t(b) * h, h, e - b, h,
                    cfg_.rmsNormEps);
      });
      if (cfg_.isMoeLayer(l)) {  // routed and shared experts (cpu_moe.h)
        moe_.forward(w, xn_.data(), T, x_.data(), mlaLinear,
                     [this](const std::vector<CpuMoe::LinearJob>& jobs) { linearMany(jobs); });
        continue;
      }
      linear(xn_.data(), T, h, w.gateUp.data(), nullptr, 2 * ffn, gu_.data(), 0.0f);
      forRows(T, 2 * ffn, [&](int b, int e) {
        kc::swiGlu(gu_.data() + size_t(b) * 2 * ffn, act_.data() + size_t(b) * ffn, e - b, ffn);
      });
      linear(act_.data(), T, ffn, w.down.data(), nullptr, h, x_.data(), 1.0f);
      continue;
    }
    if (!w.qkvBias.empty()) {
      for (int i = 0; i < T; ++i)
        std::copy(w.qkvBias.data(), w.qkvBias.data() + qkvRows, qkv_.data() + size_t(i) * qkvRows);
    }
    linear(xn_.data(), T, h, w.qkv.data(), wb ? wb->qkv : nullptr, qkvRows, qkv_.data(),
           w.qkvBias.empty() ? 0.0f : 1.0f);
    const kc::PagedKv lkv = layerKv(l);
    forRows(T, qkvRows, [&](int b, int e) {
      float* rows = qkv_.data() + size_t(b) * qkvRows;
      const float* c = cos_.data() + size_t(b) * half;
      const float* s = sin_.data() + size_t(b) * half;
      if (cfg_.qkNorm) {  // Qwen3: each q and k head RMS-normalised before RoPE, in place
        for (int r = 0; r < e - b; ++r) {
          float* row = rows + size_t(r) * qkvRows;
          kc::rmsNorm(row, hd, w.qNorm.data(), row, hd, cfg_.numHeads, hd, cfg_.rmsNormEps);
          kc::rmsNorm(row + qDim, hd, w.kNorm.data(), row + qDim, hd, cfg_.numKvHeads, hd, cfg_.rmsNormEps);
        }
      }
      kc::applyRope(rows, qkvRows, e - b, cfg_.numHeads, hd, c, s);
      kc::applyRope(rows + qDim, qkvRows, e - b, cfg_.numKvHeads, hd, c, s);
      kc::kvCacheWrite(lkv, rows + qDim, rows + qDim + kvDim, qkvRows, slots_.data() + b, e - b);
    });
    if (onLayerKvReady) onLayerKvReady(l);
    attention(batch, l);
    // Residual adds ride on the GEMM's beta = 1.
    if (!w.oBias.empty())
      for (int i = 0; i < T; ++i)
        for (int j = 0; j < h; ++j) x_[size_t(i) * h + j] += w.oBias.data()[j];
    linear(attn_.data(), T, qDim, w.o.data(), wb ? wb->o : nullptr, h, x_.data(), 1.0f);
    forRows(T, h, [&](int b, int e) {
      kc::rmsNorm(x_.data() + size_t(b) * h, h, w.postNorm.data(), xn_.data() + size_t(b) * h, h, e - b, h,
                  cfg_.rmsNormEps);
    });
    if (cfg_.isMoeLayer(l)) {
      moe_.forward(
          w, xn_.data(), T, x_.data(),
          [this](const float* in, int n, int k, const float* wt, int out, float* y, float beta) {
            linear(in, n, k, wt, nullptr, out, y, beta);
          },
          [this](const std::vector<CpuMoe::LinearJob>& jobs) { linearMany(jobs); });
      continue;
    }
    linear(xn_.data(), T, h, w.gateUp.data(), wb ? wb->gateUp : nullptr, 2 * ffn, gu_.data(), 0.0f);
    forRows(T, 2 * ffn, [&](int b, int e) {
      kc::swiGlu(gu_.data() + size_t(b) * 2 * ffn, act_.data() + size_t(b) * ffn, e - b, ffn);
    });
    linear(act_.data(), T, ffn, w.down.data(), wb ? wb->down : nullptr, h, x_.data(), 1.0f);
  }

  if (numLogits > 0) {
    for (int i = 0; i < numLogits; ++i)
      kc::rmsNorm(x_.data() + size_t(logitRows_[i]) * h, h, model_->finalNorm.data(), xn_.data() + size_t(i) * h, h, 1,
                  h, cfg_.rmsNormEps);
    linear(xn_.data(), numLogits, h, model_->lmHeadData(), nullptr, cfg_.vocabSize, logits, 0.0f);
  }
  return Status::ok();
}

// The GEMM kernel: the best this CPU supports, or the one `forced` names (tests, benchmarks).
// Logs the choice once per process and kernel; warns when a CPU that has better runs the
// portable kernel or a narrower one.
Result<kc::GemmKernel> chooseGemmKernel(const std::string& forced) {
  const kc::GemmKernel best = kc::gemmBestKernel();
  kc::GemmKernel k = best;
  if (!forced.empty()) {
    bool known = false;
    for (kc::GemmKernel c : {kc::GemmKernel::kAvx512, kc::GemmKernel::kAvx2, kc::GemmKernel::kGeneric}) {
      if (forced == kc::gemmKernelInfo(c).name) {
        known = true;
        k = c;
      }
    }
    if (!known) return invalidArgument("createCpuBackend: unknown gemmKernel \"" + forced + "\" (avx512|avx2|generic)");
    if (!kc::gemmKernelSupported(k))
      return failedPrecondition("createCpuBackend: gemmKernel " + forced +
                                " needs instructions this CPU lacks (best: " + kc::gemmKernelInfo(best).name + ")");
  }
  static std::atomic<int> logged{0};  // bit per kernel: one line per process and kernel
  const int bit = 1 << int(k);
  if ((logged.fetch_or(bit) & bit) == 0) {
    const kc::GemmKernelInfo info = kc::gemmKernelInfo(k);
    if (k != best) {
      PD_LOG(kWarn, "engine") << "cpu backend: f32 GEMM kernel " << info.name << " (" << info.mr << "x" << info.nr
                              << " tile, forced) although this CPU supports " << kc::gemmKernelInfo(best).name
                              << ": prefill runs below the hardware's speed";
    } else if (k == kc::GemmKernel::kGeneric) {
      PD_LOG(kInfo, "engine") << "cpu backend: f32 GEMM kernel generic (" << info.mr << "x" << info.nr
                              << " tile): this CPU has neither AVX-512F nor AVX2+FMA";
    } else {
      PD_LOG(kInfo, "engine") << "cpu backend: f32 GEMM kernel " << info.name << " (" << info.mr << "x" << info.nr
                              << " tile, chosen from CPUID)";
    }
  }
  return k;
}

}  // namespace

Result<std::unique_ptr<Backend>> createCpuBackend(std::shared_ptr<const ModelWeights> model, const KvLayout& layout,
                                                  void* kvBase, const CpuBackendOptions& options) {
  if (!model) return invalidArgument("createCpuBackend: no model");
  if (!model->hasHostTensors())
    return invalidArgument("createCpuBackend: the model from " + model->dir +
                           " has no weights in host memory (describeModel): the CPU backend "
                           "computes from loadModel's f32 weights");
  const ModelConfig& c = model->config;
  // f16 has no CPU kernels (bf16 covers the 16-bit case): refused by name, not read as f32.
  if (layout.dtype == KvDtype::kF16)
    return unimplemented(std::string("createCpuBackend: KV dtype ") + kvDtypeName(layout.dtype) +
                         " (the CPU backend keeps its KV cache in f32, bf16, int8 or fp8)");
  if (c.isMla() && layout.dtype != KvDtype::kF32)
    return unimplemented(std::string("createCpuBackend: KV dtype ") + kvDtypeName(layout.dtype) + " for " +
                         architectureName(c.architecture) +
                         " (multi-head latent attention keeps its latent KV in f32)");
  if (layout.numLayers != c.numLayers || layout.numKvHeads != c.numKvHeads || layout.headDim != c.headDim ||
      layout.latent != c.isMla())
    return invalidArgument("createCpuBackend: KV layout " + layout.fingerprint() +
                           " does not match the model (layers " + std::to_string(c.numLayers) + ", kv heads " +
                           std::to_string(c.numKvHeads) + ", head dim " + std::to_string(c.headDim) +
                           (c.isMla() ? ", latent" : "") + ")");
  if (layout.blockSize <= 0 || layout.numBlocks <= 0)
    return invalidArgument("createCpuBackend: KV layout needs blockSize > 0 and numBlocks > 0");
  if (!kvBase) return invalidArgument("createCpuBackend: kvBase is null");
  if (options.numThreads < 0) return invalidArgument("createCpuBackend: numThreads < 0");
  PD_ASSIGN_OR_RETURN(const kc::GemmKernel gemmKernel, chooseGemmKernel(options.gemmKernel));
  WeightFormat format = WeightFormat::kF32;
  if (options.weightFormat == "bf16")
    format = WeightFormat::kBf16;
  else if (options.weightFormat == "q8_0")
    format = WeightFormat::kQ8;
  else if (options.weightFormat != "f32")
    return invalidArgument("createCpuBackend: unknown weightFormat \"" + options.weightFormat + "\" (f32|bf16|q8_0)");
  if (model->weightFormat != "f32" && model->weightFormat != options.weightFormat)
    return failedPrecondition("createCpuBackend: the model was loaded with weight format " + model->weightFormat +
                              " (its f32 copies freed) but weightFormat is " + options.weightFormat);
  if (format != WeightFormat::kF32 && c.isMla())
    return unimplemented("createCpuBackend: weight_format " + options.weightFormat + " is not implemented for " +
                         architectureName(c.architecture) + " (multi-head latent attention runs with f32 weights)");
  kc::Bf16Kernel bf16Kernel = kc::bf16BestKernel();
  if (!options.bf16Kernel.empty()) {
    if (options.bf16Kernel == "avx2")
      bf16Kernel = kc::Bf16Kernel::kAvx2;
    else if (options.bf16Kernel == "avx512bf16")
      bf16Kernel = kc::Bf16Kernel::kAvx512Bf16;
    else
      return invalidArgument("createCpuBackend: unknown bf16Kernel \"" + options.bf16Kernel + "\" (avx512bf16|avx2)");
    if (!kc::bf16KernelSupported(bf16Kernel))
      return failedPrecondition(
          "createCpuBackend: bf16Kernel " + options.bf16Kernel +
          " needs instructions this CPU lacks (best: " + kc::bf16KernelName(kc::bf16BestKernel()) + ")");
  }
  kc::Q8Kernel q8Kernel = kc::q8BestKernel();
  if (!options.q8Kernel.empty()) {
    bool known = false;
    for (kc::Q8Kernel c : {kc::Q8Kernel::kAvx512Vnni, kc::Q8Kernel::kAvx2, kc::Q8Kernel::kGeneric})
      if (options.q8Kernel == kc::q8KernelName(c)) {
        q8Kernel = c;
        known = true;
      }
    if (!known)
      return invalidArgument("createCpuBackend: unknown q8Kernel \"" + options.q8Kernel +
                             "\" (avx512vnni|avx2|generic)");
    if (!kc::q8KernelSupported(q8Kernel))
      return failedPrecondition("createCpuBackend: q8Kernel " + options.q8Kernel +
                                " needs instructions this CPU lacks (best: " + kc::q8KernelName(kc::q8BestKernel()) +
                                ")");
  }
  if (format == WeightFormat::kQ8) {
    static std::atomic<int> logged{0};
    const int bit = 1 << int(q8Kernel);
    if ((logged.fetch_or(bit) & bit) == 0) {
      const bool narrower = q8Kernel != kc::q8BestKernel();
      if (narrower)
        PD_LOG(kWarn, "engine") << "cpu backend: q8_0 weights, decode kernel " << kc::q8KernelName(q8Kernel)
                                << " (forced) although this CPU supports " << kc::q8KernelName(kc::q8BestKernel());
      else
        PD_LOG(kInfo, "engine") << "cpu backend: q8_0 weights, decode kernel " << kc::q8KernelName(q8Kernel)
                                << (options.q8Kernel.empty() ? " (chosen from CPUID)" : " (forced)");
    }
  }
  if (format == WeightFormat::kBf16) {
    static std::atomic<int> logged{0};
    const int bit = 1 << int(bf16Kernel);
    if ((logged.fetch_or(bit) & bit) == 0) {
      PD_LOG(kInfo, "engine") << "cpu backend: bf16 weights, decode kernel " << kc::bf16KernelName(bf16Kernel)
                              << (options.bf16Kernel.empty() ? " (chosen from CPUID)" : " (forced)");
    }
  }
  return std::unique_ptr<Backend>(
      new CpuBackend(std::move(model), layout, kvBase, options, gemmKernel, format, bf16Kernel, q8Kernel));
}

}  // namespace pd::engine
