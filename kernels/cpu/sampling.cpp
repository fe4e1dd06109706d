// CPU twin of the sampler (pd/kernels/sampling.h). Same sets and draw order as the CUDA
// kernel, found the way a CPU does it fast: a bounded heap for top-k, a histogram of the
// tempered distance for top-p (only the bucket where the mass crosses top_p is sorted), and
// a single id-order walk for the draw. The CUDA kernel finds the same sets by radix selection
// on the keys; masses are exact integers, so both select the same tokens.
// Compiled with -ffp-contract=off (kernels/CMakeLists.txt): see sampling_math.h.
#include "pd/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <vector>

#include "pd/kernels/sampling_math.h"

namespace pd::kernels::cpu {
namespace {

using namespace sampling_math;

constexpr int kLanes = 16;  // independent accumulators: lets the compiler vectorise

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

// w[i] = tokenWeight(x[i]); returns the sum of the fixed-point masses of all of them.
uint64_t weightsAndMass(const float* x, int n, float lmax, float invT, float* w) {
  for (int i = 0; i < n; ++i) w[i] = tokenWeight(x[i], lmax, invT);
  uint64_t acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += fixedMass(w[i + j]);
  }
  uint64_t total = 0;
  for (; i < n; ++i) total += fixedMass(w[i]);
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

// The mass of the min-p set D = { w > 2^-41 and w >= minP }.
uint64_t keptMass(const float* w, int n, float minW) {
  uint64_t acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float x = w[i + j];
      acc[j] += x >= minW ? fixedMass(x) : 0;  // fixedMass is 0 at and below 2^-41
    }
  }
  uint64_t total = 0;
  for (; i < n; ++i) total += w[i] >= minW ? fixedMass(w[i]) : 0;
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

inline bool inMinP(float w, float minW) { return w > kMinKeptWeight && w >= minW; }

// The key order (orderKey(a) > orderKey(b)) in float comparisons, cheaper in the hot loops:
// the same for finite and -inf logits (orderKey folds -0 into +0 as == does).
struct Better {
  const float* l;
  bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

struct Scratch {
  std::vector<float> w;
  std::vector<int32_t> idx;
  std::vector<uint64_t> keys;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The k largest keys of D, sorted best first, into idx. A bounded heap: one comparison per
// token for the common case of small k.
void selectTopK(const float* logits, const float* w, int vocab, float minW, size_t k, std::vector<int32_t>& idx) {
  const Better better{logits};
  idx.clear();
  for (int32_t i = 0; i < vocab; ++i) {
    if (!inMinP(w[i], minW)) continue;
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

// top-p without top-k: the nucleus F of D (the largest keys whose mass strictly before them
// is below ceil(topP * mass(D))) into idx in ascending id order; returns F's mass.
// Buckets D by the tempered distance d = (lmax - logit) / T in 1/32 steps: d is monotone in
// the logit, so every token of a bucket before the one where the running mass reaches the
// limit has a larger key than every token of that bucket and after (and is in F). Only the
// crossing bucket is sorted.
uint64_t nucleus(const float* logits, const float* w, int vocab, float minW, float lmax, float invT, float topP,
                 std::vector<int32_t>& idx, std::vector<uint64_t>& keys) {
  constexpr int kBuckets = 1024;
  auto bucketOf = [lmax, invT](float logit) {
    const float d = fmul(fmul(fsub(lmax, logit), invT), 32.0f);
    return d < float(kBuckets - 1) ? int(d) : kBuckets - 1;
  };
  uint64_t mass[kBuckets] = {};
  uint64_t total = 0;
  for (int i = 0; i < vocab; ++i) {
    if (!inMinP(w[i], minW)) continue;
    const uint64_t q = fixedMass(w[i]);
    mass[bucketOf(logits[i])] += q;
    total += q;
  }
  const uint64_t limit = nucleusLimit(topP, total);
  uint64_t before = 0;
  int cross = 0;
  for (; cross < kBuckets - 1; ++cross) {
    if (before + mass[cross] >= limit) break;
    before += mass[cross];
  }
  idx.clear();
  keys.clear();
  for (int32_t i = 0; i < vocab; ++i) {
    if (!inMinP(w[i], minW)) continue;
    const int b = bucketOf(logits[i]);
    if (b < cross) {
      idx.push_back(i);
    } else if (b == cross) {
      keys.push_back(orderKey(logits[i], i));
    }
  }
  std::sort(keys.begin(), keys.end(), std::greater<>());
  const size_t wholeBuckets = idx.size();
  for (uint64_t k : keys) {
    if (before >= limit) break;
    idx.push_back(keyId(k));
    before += fixedMass(w[keyId(k)]);
  }
  std::sort(idx.begin() + std::ptrdiff_t(wholeBuckets), idx.end());
  std::inplace_merge(idx.begin(), idx.begin() + std::ptrdiff_t(wholeBuckets), idx.end());
  return before;
}

// Inverse CDF over ids (ascending) with masses q(w[id]); mass is their total.
int32_t drawFrom(const float* w, const std::vector<int32_t>& ids, size_t n, uint64_t mass, double u, int32_t fallback) {
  const uint64_t target = drawTarget(u, mass);
  uint64_t acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += fixedMass(w[ids[i]]);
    if (acc > target) return ids[i];
  }
  return fallback;  // unreachable: the masses sum to `mass` > target
}

void sampleRow(const float* logits, int vocab, const SampleRowParams& p, int topN, int32_t* idOut, float* logprobOut,
               int32_t* topIds, float* topLogprobs) {
  const float lmax = maxOf(logits, vocab);
  const int32_t argmax = int32_t(std::find(logits, logits + vocab, lmax) - logits);
  Scratch& sc = scratch();
  sc.w.resize(size_t(vocab));
  float* w = sc.w.data();

  float lse = std::numeric_limits<float>::infinity();  // every logprob -inf when all masked
  int32_t chosen = argmax < vocab ? argmax : 0;
  if (lmax > -std::numeric_limits<float>::infinity()) {
    const uint64_t raw = weightsAndMass(logits, vocab, lmax, 1.0f, w);
    lse = lmax + float(std::log(double(raw) * 0x1p-40));
    if (p.temperature >= kSamplingGreedyTemperature) {
      const float invT = 1.0f / p.temperature;
      const uint64_t tempered = invT != 1.0f ? weightsAndMass(logits, vocab, lmax, invT, w) : raw;
      const float minW = p.minP;
      const bool topK = p.topK > 0 && p.topK < vocab;
      const bool topP = p.topP < 1.0f;
      std::vector<int32_t>& idx = sc.idx;
      if (!topK && !topP) {
        // No ordering needed: walk the ids once.
        // keptMass with minP 0 is the tempered total (q is 0 wherever w <= 2^-41).
        const uint64_t target = drawTarget(p.u, minW > 0.0f ? keptMass(w, vocab, minW) : tempered);
        uint64_t acc = 0;
        for (int32_t i = 0; i < vocab; ++i) {
          if (!inMinP(w[i], minW)) continue;
          acc += fixedMass(w[i]);
          if (acc > target) {
            chosen = i;
            break;
          }
        }
      } else if (topK) {
        selectTopK(logits, w, vocab, minW, size_t(p.topK), idx);
        size_t n = idx.size();
        uint64_t mass = 0;
        for (size_t i = 0; i < n; ++i) mass += fixedMass(w[idx[i]]);
        if (topP) {
          const uint64_t limit = nucleusLimit(p.topP, mass);
          uint64_t before = 0;
          size_t m = 0;
          while (m < n && before < limit) before += fixedMass(w[idx[m++]]);
          n = m;
          mass = before;
        }
        std::sort(idx.begin(), idx.begin() + std::ptrdiff_t(n));  // the draw walks ids ascending
        chosen = drawFrom(w, idx, n, mass, p.u, chosen);
      } else {
        const uint64_t mass = nucleus(logits, w, vocab, minW, lmax, invT, p.topP, idx, sc.keys);
        chosen = drawFrom(w, idx, idx.size(), mass, p.u, chosen);
      }
    }
  }
  *idOut = chosen;
  *logprobOut = logits[chosen] - lse;

  if (topN > 0) {
    // One pass keeping the best n in a small sorted array (n <= 20).
    const size_t want = size_t(std::min(topN, vocab));
    const Better better{logits};
    int32_t best[kSamplingMaxTopN + 1];
    size_t have = 0;
    for (int32_t i = 0; i < vocab; ++i) {
      if (have == want && !(logits[i] > logits[best[have - 1]])) continue;  // ties keep the lower id
      const size_t pos = size_t(std::upper_bound(best, best + have, i, better) - best);
      for (size_t j = have < want ? have : want - 1; j > pos; --j) best[j] = best[j - 1];
      best[pos] = i;
      if (have < want) ++have;
    }
    for (size_t j = 0; j < want; ++j) {
      topIds[j] = best[j];
      topLogprobs[j] = logits[best[j]] - lse;
    }
  }
}

}  // namespace

void sampleRows(const float* logits, int logitsStride, int rows, int vocab, const SampleRowParams* params, int topN,
                int32_t* ids, float* logprobs, int32_t* topIds, float* topLogprobs) {
  for (int r = 0; r < rows; ++r) {
    sampleRow(logits + size_t(r) * size_t(logitsStride), vocab, params[r], topN, ids + r, logprobs + r,
              topN > 0 ? topIds + size_t(r) * size_t(topN) : nullptr,
              topN > 0 ? topLogprobs + size_t(r) * size_t(topN) : nullptr);
  }
}

}  // namespace pd::kernels::cpu
