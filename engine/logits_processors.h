// Logits processors (OpenAI's presence/frequency penalties, vLLM's repetition penalty,
// logit_bias, min_tokens): the per-request edits of one row of model logits made before the
// sampler (sampling.h) sees it, so before temperature, the masks and greedy's argmax.
//
// Definitions and order (vLLM V1's sampler, docs/engine_core.md "Sampling"), for a row of
// logits l, the request's output tokens O (counted: c[t] = occurrences of t in O) and its
// prompt P:
//   1. min_tokens: while |O| < min_tokens, l[t] = -inf for every t in stop_token_ids and for
//      the EOS token (unless ignore_eos: EOS does not stop such a request anyway);
//   2. logit_bias: l[t] += bias[t];
//   3. repetition_penalty r: for t in P or O, l[t] = l[t] > 0 ? l[t] / r : l[t] * r;
//   4. frequency f and presence p: l[t] -= f * c[t] + p * (c[t] > 0).
// Every step is a pure function of (logits, params, tokens), so the prefill worker (token 0)
// and the decode worker (tokens 1..n) edit the same logits the same way as a colocated run.
//
// Threads: reentrant; per-thread scratch buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/constraint/constraint.h"
#include "engine/sampling.h"

namespace pd::engine {

// A constrained request's mask at this step (common/constraint/constraint.h), applied after
// the processors (so before temperature, the masks and greedy's argmax): a token outside
// `allowed` gets -inf; EOS and stop_token_ids keep their logits only where `canEnd` (the
// constrained text is complete there) and EOS never under ignore_eos (it would not end the
// output, and no constrained text contains it).
struct ConstraintRow {
  const constraint::TokenMask* allowed = nullptr;
  bool canEnd = false;
};
// Applies `c` to `vocab` logits. Some token is left unless c.allowed->count == 0 and not
// c.canEnd (the caller checks: the vocabulary cannot continue the text).
void applyConstraint(float* logits, int vocab, const ConstraintRow& c, const SamplingParams& params,
                     int32_t eosTokenId);

// Edits `vocab` logits in place. tokens: the request's prompt then its output; output
// starts at outputStart (<= tokens.size()). Ids outside [0, vocab) are skipped.
// eosTokenId < 0: none.
void applyLogitsProcessors(float* logits, int vocab, const SamplingParams& params, std::span<const int32_t> tokens,
                           size_t outputStart, int32_t eosTokenId);

// sample() for a row whose processors are on (params.processesLogits()): samples from the
// processed (and, with `constraint`, masked) logits, and reports the logprobs of the raw distribution (the unedited
// row), as sample() does without processors. `logits` is left unchanged.
SampledToken sampleWithProcessors(const float* logits, int vocab, const SamplingParams& params, uint64_t step,
                                  std::span<const int32_t> tokens, size_t outputStart, int32_t eosTokenId,
                                  const ConstraintRow* constraint = nullptr);

}  // namespace pd::engine
