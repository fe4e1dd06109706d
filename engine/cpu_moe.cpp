#include "engine/cpu_moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/moe_routing.h"
#include "pd/kernels/activation.h"

namespace pd::engine {

namespace kc = pd::kernels::cpu;

void CpuMoe::forward(const LayerWeights& w, const float* xn, int T, float* x, const LinearFn& linear,
                     const LinearManyFn& linearMany) {
  const int h = cfg_.hiddenSize, ne = cfg_.moe.numExperts, k = cfg_.moe.expertsPerToken, ef = cfg_.moe.expertFfn;
  auto grow = [](auto& v, size_t n) {
    if (v.size() < n) v.resize(n);
  };
  grow(logits_, size_t(T) * ne);
  grow(chosen_, size_t(T) * k);
  grow(weights_, size_t(T) * k);

  linear(xn, T, h, w.router.data(), ne, logits_.data(), 0.0f);

  routeMoeTokens(cfg_.moe, logits_.data(), T, w.routerBias.empty() ? nullptr : w.routerBias.data(), chosen_.data(),
                 weights_.data());
  // Rows grouped by expert, tokens ascending within each (moe_routing.h, as the CUDA backend).
  planMoeRows(chosen_.data(), weights_.data(), T, k, ne, &plan_);
  const std::vector<int>& start = plan_.start;
  rowsPerExpert_ = plan_.rowsPerExpert;

  // Every routed row gathered once, grouped by expert: [T*k][hidden]; then the chosen experts'
  // gate|up products as one group, SwiGLU over all rows, their down products as one group.
  const size_t R = size_t(T) * k;
  grow(xe_, R * h);
  grow(gu_, R * 2 * ef);
  grow(act_, R * ef);
  grow(ye_, R * h);
  for (size_t r = 0; r < R; ++r) {
    const float* src = xn + size_t(plan_.srcRows[r]) * h;
    std::copy(src, src + h, xe_.data() + r * h);
  }
  // DeepseekV3's shared experts (one MLP of width sharedFfn, every token) ride in the same two
  // rounds as the routed experts: no extra fork-join round per layer.
  const int sf = w.gateUp.empty() ? 0 : cfg_.moe.sharedFfn();
  if (sf > 0) {
    grow(sgu_, size_t(T) * 2 * sf);
    grow(sact_, size_t(T) * sf);
    grow(sy_, size_t(T) * h);
  }
  jobs_.clear();
  for (int e = 0; e < ne; ++e)
    if (rowsPerExpert_[e] > 0)  // an expert no token chose is never read
      jobs_.push_back({xe_.data() + size_t(start[e]) * h, rowsPerExpert_[e], h, w.experts[e].gateUp.data(), 2 * ef,
                       gu_.data() + size_t(start[e]) * 2 * ef, true});
  if (sf > 0) jobs_.push_back({xn, T, h, w.gateUp.data(), 2 * sf, sgu_.data()});
  linearMany(jobs_);
  kc::swiGlu(gu_.data(), act_.data(), int(R), ef);
  if (sf > 0) kc::swiGlu(sgu_.data(), sact_.data(), T, sf);
  jobs_.clear();
  for (int e = 0; e < ne; ++e)
    if (rowsPerExpert_[e] > 0)
      jobs_.push_back({act_.data() + size_t(start[e]) * ef, rowsPerExpert_[e], ef, w.experts[e].down.data(), h,
                       ye_.data() + size_t(start[e]) * h, true});
  if (sf > 0) jobs_.push_back({sact_.data(), T, sf, w.down.data(), h, sy_.data()});
  linearMany(jobs_);
  // Each token's experts' outputs in ascending expert order (its slots as planned).
  for (size_t s = 0; s < R; ++s) {
    const float g = plan_.slotWeights[s];
    float* dst = x + (s / k) * h;
    const float* y = ye_.data() + size_t(plan_.slotRows[s]) * h;
    for (int i = 0; i < h; ++i) dst[i] += g * y[i];
  }
  if (sf > 0)
    for (size_t i = 0; i < size_t(T) * h; ++i) x[i] += sy_[i];
}

}  // namespace pd::engine
