#include "engine/cpu_mla.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "pd/kernels/attention.h"
#include "pd/kernels/norm.h"

namespace pd::engine {

namespace kc = pd::kernels::cpu;

namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr int kRowsPerTile = 256;  // query rows (token x head) per attention tile

// DeepSeek's RoPE frequencies for `dim` rotary values: theta^(-2i/dim), or under YaRN a blend
// of those (high frequencies, kept) and those divided by factor (low frequencies,
// interpolated) with a linear ramp between the dimensions where the original context turns
// beta_fast and beta_slow times.
std::vector<double> ropeInvFrequencies(const ModelConfig& c, int dim) {
  const RopeConfig& r = c.rope;
  std::vector<double> inv(dim / 2);
  for (int i = 0; i < dim / 2; ++i) inv[i] = 1.0 / std::pow(r.theta, double(2 * i) / dim);
  if (!r.yarn) return inv;
  auto correctionDim = [&](double rotations) {
    return dim * std::log(r.originalMaxPositionEmbeddings / (rotations * 2 * kPi)) / (2 * std::log(r.theta));
  };
  const double low = std::max(0.0, std::floor(correctionDim(r.betaFast)));
  double high = std::min(double(dim - 1), std::ceil(correctionDim(r.betaSlow)));
  if (low == high) high += 0.001;
  for (int i = 0; i < dim / 2; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extrapolate = 1.0 - ramp;  // weight of the unscaled frequency
    inv[i] = inv[i] / r.factor * (1.0 - extrapolate) + inv[i] * extrapolate;
  }
  return inv;
}

// Rotates the adjacent pairs (x[2i], x[2i+1]) by cs[i] = (cos, sin) (magnitude scale folded
// in). The published code de-interleaves before its rotate_half; the dot products of q_pe and
// k_pe, all attention sees, are the same.
void ropeInterleaved(float* x, const float* cs, int half) {
  for (int i = 0; i < half; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = b * c + a * s;
  }
}

}  // namespace

std::vector<double> mlaRopeInvFreq(const ModelConfig& c) { return ropeInvFrequencies(c, c.mla.qkRopeHeadDim); }

double mlaRopeMscale(const ModelConfig& c) {
  if (!c.rope.yarn) return 1.0;
  return yarnMscale(c.rope.factor, c.rope.mscale) / yarnMscale(c.rope.factor, c.rope.mscaleAllDim);
}

CpuMla::CpuMla(const ModelWeights& model, const KvLayout& layout, kc::GemmKernel kernel, int threads)
    : cfg_(model.config),
      model_(model),
      layout_(layout),
      kernel_(kernel),
      scale_(float(model.config.softmaxScale())),
      invFreq_(mlaRopeInvFreq(model.config)),
      scratch_(std::max(1, threads)) {
  const ModelConfig& c = model.config;
  ropeMscale_ = mlaRopeMscale(c);
  for (const LayerWeights& w : model.layers) {
    const WeightBuffer& q = c.mla.qLoraRank > 0 ? w.qA : w.qB;
    std::vector<float> s(q.size() + w.kvA.size());
    std::copy(q.data(), q.data() + q.size(), s.begin());
    std::copy(w.kvA.data(), w.kvA.data() + w.kvA.size(), s.begin() + q.size());
    stackedA_.push_back(std::move(s));
  }
}

const float* CpuMla::latentRow(const float* layerKv, const int32_t* blockTable, int p) const {
  return layerKv + size_t(blockTable[p / layout_.blockSize]) * layout_.blockElems() +
         size_t(p % layout_.blockSize) * layout_.tokenElems();
}

void CpuMla::project(int layer, const float* xn, int T, const int32_t* pos, const int32_t* slots, float* layerKv,
                     const LinearFn& linear, const ParallelFn& parallel) {
  const LayerWeights& w = model_.layers[layer];
  const MlaConfig& m = cfg_.mla;
  const int h = cfg_.hiddenSize, H = cfg_.numHeads, qh = m.qHeadDim(), nope = m.qkNopeHeadDim;
  const int R = m.kvLoraRank, L = m.latentDim(), half = m.qkRopeHeadDim / 2;
  T_ = T;
  auto grow = [](std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  };
  // One product for q_a (or q_proj) and kv_a: [T][qRows + L].
  const int qRows = m.qLoraRank > 0 ? m.qLoraRank : H * qh, rows = qRows + L;
  grow(stacked_, size_t(T) * rows);
  grow(q_, size_t(T) * H * qh);
  grow(kva_, size_t(T) * L);
  grow(qlat_, size_t(T) * H * L);
  linear(xn, T, h, stackedA_[layer].data(), rows, stacked_.data(), 0.0f);
  for (int t = 0; t < T; ++t)
    std::memcpy(kva_.data() + size_t(t) * L, stacked_.data() + size_t(t) * rows + qRows, sizeof(float) * L);
  if (m.qLoraRank > 0) {
    grow(qa_, size_t(T) * m.qLoraRank);
    kc::rmsNorm(stacked_.data(), rows, w.qANorm.data(), qa_.data(), m.qLoraRank, T, m.qLoraRank, cfg_.rmsNormEps);
    linear(qa_.data(), T, m.qLoraRank, w.qB.data(), H * qh, q_.data(), 0.0f);
  } else {
    for (int t = 0; t < T; ++t)
      std::memcpy(q_.data() + size_t(t) * H * qh, stacked_.data() + size_t(t) * rows, sizeof(float) * H * qh);
  }

  // Per token: c_kv normalised, k_pe and every head's q_pe rotated, the latent written to the
  // cache and q_pe placed after its head's absorbed part.
  std::vector<float> cs(size_t(half) * 2);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < half; ++i) {
      const double a = double(pos[t]) * invFreq_[i];
      cs[2 * i] = float(std::cos(a) * ropeMscale_);
      cs[2 * i + 1] = float(std::sin(a) * ropeMscale_);
    }
    float* kv = kva_.data() + size_t(t) * L;
    kc::rmsNorm(kv, R, w.kvANorm.data(), kv, R, 1, R, cfg_.rmsNormEps);
    ropeInterleaved(kv + R, cs.data(), half);
    const int slot = slots[t];
    float* dst = layerKv + size_t(slot / layout_.blockSize) * layout_.blockElems() +
                 size_t(slot % layout_.blockSize) * layout_.tokenElems();
    std::memcpy(dst, kv, sizeof(float) * L);
    for (int hd = 0; hd < H; ++hd) {
      float* qpe = q_.data() + (size_t(t) * H + hd) * qh + nope;
      ropeInterleaved(qpe, cs.data(), half);
      std::memcpy(qlat_.data() + (size_t(t) * H + hd) * L + R, qpe, sizeof(float) * m.qkRopeHeadDim);
    }
  }
  // Absorption: q_lat[t][head] = q_nope[t][head] . W_UK[head] ([nope][R] rows of kv_b_proj).
  parallel(H, [&](int hd, int thread) {
    const float* wuk = w.kvB.data() + size_t(hd) * (nope + m.vHeadDim) * R;
    kc::gemm(kernel_, T, 0, R, nope, q_.data() + size_t(hd) * qh, H * qh, wuk, R, kc::GemmB::kKN, 0.0f,
             qlat_.data() + size_t(hd) * L, H * L, scratch_[thread].gemm);
  });
}

void CpuMla::attend(const LayerWeights& w, std::span<const SeqChunk> batch, const int* tokenStart, const float* layerKv,
                    float* out, const ParallelFn& parallel) {
  const MlaConfig& m = cfg_.mla;
  const int H = cfg_.numHeads, R = m.kvLoraRank, L = m.latentDim(), nope = m.qkNopeHeadDim, v = m.vHeadDim;
  const int T = T_;
  if (olat_.size() < size_t(T) * H * R) olat_.resize(size_t(T) * H * R);

  // Work items: (chunk, tile of tokens). Rows are (token, head) pairs: a token's heads share
  // its position, so one token's H query rows see the same keys, and one tile is one GEMM
  // against the chunk's latent context (an MQA with a single latent KV head).
  struct Item {
    int chunk, tok0, tok1;
  };
  std::vector<Item> items;
  const int tileTokens = std::max(1, kRowsPerTile / H);
  for (size_t c = 0; c < batch.size(); ++c)
    for (int t0 = 0; t0 < batch[c].numTokens; t0 += tileTokens)
      items.push_back({int(c), t0, std::min(batch[c].numTokens, t0 + tileTokens)});
  parallel(int(items.size()), [&](int i, int thread) {
    const Item it = items[i];
    const SeqChunk& s = batch[it.chunk];
    Scratch& sc = scratch_[thread];
    const int keyEnd = s.startPos + it.tok1;  // keys the tile's last token sees
    // The latent context gathered once per item (contiguous for the GEMM's packing).
    if (sc.ctx.size() < size_t(keyEnd) * L) sc.ctx.resize(size_t(keyEnd) * L);
    for (int p = 0; p < keyEnd; ++p)
      std::memcpy(sc.ctx.data() + size_t(p) * L, latentRow(layerKv, s.blockTable, p), sizeof(float) * L);
    const int rows = (it.tok1 - it.tok0) * H;
    if (sc.scores.size() < size_t(rows) * keyEnd) sc.scores.resize(size_t(rows) * keyEnd);
    const size_t row0 = size_t(tokenStart[it.chunk] + it.tok0) * H;
    kc::gemm(kernel_, rows, 0, keyEnd, L, qlat_.data() + row0 * L, L, sc.ctx.data(), L, kc::GemmB::kNK, 0.0f,
             sc.scores.data(), keyEnd, sc.gemm);
    for (int r = 0; r < rows; ++r)
      kc::causalSoftmaxRows(sc.scores.data() + size_t(r) * keyEnd, keyEnd, 1, keyEnd, s.startPos + it.tok0 + r / H,
                            scale_);
    kc::gemm(kernel_, rows, 0, R, keyEnd, sc.scores.data(), keyEnd, sc.ctx.data(), L, kc::GemmB::kKN, 0.0f,
             olat_.data() + row0 * R, R, sc.gemm);
  });
  // Each head's latent output through its W_UV ([v][R] rows of kv_b_proj).
  parallel(H, [&](int hd, int thread) {
    const float* wuv = w.kvB.data() + (size_t(hd) * (nope + v) + nope) * R;
    kc::gemm(kernel_, T, 0, v, R, olat_.data() + size_t(hd) * R, H * R, wuv, R, kc::GemmB::kNK, 0.0f,
             out + size_t(hd) * v, H * v, scratch_[thread].gemm);
  });
}

}  // namespace pd::engine
