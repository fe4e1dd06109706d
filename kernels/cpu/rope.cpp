#include "pd/kernels/rope.h"

#include <cmath>

namespace pd::kernels::cpu {

void ropeInvFreq(float* invFreq, int headDim, double theta, const RopeLlama3Scaling* llama3) {
  const int half = headDim / 2;
  for (int i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(theta, double(2 * i) / headDim);
    if (llama3) {
      // Wavelengths longer than the original context / lowFreqFactor are slowed by factor,
      // those shorter than original / highFreqFactor are kept, and the band between is a
      // linear blend in 1/wavelength (Llama 3.1's published rule).
      const double kPi = 3.14159265358979323846;
      const double wavelen = 2 * kPi / f;
      const double lowWavelen = llama3->originalMaxPositionEmbeddings / llama3->lowFreqFactor;
      const double highWavelen = llama3->originalMaxPositionEmbeddings / llama3->highFreqFactor;
      if (wavelen > lowWavelen) {
        f = f / llama3->factor;
      } else if (wavelen >= highWavelen) {
        const double smooth = (llama3->originalMaxPositionEmbeddings / wavelen - llama3->lowFreqFactor) /
                              (llama3->highFreqFactor - llama3->lowFreqFactor);
        f = (1 - smooth) * f / llama3->factor + smooth * f;
      }
    }
    invFreq[i] = float(f);
  }
}

void ropeCosSin(const int32_t* positions, int numTokens, const float* invFreq, int halfDim, float* cosOut,
                float* sinOut) {
  for (int t = 0; t < numTokens; ++t) {
    const double pos = positions[t];
    for (int i = 0; i < halfDim; ++i) {
      const double a = pos * double(invFreq[i]);
      cosOut[size_t(t) * halfDim + i] = float(std::cos(a));
      sinOut[size_t(t) * halfDim + i] = float(std::sin(a));
    }
  }
}

void applyRope(float* x, int rowStride, int numTokens, int numHeads, int headDim, const float* cosT,
               const float* sinT) {
  const int half = headDim / 2;
  for (int t = 0; t < numTokens; ++t) {
    const float* c = cosT + size_t(t) * half;
    const float* s = sinT + size_t(t) * half;
    for (int h = 0; h < numHeads; ++h) {
      float* __restrict a = x + size_t(t) * rowStride + size_t(h) * headDim;
      float* __restrict b = a + half;
      for (int i = 0; i < half; ++i) {
        const float x0 = a[i], x1 = b[i];
        a[i] = x0 * c[i] - x1 * s[i];
        b[i] = x1 * c[i] + x0 * s[i];
      }
    }
  }
}

}  // namespace pd::kernels::cpu
