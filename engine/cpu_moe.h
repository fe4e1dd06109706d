// The mixture-of-experts feed-forward block of the CPU backend (Mixtral, Qwen3-MoE;
// docs/models.md): routing and the experts' SwiGLU MLPs over a step's tokens.
//
// Routing (moe_routing.h, shared with the CUDA backend): router logits = xn W_router^T, softmax over every expert, the
// top expertsPerToken (ties to the lower expert id), weights renormalised to sum 1 when normTopkProb. DeepseekV3
// (moe.sigmoidScoring): sigmoid scores, the correction bias added for the choice only, the top k inside the best
// topkGroups groups, weights times routedScalingFactor (model_config.h). Its shared experts (the layer's gateUp/down,
// every token) run in the same two rounds as the routed ones and are added after them. Tokens are then grouped by
// expert: each expert that any token chose runs once, on the rows routed to it (gathered). The chosen experts' gate|up
// products go to the backend as one group and their down products as another (few rows: one fork-join round streaming
// each expert's weights; many rows: the GEMM, expert by expert), so a batch-1 decode reads the router and only its
// chosen experts' weights (the active parameters), and a prefill reads each chosen expert once for all its tokens. Each
// token's output is added to the residual in ascending expert order (deterministic for a given batch).
//
// Not thread-safe: one per backend, called from the backend's forward (which splits the
// linear products over its pool itself).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/moe_routing.h"

namespace pd::engine {

class CpuMoe {
 public:
  // y[n][out] = x[n][in] * W^T (+ beta * y), run over the backend's threads.
  using LinearFn = std::function<void(const float* x, int n, int in, const float* w, int out, float* y, float beta)>;
  // One product y[n][out] = x[n][in] * W^T of a group the backend may run in one round.
  struct LinearJob {
    const float* x;
    int n, in;
    const float* w;
    int out;
    float* y;
    bool rows8 = false;  // w is in the rows8 layout (an expert's weight; ExpertWeights)
  };
  // Runs every job (beta 0); the backend runs few-row jobs together, in one fork-join round.
  using LinearManyFn = std::function<void(const std::vector<LinearJob>& jobs)>;

  explicit CpuMoe(const ModelConfig& config) : cfg_(config) {}

  // x[T][hidden] += the layer's MoE block applied to xn[T][hidden] (the normalised rows).
  // The chosen experts' gate|up products run as one group, then their down products as one.
  void forward(const LayerWeights& w, const float* xn, int T, float* x, const LinearFn& linear,
               const LinearManyFn& linearMany);

  // The experts the last forward() ran and the token rows each got (tests, benchmarks).
  const std::vector<int>& lastExpertRows() const { return rowsPerExpert_; }

 private:
  const ModelConfig& cfg_;
  std::vector<float> logits_, xe_, gu_, act_, ye_, sgu_, sact_, sy_;
  std::vector<int> chosen_;         // [T][k] expert ids
  std::vector<float> weights_;      // [T][k] routing weights
  std::vector<int> rowsPerExpert_;  // [numExperts]
  MoeRowPlan plan_;                 // rows grouped by expert (moe_routing.h)
  std::vector<LinearJob> jobs_;
};

}  // namespace pd::engine
