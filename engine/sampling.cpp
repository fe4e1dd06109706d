#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "common/base/hash.h"
#include "pd/kernels/sampling.h"

namespace pd::engine {
namespace {

static_assert(kGreedyTemperature == pd::kernels::kSamplingGreedyTemperature);
static_assert(kMaxLogprobs <= pd::kernels::kSamplingMaxTopN);

}  // namespace

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return invalidArgument("sampling: temperature " + std::to_string(temperature) + " must be a finite number >= 0");
  }
  if (!(topP > 0.0f && topP <= 1.0f)) {
    return invalidArgument("sampling: top_p " + std::to_string(topP) + " must be in (0, 1]");
  }
  if (!(minP >= 0.0f && minP <= 1.0f)) {
    return invalidArgument("sampling: min_p " + std::to_string(minP) + " must be in [0, 1]");
  }
  if (logprobs < 0 || logprobs > kMaxLogprobs) {
    return invalidArgument("sampling: logprobs " + std::to_string(logprobs) + " must be in [0, " +
                           std::to_string(kMaxLogprobs) + "]");
  }
  if (maxTokens < 1) {
    return invalidArgument("sampling: max_tokens " + std::to_string(maxTokens) + " must be at least 1");
  }
  if (!(presencePenalty >= -2.0f && presencePenalty <= 2.0f)) {
    return invalidArgument("sampling: presence_penalty " + std::to_string(presencePenalty) + " must be in [-2, 2]");
  }
  if (!(frequencyPenalty >= -2.0f && frequencyPenalty <= 2.0f)) {
    return invalidArgument("sampling: frequency_penalty " + std::to_string(frequencyPenalty) + " must be in [-2, 2]");
  }
  if (!(repetitionPenalty > 0.0f && repetitionPenalty <= 2.0f)) {
    return invalidArgument("sampling: repetition_penalty " + std::to_string(repetitionPenalty) + " must be in (0, 2]");
  }
  if (logitBias.size() > size_t(kMaxLogitBias)) {
    return invalidArgument("sampling: logit_bias has " + std::to_string(logitBias.size()) + " entries, at most " +
                           std::to_string(kMaxLogitBias));
  }
  for (const auto& [id, bias] : logitBias) {
    if (id < 0 || !(bias >= -100.0f && bias <= 100.0f)) {
      return invalidArgument("sampling: logit_bias entry (" + std::to_string(id) + ", " + std::to_string(bias) +
                             ") needs a token id >= 0 and a bias in [-100, 100]");
    }
  }
  if (minTokens < 0 || generatedInPrompt < 0) {
    return invalidArgument("sampling: min_tokens " + std::to_string(minTokens) + " and generated_in_prompt " +
                           std::to_string(generatedInPrompt) + " must be >= 0");
  }
  for (int32_t id : stopTokenIds) {
    if (id < 0) {
      return invalidArgument("sampling: stop token id " + std::to_string(id) + " must be >= 0");
    }
  }
  return Status::ok();
}

double samplingUniform(uint64_t seed, uint64_t step) {
  // Counter-based: a keyed bijective mix of the step, no state carried between draws.
  const uint64_t h = mix64(mix64(seed) ^ (step * 0xD1B54A32D192ED03ULL));
  return double(h >> 11) * 0x1.0p-53;
}

uint64_t randomSeed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ uint64_t(rd());
}

pd::kernels::SampleRowParams rowParams(const SamplingParams& params, uint64_t step) {
  pd::kernels::SampleRowParams p;
  p.temperature = params.temperature;
  p.topK = params.topK;
  p.topP = params.topP;
  p.minP = params.minP;
  if (!params.greedy()) p.u = samplingUniform(params.seed ? *params.seed : randomSeed(), step);
  return p;
}

SampledToken sample(const float* logits, int vocab, const SamplingParams& params, uint64_t step) {
  const pd::kernels::SampleRowParams p = rowParams(params, step);
  const int want = std::min(params.logprobs, vocab);
  int32_t topIds[pd::kernels::kSamplingMaxTopN];
  float topLogprobs[pd::kernels::kSamplingMaxTopN];
  SampledToken out;
  pd::kernels::cpu::sampleRows(logits, vocab, 1, vocab, &p, want, &out.id, &out.logprob, topIds, topLogprobs);
  out.topLogprobs.reserve(size_t(want));
  for (int j = 0; j < want; ++j) out.topLogprobs.emplace_back(topIds[j], topLogprobs[j]);
  return out;
}

}  // namespace pd::engine
