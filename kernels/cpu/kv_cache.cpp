#include "pd/kernels/kv_cache.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace pd::kernels::cpu {

namespace {

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;  // e4m3fn: 1.75 * 2^8, the largest finite code (0x7e)

// Every fp8 code's value: dequantizing is a table lookup (a gather in the AVX2 loop).
const std::array<float, 256>& fp8Table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int c = 0; c < 256; ++c) a[c] = fp8E4m3ToFloat(uint8_t(c));
    return a;
  }();
  return t;
}

uint16_t toBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // nearest, ties to even
  return uint16_t(u >> 16);
}

float maxAbs(const float* x, int n) {
  __m256 m = _mm256_setzero_ps();
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), mask));
  alignas(32) float l[8];
  _mm256_store_ps(l, m);
  float r = 0.0f;
  for (float v : l) r = std::max(r, v);
  for (; i < n; ++i) r = std::max(r, std::fabs(x[i]));
  return r;
}

void writeRow(const PagedKv& kv, int slot, int h, bool isV, const float* x) {
  float scale = 1.0f;
  kvQuantizeRow(x, kv.headDim, kv.format, kv.row(slot, h, isV), &scale);
  if (kv.scaled()) *kv.scale(slot, h, isV) = scale;
}

void readRow(const PagedKv& kv, int slot, int h, bool isV, float* out) {
  kvDequantizeRow(kv.row(slot, h, isV), kv.scaled() ? *kv.scale(slot, h, isV) : 1.0f, kv.headDim, kv.format, out);
}

}  // namespace

float fp8E4m3ToFloat(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  float v;
  if (e == 15 && m == 7)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(float(m), -9);  // subnormal: m * 2^-6 / 8
  else
    v = std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (code & 0x80) ? -v : v;
}

uint8_t fp8E4m3FromFloat(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= kFp8Max) return sign | 0x7e;  // saturate: e4m3fn has no infinity
  if (a < 0.015625f) {                   // below 2^-6: subnormal steps of 2^-9 (8 rounds to 2^-6's code)
    return sign | uint8_t(std::nearbyint(a * 512.0f));
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  u += 0x7ffffu + ((u >> 20) & 1u);  // keep 3 mantissa bits, nearest, ties to even
  const int e = int(u >> 23) - 127;  // in [-6, 8]: a < 448 rounds to at most 448
  return sign | uint8_t(((e + 7) << 3) | ((u >> 20) & 7u));
}

void kvQuantizeRow(const float* x, int n, KvFormat format, void* codes, float* scale) {
  *scale = 1.0f;
  switch (format) {
    case KvFormat::kF32:
      std::memcpy(codes, x, sizeof(float) * n);
      return;
    case KvFormat::kBf16: {
      auto* c = static_cast<uint16_t*>(codes);
      for (int i = 0; i < n; ++i) c[i] = toBf16(x[i]);
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kFp8: {
      const float amax = maxAbs(x, n);
      const float top = format == KvFormat::kInt8 ? kInt8Max : kFp8Max;
      auto* c = static_cast<uint8_t*>(codes);
      if (!(amax > 0.0f) || !std::isfinite(amax)) {
        // Zeros (or a row already broken by an inf/NaN upstream): codes 0 and scale 0 keep
        // attention finite rather than spreading NaN to every later token.
        std::memset(c, 0, n);
        *scale = 0.0f;
        return;
      }
      *scale = amax / top;
      const float inv = top / amax;
      if (format == KvFormat::kInt8) {
        for (int i = 0; i < n; ++i) {
          const float q = std::nearbyint(x[i] * inv);
          c[i] = uint8_t(int8_t(std::clamp(q, -kInt8Max, kInt8Max)));
        }
      } else {
        for (int i = 0; i < n; ++i) c[i] = fp8E4m3FromFloat(x[i] * inv);
      }
      return;
    }
  }
}

void kvDequantizeRow(const void* codes, float scale, int n, KvFormat format, float* out) {
  int i = 0;
  const __m256 s = _mm256_set1_ps(scale);
  switch (format) {
    case KvFormat::kF32:
      std::memcpy(out, codes, sizeof(float) * n);
      return;
    case KvFormat::kBf16: {
      const auto* c = static_cast<const uint16_t*>(codes);
      for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
      for (; i < n; ++i) {
        const uint32_t u = uint32_t(c[i]) << 16;
        std::memcpy(out + i, &u, 4);
      }
      return;
    }
    case KvFormat::kInt8: {
      const auto* c = static_cast<const int8_t*>(codes);
      for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s));
      }
      for (; i < n; ++i) out[i] = float(c[i]) * scale;
      return;
    }
    case KvFormat::kFp8: {
      // Bit arithmetic rather than a table gather (a gather costs about a cycle an element):
      // a normal code's exponent and mantissa moved into f32's fields with the bias changed
      // from 7 to 127; a subnormal's mantissa m is m * 2^-9. NaN codes are never written (the
      // encoder saturates) and read here as 480.
      const auto* c = static_cast<const uint8_t*>(codes);
      const float* t = fp8Table().data();
      const __m256i low7 = _mm256_set1_epi32(0x7f), bias = _mm256_set1_epi32(120 << 23);
      const __m256i eight = _mm256_set1_epi32(8), sign = _mm256_set1_epi32(0x80);
      const __m256 subStep = _mm256_set1_ps(1.0f / 512.0f);
      for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
        const __m256i mag = _mm256_and_si256(v, low7);
        const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), subStep);
        const __m256 isSub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, mag));
        __m256 f = _mm256_blendv_ps(normal, sub, isSub);
        f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, sign), 24)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(f, s));
      }
      for (; i < n; ++i) out[i] = t[c[i]] * scale;
      return;
    }
  }
}

void kvCacheWrite(const PagedKv& kv, const float* k, const float* v, int rowStride, const int32_t* slots,
                  int numTokens) {
  if (kv.format == KvFormat::kF32) {
    kvCacheWrite(static_cast<float*>(kv.layer), k, v, rowStride, slots, numTokens, kv.blockSize, kv.numKvHeads,
                 kv.headDim);
    return;
  }
  for (int t = 0; t < numTokens; ++t) {
    for (int h = 0; h < kv.numKvHeads; ++h) {
      writeRow(kv, slots[t], h, false, k + size_t(t) * rowStride + size_t(h) * kv.headDim);
      writeRow(kv, slots[t], h, true, v + size_t(t) * rowStride + size_t(h) * kv.headDim);
    }
  }
}

void kvGatherHead(const PagedKv& kv, const int32_t* blockTable, int numPositions, int kvHead, float* kOut,
                  float* vOut) {
  if (kv.format == KvFormat::kF32) {
    kvGatherHead(static_cast<const float*>(kv.layer), blockTable, numPositions, kv.blockSize, kv.numKvHeads, kv.headDim,
                 kvHead, kOut, vOut);
    return;
  }
  for (int p = 0; p < numPositions; ++p) {
    const int slot = blockTable[p / kv.blockSize] * kv.blockSize + p % kv.blockSize;
    readRow(kv, slot, kvHead, false, kOut + size_t(p) * kv.headDim);
    readRow(kv, slot, kvHead, true, vOut + size_t(p) * kv.headDim);
  }
}

void kvCacheWrite(float* layerKv, const float* k, const float* v, int rowStride, const int32_t* slots, int numTokens,
                  int blockSize, int numKvHeads, int headDim) {
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  const size_t blockElems = 2 * size_t(blockSize) * tokenElems;
  for (int t = 0; t < numTokens; ++t) {
    const int block = slots[t] / blockSize, off = slots[t] % blockSize;
    float* kd = layerKv + size_t(block) * blockElems + size_t(off) * tokenElems;
    float* vd = kd + size_t(blockSize) * tokenElems;
    std::memcpy(kd, k + size_t(t) * rowStride, sizeof(float) * tokenElems);
    std::memcpy(vd, v + size_t(t) * rowStride, sizeof(float) * tokenElems);
  }
}

void kvGatherHead(const float* layerKv, const int32_t* blockTable, int numPositions, int blockSize, int numKvHeads,
                  int headDim, int kvHead, float* kOut, float* vOut) {
  const size_t tokenElems = size_t(numKvHeads) * headDim;
  const size_t blockElems = 2 * size_t(blockSize) * tokenElems;
  for (int p = 0; p < numPositions; ++p) {
    const float* kb = layerKv + size_t(blockTable[p / blockSize]) * blockElems + size_t(p % blockSize) * tokenElems +
                      size_t(kvHead) * headDim;
    std::memcpy(kOut + size_t(p) * headDim, kb, sizeof(float) * headDim);
    std::memcpy(vOut + size_t(p) * headDim, kb + size_t(blockSize) * tokenElems, sizeof(float) * headDim);
  }
}

}  // namespace pd::kernels::cpu
