// The arithmetic the CPU and CUDA samplers share (pd/kernels/sampling.h,
// pd/kernels/cuda/sampling.h), written once for host and device so both compute the same
// bits: the tempered weight w of a token, its fixed-point mass q, and its order key.
//
// Bit-exactness: every float/double operation is a single IEEE-rounded operation. On the
// device the *_rn intrinsics keep nvcc from fusing a multiply and an add into an FMA; on the
// host the including file must be compiled with -ffp-contract=off (kernels/CMakeLists.txt
// sets it for cpu/sampling.cpp). Include this header only from those two files.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PD_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define PD_SAMPLING_HD inline
#endif

namespace pd::kernels::sampling_math {

// Masses are fixed point with this many fraction bits (the most likely token weighs 2^40):
// sums of up to 2^23 tokens fit in 64 bits, and integer sums do not depend on the order of
// addition, so the CPU loop and the GPU's parallel reductions agree exactly.
inline constexpr int kMassBits = 40;
// q(w) > 0 exactly when w > 2^-41 (2^-41 itself rounds to even, i.e. to 0).
inline constexpr float kMinKeptWeight = 0x1p-41f;

PD_SAMPLING_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PD_SAMPLING_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
PD_SAMPLING_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PD_SAMPLING_HD uint32_t floatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
PD_SAMPLING_HD float bitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// exp(x) for x <= 0 in straight-line arithmetic (round to nearest by the 1.5 * 2^23 trick, a
// degree-6 polynomial on [-ln2/2, ln2/2], the exponent added into the bits). Relative error
// ~1e-7; x < -87 (including -inf, a masked token) gives exactly 0. Not guaranteed monotone
// to the last bit, which is why nothing relies on w ordering tokens (keys do).
PD_SAMPLING_HD float expNonPositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float k = fsub(fadd(fmul(xc, 1.44269504088896341f), 12582912.0f), 12582912.0f);
  const float r = fadd(fsub(xc, fmul(k, 0.693359375f)), fmul(k, 2.12194440e-4f));
  float p = 1.9875691500e-4f;
  p = fadd(fmul(p, r), 1.3981999507e-3f);
  p = fadd(fmul(p, r), 8.3334519073e-3f);
  p = fadd(fmul(p, r), 4.1665795894e-2f);
  p = fadd(fmul(p, r), 1.6666665459e-1f);
  p = fadd(fmul(p, r), 5.0000001201e-1f);
  p = fadd(fadd(fmul(fmul(p, r), r), r), 1.0f);
  // Unsigned: k < 0 shifted left is well defined (two's complement wrap-around, as intended).
  const uint32_t bits = floatBits(p) + (uint32_t(int32_t(k)) << 23);
  return x < -87.0f ? 0.0f : bitsFloat(bits);
}

// The weight of a token relative to the most likely one: exp((logit - lmax) * invT), in
// [0, 1]. invT is 1 / temperature, rounded once (1.0f / t on the host, __frcp_rn on device).
PD_SAMPLING_HD float tokenWeight(float logit, float lmax, float invT) {
  return expNonPositive(fmul(fsub(logit, lmax), invT));
}

// round-half-even(w * 2^40) for w in [0, 1]: the 2^52 trick (w * 2^40 is exact in double,
// adding 2^52 rounds it to an integer in the mantissa).
PD_SAMPLING_HD uint64_t fixedMass(float w) {
#if defined(__CUDA_ARCH__)
  const double d = __dadd_rn(__dmul_rn(double(w), 0x1p40), 0x1p52);
  return uint64_t(__double_as_longlong(d)) - 0x4330000000000000ULL;
#else
  const double d = double(w) * 0x1p40 + 0x1p52;
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u - 0x4330000000000000ULL;  // the bits of 2^52
#endif
}

// (logit, id) as one integer ordered like (logit descending, id ascending): larger = better.
// Unique per token, so "the k best" and "the smallest prefix reaching a mass" are sets.
PD_SAMPLING_HD uint64_t orderKey(float logit, int32_t id) {
  uint32_t b = floatBits(logit);
  if (b == 0x80000000u) b = 0;                     // -0 == +0, as the float comparison says
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // IEEE order -> unsigned order
  return (uint64_t(b) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(id));
}
PD_SAMPLING_HD int32_t keyId(uint64_t key) { return int32_t(0xFFFFFFFFu - uint32_t(key)); }

// The draw's target mass: floor(u * total) in [0, total), from u in [0, 1) and total >= 1.
PD_SAMPLING_HD uint64_t drawTarget(double u, uint64_t total) {
#if defined(__CUDA_ARCH__)
  const double t = __dmul_rn(u, double(total));
#else
  const double t = u * double(total);
#endif
  const uint64_t target = uint64_t(t);
  return target < total ? target : total - 1;
}

// Nucleus limit: ceil(topP * total) (a token is in the nucleus when the mass strictly before
// it in key order is below this).
PD_SAMPLING_HD uint64_t nucleusLimit(float topP, uint64_t total) {
#if defined(__CUDA_ARCH__)
  const double t = __dmul_rn(double(topP), double(total));
#else
  const double t = double(topP) * double(total);
#endif
  const uint64_t f = uint64_t(t);
  return double(f) < t ? f + 1 : f;
}

// The CUDA sampler's radix selection, one digit at a time (the walk its thread 0 does after
// each histogram pass; here so a CPU test can drive it with histograms built on the host).
// Selects among a domain's tokens the set { key >= threshold } that is, by count, the `need`
// largest keys, or, by mass, the smallest key-order prefix whose mass reaches `need`; all of
// the domain when it holds less. Each pass histograms digit (key >> shift) & 255 of the
// domain's keys whose bits above `shift + 8` equal `prefix`.
inline constexpr int kRadixDigitBits = 8;
inline constexpr int kRadixDigits = 1 << kRadixDigitBits;

struct RadixSelect {
  uint64_t prefix = 0;  // the bits above shift + 8 chosen so far
  int shift = 64 - kRadixDigitBits;
  uint64_t before = 0;      // count (or mass, byMass) of the domain above the prefix
  uint64_t beforeMass = 0;  // mass of the domain above the prefix
  bool done = false;
  uint64_t threshold = 0;  // when done
  uint64_t mass = 0;       // when done: the selected set's mass

  // The key bits a token must match to be counted in this pass.
  PD_SAMPLING_HD uint64_t prefixMask() const {
    return shift + kRadixDigitBits >= 64 ? 0ULL : (~0ULL << (shift + kRadixDigitBits));
  }
  PD_SAMPLING_HD int digitOf(uint64_t key) const { return int((key >> shift) & uint64_t(kRadixDigits - 1)); }
  // Consumes this pass's histograms (count and mass per digit); either finishes or narrows
  // the prefix to the digit where the running total reaches `need` and moves to the next.
  template <typename MassT, typename CountT>
  PD_SAMPLING_HD void step(const MassT* massHist, const CountT* countHist, bool byMass, uint64_t need,
                           uint64_t floorKey) {
    int chosen = -1;
    for (int d = kRadixDigits - 1; d >= 0; --d) {
      const uint64_t v = byMass ? uint64_t(massHist[d]) : uint64_t(countHist[d]);
      if (v > 0 && before + v >= need) {
        chosen = d;
        break;
      }
      before += v;
      beforeMass += uint64_t(massHist[d]);
    }
    if (chosen < 0) {  // the whole domain (only possible on the first pass)
      done = true;
      threshold = floorKey;
      mass = beforeMass;
      return;
    }
    const uint64_t here = prefix | (uint64_t(chosen) << shift);
    const uint64_t count = uint64_t(countHist[chosen]);
    // Done when the bucket is wholly in: a single token, or exactly the count still needed
    // (keys are unique, so the last digit always ends it).
    if (count == 1 || (!byMass && before + count == need) || shift == 0) {
      done = true;
      // The bucket's lowest possible key may lie below the domain's floor; the set is the
      // domain's keys above `here`, so the floor still applies.
      threshold = here > floorKey ? here : floorKey;
      mass = beforeMass + uint64_t(massHist[chosen]);
      return;
    }
    prefix = here;
    shift -= kRadixDigitBits;
  }
};

}  // namespace pd::kernels::sampling_math
