#include "pd/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {
namespace {

constexpr int kTile = 32;  // key positions scored before one online-softmax update

// acc[d] += sum_i p[i] * v[i][d], 64 (then 32) columns at a time held in registers across all
// keys (an axpy per key would load and store acc once per key). Eight accumulators at 64
// columns: each is a chain of dependent FMAs, one per key, so more chains keep the FMA units
// busier. Every acc[d] sums its keys in the same order whichever width runs it.
inline void accumulatePV(float* acc, const float* p, const float* const* v, int np, int headDim) {
  int d = 0;
  for (; d + 64 <= headDim; d += 64) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + d + 8 * c);
    for (int i = 0; i < np; ++i) {
      const __m256 pi = _mm256_set1_ps(p[i]);
      const float* vi = v[i] + d;
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d + 8 * c, a[c]);
  }
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
  const int nkv = kvHeadEnd - kvHeadBegin, nq = nkv * group;  // kv heads and query heads of this call
  if (nkv <= 0) return;
  const bool f32 = kv.format == KvFormat::kF32;
  const size_t eb = kv.elemBytes();
  // Every query head of the call keeps its online-softmax state across one pass over the keys:
  // a tile of key positions is read once for all the call's kv heads, whose rows of a token
  // are contiguous in the pool (one kv head per pass walked a slice of every token row, once
  // per kv head). Each head's arithmetic, and its order, is the same as one head alone: the
  // results do not depend on the range (nor on the tile's prefetching below).
  static thread_local std::vector<float> accBuf, sBuf, mBuf, lBuf, wide;
  static thread_local std::vector<const float*> rowBuf;
  if (accBuf.size() < size_t(nq) * headDim) accBuf.resize(size_t(nq) * headDim);
  if (sBuf.size() < size_t(nq) * kTile) sBuf.resize(size_t(nq) * kTile);
  if (mBuf.size() < size_t(nq)) {
    mBuf.resize(nq);
    lBuf.resize(nq);
  }
  if (rowBuf.size() < 2 * size_t(nkv) * kTile) rowBuf.resize(2 * size_t(nkv) * kTile);
  // A narrower pool: the tile's K and V rows widened here once, then read by every head of
  // the group (8-bit: code * the token's scale).
  if (!f32 && wide.size() < 2 * size_t(nkv) * kTile * headDim) wide.resize(2 * size_t(nkv) * kTile * headDim);
  float* m = mBuf.data();
  float* l = lBuf.data();
  const size_t spanBytes = size_t(nkv) * headDim * eb;         // one token's rows of the call's kv heads
  const size_t vOffset = size_t(blockSize) * kv.tokenElems();  // K row to V row, elements
  const size_t vBytes = vOffset * eb;
  const uint8_t* nextRow[kTile];

  for (int t = 0; t < numTokens; ++t) {
    const int ctx = startPos + t + 1;
    for (int j = 0; j < nq; ++j) {
      m[j] = -std::numeric_limits<float>::infinity();
      l[j] = 0.0f;
      std::fill(accBuf.data() + size_t(j) * headDim, accBuf.data() + size_t(j + 1) * headDim, 0.0f);
    }
    for (int p0 = 0; p0 < ctx; p0 += kTile) {
      const int np = std::min(kTile, ctx - p0);
      for (int i = 0; i < np; ++i) {
        const int p = p0 + i;
        const int slot = blockTable[p / blockSize] * blockSize + p % blockSize;
        if (f32) {
          // The token's K row of the range's first kv head; the others follow it, and its V
          // rows sit blockSize token rows later (kv.row's layout, one division per token).
          const float* k = reinterpret_cast<const float*>(kv.row(slot, kvHeadBegin, false));
          for (int g = 0; g < nkv; ++g) {
            const float** kRow = rowBuf.data() + size_t(g) * 2 * kTile;
            kRow[i] = k + size_t(g) * headDim;
            kRow[kTile + i] = k + vOffset + size_t(g) * headDim;
          }
          continue;
        }
        for (int g = 0; g < nkv; ++g) {
          const float** kRow = rowBuf.data() + size_t(g) * 2 * kTile;
          const float** vRow = kRow + kTile;
          float* kw = wide.data() + (size_t(g) * 2 * kTile + i) * headDim;
          float* vw = wide.data() + (size_t(g) * 2 * kTile + kTile + i) * headDim;
          const float ks = kv.scaled() ? *kv.scale(slot, kvHeadBegin + g, false) : 1.0f;
          const float vs = kv.scaled() ? *kv.scale(slot, kvHeadBegin + g, true) : 1.0f;
          kvDequantizeRow(kv.row(slot, kvHeadBegin + g, false), ks, headDim, kv.format, kw);
          kvDequantizeRow(kv.row(slot, kvHeadBegin + g, true), vs, headDim, kv.format, vw);
          kRow[i] = kw;
          vRow[i] = vw;
        }
      }
      // The next tile's rows (the block table may scatter its blocks, which no hardware
      // prefetcher can guess) are asked for into L2 a few tokens at a time between this tile's
      // heads: a tile of every kv head is larger than L1, and one burst of all its lines fills
      // the miss queue and stalls the loads it should hide. On the AMD EPYC guest, with the
      // cache evicted between layers as the weights' streaming does, a decode token's
      // attention over 512 positions (4 kv heads of 64, 8 layers, 8.4 MB) took 0.80-0.93
      // CPU-ms against 1.10-1.19 before (one kv head per pass, a burst into L1).
      const int npNext = std::min(kTile, ctx - p0 - kTile);
      for (int i = 0; i < npNext; ++i) {
        const int p = p0 + kTile + i;
        nextRow[i] = kv.row(blockTable[p / blockSize] * blockSize + p % blockSize, kvHeadBegin, false);
      }
      const int perHead = npNext <= 0 ? 0 : (npNext + nq - 1) / nq;  // tokens prefetched before each head
      int prefetched = 0;
      for (int g = 0; g < nkv; ++g) {
        const float* const* kRow = rowBuf.data() + size_t(g) * 2 * kTile;
        const float* const* vRow = kRow + kTile;
        for (int jj = 0; jj < group; ++jj) {
          const int j = g * group + jj;
          const float* qh = q + size_t(t) * qStride + size_t(kvHeadBegin * group + j) * headDim;
          float* s = sBuf.data() + size_t(j) * kTile;
          float* acc = accBuf.data() + size_t(j) * headDim;
          for (const int stop = std::min(npNext, prefetched + perHead); prefetched < stop; ++prefetched)
            for (size_t d = 0; d < spanBytes; d += 64) {
              _mm_prefetch(nextRow[prefetched] + d, _MM_HINT_T1);
              _mm_prefetch(nextRow[prefetched] + vBytes + d, _MM_HINT_T1);
            }
          float tileMax = m[j];
          int i = 0;
          for (; i + 8 <= np; i += 8)
            _mm256_storeu_ps(&s[i], _mm256_mul_ps(dot8(qh, kRow + i, headDim), _mm256_set1_ps(scale)));
          for (; i < np; ++i) s[i] = dot(qh, kRow[i], headDim) * scale;
          for (i = 0; i < np; ++i) tileMax = std::max(tileMax, s[i]);
          // Rescale what was accumulated under the old maximum once per tile.
          const float corr = std::exp(m[j] - tileMax);
          m[j] = tileMax;
          l[j] *= corr;
          const __m256 vmax = _mm256_set1_ps(tileMax);
          __m256 vsum = _mm256_setzero_ps();
          for (i = 0; i + 8 <= np; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&s[i]), vmax));
            _mm256_storeu_ps(&s[i], e);
            vsum = _mm256_add_ps(vsum, e);
          }
          l[j] += hsum(vsum);
          for (; i < np; ++i) {
            s[i] = std::exp(s[i] - tileMax);
            l[j] += s[i];
          }
          if (corr != 1.0f)
            for (int d = 0; d < headDim; ++d) acc[d] *= corr;
        }
        for (int jj = 0; jj < group; ++jj) {
          const int j = g * group + jj;
          accumulatePV(accBuf.data() + size_t(j) * headDim, sBuf.data() + size_t(j) * kTile, vRow, np, headDim);
        }
      }
    }
    for (int j = 0; j < nq; ++j) {
      float* o = out + size_t(t) * outStride + size_t(kvHeadBegin * group + j) * headDim;
      const float* acc = accBuf.data() + size_t(j) * headDim;
      const float inv = 1.0f / l[j];
      for (int d = 0; d < headDim; ++d) o[d] = acc[d] * inv;
    }
  }
}

void latentAttention(const float* q, int ldq, int rows, const float* layerKv, const int32_t* blockTable, int blockSize,
                     size_t blockStride, int latentStride, int scoreDim, int valueDim, int numKeys, float scale,
                     float* scores, float* out, int ldo) {
  using namespace detail;
  static thread_local std::vector<const float*> keys;
  if (keys.size() < size_t(numKeys)) keys.resize(numKeys);
  for (int p = 0; p < numKeys; ++p)
    keys[p] = layerKv + size_t(blockTable[p / blockSize]) * blockStride + size_t(p % blockSize) * latentStride;
  // Scores eight keys at a time for every row (the eight rows stay in L1 across the rows);
  // the next eight keys' rows are asked for meanwhile.
  const size_t rowBytes = size_t(scoreDim) * sizeof(float);
  int p = 0;
  for (; p + 8 <= numKeys; p += 8) {
    for (int i = p + 8; i < std::min(numKeys, p + 16); ++i)
      for (size_t d = 0; d < rowBytes; d += 64) _mm_prefetch(reinterpret_cast<const char*>(keys[i]) + d, _MM_HINT_T0);
    for (int r = 0; r < rows; ++r)
      _mm256_storeu_ps(scores + size_t(r) * numKeys + p, dot8(q + size_t(r) * ldq, keys.data() + p, scoreDim));
  }
  for (; p < numKeys; ++p)
    for (int r = 0; r < rows; ++r) scores[size_t(r) * numKeys + p] = dot(q + size_t(r) * ldq, keys[p], scoreDim);
  causalSoftmaxRows(scores, numKeys, rows, numKeys, numKeys - 1, scale);
  for (int r = 0; r < rows; ++r) {
    float* o = out + size_t(r) * ldo;
    std::fill(o, o + valueDim, 0.0f);
    accumulatePV(o, scores + size_t(r) * numKeys, keys.data(), numKeys, valueDim);
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
