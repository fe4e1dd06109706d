// plan calibration: measure the real CPU backend's step times on a model and fit the cost
// model's device to them, so `pdserve plan` predicts this machine's workers
// (`pdserve plan --calibrate`, docs/plan.md "Calibration").
//
// Measured: prefill chunks of 32..1,024 tokens and decode batches of 1..32 streams at 256
// and 1,024 tokens of context, each the median of several runs after a warm-up, with the
// backend on `threads` threads. Fitted: step = overhead + FLOPs / F + weight bytes / B +
// KV bytes / K (a CPU does not overlap compute and memory traffic, and its paged attention
// reads KV slower than it streams weights), with the linear layers' rate falling off at few
// rows (Efficiency::halfRateTokens, searched on a grid), least squares on the relative
// error; the residual of every point is kept in the file.
//
// Threads: calibrateCpu() runs the backend on the calling thread (and its pool); the file
// functions are pure I/O. Errors name the model directory or the file and the problem.
#pragma once

#include <string>
#include <vector>

#include "common/base/status.h"
#include "tools/plan/cost_model.h"

namespace pd::plan {

struct CalibrationPoint {
  int batch = 1;          // sequences in the step
  int tokensPerSeq = 1;   // 1: decode
  int context = 0;        // tokens already in each sequence's KV
  double seconds = 0;     // measured (median)
  double predicted = 0;   // by the fitted device
};

struct Calibration {
  std::string modelDir;
  int threads = 1;
  int dtypeBytes = 4;     // the CPU backend computes in f32
  double flopsPerS = 0;
  double bytesPerS = 0;       // streaming the weights
  double kvBytesPerS = 0;     // the KV context's paged reads
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
