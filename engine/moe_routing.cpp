#include "engine/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace pd::engine {

void routeMoeTokens(const MoeConfig& moe, const float* logits, int T, const float* routerBias, int* chosen,
                    float* weights) {
  const int ne = moe.numExperts, k = moe.expertsPerToken;
  // Scores in double (the top-k order must not hinge on rounding); ties to the lower id.
  std::vector<double> p(ne), choice(ne), groupScore(moe.numGroups);
  std::vector<int> ids(ne), groups(moe.numGroups);
  for (int t = 0; t < T; ++t) {
    const float* row = logits + size_t(t) * ne;
    int candidates = ne;
    if (moe.sigmoidScoring) {
      // DeepseekV3: sigmoid scores; the correction bias steers the choice only. The best
      // topkGroups groups (by the sum of each one's 2 best choice scores) hold the candidates.
      for (int e = 0; e < ne; ++e) {
        p[e] = 1.0 / (1.0 + std::exp(-double(row[e])));
        choice[e] = p[e] + (routerBias ? double(routerBias[e]) : 0.0);
      }
      const int G = moe.numGroups, per = ne / G;
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
      std::partial_sort(groups.begin(), groups.begin() + moe.topkGroups, groups.end(), [&](int a, int b) {
        return groupScore[a] > groupScore[b] || (groupScore[a] == groupScore[b] && a < b);
      });
      std::sort(groups.begin(), groups.begin() + moe.topkGroups);
      candidates = 0;
      for (int i = 0; i < moe.topkGroups; ++i)
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
    if (moe.sigmoidScoring) kept += 1e-20;
    const bool norm = moe.normTopkProb && !(moe.sigmoidScoring && k == 1);
    for (int j = 0; j < k; ++j) {
      chosen[size_t(t) * k + j] = ids[j];
      weights[size_t(t) * k + j] = float((norm ? p[ids[j]] / kept : p[ids[j]]) * moe.routedScalingFactor);
    }
  }
}

void planMoeRows(const int* chosen, const float* weights, int T, int k, int numExperts, MoeRowPlan* plan) {
  const size_t R = size_t(T) * size_t(k);
  plan->rowsPerExpert.assign(numExperts, 0);
  for (size_t i = 0; i < R; ++i) ++plan->rowsPerExpert[chosen[i]];
  plan->start.assign(numExperts + 1, 0);
  for (int e = 0; e < numExperts; ++e) plan->start[e + 1] = plan->start[e] + plan->rowsPerExpert[e];
  plan->srcRows.resize(R);
  plan->slotRows.resize(R);
  plan->slotWeights.resize(R);
  std::vector<int> fill(plan->start.begin(), plan->start.end() - 1);
  for (int t = 0; t < T; ++t) {
    int32_t* rows = plan->slotRows.data() + size_t(t) * k;
    float* w = plan->slotWeights.data() + size_t(t) * k;
    for (int j = 0; j < k; ++j) {
      const size_t s = size_t(t) * k + j;
      const int r = fill[chosen[s]]++;
      plan->srcRows[r] = t;
      // Insertion by row: the token's slots end up ascending (k is small).
      int i = j;
      for (; i > 0 && rows[i - 1] > r; --i) {
        rows[i] = rows[i - 1];
        w[i] = w[i - 1];
      }
      rows[i] = r;
      w[i] = weights[s];
    }
  }
}

}  // namespace pd::engine
