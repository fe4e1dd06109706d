// CUDA twin of the sampler (see pd/kernels/cuda/sampling.h and, for the definition,
// pd/kernels/sampling.h). One block per row; every set (min-p, top-k, top-p, top-N) is
// "the tokens of a domain whose key is >= a threshold", and the thresholds are found by a
// radix selection over the 64-bit keys with count and mass histograms in shared memory.
// Integer masses and integer atomics: the result does not depend on thread scheduling.
#include <cmath>

#include "pd/kernels/cuda/sampling.h"
#include "pd/kernels/sampling_math.h"

namespace pd::kernels::cuda {
namespace {

using namespace pd::kernels::sampling_math;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kDigits = kRadixDigits;

struct Shared {
  unsigned long long mass[kDigits];
  unsigned int count[kDigits];
  unsigned long long warpVal[kWarps];
  unsigned long long bcast[3];
  unsigned long long topKeys[kSamplingMaxTopN];
  unsigned int topCount;
  int drawWarp;
};

// The row and what the domain predicates need.
struct Row {
  const float* logits;
  int vocab;
  float lmax;
  float invT;
  float minW;
};

__device__ __forceinline__ unsigned long long warpSum(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned long long warpMax(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long x = __shfl_xor_sync(0xffffffffu, v, o);
    v = x > v ? x : v;
  }
  return v;
}

// Block-wide sum (max when isMax) of one value per thread; every thread gets the result.
__device__ unsigned long long blockReduce(unsigned long long v, bool isMax, Shared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = isMax ? warpMax(v) : warpSum(v);
  if (lane == 0) sh.warpVal[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? sh.warpVal[lane] : 0ULL;
    v = isMax ? warpMax(v) : warpSum(v);
    if (lane == 0) sh.bcast[0] = v;
  }
  __syncthreads();
  const unsigned long long r = sh.bcast[0];
  __syncthreads();  // bcast and warpVal are reused by the next reduction
  return r;
}

// Token i's mass if it is in the min-p set D, else 0 (q = 0 is outside D by definition).
__device__ __forceinline__ unsigned long long minPMass(const Row& r, int i) {
  const float w = tokenWeight(r.logits[i], r.lmax, r.invT);
  return (w > kMinKeptWeight && w >= r.minW) ? fixedMass(w) : 0ULL;
}

struct Selected {
  unsigned long long threshold;  // the set is { i in domain : key(i) >= threshold }
  unsigned long long mass;       // its mass (min-p domains only)
};

// Radix selection of the largest keys of a domain. The domain is D (useMinP) or every token,
// restricted to key >= floorKey. byMass: the smallest prefix (in key order) whose mass
// reaches `need` (need >= 1; all of the domain if its mass is below); else the `need`
// largest keys (all of the domain if it has fewer).
// Each pass histograms the next 8-bit digit of the keys that share the prefix chosen so far;
// the walk from the top digit down finds the bucket where the running total reaches `need`.
// It stops as soon as that bucket is wholly in (count reached exactly, or a single token).
__device__ Selected radixSelect(const Row& r, bool useMinP, unsigned long long floorKey, bool byMass,
                                unsigned long long need, Shared& sh) {
  RadixSelect sel;  // advanced by thread 0 only; the others read the broadcast prefix/shift
  for (;;) {
    for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
      sh.mass[d] = 0;
      sh.count[d] = 0;
    }
    __syncthreads();
    const unsigned long long mask = sel.prefixMask();
    // Warp-uniform trip count, so every lane reaches the warp-wide intrinsics below.
    for (int base = 0; base < r.vocab; base += blockDim.x) {
      const int i = base + int(threadIdx.x);
      int digit = -1;
      unsigned long long q = 0;
      if (i < r.vocab) {
        const unsigned long long key = orderKey(r.logits[i], i);
        if ((key & mask) == sel.prefix && key >= floorKey) {
          q = useMinP ? minPMass(r, i) : 1ULL;
          if (q != 0) digit = sel.digitOf(key);
        }
      }
      // Most tokens share the leading digits: one shared atomic per (warp, digit) instead of
      // one per token. Lanes with the same digit sum their masses exactly (q < 2^41, split
      // into 24 + 17 bits so 32 lanes cannot overflow a 32-bit reduction).
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      const unsigned lo = __reduce_add_sync(peers, unsigned(q & 0xFFFFFFu));
      const unsigned hi = __reduce_add_sync(peers, unsigned(q >> 24));
      const bool leader = int(threadIdx.x % 32) == __ffs(peers) - 1;
      if (digit >= 0 && leader) {
        atomicAdd(&sh.count[digit], unsigned(__popc(peers)));
        if (useMinP) atomicAdd(&sh.mass[digit], (static_cast<unsigned long long>(hi) << 24) + lo);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      sel.step(sh.mass, sh.count, byMass, need, floorKey);
      sh.bcast[0] = sel.done ? 1ULL : 0ULL;
      sh.bcast[1] = sel.done ? sel.threshold : sel.prefix;
      sh.bcast[2] = sel.done ? sel.mass : static_cast<unsigned long long>(sel.shift);
    }
    __syncthreads();
    const bool done = sh.bcast[0] != 0;
    const Selected s{sh.bcast[1], sh.bcast[2]};
    if (!done) {
      sel.prefix = sh.bcast[1];
      sel.shift = int(sh.bcast[2]);
    }
    __syncthreads();  // the histograms and bcast are rewritten next
    if (done) return s;
  }
}

// Inverse CDF in ascending id order over { i in D : key(i) >= floorKey } (mass `total`).
// Warp w owns a contiguous id range; thread 0 finds the warp whose range holds the target,
// that warp scans its range 32 ids at a time.
__device__ int drawInIdOrder(const Row& r, unsigned long long floorKey, unsigned long long target, Shared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = ((r.vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int begin = warp * chunk;
  const int end = min(begin + chunk, r.vocab);
  auto massOf = [&](int i) -> unsigned long long {
    if (i >= end || orderKey(r.logits[i], i) < floorKey) return 0ULL;
    return minPMass(r, i);
  };
  unsigned long long sum = 0;
  for (int i = begin + lane; i < end; i += 32) sum += massOf(i);
  sum = warpSum(sum);
  if (lane == 0) sh.warpVal[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long acc = 0;
    int sel = kWarps - 1;
    for (int w = 0; w < kWarps; ++w) {
      if (acc + sh.warpVal[w] > target) {
        sel = w;
        break;
      }
      acc += sh.warpVal[w];
    }
    sh.drawWarp = sel;
    sh.bcast[0] = target - acc;
    sh.bcast[1] = 0;  // chosen id (set below)
  }
  __syncthreads();
  if (warp == sh.drawWarp) {
    const unsigned long long local = sh.bcast[0];
    unsigned long long base = 0;
    for (int start = begin; start < end; start += 32) {
      const int i = start + lane;
      unsigned long long incl = massOf(i);
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
      }
      const unsigned int hit = __ballot_sync(0xffffffffu, base + incl > local);
      if (hit != 0) {
        if (lane == 0) sh.bcast[1] = static_cast<unsigned long long>(start + __ffs(hit) - 1);
        break;
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  const int id = int(sh.bcast[1]);
  __syncthreads();
  return id;
}

// Launch: grid = rows, block = kThreads; one block samples one row.
__global__ void __launch_bounds__(kThreads)
    sampleRowsKernel(const float* __restrict__ logits, int logitsStride, int vocab,
                     const SampleRowParams* __restrict__ params, int topN, int32_t* ids, float* logprobs,
                     int32_t* topIds, float* topLogprobs) {
  __shared__ Shared sh;
  const float* l = logits + size_t(blockIdx.x) * size_t(logitsStride);
  const SampleRowParams p = params[blockIdx.x];

  unsigned long long best = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const unsigned long long k = orderKey(l[i], i);
    best = k > best ? k : best;
  }
  best = blockReduce(best, /*isMax=*/true, sh);
  const int argmax = keyId(best);
  const float lmax = l[argmax];

  Row row{l, vocab, lmax, 1.0f, p.minP};
  int chosen = argmax;
  float lse = INFINITY;  // all logits -inf: every logprob is -inf
  if (lmax > -INFINITY) {
    const bool sampled = p.temperature >= kSamplingGreedyTemperature;
    const float invT = sampled ? __frcp_rn(p.temperature) : 1.0f;
    unsigned long long raw = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) raw += fixedMass(tokenWeight(l[i], lmax, 1.0f));
    raw = blockReduce(raw, /*isMax=*/false, sh);
    lse = lmax + float(log(double(raw) * 0x1p-40));
    if (sampled) {
      row.invT = invT;
      const bool topK = p.topK > 0 && p.topK < vocab;
      const bool topP = p.topP < 1.0f;
      unsigned long long floorKey = 0, mass = 0;
      if (topK) {
        const Selected s = radixSelect(row, true, 0, false, (unsigned long long)p.topK, sh);
        floorKey = s.threshold;
        mass = s.mass;
      } else {
        unsigned long long m = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) m += minPMass(row, i);
        mass = blockReduce(m, /*isMax=*/false, sh);
      }
      if (topP) {
        const Selected s = radixSelect(row, true, floorKey, true, nucleusLimit(p.topP, mass), sh);
        floorKey = s.threshold;
        mass = s.mass;
      }
      chosen = drawInIdOrder(row, floorKey, drawTarget(p.u, mass), sh);
    }
  }
  if (threadIdx.x == 0) {
    ids[blockIdx.x] = chosen;
    logprobs[blockIdx.x] = l[chosen] - lse;
  }

  if (topN > 0) {
    const Selected s = radixSelect(row, false, 0, false, (unsigned long long)topN, sh);
    if (threadIdx.x == 0) sh.topCount = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const unsigned long long k = orderKey(l[i], i);
      if (k >= s.threshold) {
        const unsigned int slot = atomicAdd(&sh.topCount, 1u);
        if (slot < unsigned(kSamplingMaxTopN)) sh.topKeys[slot] = k;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int n = min(int(sh.topCount), topN);
      for (int a = 1; a < n; ++a) {  // insertion sort, best first (n <= 20)
        const unsigned long long k = sh.topKeys[a];
        int b = a;
        for (; b > 0 && sh.topKeys[b - 1] < k; --b) sh.topKeys[b] = sh.topKeys[b - 1];
        sh.topKeys[b] = k;
      }
      int32_t* outIds = topIds + size_t(blockIdx.x) * size_t(topN);
      float* outLp = topLogprobs + size_t(blockIdx.x) * size_t(topN);
      for (int j = 0; j < n; ++j) {
        const int id = keyId(sh.topKeys[j]);
        outIds[j] = id;
        outLp[j] = l[id] - lse;
      }
    }
  }
}

}  // namespace

cudaError_t sampleRows(const float* logits, int logitsStride, int rows, int vocab, const SampleRowParams* params,
                       int topN, int32_t* ids, float* logprobs, int32_t* topIds, float* topLogprobs,
                       cudaStream_t stream) {
  if (rows < 1 || vocab < 1 || logitsStride < vocab || topN < 0 || topN > kSamplingMaxTopN || topN > vocab ||
      (topN > 0 && (topIds == nullptr || topLogprobs == nullptr)))
    return cudaErrorInvalidValue;
  sampleRowsKernel<<<rows, kThreads, 0, stream>>>(logits, logitsStride, vocab, params, topN, ids, logprobs, topIds,
                                                  topLogprobs);
  return cudaGetLastError();
}

}  // namespace pd::kernels::cuda
