// bf16 weights for the CPU backend: conversion and the decode-side streaming linear layer.
//
// A bf16 weight is the upper 16 bits of an f32 (8-bit exponent, 7-bit mantissa): half the
// bytes of f32, and decode, which streams every weight once per step, is bound by those bytes.
// Weights are rounded to bf16 once (round to nearest even) when a backend is created; the
// kernels below read them as stored. Prefill widens them to f32 while packing the GEMM's B
// panels (pd/kernels/gemm.h, gemmBf16), so prefill runs at the f32 GEMM's speed.
//
// Kernels for linearSkinnyBf16 (chosen once from CPUID like the GEMM; docs/engine-cpu.md,
// "bf16 weights"):
//   kAvx512Bf16  avx512f + avx512bw + avx512_bf16: the activations are rounded to bf16 once
//                per call and each 32-column step is one vdpbf16ps per weight row (products
//                exact in f32, sums in f32).
//   kAvx2        avx2 + fma: each weight is widened to f32 with a shift and multiplied with
//                the f32 activation (the f32 kernel's arithmetic on the rounded weights).
// Error against the exact sum over the bf16 weights w and f32 activations x, S = sum |x_p w_p|:
//   kAvx2        <= gamma(k + 2) * S                       (gamma(n) = n u / (1 - n u), u = 2^-24)
//   kAvx512Bf16  <= (2^-8 + 2 gamma(k + 2)) * S            (x rounded to bf16: relative 2^-8 each)
// (bf16 rounding itself: relative error <= 2^-8, its unit roundoff.)
// Pure functions; callers split [0, n) output columns across threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pd::kernels::cpu {

enum class Bf16Kernel { kAvx2, kAvx512Bf16 };

const char* bf16KernelName(Bf16Kernel kernel);  // "avx2", "avx512bf16"
bool bf16KernelSupported(Bf16Kernel kernel);    // this CPU and OS can run it
Bf16Kernel bf16BestKernel();                    // decided once from CPUID

// Round to nearest even; NaN stays a (quiet) NaN, infinities stay infinite.
inline uint16_t f32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float bf16ToF32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
void f32ToBf16(const float* src, uint16_t* dst, size_t n);

// x: [m][ldx] (k used, f32), w: [n][k] bf16, y: [m][ldy] f32; computes columns [nBegin, nEnd):
// y[i][j] = sum_p x[i][p] * w[j][p] + beta * y[i][j]   (beta 0 ignores y's old contents).
// `kernel` must be supported. kAvx512Bf16 uses a thread-local buffer for the rounded x.
void linearSkinnyBf16(Bf16Kernel kernel, const float* x, int ldx, const uint16_t* w, float* y, int ldy, int m, int k,
                      int nBegin, int nEnd, float beta);

}  // namespace pd::kernels::cpu
