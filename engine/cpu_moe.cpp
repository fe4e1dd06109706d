#include "engine/cpu_moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

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
  rowsPerExpert_.assign(ne, 0);

  linear(xn, T, h, w.router.data(), ne, logits_.data(), 0.0f);

  // Scores in double (the top-k order must not hinge on rounding); ties to the lower id.
  std::vector<double> p(ne), choice(ne), groupScore(cfg_.moe.numGroups);
  std::vector<int> ids(ne), groups(cfg_.moe.numGroups);
  for (int t = 0; t < T; ++t) {
    const float* row = logits_.data() + size_t(t) * ne;
    int candidates = ne;
    if (cfg_.moe.sigmoidScoring) {
      // DeepseekV3: sigmoid scores; the correction bias steers the choice only. The best
      // topkGroups groups (by the sum of each one's 2 best choice scores) hold the candidates.
      for (int e = 0; e < ne; ++e) {
        p[e] = 1.0 / (1.0 + std::exp(-double(row[e])));
        choice[e] = p[e] + (w.routerBias.empty() ? 0.0 : double(w.routerBias.data()[e]));
      }
      const int G = cfg_.moe.numGroups, per = ne / G;
      for (int g = 0; g < G; ++g) {
        double a = -INFINITY, b = -INFINITY;
        for (int e = g * per; e < (g + 1) * per; ++e) {
          if (choice[e] > a) {
            b = a;
            a = choice[e];
          } else if (choice[e] > b) {
            b = choice[e];
          }
        }
        groupScore[g] = a + b;
      }
      std::iota(groups.begin(), groups.end(), 0);
      std::partial_sort(groups.begin(), groups.begin() + cfg_.moe.topkGroups, groups.end(), [&](int a, int b) {
        return groupScore[a] > groupScore[b] || (groupScore[a] == groupScore[b] && a < b);
      });
      std::sort(groups.begin(), groups.begin() + cfg_.moe.topkGroups);
      candidates = 0;
      for (int i = 0; i < cfg_.moe.topkGroups; ++i)
        for (int e = groups[i] * per; e < (groups[i] + 1) * per; ++e) ids[candidates++] = e;
    } else {
      // Softmax over every expert.
      const double mx = *std::max_element(row, row + ne);
      double sum = 0;
      for (int e = 0; e < ne; ++e) sum += p[e] = std::exp(double(row[e]) - mx);
      for (int e = 0; e < ne; ++e) choice[e] = p[e] /= sum;
      std::iota(ids.begin(), ids.end(), 0);
    }
    std::partial_sort(ids.begin(), ids.begin() + k, ids.begin() + candidates,
                      [&](int a, int b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
    double kept = 0;
    for (int j = 0; j < k; ++j) kept += p[ids[j]];
    // DeepseekV3 renormalises only when k > 1, with a 1e-20 floor in the denominator.
    if (cfg_.moe.sigmoidScoring) kept += 1e-20;
    const bool norm = cfg_.moe.normTopkProb && !(cfg_.moe.sigmoidScoring && k == 1);
    for (int j = 0; j < k; ++j) {
      chosen_[size_t(t) * k + j] = ids[j];
      weights_[size_t(t) * k + j] = float((norm ? p[ids[j]] / kept : p[ids[j]]) * cfg_.moe.routedScalingFactor);
      ++rowsPerExpert_[ids[j]];
    }
  }

  // Group (token, slot) pairs by expert, tokens ascending within each.
  std::vector<int> start(ne + 1, 0);
  for (int e = 0; e < ne; ++e) start[e + 1] = start[e] + rowsPerExpert_[e];
  order_.resize(size_t(T) * k);
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) order_[fill[chosen_[size_t(t) * k + j]]++] = t * k + j;
  }

  // Every routed row gathered once, grouped by expert: [T*k][hidden]; then the chosen experts'
  // gate|up products as one group, SwiGLU over all rows, their down products as one group.
  const size_t R = size_t(T) * k;
  grow(xe_, R * h);
  grow(gu_, R * 2 * ef);
  grow(act_, R * ef);
  grow(ye_, R * h);
  for (size_t r = 0; r < R; ++r) {
    const float* src = xn + size_t(order_[r] / k) * h;
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
  for (size_t r = 0; r < R; ++r) {
    const float g = weights_[order_[r]];
    float* dst = x + size_t(order_[r] / k) * h;
    const float* y = ye_.data() + r * h;
    for (int i = 0; i < h; ++i) dst[i] += g * y[i];
  }
  if (sf > 0)
    for (size_t i = 0; i < size_t(T) * h; ++i) x[i] += sy_[i];
}

}  // namespace pd::engine
