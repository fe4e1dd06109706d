#include "common/engine/sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
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

// exp(x) for x <= 0 in straight-line arithmetic (round to nearest by the 1.5 * 2^23 trick,
// a degree-6 polynomial on [-ln2/2, ln2/2], the exponent added into the bits), so loops
// over a 128k vocabulary vectorise. Relative error ~1e-7; x < -87 (including -inf, a masked
// token) gives exactly 0.
inline float expNonPositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = std::bit_cast<int32_t>(p) + (int32_t(k) << 23);
  return x < -87.0f ? 0.0f : std::bit_cast<float>(bits);
}

constexpr int kLanes = 16;  // independent accumulators: lets the compiler vectorise sums

float maxOf(const float* x, int n) {
  float m[kLanes];
  for (int j = 0; j < kLanes; ++j) m[j] = -std::numeric_limits<float>::infinity();
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
  }
  float best = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  for (int j = 0; j < kLanes; ++j) best = m[j] > best ? m[j] : best;
  return best;
}

// w[i] = exp((x[i] - shift) * scale) for all i; returns their sum.
double expAndSum(const float* x, int n, float shift, float scale, float* w) {
  for (int i = 0; i < n; ++i) w[i] = expNonPositive((x[i] - shift) * scale);
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += w[i + j];
  }
  double total = 0;
  for (; i < n; ++i) total += w[i];
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

// Per-thread scratch, so a 128k vocabulary costs no allocation per token.
struct Scratch {
  std::vector<float> w;
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

// Inverse-CDF draw over ids[0..n) in that order, with weights w.
int32_t drawFrom(const float* w, const int32_t* ids, size_t n, double u) {
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += w[ids[i]];
  const double target = u * total;
  double acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += w[ids[i]];
    if (acc > target) return ids[i];
  }
  return ids[n - 1];  // rounding left target at the very top
}

// Length of the shortest prefix of `sorted` whose weight reaches topP of `total`.
size_t nucleusLength(const float* w, const int32_t* sorted, size_t n, double total, float topP) {
  const double limit = double(topP) * total;
  double before = 0;
  for (size_t i = 0; i < n; ++i) {
    if (before >= limit) return std::max<size_t>(i, 1);
    before += w[sorted[i]];
  }
  return n;
}

// The k best of `vocab` tokens by ByLogitDesc among those with w >= minW, sorted, into idx.
// A bounded heap: one comparison per token for the common case of small k.
void selectTopK(const float* logits, const float* w, int vocab, float minW, size_t k,
                std::vector<int32_t>& idx) {
  const ByLogitDesc better{logits};
  idx.clear();
  for (int32_t i = 0; i < vocab; ++i) {
    if (w[i] < minW || w[i] == 0.0f) continue;
    if (idx.size() < k) {
      idx.push_back(i);
      std::push_heap(idx.begin(), idx.end(), better);  // heap top = the worst kept
    } else if (better(i, idx.front())) {
      std::pop_heap(idx.begin(), idx.end(), better);
      idx.back() = i;
      std::push_heap(idx.begin(), idx.end(), better);
    }
  }
  std::sort(idx.begin(), idx.end(), better);
}

// Packs (logit, id) into one integer ordered like ByLogitDesc (larger = better), so big
// sorts compare plain integers instead of chasing indices.
inline uint64_t orderKey(float logit, int32_t id) {
  uint32_t b = std::bit_cast<uint32_t>(logit);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // IEEE order -> unsigned order
  return (uint64_t(b) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(id));
}

// top-p without top-k. Buckets the eligible tokens by the leading bits of their weight (w in
// (0, 1]: exponent and 3 mantissa bits, 1/8-octave buckets). Every token of a bucket above
// the one where the cumulative mass crosses top_p is in the nucleus, so only the crossing
// bucket is sorted. Fills idx with the nucleus (higher buckets in id order, then the
// crossing bucket's prefix in ByLogitDesc order) and returns its size.
size_t nucleusByHistogram(const float* logits, const float* w, int vocab, float minW, float topP,
                          std::vector<int32_t>& idx) {
  constexpr int kBuckets = 1024;  // (exponent <= 127) << 3 | mantissa bits
  double mass[kBuckets] = {};
  auto bucketOf = [](float x) { return int(std::bit_cast<uint32_t>(x) >> 20); };
  double kept = 0;
  for (int i = 0; i < vocab; ++i) {
    if (w[i] < minW || w[i] == 0.0f) continue;
    mass[bucketOf(w[i])] += w[i];
    kept += w[i];
  }
  const double limit = double(topP) * kept;
  double before = 0;
  int cross = kBuckets - 1;
  for (; cross > 0; --cross) {
    if (before + mass[cross] >= limit) break;
    before += mass[cross];
  }
  idx.clear();
  std::vector<uint64_t> keys;
  for (int32_t i = 0; i < vocab; ++i) {
    if (w[i] < minW || w[i] == 0.0f) continue;
    const int b = bucketOf(w[i]);
    if (b > cross) {
      idx.push_back(i);
    } else if (b == cross) {
      keys.push_back(orderKey(logits[i], i));
    }
  }
  std::sort(keys.begin(), keys.end(), std::greater<>());
  for (uint64_t k : keys) {
    if (before >= limit && !idx.empty()) break;
    const int32_t id = int32_t(0xFFFFFFFFu - uint32_t(k & 0xFFFFFFFFu));
    idx.push_back(id);
    before += w[id];
  }
  return idx.size();
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
    return invalidArgument("sampling: logprobs " + std::to_string(logprobs) + " must be in [0, " +
                           std::to_string(kMaxLogprobs) + "]");
  }
  if (maxTokens < 1) {
    return invalidArgument("sampling: max_tokens " + std::to_string(maxTokens) +
                           " must be at least 1");
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

SampledToken sample(const float* logits, int vocab, const SamplingParams& params, uint64_t step) {
  SampledToken out;
  const float lmax = maxOf(logits, vocab);
  const int32_t argmax = int32_t(std::find(logits, logits + vocab, lmax) - logits);
  if (!std::isfinite(lmax)) {  // everything masked (or NaN): nothing meaningful to draw
    out.id = argmax < vocab ? argmax : 0;
    out.logprob = -std::numeric_limits<float>::infinity();
    return out;
  }
  Scratch& sc = scratch();
  sc.w.resize(size_t(vocab));
  float* w = sc.w.data();

  int32_t chosen = argmax;
  double rawTotal = 0;
  if (params.greedy()) {
    rawTotal = expAndSum(logits, vocab, lmax, 1.0f, w);
  } else {
    const float invT = 1.0f / params.temperature;
    // Tempered weights relative to the most likely token: w = p / p_max, in (0, 1].
    const double total = expAndSum(logits, vocab, lmax, invT, w);
    const double u = samplingUniform(params.seed ? *params.seed : randomSeed(), step);
    // min-p keeps p >= min_p * p_max, i.e. w >= min_p.
    const float minW = params.minP;
    const bool topK = params.topK > 0 && params.topK < vocab;
    const bool topP = params.topP < 1.0f;
    std::vector<int32_t>& idx = sc.idx;
    if (!topK && !topP) {
      // No ordering needed: walk the ids once.
      double kept = total;
      if (minW > 0.0f) {
        kept = 0;
        for (int i = 0; i < vocab; ++i) kept += w[i] >= minW ? w[i] : 0.0f;
      }
      const double target = u * kept;
      double acc = 0;
      chosen = argmax;
      for (int i = 0; i < vocab; ++i) {
        if (w[i] < minW || w[i] == 0.0f) continue;
        acc += w[i];
        chosen = i;
        if (acc > target) break;
      }
    } else {
      size_t n;
      if (topK) {
        selectTopK(logits, w, vocab, minW, size_t(params.topK), idx);
        n = idx.size();
        if (topP) {
          double kept = 0;
          for (size_t i = 0; i < n; ++i) kept += w[idx[i]];
          n = nucleusLength(w, idx.data(), n, kept, params.topP);
        }
      } else {
        n = nucleusByHistogram(logits, w, vocab, minW, params.topP, idx);
      }
      chosen = n > 0 ? drawFrom(w, idx.data(), n, u) : argmax;
    }
    rawTotal = params.temperature == 1.0f ? total : expAndSum(logits, vocab, lmax, 1.0f, w);
  }
  const float lse = lmax + float(std::log(rawTotal));
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
