// 8-bit block-quantized weights (Q8_0-like) for the CPU backend: a weight row [k] is held as
// int8 q[k] and one f32 scale per block of 32 consecutive columns (the last block of a row may
// be shorter), w[p] ~ q[p] * scale[p / 32], scale = max |w| over the block / 127, q rounded to
// nearest. A quarter of f32's bytes plus 4 bytes per 32 weights (1.125 bytes a weight).
// Round-trip error: |w - q * scale| <= scale / 2 = max |w| over the block / 254.
//
// The kernels dequantize (float(q) * scale, one f32 rounding: exactly q8Dequantize's values)
// and then compute as the f32 kernels do, so their error against the exact sum over the
// dequantized weights is the f32 bound, gamma(k + 2) * sum |x_p w_p|. Prefill: gemmQ8
// (pd/kernels/gemm.h) dequantizes while packing the GEMM's B panels. AVX2 only for now (an
// int8 dot-product path, VNNI, would also quantize the activations).
// Pure functions; callers split [0, n) output columns across threads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pd::kernels::cpu {

inline constexpr int kQ8Block = 32;
inline int q8BlocksPerRow(int k) { return (k + kQ8Block - 1) / kQ8Block; }

// w: [n][k] f32 -> q: [n][k] int8, scales: [n][q8BlocksPerRow(k)] f32.
void q8Quantize(const float* w, int n, int k, int8_t* q, float* scales);
// The weights the kernels compute with: out[j][p] = float(q[j][p]) * scales[j][p / 32].
void q8Dequantize(const int8_t* q, const float* scales, int n, int k, float* out);

// x: [m][ldx] (k used, f32), weights as above; computes columns [nBegin, nEnd) of y [m][ldy]:
// y[i][j] = sum_p x[i][p] * w[j][p] + beta * y[i][j]   (beta 0 ignores y's old contents).
void linearSkinnyQ8(const float* x, int ldx, const int8_t* q, const float* scales, float* y, int ldy, int m, int k,
                    int nBegin, int nEnd, float beta);

}  // namespace pd::kernels::cpu
