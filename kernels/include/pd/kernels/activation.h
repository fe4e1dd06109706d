// SwiGLU for the Llama/Qwen2 MLP: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
//
// Pure function; no allocation, no threads; safe to call concurrently on disjoint rows.
#pragma once

namespace pd::kernels::cpu {

// gateUp: [numRows][2*ffn] with gate in columns [0, ffn) and up in [ffn, 2*ffn) (the fused
// gate|up projection's output), out: [numRows][ffn]. out must not alias gateUp.
void swiGlu(const float* gateUp, float* out, int numRows, int ffn);

}  // namespace pd::kernels::cpu
