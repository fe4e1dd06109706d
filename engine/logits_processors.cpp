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

void applyConstraint(float* logits, int vocab, const ConstraintRow& c, const SamplingParams& params,
                     int32_t eosTokenId) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const auto inVocab = [vocab](int32_t t) { return t >= 0 && t < vocab; };
  // The ends (EOS unless ignore_eos, and the stop ids) end the output whatever the mask
  // says: they keep their logits exactly where the constrained text is complete.
  std::vector<std::pair<int32_t, float>> ends;
  if (!params.ignoreEos && inVocab(eosTokenId)) ends.emplace_back(eosTokenId, logits[eosTokenId]);
  for (int32_t t : params.stopTokenIds)
    if (inVocab(t)) ends.emplace_back(t, logits[t]);
  const auto& words = c.allowed->words;
  // A word at a time: most words of a mask are all-allowed or all-masked.
  for (int base = 0; base < vocab; base += 64) {
    const size_t w = size_t(base) >> 6;
    const uint64_t bits = w < words.size() ? words[w] : 0;
    const int n = std::min(64, vocab - base);
    if (bits == ~uint64_t(0) && n == 64) continue;
    if (bits == 0) {
      std::fill_n(logits + base, n, kMasked);
      continue;
    }
    for (int k = 0; k < n; ++k)
      if (!((bits >> k) & 1)) logits[base + k] = kMasked;
  }
  for (const auto& [t, l] : ends) logits[t] = c.canEnd ? l : kMasked;
}

SampledToken sampleWithProcessors(const float* logits, int vocab, const SamplingParams& params, uint64_t step,
                                  std::span<const int32_t> tokens, size_t outputStart, int32_t eosTokenId,
                                  const ConstraintRow* constraint) {
  Scratch& s = scratch();
  s.row.assign(logits, logits + vocab);
  applyLogitsProcessors(s.row.data(), vocab, params, tokens, outputStart, eosTokenId);
  if (constraint) applyConstraint(s.row.data(), vocab, *constraint, params, eosTokenId);
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
