// Multi-head latent attention on the CPU backend (DeepseekV3ForCausalLM: DeepSeek-V3/R1,
// Kimi K2; docs/models.md, "DeepSeek-V3").
//
// Per token: q = q_b(rmsnorm(q_a(x))) (or q_proj(x)), split per head into q_nope and q_pe;
// [c_kv | k_pe] = kv_a_proj_with_mqa(x), c_kv RMS-normalised; q_pe and k_pe rotated with
// DeepSeek's interleaved RoPE (pairs of adjacent values; YaRN frequencies and magnitude scale
// when rope_scaling is yarn). The KV cache stores [c_kv | k_pe] (a latent layout, kv_layout.h).
//
// Every step uses the absorbed form, prefill and decode alike: kv_b_proj's key part W_UK is
// folded into each head's query (q_lat = W_UK^T q_nope), so scores are q_lat . c_kv +
// q_pe . k_pe straight against the cached latent vectors, the probability-weighted sum of c_kv
// is taken per head, and kv_b_proj's value part W_UV maps it to the head's output. No per-head
// K or V is ever expanded; attention reads kvLoraRank + qkRopeHeadDim values per position for
// all heads at once (an MQA over the latent). A token's heads share its position, so the
// (token, head) query rows of a tile of a chunk run as one GEMM against the chunk's latent
// context, gathered from the paged cache once per tile (decode: one tile of `heads` rows).
//
// Not thread-safe: one per backend, called from its forward(), which lends its pool through
// ParallelFn and its linear layers through LinearFn.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "engine/backend.h"
#include "engine/kv_layout.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "pd/kernels/gemm.h"

namespace pd::engine {

// The RoPE inverse frequencies of the qk_rope_head_dim part (qkRopeHeadDim / 2 values, YaRN
// applied when rope_scaling is yarn), and the magnitude factor on cos and sin (YaRN's
// yarnMscale(factor, mscale) / yarnMscale(factor, mscaleAllDim); 1 without YaRN). The CUDA
// backend (cuda_mla.h) rotates with the same.
std::vector<double> mlaRopeInvFreq(const ModelConfig& config);
double mlaRopeMscale(const ModelConfig& config);

class CpuMla {
 public:
  // y[n][out] = x[n][in] * W^T (+ beta * y), run over the backend's threads.
  using LinearFn = std::function<void(const float* x, int n, int in, const float* w, int out, float* y, float beta)>;
  // Runs fn(task, thread) for tasks [0, numTasks) over the backend's pool (thread < threads).
  using ParallelFn = std::function<void(int numTasks, const std::function<void(int task, int thread)>& fn)>;

  // Keeps, per layer, q_a_proj (or q_proj) and kv_a_proj_with_mqa stacked in one matrix: the
  // two products of the normalised input run as one (one pool round per layer, not two).
  CpuMla(const ModelWeights& model, const KvLayout& layout, pd::kernels::cpu::GemmKernel kernel, int threads);

  // Projects xn [T][hidden] (layer `layer`'s normalised input) to the absorbed queries (kept for attend()) and writes
  // each token's latent [c_kv | k_pe] to layerKv at slots[t] (block * blockSize + offset). pos: [T].
  void project(int layer, const float* xn, int T, const int32_t* pos, const int32_t* slots, float* layerKv,
               const LinearFn& linear, const ParallelFn& parallel);
  // Attention of project()'s queries over each chunk's context (its own tokens included,
  // already written); out: [T][heads * vHeadDim]. tokenStart[c]: chunk c's first row.
  void attend(const LayerWeights& w, std::span<const SeqChunk> batch, const int* tokenStart, const float* layerKv,
              float* out, const ParallelFn& parallel);

  // The RoPE inverse frequencies of the qk_rope_head_dim part (YaRN applied) and the factor on
  // cos and sin (tests).
  const std::vector<double>& invFreq() const { return invFreq_; }
  double ropeMscale() const { return ropeMscale_; }

 private:
  const float* latentRow(const float* layerKv, const int32_t* blockTable, int p) const;

  const ModelConfig& cfg_;
  const ModelWeights& model_;
  KvLayout layout_;
  std::vector<std::vector<float>> stackedA_;  // per layer: [q_a (or q_proj) rows | kv_a rows][hidden]
  pd::kernels::cpu::GemmKernel kernel_;
  float scale_;
  std::vector<double> invFreq_;
  double ropeMscale_ = 1.0;
  int T_ = 0;
  // Per-step buffers: the stacked product [T][qa rows + latentDim], q_a [T][qLoraRank], q [T][heads][qHeadDim], the
  // latent of the step's tokens [T][latentDim], absorbed queries [T][heads][latentDim], per-head latent outputs
  // [T][heads][kvLoraRank].
  std::vector<float> stacked_, qa_, q_, kva_, qlat_, olat_;
  struct Scratch {
    std::vector<float> scores, ctx;
    pd::kernels::cpu::GemmWorkspace gemm;
  };
  std::vector<Scratch> scratch_;
};

}  // namespace pd::engine
