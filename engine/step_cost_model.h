// The cost of a decode step as a function of its batch: step_ms = base + perStream * streams,
// fitted online by exponentially weighted least squares over the steps that decoded without
// prompt tokens (docs/serving.md "Overload"). The router predicts from it what one
// more stream would do to every stream's inter-token latency, before it admits that stream:
// the average step time alone says only that a worker is already past its target.
//
// Why a line: a decode step reads every weight once (the fixed part, which dominates small
// batches) and, per stream, its KV and one row of each GEMM; attention grows with context
// too, and the weighted fit follows the contexts of the recent steps.
//
// Threads: a plain value; its owner (the Engine) serialises.
#pragma once

#include <optional>

namespace pd::engine {

class StepCostModel {
 public:
  struct Line {
    double baseMs = 0;
    double perStreamMs = 0;
    // What a small prompt chunk (at most the engine's minimum chunk) adds to a decode step:
    // the least any step that prefills beside the streams costs on top of them. 0 until seen.
    double smallChunkMs = 0;
    double stepMs(int streams) const { return baseMs + perStreamMs * streams; }
  };

  // One step of `streams` decode rows and no prompt tokens took `ms`. Non-positive inputs
  // are ignored.
  void observe(int streams, double ms);
  // One step of `streams` decode rows and a small prompt chunk took `ms`: its excess over the
  // line is folded into smallChunkMs (ignored while there is no line).
  void observeSmallChunk(int streams, double ms);
  // The fitted line, once the recent steps spread over at least two batch sizes (one size
  // cannot split the fixed part from the per-stream part); nullopt before. Both parts are
  // clamped at 0: a noisy fit never predicts that more streams make a step faster.
  std::optional<Line> line() const;

 private:
  // Weight of the past at each new step: an effective window of ~50 steps, a few seconds of
  // decoding, so the line follows the contexts growing and the machine's load.
  static constexpr double kDecay = 0.98;
  double w_ = 0, n_ = 0, nn_ = 0, y_ = 0, ny_ = 0;  // weighted sums of 1, n, n^2, ms, n*ms
  double smallChunkMs_ = 0;                         // moving average of the excess
};

}  // namespace pd::engine
