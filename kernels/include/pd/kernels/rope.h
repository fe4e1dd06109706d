// Rotary position embeddings, Hugging Face "rotate_half" (non-interleaved) convention:
// for pair i in [0, headDim/2): (x[i], x[i + headDim/2]) is rotated by pos * invFreq[i].
//
// Pure functions; no allocation, no threads; safe to call concurrently on disjoint rows.
#pragma once

#include <cstdint>

namespace pd::kernels::cpu {

// Llama 3 frequency scaling (config.json rope_scaling with rope_type "llama3").
struct RopeLlama3Scaling {
  float factor = 8.0f;
  float lowFreqFactor = 1.0f;
  float highFreqFactor = 4.0f;
  int originalMaxPositionEmbeddings = 8192;
};

// invFreq: [headDim/2] out. invFreq[i] = theta^(-2i/headDim), then, when llama3 is not null,
// the Llama 3 piecewise scaling (long wavelengths divided by factor, short ones kept, a
// smooth blend in between). Computed in double, stored as float.
void ropeInvFreq(float* invFreq, int headDim, double theta, const RopeLlama3Scaling* llama3);

// positions: [numTokens], invFreq: [halfDim],
// cosOut, sinOut: [numTokens][halfDim] out. Angles are formed in double (pos * invFreq) so
// large positions keep their precision.
void ropeCosSin(const int32_t* positions, int numTokens, const float* invFreq, int halfDim, float* cosOut,
                float* sinOut);

// x: [numTokens][rowStride] with numHeads heads of headDim floats starting at x[t*rowStride]
// (rotated in place). cosT, sinT: [numTokens][headDim/2] from ropeCosSin.
void applyRope(float* x, int rowStride, int numTokens, int numHeads, int headDim, const float* cosT, const float* sinT);

}  // namespace pd::kernels::cpu
