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

#include "engine/model_config.h"

namespace pd::engine {

// logits: [T][numExperts] f32; routerBias: [numExperts] or null (sigmoid scoring only).
// Writes chosen[T][expertsPerToken] (expert ids, best first) and weights[T][expertsPerToken].
void routeMoeTokens(const MoeConfig& moe, const float* logits, int T, const float* routerBias, int* chosen,
                    float* weights);

}  // namespace pd::engine
