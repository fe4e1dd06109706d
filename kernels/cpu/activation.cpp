#include "pd/kernels/activation.h"

#include <cmath>

#include "kernels/cpu/simd_avx2.h"

namespace pd::kernels::cpu {

void swiGlu(const float* gateUp, float* out, int numRows, int ffn) {
  using namespace detail;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int r = 0; r < numRows; ++r) {
    const float* g = gateUp + size_t(r) * 2 * ffn;
    const float* u = g + ffn;
    float* o = out + size_t(r) * ffn;
    int i = 0;
    for (; i + 8 <= ffn; i += 8) {
      const __m256 vg = _mm256_loadu_ps(g + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), vg));
      const __m256 silu = _mm256_div_ps(vg, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (; i < ffn; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

}  // namespace pd::kernels::cpu
