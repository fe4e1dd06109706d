// plan::CostModel: how long one engine step takes on a device, and how long a prompt's KV
// takes to move between workers -- the only two things `pdserve plan`'s simulator does not
// run for real (tools/plan/cluster_sim.h runs the engine's own scheduler around them).
//
// A step is a roofline: time = overhead + max(FLOPs / (peak x compute efficiency),
// bytes / (bandwidth x memory efficiency)) + tensor-parallel all-reduces, where
//   FLOPs = 2 x linear params x tokens (q|k|v, o, gate|up, down)
//         + 4 x layers x q dim x (attended positions summed over the step's tokens)
//         + 2 x hidden x vocab x rows sampled;
//   bytes = the weights once per step + each chunk's KV context read once + the KV written.
// Divided by the tensor-parallel degree; each layer adds two ring all-reduces of the step's
// activations over the GPUs' peer link.
//
// A calibrated device (tools/plan/calibrate.h) is fitted the other way round: its FLOP/s
// and bytes/s are what the real engine achieved, at efficiency 1, and on a CPU compute and
// memory time add up (`additive`) instead of overlapping. The fit is a line through kernels
// that are not one (the CPU backend streams weights through its own kernel up to 32 rows and
// runs a GEMM above), so a calibrated step is also scaled by its measured over fitted time,
// interpolated between the calibration's points (Device::decodeScale, prefillScale).
//
// The efficiencies are what calibration measures (Efficiency's defaults are assumptions,
// docs/plan.md says which figures are measured). Pure and immutable: any thread.
#pragma once

#include <span>
#include <vector>

#include "engine/backend.h"
#include "tools/plan/hardware.h"

namespace pd::plan {

struct Efficiency {
  double compute = 0.6;         // of the dense peak, in prompt-heavy steps
  double memory = 0.8;          // of the bandwidth, in decode steps
  double stepOverheadMs = 1.0;  // per step: scheduling, launches, sampling
  // Matrix products over few rows run below the peak: the linear layers of a step of T
  // tokens reach T / (T + halfRateTokens) of it (0: always the peak). Calibrated on a CPU.
  double halfRateTokens = 0;
};

struct Device {
  std::string name;          // a GpuSpec name, or the calibrated local device
  double flops = 0;          // peak FLOP/s in the weights' dtype
  double bytesPerS = 0;      // memory bandwidth
  double kvBytesPerS = 0;    // for the KV context's paged reads, when calibrated apart (0: bytesPerS)
  double memoryBytes = 0;    // per device
  double peerBytesPerS = 0;  // device to device in a node
  double nicBytesPerS = 0;   // between nodes
  Efficiency efficiency;
  bool additive = false;    // compute + memory time (a CPU) instead of their max (a GPU)
  bool calibrated = false;  // fitted to measured steps of the engine
  // Measured over fitted step time at the calibration's points, piecewise linear in
  // log(rows) and flat beyond the ends: by decode streams for steps without prompt tokens,
  // by prompt tokens for steps with them (a mixed step's linear layers see both, and its
  // prompt tokens are most of its rows). Empty: no scaling (a GPU from its data sheet).
  struct ScalePoint {
    double rows = 0;
    double scale = 1;
  };
  std::vector<ScalePoint> decodeScale, prefillScale;  // rows ascending
};
// The scale at `rows` on a curve (1 when it is empty).
double scaleAt(const std::vector<Device::ScalePoint>& curve, double rows);
Device deviceOf(const GpuSpec& gpu, const Efficiency& e = {});

struct StepWork {
  double flops = 0;        // all of it
  double linearFlops = 0;  // of which the linear layers (the part whose rate depends on the rows)
  double bytes = 0;        // all of it
  double kvBytes = 0;      // of which the KV context read and written
  int64_t tokens = 0;
  // The FLOPs at the peak rate that take as long as this step's, for `halfRateTokens`.
  double effectiveFlops(double halfRateTokens) const {
    if (halfRateTokens <= 0 || tokens == 0) return flops;
    return flops - linearFlops + linearFlops * (double(tokens) + halfRateTokens) / double(tokens);
  }
};

class CostModel {
 public:
  CostModel(ModelShape model, Device device, int tensorParallel = 1);

  StepWork work(std::span<const engine::SeqChunk> batch) const;
  double stepSeconds(std::span<const engine::SeqChunk> batch) const;

  // The time from a prefill's end to its KV being in the decode worker, over a link of
  // `bytesPerS`: with the layer-by-layer push all but the last layer overlap the prefill
  // (`prefillSeconds`), so only what the link could not keep up with, plus the last layer, is left.
  double kvTransferSeconds(int64_t tokens, double bytesPerS, double prefillSeconds) const;

  // KV blocks one worker (all its tensor-parallel ranks) holds when it may use
  // `memoryUtilization` of each device: what is left after the weights and an activation
  // reserve; 0 when the weights do not fit. With `kvCacheBytes` > 0 (engine.kv_cache_bytes:
  // the whole cache), that many bytes instead.
  int64_t kvBlocks(int blockSize, double memoryUtilization, double kvCacheBytes = 0) const;
  double weightBytesPerDevice() const;

  const ModelShape& model() const { return model_; }
  const Device& device() const { return device_; }
  int tensorParallel() const { return tp_; }

 private:
  ModelShape model_;
  Device device_;
  int tp_;
  double linearParams_;  // per token, all layers
};

}  // namespace pd::plan
