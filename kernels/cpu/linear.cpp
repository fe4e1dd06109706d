#include "pd/kernels/linear.h"

#include "kernels/cpu/linear_stream.h"

namespace pd::kernels::cpu {
namespace {

struct F32 {
  static __m256 vec(const float* p) { return _mm256_loadu_ps(p); }
  static float one(float w) { return w; }
};

}  // namespace

void linearSkinny(const float* x, int ldx, const float* w, float* y, int ldy, int m, int k, int nBegin, int nEnd,
                  float beta) {
  detail::streamLinear(detail::WideningRows<float, F32>{x, ldx, w, k}, y, ldy, m, nBegin, nEnd, beta);
}

}  // namespace pd::kernels::cpu
