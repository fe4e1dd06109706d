#include "common/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace pd::engine {
namespace {

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Per-thread scratch, so a 128k vocabulary costs no allocation per token.
struct Scratch {
  std::vector<int32_t> idx;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// (logit descending, id ascending): the one order every mask and tie-break uses.
struct ByLogitDesc {
  const float* l;
  bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

// Inverse-CDF draw over `ids` (in the given order) with weights exp((l - lmax) / T).
int32_t drawFrom(const float* logits, const int32_t* ids, size_t n, float lmax, float invT,
                 double u) {
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += std::exp((logits[ids[i]] - lmax) * invT);
  const double target = u * total;
  double acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += std::exp((logits[ids[i]] - lmax) * invT);
    if (acc > target) return ids[i];
  }
  return ids[n - 1];  // rounding left target at the very top
}

// Length of the shortest prefix of `sorted` whose mass reaches `topP` of `total`.
size_t nucleusLength(const float* logits, const int32_t* sorted, size_t n, float lmax,
                     float invT, double total, float topP) {
  const double limit = double(topP) * total;
  double before = 0;
  for (size_t i = 0; i < n; ++i) {
    if (before >= limit) return std::max<size_t>(i, 1);
    before += std::exp((logits[sorted[i]] - lmax) * invT);
  }
  return n;
}

}  // namespace

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return invalidArgument("sampling: temperature " + std::to_string(temperature) +
                           " must be a finite number >= 0");
  }
  if (!(topP > 0.0f && topP <= 1.0f)) {
    return invalidArgument("sampling: top_p " + std::to_string(topP) + " must be in (0, 1]");
  }
  if (!(minP >= 0.0f && minP <= 1.0f)) {
    return invalidArgument("sampling: min_p " + std::to_string(minP) + " must be in [0, 1]");
  }
  if (logprobs < 0 || logprobs > kMaxLogprobs) {
    return invalidArgument("sampling: logprobs " + std::to_string(logprobs) +
                           " must be in [0, " + std::to_string(kMaxLogprobs) + "]");
  }
  if (maxTokens < 1) {
    return invalidArgument("sampling: max_tokens " + std::to_string(maxTokens) +
                           " must be at least 1");
  }
  for (int32_t id : stopTokenIds) {
    if (id < 0) {
      return invalidArgument("sampling: stop token id " + std::to_string(id) +
                             " must be >= 0");
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

SampledToken sample(const float* logits, int vocab, const SamplingParams& params,
                    uint64_t step) {
  SampledToken out;
  int32_t argmax = 0;
  float lmax = logits[0];
  for (int i = 1; i < vocab; ++i) {
    if (logits[i] > lmax) {
      lmax = logits[i];
      argmax = i;
    }
  }
  if (!std::isfinite(lmax)) {  // everything masked: nothing meaningful to draw
    out.id = argmax;
    out.logprob = -std::numeric_limits<float>::infinity();
    return out;
  }
  double sumRaw = 0;
  for (int i = 0; i < vocab; ++i) sumRaw += std::exp(logits[i] - lmax);
  const float lse = lmax + float(std::log(sumRaw));

  int32_t chosen = argmax;
  if (!params.greedy()) {
    const float temp = params.temperature;
    const float invT = 1.0f / temp;
    const double u = samplingUniform(params.seed ? *params.seed : randomSeed(), step);
    // min-p in logit terms: p_i >= minP * p_max  <=>  l_i >= lmax + T * log(minP).
    const float cut = params.minP > 0.0f ? lmax + temp * std::log(params.minP)
                                         : -std::numeric_limits<float>::infinity();
    std::vector<int32_t>& idx = scratch().idx;
    idx.clear();
    for (int i = 0; i < vocab; ++i) {
      if (logits[i] >= cut && logits[i] > -std::numeric_limits<float>::infinity()) {
        idx.push_back(i);
      }
    }
    size_t n = idx.size();
    const ByLogitDesc cmp{logits};
    const bool topK = params.topK > 0 && size_t(params.topK) < n;
    const bool topP = params.topP < 1.0f;
    if (topK) {
      // Partial selection: O(V) to find the k best, then sort only those k.
      std::nth_element(idx.begin(), idx.begin() + params.topK, idx.begin() + long(n), cmp);
      n = size_t(params.topK);
      std::sort(idx.begin(), idx.begin() + long(n), cmp);
      if (topP) {
        double total = 0;
        for (size_t i = 0; i < n; ++i) total += std::exp((logits[idx[i]] - lmax) * invT);
        n = nucleusLength(logits, idx.data(), n, lmax, invT, total, params.topP);
      }
    } else if (topP) {
      double total = 0;
      for (size_t i = 0; i < n; ++i) total += std::exp((logits[idx[i]] - lmax) * invT);
      // Sort only as far as the nucleus reaches: grow the sorted head until its mass
      // covers top_p (a peaked distribution needs a few dozen tokens, not 128k).
      size_t m = std::min<size_t>(n, 64);
      for (;;) {
        std::partial_sort(idx.begin(), idx.begin() + long(m), idx.begin() + long(n), cmp);
        double head = 0;
        for (size_t i = 0; i < m; ++i) head += std::exp((logits[idx[i]] - lmax) * invT);
        if (head >= double(params.topP) * total || m == n) break;
        m = std::min(n, m * 8);
      }
      n = nucleusLength(logits, idx.data(), m, lmax, invT, total, params.topP);
    } else if (params.topK > 0) {
      // top-k covering everything eligible: still draw in sorted order for a stable CDF.
      std::sort(idx.begin(), idx.begin() + long(n), cmp);
    }
    chosen = drawFrom(logits, idx.data(), n, lmax, invT, u);
  }
  out.id = chosen;
  out.logprob = logits[chosen] - lse;

  if (params.logprobs > 0) {
    // One pass keeping the best n in a small sorted array (n <= 20).
    const size_t want = std::min<size_t>(size_t(params.logprobs), size_t(vocab));
    const ByLogitDesc cmp{logits};
    std::vector<int32_t> best;
    best.reserve(want + 1);
    for (int32_t i = 0; i < vocab; ++i) {
      if (best.size() == want && !cmp(i, best.back())) continue;
      best.insert(std::upper_bound(best.begin(), best.end(), i, cmp), i);
      if (best.size() > want) best.pop_back();
    }
    out.topLogprobs.reserve(best.size());
    for (int32_t id : best) out.topLogprobs.emplace_back(id, logits[id] - lse);
  }
  return out;
}

}  // namespace pd::engine
