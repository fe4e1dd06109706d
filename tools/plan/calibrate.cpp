#include "tools/plan/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/engine/cpu_backend.h"
#include "common/engine/model_weights.h"

namespace pd::plan {

namespace {

struct Shape {
  int batch, tokensPerSeq, context;
};
// Prompt-heavy steps (compute) and decode batches (weights and KV): both sides of the fit.
// Decode at two contexts separates the weights' streaming from the KV context's paged reads.
constexpr Shape kShapes[] = {{1, 32, 0},  {1, 128, 0}, {1, 512, 0},   {1, 1024, 0}, {1, 1, 256},
                             {4, 1, 256}, {16, 1, 256}, {32, 1, 256}, {1, 1, 1024}, {8, 1, 1024}};
constexpr int kUnknowns = 4;  // overhead, 1 / FLOP rate, 1 / weight bandwidth, 1 / KV bandwidth
constexpr int kBlockSize = 16;

// Solves the kUnknowns-square system a x = b (Gaussian elimination with partial pivoting);
// false if singular.
bool solve(double a[kUnknowns][kUnknowns], double b[kUnknowns], double x[kUnknowns]) {
  for (int c = 0; c < kUnknowns; ++c) {
    int p = c;
    for (int r = c + 1; r < kUnknowns; ++r)
      if (std::abs(a[r][c]) > std::abs(a[p][c])) p = r;
    if (std::abs(a[p][c]) < 1e-300) return false;
    std::swap(a[c], a[p]);
    std::swap(b[c], b[p]);
    for (int r = c + 1; r < kUnknowns; ++r) {
      const double f = a[r][c] / a[c][c];
      for (int k = c; k < kUnknowns; ++k) a[r][k] -= f * a[c][k];
      b[r] -= f * b[c];
    }
  }
  for (int c = kUnknowns - 1; c >= 0; --c) {
    double s = b[c];
    for (int k = c + 1; k < kUnknowns; ++k) s -= a[c][k] * x[k];
    x[c] = s / a[c][c];
  }
  return true;
}

}  // namespace

Result<Calibration> calibrateCpu(const std::string& modelDir, int threads) {
  auto weights = engine::loadModel(modelDir);
  if (!weights.ok()) return weights.status();
  const engine::ModelConfig& cfg = (*weights)->config;
  int maxBlocks = 0;
  for (const Shape& s : kShapes)
    maxBlocks = std::max(maxBlocks, s.batch * ((s.context + s.tokensPerSeq + kBlockSize - 1) / kBlockSize));
  const engine::KvLayout layout = engine::kvLayoutFor(cfg, maxBlocks, kBlockSize);
  std::vector<float> kv(layout.totalBytes() / sizeof(float));
  engine::CpuBackendOptions bo;
  bo.numThreads = threads;
  auto backend = engine::createCpuBackend(*weights, layout, kv.data(), bo);
  if (!backend.ok()) return backend.status();

  // The same shape through the cost model's accounting (dtype f32) gives each point's work.
  ModelShape shape;
  shape.name = modelDir;
  shape.config = cfg;
  shape.weightBytes = shape.kvBytes = 4;
  Device unit;
  unit.flops = unit.bytesPerS = 1;  // work() only
  const CostModel accounting(shape, unit);

  Calibration c;
  c.modelDir = modelDir;
  c.threads = threads;
  std::vector<StepWork> works;
  for (const Shape& s : kShapes) {
    std::vector<std::vector<int32_t>> tokens(size_t(s.batch), std::vector<int32_t>(size_t(s.tokensPerSeq), 7));
    std::vector<std::vector<int32_t>> tables(size_t(s.batch));
    std::vector<engine::SeqChunk> batch(size_t(s.batch));
    const int perSeq = (s.context + s.tokensPerSeq + kBlockSize - 1) / kBlockSize;
    for (int i = 0; i < s.batch; ++i) {
      tables[size_t(i)].resize(size_t(perSeq));
      std::iota(tables[size_t(i)].begin(), tables[size_t(i)].end(), i * perSeq);
      engine::SeqChunk& ch = batch[size_t(i)];
      ch.tokens = tokens[size_t(i)].data();
      ch.numTokens = s.tokensPerSeq;
      ch.startPos = s.context;
      ch.blockTable = tables[size_t(i)].data();
      ch.numBlocks = perSeq;
      ch.wantLogits = true;
    }
    std::vector<float> logits(size_t(s.batch) * size_t(cfg.vocabSize));
    const int runs = s.tokensPerSeq > 1 ? 3 : 9;
    std::vector<double> times;
    for (int r = 0; r <= runs; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      PD_RETURN_IF_ERROR((*backend)->forward(batch, logits.data()));
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) times.push_back(dt);  // the first run warms caches and the pool
    }
    std::nth_element(times.begin(), times.begin() + long(times.size() / 2), times.end());
    CalibrationPoint p;
    p.batch = s.batch;
    p.tokensPerSeq = s.tokensPerSeq;
    p.context = s.context;
    p.seconds = times[times.size() / 2];
    c.points.push_back(p);
    works.push_back(accounting.work(batch));
  }

  // Least squares of t = o + effective FLOPs * a + weight bytes * b + KV bytes * k on the
  // relative error (rows over t), for each half-rate row count on a grid; the best fit wins.
  // Noise (a busy machine, a model too small to separate the terms) can drive a term below
  // zero; then the fit is constrained: o = 0 first, then the KV context read at the weights'
  // rate (k = b), then both. FLOPs and weight bytes must keep positive rates.
  struct Fit {
    double x[kUnknowns] = {};
    double halfRate = 0;
    double sq = 1e300;
  };
  auto predict = [&](const Fit& f, size_t i) {
    return f.x[0] + works[i].effectiveFlops(f.halfRate) * f.x[1] + (works[i].bytes - works[i].kvBytes) * f.x[2] +
           works[i].kvBytes * f.x[3];
  };
  auto fitAt = [&](double halfRate, bool withOverhead, bool kvAtWeightRate, Fit* f) {
    double ata[kUnknowns][kUnknowns] = {}, atb[kUnknowns] = {};
    for (size_t i = 0; i < c.points.size(); ++i) {
      const double t = c.points[i].seconds;
      const double weights = works[i].bytes - works[i].kvBytes;
      const double row[kUnknowns] = {withOverhead ? 1 / t : 0, works[i].effectiveFlops(halfRate) / t,
                                     (kvAtWeightRate ? works[i].bytes : weights) / t,
                                     kvAtWeightRate ? 0 : works[i].kvBytes / t};
      for (int r = 0; r < kUnknowns; ++r) {
        for (int k = 0; k < kUnknowns; ++k) ata[r][k] += row[r] * row[k];
        atb[r] += row[r];  // target t / t = 1
      }
    }
    if (!withOverhead) ata[0][0] = 1;    // o = 0
    if (kvAtWeightRate) ata[3][3] = 1;   // k = 0 here, b below
    if (!solve(ata, atb, f->x)) return false;
    if (kvAtWeightRate) f->x[3] = f->x[2];
    if (!(f->x[0] >= 0) || !(f->x[1] > 0) || !(f->x[2] > 0) || !(f->x[3] > 0)) return false;
    f->halfRate = halfRate;
    f->sq = 0;
    for (size_t i = 0; i < c.points.size(); ++i) f->sq += std::pow(predict(*f, i) / c.points[i].seconds - 1, 2);
    return true;
  };
  Fit best;
  for (double halfRate : {0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0}) {
    Fit f;
    if (fitAt(halfRate, true, false, &f) || fitAt(halfRate, false, false, &f) || fitAt(halfRate, true, true, &f) ||
        fitAt(halfRate, false, true, &f)) {
      if (f.sq < best.sq) best = f;
    }
  }
  if (best.sq >= 1e300) {
    return failedPrecondition("plan --calibrate: the step times of " + modelDir +
                              " do not fit overhead + FLOPs/F + bytes/B with positive rates (a machine too noisy "
                              "to calibrate on? run it again on a quiet one)");
  }
  c.halfRateTokens = best.halfRate;
  c.stepOverheadMs = std::max(0.0, best.x[0]) * 1000;
  c.flopsPerS = 1 / best.x[1];
  c.bytesPerS = 1 / best.x[2];
  c.kvBytesPerS = 1 / best.x[3];
  for (size_t i = 0; i < c.points.size(); ++i) c.points[i].predicted = predict(best, i);
  double sq = 0;
  for (const auto& p : c.points) sq += std::pow((p.predicted - p.seconds) / p.seconds, 2);
  c.rmsRelativeError = std::sqrt(sq / double(c.points.size()));
  return c;
}

Device deviceOf(const Calibration& c, double linkBytesPerS) {
  Device d;
  d.name = "cpu (" + std::to_string(c.threads) + " thread" + (c.threads == 1 ? "" : "s") + ", calibrated)";
  d.flops = c.flopsPerS;
  d.bytesPerS = c.bytesPerS;
  d.kvBytesPerS = c.kvBytesPerS;
  d.peerBytesPerS = d.nicBytesPerS = linkBytesPerS;
  d.efficiency = Efficiency{1, 1, c.stepOverheadMs, c.halfRateTokens};
  d.additive = true;
  d.calibrated = true;
  return d;
}

Status writeCalibration(const std::string& path, const Calibration& c) {
  nlohmann::json j;
  j["model_dir"] = c.modelDir;
  j["threads"] = c.threads;
  j["dtype_bytes"] = c.dtypeBytes;
  j["flops_per_s"] = c.flopsPerS;
  j["bytes_per_s"] = c.bytesPerS;
  j["kv_bytes_per_s"] = c.kvBytesPerS;
  j["step_overhead_ms"] = c.stepOverheadMs;
  j["half_rate_tokens"] = c.halfRateTokens;
  j["rms_relative_error"] = c.rmsRelativeError;
  for (const auto& p : c.points) {
    j["points"].push_back({{"batch", p.batch}, {"tokens_per_seq", p.tokensPerSeq}, {"context", p.context},
                           {"seconds", p.seconds}, {"predicted", p.predicted}});
  }
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) return invalidArgument("plan --calibrate: cannot write " + path);
  return Status::ok();
}

Result<Calibration> readCalibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) return invalidArgument("--calibration: cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  Calibration c;
  auto number = [&](const char* key, double* out) -> Status {
    if (!j.is_object() || !j.contains(key) || !j[key].is_number() || !(j[key].get<double>() >= 0))
      return invalidArgument("--calibration " + path + ": \"" + key + "\" missing or not a non-negative number");
    *out = j[key].get<double>();
    return Status::ok();
  };
  double threads = 0, dtype = 0;
  PD_RETURN_IF_ERROR(number("flops_per_s", &c.flopsPerS));
  PD_RETURN_IF_ERROR(number("bytes_per_s", &c.bytesPerS));
  PD_RETURN_IF_ERROR(number("kv_bytes_per_s", &c.kvBytesPerS));
  PD_RETURN_IF_ERROR(number("step_overhead_ms", &c.stepOverheadMs));
  PD_RETURN_IF_ERROR(number("half_rate_tokens", &c.halfRateTokens));
  PD_RETURN_IF_ERROR(number("threads", &threads));
  PD_RETURN_IF_ERROR(number("dtype_bytes", &dtype));
  if (!(c.flopsPerS > 0 && c.bytesPerS > 0 && c.kvBytesPerS > 0))
    return invalidArgument("--calibration " + path + ": flops_per_s, bytes_per_s and kv_bytes_per_s must be positive");
  c.threads = int(threads);
  c.dtypeBytes = int(dtype);
  if (j.contains("model_dir") && j["model_dir"].is_string()) c.modelDir = j["model_dir"].get<std::string>();
  return c;
}

}  // namespace pd::plan
