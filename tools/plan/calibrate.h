// plan calibration: measure the real CPU backend's step times on a model and fit the cost
// model's device to them, so `pdserve plan` predicts this machine's workers
// (`pdserve plan --calibrate`, docs/plan.md "Calibration").
//
// Measured: step() of a real Engine on the CPU backend (scheduler, KV bookkeeping, forward,
// sampling) for prefill chunks of 32..1,024 tokens and decode batches of 1..32 streams at 256
// and 1,024 tokens of context, in rounds over every shape (the median of each shape's steps
// after a warm-up round), with the backend on `threads` threads. Fitted: step = overhead +
// FLOPs / F + weight bytes / B + KV bytes / K (a CPU does not overlap compute and memory
// traffic, and its paged attention reads KV slower than it streams weights), with the linear
// layers' rate falling off at few rows (Efficiency::halfRateTokens, searched on a grid),
// least squares on the relative error. Every point's measured and fitted time is kept in
// the file: deviceOf() turns their ratios into the device's scale curves (cost_model.h).
//
// Threads: calibrateCpu() runs its engines on the calling thread (and their pools); the file
// functions are pure I/O. Errors name the model directory or the file and the problem.
#pragma once

#include <string>
#include <vector>

#include "common/base/status.h"
#include "tools/plan/cost_model.h"

namespace pd::plan {

struct CalibrationPoint {
  int batch = 1;         // sequences in the step
  int tokensPerSeq = 1;  // 1: decode
  int context = 0;       // tokens already in each sequence's KV
  double seconds = 0;    // measured (median)
  double predicted = 0;  // by the fitted device
};

struct Calibration {
  std::string modelDir;
  int threads = 1;
  int dtypeBytes = 4;  // the CPU backend computes in f32
  double flopsPerS = 0;
  double bytesPerS = 0;    // streaming the weights
  double kvBytesPerS = 0;  // the KV context's paged reads
  double stepOverheadMs = 0;
  double halfRateTokens = 0;  // Efficiency::halfRateTokens
  double rmsRelativeError = 0;
  std::vector<CalibrationPoint> points;
};

Result<Calibration> calibrateCpu(const std::string& modelDir, int threads);

// The device a calibration describes, `linkBytesPerS` between its workers. It has no memory
// figure: a host's KV budget is engine.kv_cache_bytes (SimOptions::kvCacheBytes).
Device deviceOf(const Calibration& c, double linkBytesPerS);

Status writeCalibration(const std::string& path, const Calibration& c);
Result<Calibration> readCalibration(const std::string& path);

}  // namespace pd::plan
