// Logits processing and sampling over a batch of rows: temperature, min-p, top-k, top-p
// (vLLM's order), a caller-given uniform draw per row, the raw logprob of the chosen token
// and the top-N raw logprobs. The CPU twin is here; the CUDA twin (pd/kernels/cuda/
// sampling.h) has the same signature plus a stream and returns the same tokens bit for bit.
// pd::engine::sample() (engine/sampling.h) is this function on one row.
//
// Definition (what both twins compute; the implementations differ, the results do not):
//   key(i)  = (logit i descending, id ascending) packed in a unique integer (sampling_math.h)
//   raw     = log-softmax of the logits; logprob(i) = logit_i - lmax - log(sum_j q1_j / 2^40)
//             with q1_j the fixed-point mass of exp(logit_j - lmax).
//   greedy (temperature < kSamplingGreedyTemperature): the token of the largest key.
//   else    w_i = exp((logit_i - lmax) / T) (bit-exact polynomial), q_i = round(w_i * 2^40)
//           D  = { i : q_i > 0 and w_i >= minP }                          (min-p)
//           D' = the topK largest keys of D (all of D when topK <= 0, >= vocab or >= |D|)
//           F  = the largest keys of D' whose mass strictly before them (in key order) is
//                below ceil(topP * mass(D')): the smallest prefix reaching top_p, never
//                empty (F = D' when topP >= 1)
//           token = the first id, in ascending id order over F, whose running mass exceeds
//                   floor(u * mass(F)) -- an inverse CDF in id order.
// Masses are 64-bit integers, so every sum is exact and order-free: the CPU and GPU agree
// exactly for the same logits and u, and a GPU run is deterministic. Tokens lighter than
// 2^-41 of the most likely one (q = 0) are never drawn.
// Rows whose logits are all -inf return the lowest id with logprob -inf.
//
// Preconditions (unchecked: validate before calling): 1 <= vocab < 2^23, logits finite or
// -inf, temperature finite >= 0, topP in (0, 1], minP in [0, 1], u in [0, 1),
// 0 <= topN <= min(kSamplingMaxTopN, vocab).
// Threads: reentrant (per-thread scratch); rows are independent.
#pragma once

#include <cstdint>

namespace pd::kernels {

inline constexpr int kSamplingMaxTopN = 20;
// Temperatures below this are greedy (as pd::engine::kGreedyTemperature; checked there).
inline constexpr float kSamplingGreedyTemperature = 1e-5f;

struct SampleRowParams {
  float temperature = 1.0f;
  int32_t topK = 0;   // <= 0 or >= vocab: off
  float topP = 1.0f;  // 1: off
  float minP = 0.0f;  // 0: off
  double u = 0.0;     // the row's uniform draw (pd::engine::samplingUniform(seed, step))
};

}  // namespace pd::kernels

namespace pd::kernels::cpu {

// logits: [rows][logitsStride] f32 (vocab used per row), params: [rows],
// ids: [rows], logprobs: [rows] (raw logprob of ids[r]),
// topIds, topLogprobs: [rows][topN] (the topN largest keys, best first, with raw logprobs);
// may be null when topN == 0.
void sampleRows(const float* logits, int logitsStride, int rows, int vocab, const SampleRowParams* params, int topN,
                int32_t* ids, float* logprobs, int32_t* topIds, float* topLogprobs);

}  // namespace pd::kernels::cpu
