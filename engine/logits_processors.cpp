#include "engine/logits_processors.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "pd/kernels/sampling.h"

namespace pd::engine {
namespace {

struct Scratch {
  std::vector<uint32_t> count;   // [vocab] occurrences in the output
  std::vector<uint8_t> seen;     // [vocab] in the prompt or the output
  std::vector<int32_t> touched;  // ids whose count/seen are set: reset after use
  std::vector<float> row;        // sampleWithProcessors' processed copy
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

void applyLogitsProcessors(float* logits, int vocab, const SamplingParams& p, std::span<const int32_t> tokens,
                           size_t outputStart, int32_t eosTokenId) {
  outputStart = std::min(outputStart, tokens.size());
  const size_t numOutput = tokens.size() - outputStart;
  const auto inVocab = [vocab](int32_t t) { return t >= 0 && t < vocab; };
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  if (numOutput < size_t(std::max(p.minTokens, 0))) {
    for (int32_t t : p.stopTokenIds)
      if (inVocab(t)) logits[t] = kMasked;
    if (!p.ignoreEos && inVocab(eosTokenId)) logits[eosTokenId] = kMasked;
  }
  for (const auto& [t, bias] : p.logitBias)
    if (inVocab(t)) logits[t] += bias;

  const bool repetition = p.repetitionPenalty != 1.0f;
  const bool output = p.frequencyPenalty != 0.0f || p.presencePenalty != 0.0f;
  if (!repetition && !output) return;
  Scratch& s = scratch();
  if (s.count.size() < size_t(vocab)) {
    s.count.assign(size_t(vocab), 0);
    s.seen.assign(size_t(vocab), 0);
  }
  s.touched.clear();
  const auto mark = [&](int32_t t, bool isOutput) {
    if (!inVocab(t)) return;
    if (!s.seen[size_t(t)]) {
      s.seen[size_t(t)] = 1;
      s.touched.push_back(t);
    }
    if (isOutput) ++s.count[size_t(t)];
  };
  for (size_t i = repetition ? 0 : outputStart; i < tokens.size(); ++i) mark(tokens[i], i >= outputStart);
  for (int32_t t : s.touched) {
    float& l = logits[t];
    if (repetition) l = l > 0.0f ? l / p.repetitionPenalty : l * p.repetitionPenalty;
    const uint32_t c = s.count[size_t(t)];
    if (c > 0) l -= p.frequencyPenalty * float(c) + p.presencePenalty;
    s.seen[size_t(t)] = 0;
    s.count[size_t(t)] = 0;
  }
}

SampledToken sampleWithProcessors(const float* logits, int vocab, const SamplingParams& params, uint64_t step,
                                  std::span<const int32_t> tokens, size_t outputStart, int32_t eosTokenId) {
  Scratch& s = scratch();
  s.row.assign(logits, logits + vocab);
  applyLogitsProcessors(s.row.data(), vocab, params, tokens, outputStart, eosTokenId);
  SampledToken out = sample(s.row.data(), vocab, params, step);
  // The raw distribution's logprobs: the greedy pass over the unedited row gives the top-n
  // and lse = l[argmax] - logprob(argmax); the chosen token's is then l[id] - lse.
  SamplingParams raw;
  raw.temperature = 0.0f;
  raw.logprobs = params.logprobs;
  const SampledToken r = sample(logits, vocab, raw, step);
  const float lse = logits[r.id] - r.logprob;
  out.logprob = out.id == r.id ? r.logprob : logits[out.id] - lse;
  out.topLogprobs = r.topLogprobs;
  return out;
}

}  // namespace pd::engine
