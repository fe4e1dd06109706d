// Token sampling (docs/design.md §4): greedy, temperature, top-k, top-p, min-p, per-request seed,
// logprobs.
//
// Determinism: the random draw for generated token number `step` (0 for the first token)
// is a pure function of (seed, step), made with a counter-based generator. There is no
// shared random state, so a seeded request yields the same tokens whatever batch it runs
// in and whichever process samples it: the prefill worker samples token 0, the decode
// worker tokens 1..n, and the text equals that of a colocated run. Sampling from the same
// logits with the same params and step always returns the same token.
//
// Masks follow vLLM's order: temperature, then min-p (keep tokens with probability >=
// min_p * max probability), top-k, then top-p over what is left, renormalised (the smallest
// set of most likely tokens whose mass reaches top_p; never empty). top-k and top-p keep a
// prefix of the tokens sorted by (logit descending, id ascending), so ties are broken by the
// lower id everywhere. The draw is an inverse CDF over the kept tokens in ascending id order.
//
// The computation is pd::kernels::cpu::sampleRows (kernels/include/pd/kernels/sampling.h,
// which defines it exactly: fixed-point masses, so sums are exact), and the CUDA twin
// pd::kernels::cuda::sampleRows returns the same token for the same logits and draw: a
// backend that samples on the device (CudaBackend::forwardAndSample) agrees with sample().
//
// Logprobs are those of the raw model distribution (log-softmax of the logits before the
// logits processors, temperature and masks), as vLLM returns them by default.
//
// Threads: sample() is reentrant; it keeps per-thread scratch buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/base/status.h"
#include "common/constraint/spec.h"
#include "pd/kernels/sampling.h"

namespace pd::engine {

inline constexpr int kMaxLogprobs = 20;
// logit_bias entries per request at most (the router's limit too; OpenAI documents none).
inline constexpr int kMaxLogitBias = 1024;
// Temperatures below this are greedy (as in vLLM): dividing by them would overflow.
inline constexpr float kGreedyTemperature = 1e-5f;

struct SamplingParams {
  float temperature = 1.0f;           // 0 = greedy
  int topK = 0;                       // <= 0: off
  float topP = 1.0f;                  // in (0, 1]; 1: off
  float minP = 0.0f;                  // in [0, 1]; 0: off
  std::optional<uint64_t> seed;       // unset: Request draws one at creation
  int logprobs = 0;                   // alternatives to return, 0..kMaxLogprobs
  std::vector<int32_t> stopTokenIds;  // generation ends after one of these
  int maxTokens = 16;                 // generated tokens at most (>= 1)
  bool ignoreEos = false;             // keep generating past the model's EOS token

  // Logits processors (engine/logits_processors.h): applied to the model's logits
  // before temperature and the masks, so also before greedy's argmax. All off by default.
  float presencePenalty = 0.0f;                      // [-2, 2] (OpenAI): minus this once per generated token id
  float frequencyPenalty = 0.0f;                     // [-2, 2] (OpenAI): minus this per occurrence in the output
  float repetitionPenalty = 1.0f;                    // (0, 2] (vLLM): over prompt and output ids; 1: off
  std::vector<std::pair<int32_t, float>> logitBias;  // (token id, bias in [-100, 100])
  int minTokens = 0;                                 // EOS and stopTokenIds masked until this many tokens are generated
  // The last `generatedInPrompt` prompt tokens are earlier output of this same request (a
  // request migrated to another worker resumes with its output appended to the prompt):
  // they count as generated for the penalties and min_tokens.
  int generatedInPrompt = 0;
  // Structured output (common/constraint, docs/design.md "Constraint module"): every token
  // sampled keeps the output a prefix of a text the spec accepts. The engine compiles it on
  // submit (Engine::setConstraintVocabulary) and masks each row after the processors.
  constraint::ConstraintSpec constraint;

  bool greedy() const { return temperature < kGreedyTemperature; }
  // Whether any logits processor is on (the row then needs its logits on the host).
  bool processesLogits() const {
    return presencePenalty != 0.0f || frequencyPenalty != 0.0f || repetitionPenalty != 1.0f || !logitBias.empty() ||
           minTokens > 0 || constraint.active();
  }
  // Checks every field's range; names the field and the allowed values.
  Status validate() const;
};

struct SampledToken {
  int32_t id = -1;
  float logprob = 0.0f;  // raw log-softmax of the chosen token
  // The `logprobs` most likely tokens of the raw distribution, most likely first, ties by
  // lower id.
  std::vector<std::pair<int32_t, float>> topLogprobs;
};

// Samples one token from `vocab` logits for generated token number `step`. Greedy when
// params.greedy(); otherwise the seed must be set (Request guarantees it); an unset seed
// falls back to a fresh non-deterministic draw. Preconditions: vocab >= 1, logits finite
// or -inf (masked), params validated.
SampledToken sample(const float* logits, int vocab, const SamplingParams& params, uint64_t step);

// The kernel parameters of one row: the masks and the uniform draw for (seed, step) (a
// fresh seed when unset and not greedy). For backends that sample on the device.
pd::kernels::SampleRowParams rowParams(const SamplingParams& params, uint64_t step);

// The uniform draw in [0, 1) that sample() uses for (seed, step): exposed for tests and
// for backends that sample on the device and must agree with the host.
double samplingUniform(uint64_t seed, uint64_t step);

// A fresh non-deterministic seed (for requests without one).
uint64_t randomSeed();

}  // namespace pd::engine
