// 8-bit block-quantized weights (Q8_0-like) for the CPU backend: a weight row [k] is held as
// int8 q[k] and one f32 scale per block of 32 consecutive columns (the last block of a row may
// be shorter), w[p] ~ q[p] * scale[p / 32], scale = max |w| over the block / 127, q rounded to
// nearest. A quarter of f32's bytes plus 4 bytes per 32 weights (1.125 bytes a weight).
// Round-trip error: |w - q * scale| <= scale / 2 = max |w| over the block / 254.
//
// Decode (linearSkinnyQ8): the input rows are quantized the same way once per call (blocks of
// 32 columns, xs = max |x| / 127, xq = round(x / xs)), each block's dot product is computed in
// integers (exact) and scaled by ws * xs in f32: an int8 x int8 product like llama.cpp's
// Q8_0 x Q8_0. Error against the exact sum over the dequantized weights w^ = q * ws and the f32
// input x, with S = sum_p |x_p w^_p| and, per block b, W_b = sum_{p in b} |w^_p|:
//   <= sum_b (xs_b / 2) * W_b * (1 + 2^-20)     (the input's rounding to xq)
//    + gamma(k + 4) * (S + sum_b (xs_b / 2) * W_b) (f32 arithmetic; gamma(n) = n u / (1 - n u))
// Kernels (chosen once from CPUID; docs/engine-cpu.md, "q8_0 weights"):
//   kAvx512Vnni  avx512f/bw/vl + avx512_vnni: 64 columns (two blocks) per step and weight
//                row, vpdpbusd on |x| and w with x's sign, the row tail under a mask
//   kAvx2        avx2 + fma: one block per step, vpmaddubsw + vpmaddwd
//   kGeneric     plain C++ (the reference the others are tested against)
// Prefill: gemmQ8 (pd/kernels/gemm.h) dequantizes while packing the GEMM's B panels, f32
// activations, exactly the f32 GEMM on q8Dequantize's values.
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

enum class Q8Kernel { kGeneric, kAvx2, kAvx512Vnni };
const char* q8KernelName(Q8Kernel kernel);  // "generic", "avx2", "avx512vnni"
bool q8KernelSupported(Q8Kernel kernel);    // this CPU and OS can run it
Q8Kernel q8BestKernel();                    // decided once from CPUID

// x: [m][ldx] (k used, f32), weights as above; computes columns [nBegin, nEnd) of y [m][ldy]:
// y[i][j] = sum_p x[i][p] * w[j][p] + beta * y[i][j]   (beta 0 ignores y's old contents).
// `kernel` must be supported. Uses a thread-local buffer for the quantized x.
void linearSkinnyQ8(Q8Kernel kernel, const float* x, int ldx, const int8_t* q, const float* scales, float* y, int ldy,
                    int m, int k, int nBegin, int nEnd, float beta);

}  // namespace pd::kernels::cpu
