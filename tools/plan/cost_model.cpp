#include "tools/plan/cost_model.h"

#include <algorithm>
#include <cmath>

namespace pd::plan {

Device deviceOf(const GpuSpec& gpu, const Efficiency& e) {
  Device d;
  d.name = gpu.name;
  d.flops = gpu.bf16Tflops * 1e12;
  d.bytesPerS = gpu.memoryGBps * 1e9;
  d.memoryBytes = gpu.memoryGiB * double(1ull << 30);
  d.peerBytesPerS = gpu.peerGBps * 1e9;
  d.nicBytesPerS = gpu.nicGbps * 1e9 / 8;
  d.efficiency = e;
  return d;
}

CostModel::CostModel(ModelShape model, Device device, int tensorParallel)
    : model_(std::move(model)), device_(std::move(device)), tp_(std::max(1, tensorParallel)) {
  linearParams_ = model_.linearParamsPerToken();
}

StepWork CostModel::work(std::span<const engine::SeqChunk> batch) const {
  const auto& c = model_.config;
  const double kvPerToken = double(model_.kvBytesPerToken());
  StepWork w;
  double attended = 0, contextBytes = 0;
  int logits = 0;
  for (const auto& ch : batch) {
    const double n = ch.numTokens, s = ch.startPos;
    w.tokens += ch.numTokens;
    attended += n * s + n * (n + 1) / 2;   // causal: token i sees s + i + 1 positions
    contextBytes += (s + n) * kvPerToken;  // read once per chunk, written n
    logits += ch.wantLogits ? 1 : 0;
  }
  w.linearFlops = 2 * linearParams_ * double(w.tokens);
  // Per attended (query, key) pair and layer: QK and AV, or MLA's absorbed form (scores over the
  // latent, the weighted sum over kv_lora_rank, every head).
  const double pairFlops = c.isMla() ? 2.0 * c.numHeads * (c.mla.latentDim() + c.mla.kvLoraRank) : 4.0 * c.qDim();
  w.flops = w.linearFlops + pairFlops * c.numLayers * attended + 2.0 * c.hiddenSize * c.vocabSize * logits;
  w.kvBytes = contextBytes;
  w.bytes = model_.paramsRead(w.tokens) * model_.weightBytes + contextBytes;
  return w;
}

double CostModel::stepSeconds(std::span<const engine::SeqChunk> batch) const {
  const StepWork w = work(batch);
  const Efficiency& e = device_.efficiency;
  const double compute = w.effectiveFlops(e.halfRateTokens) / tp_ / (device_.flops * e.compute);
  const double kvRate = device_.kvBytesPerS > 0 ? device_.kvBytesPerS : device_.bytesPerS;
  const double memory = ((w.bytes - w.kvBytes) / device_.bytesPerS + w.kvBytes / kvRate) / tp_ / e.memory;
  double allReduce = 0;
  if (tp_ > 1 && device_.peerBytesPerS > 0) {
    // Two ring all-reduces per layer over the step's activations, ~10 us of latency each.
    const double bytes = double(w.tokens) * model_.config.hiddenSize * model_.weightBytes;
    const double one = 2.0 * (tp_ - 1) / tp_ * bytes / device_.peerBytesPerS + 10e-6;
    allReduce = 2.0 * model_.config.numLayers * one;
  }
  double scale = 1;
  if (!device_.decodeScale.empty() || !device_.prefillScale.empty()) {
    int64_t promptTokens = 0, decodeRows = 0;
    for (const auto& ch : batch) {
      if (ch.numTokens == 1)
        ++decodeRows;
      else
        promptTokens += ch.numTokens;
    }
    scale = promptTokens > 0 ? scaleAt(device_.prefillScale, double(promptTokens))
                             : scaleAt(device_.decodeScale, double(decodeRows));
  }
  return scale * (e.stepOverheadMs / 1000 + (device_.additive ? compute + memory : std::max(compute, memory))) +
         allReduce;
}

double scaleAt(const std::vector<Device::ScalePoint>& curve, double rows) {
  if (curve.empty()) return 1;
  if (rows <= curve.front().rows) return curve.front().scale;
  if (rows >= curve.back().rows) return curve.back().scale;
  size_t k = 1;
  while (curve[k].rows < rows) ++k;
  const auto& a = curve[k - 1];
  const auto& b = curve[k];
  const double f = std::log(rows / a.rows) / std::log(b.rows / a.rows);
  return a.scale + f * (b.scale - a.scale);
}

double CostModel::kvTransferSeconds(int64_t tokens, double bytesPerS, double prefillSeconds) const {
  if (bytesPerS <= 0) return 0;
  const double total = double(tokens) * double(model_.kvBytesPerToken()) / bytesPerS;
  const double lastLayer = total / model_.config.numLayers;
  // Layers 0..L-2 are pushed while later layers compute; the link is the bound if slower.
  const double overlapped = total - lastLayer;
  const double computeWindow = prefillSeconds * (model_.config.numLayers - 1) / model_.config.numLayers;
  return std::max(0.0, overlapped - computeWindow) + lastLayer;
}

double CostModel::weightBytesPerDevice() const { return double(model_.params()) * model_.weightBytes / tp_; }

int64_t CostModel::kvBlocks(int blockSize, double memoryUtilization, double kvCacheBytes) const {
  if (kvCacheBytes > 0) return int64_t(kvCacheBytes / (double(model_.kvBytesPerToken()) * blockSize));
  // Activations of a 8k-token step plus workspace: a fixed reserve per device.
  constexpr double kActivationReserve = 2.0 * (1ull << 30);
  const double free = device_.memoryBytes * memoryUtilization - weightBytesPerDevice() - kActivationReserve;
  if (free <= 0) return 0;
  // Tensor parallelism splits the kv heads over the devices; a latent KV (MLA) has one
  // "head" that every device holds whole.
  const double blockBytes = double(model_.kvBytesPerToken()) * blockSize / (model_.config.isMla() ? 1 : tp_);
  return int64_t(free / blockBytes);
}

}  // namespace pd::plan
