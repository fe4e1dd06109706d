#include "pd/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

// Query heads handled together per pass over the keys: each K/V row loaded from the pool is
// reused by all of them (the point of GQA on a bandwidth-bound decode).
constexpr int kHeadsPerPass = 8;
constexpr int kTile = 32;  // key positions scored before one online-softmax update
constexpr int kMaxHeadDim = 512;

// acc[d] += sum_i p[i] * v[i][d], 32 columns at a time held in registers across all keys
// (an axpy per key would load and store acc once per key).
inline void accumulatePV(float* acc, const float* p, const float* const* v, int np, int headDim) {
  int d = 0;
  for (; d + 32 <= headDim; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int i = 0; i < np; ++i) {
      const __m256 pi = _mm256_set1_ps(p[i]);
      a0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v[i] + d), a0);
      a1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v[i] + d + 8), a1);
      a2 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v[i] + d + 16), a2);
      a3 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v[i] + d + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= headDim; d += 8) {
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int i = 0; i < np; ++i) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v[i] + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
  for (; d < headDim; ++d)
    for (int i = 0; i < np; ++i) acc[d] += p[i] * v[i][d];
}

}  // namespace

void pagedAttention(const float* q, int qStride, const float* layerKv, const int32_t* blockTable, int numTokens,
                    int startPos, int blockSize, int numHeads, int numKvHeads, int headDim, int kvHeadBegin,
                    int kvHeadEnd, float scale, float* out, int outStride) {
  PagedKv kv;
  kv.layer = const_cast<float*>(layerKv);  // only read
  kv.format = KvFormat::kF32;
  kv.blockSize = blockSize;
  kv.numKvHeads = numKvHeads;
  kv.headDim = headDim;
  pagedAttention(q, qStride, kv, blockTable, numTokens, startPos, numHeads, kvHeadBegin, kvHeadEnd, scale, out,
                 outStride);
}

void pagedAttention(const float* q, int qStride, const PagedKv& kv, const int32_t* blockTable, int numTokens,
                    int startPos, int numHeads, int kvHeadBegin, int kvHeadEnd, float scale, float* out,
                    int outStride) {
  using namespace detail;
  const int blockSize = kv.blockSize, numKvHeads = kv.numKvHeads, headDim = kv.headDim;
  const int group = numHeads / numKvHeads;
  const bool f32 = kv.format == KvFormat::kF32;
  const size_t eb = kv.elemBytes();
  alignas(32) float acc[kHeadsPerPass][kMaxHeadDim];
  float s[kHeadsPerPass][kTile];
  float m[kHeadsPerPass], l[kHeadsPerPass];
  const float* kRow[kTile];
  const float* vRow[kTile];
  // A narrower pool: the tile's K and V rows widened here once, then read by every head of
  // the group (8-bit: code * the token's scale).
  static thread_local std::vector<float> wide;
  if (!f32 && wide.size() < 2 * size_t(kTile) * headDim) wide.resize(2 * size_t(kTile) * headDim);

  for (int t = 0; t < numTokens; ++t) {
    const int ctx = startPos + t + 1;
    for (int g = kvHeadBegin; g < kvHeadEnd; ++g) {
      for (int h0 = 0; h0 < group; h0 += kHeadsPerPass) {
        const int nh = std::min(kHeadsPerPass, group - h0);
        const float* qh[kHeadsPerPass];
        for (int j = 0; j < nh; ++j) {
          qh[j] = q + size_t(t) * qStride + size_t(g * group + h0 + j) * headDim;
          m[j] = -std::numeric_limits<float>::infinity();
          l[j] = 0.0f;
          std::fill(acc[j], acc[j] + headDim, 0.0f);
        }
        for (int p0 = 0; p0 < ctx; p0 += kTile) {
          const int np = std::min(kTile, ctx - p0);
          for (int i = 0; i < np; ++i) {
            const int p = p0 + i;
            const int slot = blockTable[p / blockSize] * blockSize + p % blockSize;
            if (f32) {
              kRow[i] = reinterpret_cast<const float*>(kv.row(slot, g, false));
              vRow[i] = reinterpret_cast<const float*>(kv.row(slot, g, true));
            } else {
              float* kw = wide.data() + size_t(i) * headDim;
              float* vw = wide.data() + size_t(kTile + i) * headDim;
              const float ks = kv.scaled() ? *kv.scale(slot, g, false) : 1.0f;
              const float vs = kv.scaled() ? *kv.scale(slot, g, true) : 1.0f;
              kvDequantizeRow(kv.row(slot, g, false), ks, headDim, kv.format, kw);
              kvDequantizeRow(kv.row(slot, g, true), vs, headDim, kv.format, vw);
              kRow[i] = kw;
              vRow[i] = vw;
            }
          }
          // This head's K and V rows sit a token's row apart (the other kv heads in between),
          // a stride the hardware prefetchers follow poorly: ask for the next tile's rows
          // while this one computes.
          for (int p = p0 + kTile; p < std::min(ctx, p0 + 2 * kTile); ++p) {
            const int slot = blockTable[p / blockSize] * blockSize + p % blockSize;
            const char* k = reinterpret_cast<const char*>(kv.row(slot, g, false));
            const char* v = reinterpret_cast<const char*>(kv.row(slot, g, true));
            for (size_t d = 0; d < headDim * eb; d += 64) {
              _mm_prefetch(k + d, _MM_HINT_T0);
              _mm_prefetch(v + d, _MM_HINT_T0);
            }
          }
          for (int j = 0; j < nh; ++j) {
            float tileMax = m[j];
            int i = 0;
            for (; i + 8 <= np; i += 8)
              _mm256_storeu_ps(&s[j][i], _mm256_mul_ps(dot8(qh[j], kRow + i, headDim), _mm256_set1_ps(scale)));
            for (; i < np; ++i) s[j][i] = dot(qh[j], kRow[i], headDim) * scale;
            for (i = 0; i < np; ++i) tileMax = std::max(tileMax, s[j][i]);
            // Rescale what was accumulated under the old maximum once per tile.
            const float corr = std::exp(m[j] - tileMax);
            m[j] = tileMax;
            l[j] *= corr;
            const __m256 vmax = _mm256_set1_ps(tileMax);
            __m256 vsum = _mm256_setzero_ps();
            for (i = 0; i + 8 <= np; i += 8) {
              const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&s[j][i]), vmax));
              _mm256_storeu_ps(&s[j][i], e);
              vsum = _mm256_add_ps(vsum, e);
            }
            l[j] += hsum(vsum);
            for (; i < np; ++i) {
              s[j][i] = std::exp(s[j][i] - tileMax);
              l[j] += s[j][i];
            }
            if (corr != 1.0f)
              for (int d = 0; d < headDim; ++d) acc[j][d] *= corr;
          }
          for (int j = 0; j < nh; ++j) accumulatePV(acc[j], s[j], vRow, np, headDim);
        }
        for (int j = 0; j < nh; ++j) {
          float* o = out + size_t(t) * outStride + size_t(g * group + h0 + j) * headDim;
          const float inv = 1.0f / l[j];
          for (int d = 0; d < headDim; ++d) o[d] = acc[j][d] * inv;
        }
      }
    }
  }
}

void causalSoftmaxRows(float* scores, int ldScores, int numRows, int numCols, int firstQueryPos, float scale) {
  using namespace detail;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int r = 0; r < numRows; ++r) {
    float* row = scores + size_t(r) * ldScores;
    const int valid = std::min(numCols, firstQueryPos + r + 1);
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int i = 0;
    for (; i + 8 <= valid; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + i));
    float mx = hmax(vmax);
    for (; i < valid; ++i) mx = std::max(mx, row[i]);
    mx *= scale;  // scale > 0, so max(scale * x) = scale * max(x)
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    i = 0;
    for (; i + 8 <= valid; i += 8) {
      const __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(row + i), vscale, vmx));
      _mm256_storeu_ps(row + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; i < valid; ++i) {
      row[i] = std::exp(row[i] * scale - mx);
      sum += row[i];
    }
    const __m256 vinv = _mm256_set1_ps(1.0f / sum);
    i = 0;
    for (; i + 8 <= valid; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), vinv));
    for (; i < valid; ++i) row[i] *= 1.0f / sum;
    std::fill(row + valid, row + numCols, 0.0f);
  }
}

}  // namespace pd::kernels::cpu
