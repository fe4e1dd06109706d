// Mixture-of-experts routing (docs/models.md): which experts each token runs and with what
// weight, from the router logits. One definition for every backend, so the CPU and CUDA
// backends pick the same experts for the same logits.
//
// Softmax scoring (Mixtral, Qwen3-MoE): softmax over every expert, the top expertsPerToken
// (ties to the lower expert id), weights renormalised to sum 1 when normTopkProb.
// Sigmoid scoring (DeepseekV3, moe.sigmoidScoring): sigmoid scores, the correction bias added
// for the choice only, the top k inside the best topkGroups of numGroups groups (a group
// scores the sum of its 2 best choice scores), weights renormalised (k > 1, 1e-20 floor) when
// normTopkProb, times routedScalingFactor. Scores are formed in double so the top-k order
// does not hinge on f32 rounding.
//
// Pure host function; any thread (no shared state).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/model_config.h"

namespace pd::engine {

// logits: [T][numExperts] f32; routerBias: [numExperts] or null (sigmoid scoring only).
// Writes chosen[T][expertsPerToken] (expert ids, best first) and weights[T][expertsPerToken].
void routeMoeTokens(const MoeConfig& moe, const float* logits, int T, const float* routerBias, int* chosen,
                    float* weights);

// A step's routed rows grouped by expert, as both backends run them: experts ascending, tokens
// ascending within each. Row r of the grouped matrix is token srcRows[r]; expert e owns rows
// [start[e], start[e+1]) (rowsPerExpert[e] of them). Each token's k slots as rows of that
// matrix in ascending order -- ascending expert, the order in which both backends add the
// experts' outputs to the residual -- with their routing weights.
struct MoeRowPlan {
  std::vector<int> rowsPerExpert;  // [numExperts]
  std::vector<int> start;          // [numExperts + 1]
  std::vector<int32_t> srcRows;    // [T*k]
  std::vector<int32_t> slotRows;   // [T][k]
  std::vector<float> slotWeights;  // [T][k]
};
// chosen, weights: [T][k] as routeMoeTokens writes them (a token's k experts distinct).
void planMoeRows(const int* chosen, const float* weights, int T, int k, int numExperts, MoeRowPlan* plan);

}  // namespace pd::engine
