#include "tools/plan/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/clock.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_weights.h"

namespace pd::plan {

namespace {

struct Shape {
  int batch, tokensPerSeq, context;
};
// Prompt-heavy steps (compute) and decode batches (weights and KV): both sides of the fit.
// Decode at three contexts separates the weights' streaming from the KV context's paged
// reads; 2,048 because long prompts decode there (Mooncake's, scaled to 1,500 tokens), past
// the two shorter contexts the fit would otherwise extrapolate from.
constexpr Shape kShapes[] = {{1, 32, 0},   {1, 64, 0},   {1, 128, 0},  {1, 256, 0},  {1, 512, 0},  {1, 1024, 0},
                             {1, 1, 256},  {2, 1, 256},  {4, 1, 256},  {8, 1, 256},  {16, 1, 256}, {32, 1, 256},
                             {1, 1, 1024}, {4, 1, 1024}, {8, 1, 1024}, {1, 1, 2048}, {4, 1, 2048}};
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

constexpr int kRounds = 11;  // samples of each shape; the first warms caches and is dropped

// One shape's own Engine, over the shared weights, with its own KV cache: step() of a real
// Engine (scheduler, KV bookkeeping, forward, sampling: what a worker's loop runs each step).
// A prefill shape submits one request whose whole prompt is one chunk, steps once and
// cancels it; a decode shape keeps `batch` requests, prefilled to `context` tokens before the
// rounds, and steps them once a sample. Every prompt is distinct, so no prefix-cache hit
// shortens a prefill.
class ShapeRunner {
 public:
  static Result<std::unique_ptr<ShapeRunner>> create(std::shared_ptr<const engine::ModelWeights> weights,
                                                     const Shape& shape, int threads) {
    const engine::ModelConfig& cfg = weights->config;
    // Decode shapes grow by one token a round.
    const int perSeq = (shape.context + shape.tokensPerSeq + kRounds + kBlockSize) / kBlockSize;
    const engine::KvLayout layout = engine::kvLayoutFor(cfg, shape.batch * perSeq, kBlockSize);
    PD_ASSIGN_OR_RETURN(auto kv, engine::KvCacheManager::create(layout));
    engine::CpuBackendOptions bo;
    bo.numThreads = threads;
    PD_ASSIGN_OR_RETURN(auto backend, engine::createCpuBackend(std::move(weights), layout, kv->data(), bo));
    engine::EngineOptions eo;  // a worker's, with prefix caching off and room for the shape
    eo.scheduler.maxBatchTokens = std::max(shape.tokensPerSeq, 1024);
    eo.scheduler.maxNumSeqs = shape.batch;
    eo.scheduler.enablePrefixCaching = false;
    eo.scheduler.admissionWatermark = 0;  // the cache holds the shape exactly
    PD_RETURN_IF_ERROR(eo.scheduler.validate());
    auto r = std::unique_ptr<ShapeRunner>(new ShapeRunner(shape, cfg));
    r->engine_ = std::make_unique<engine::Engine>(std::move(backend), std::move(kv), eo);
    if (shape.tokensPerSeq == 1) PD_RETURN_IF_ERROR(r->formDecodeBatch());
    return r;
  }

  // Seconds of one step of the shape.
  Result<double> sample() {
    if (shape_.tokensPerSeq == 1) return timedStep();
    PD_ASSIGN_OR_RETURN(uint64_t id, submit(shape_.tokensPerSeq, 1));
    auto dt = timedStep();
    engine_->cancel(id);
    return dt;
  }

 private:
  ShapeRunner(const Shape& shape, const engine::ModelConfig& cfg)
      : shape_(shape), vocab_(cfg.vocabSize), eos_(cfg.eosTokenIds) {}

  Status formDecodeBatch() {
    std::vector<uint64_t> ids;
    for (int i = 0; i < shape_.batch; ++i) {
      PD_ASSIGN_OR_RETURN(uint64_t id, submit(shape_.context, kRounds + 4));
      ids.push_back(id);
    }
    for (int guard = 0;; ++guard) {
      bool decoding = true;
      for (uint64_t id : ids) decoding = decoding && engine_->find(id) && engine_->find(id)->numGenerated() >= 1;
      if (decoding) return Status::ok();
      if (guard > 1000) return internalError("plan --calibrate: the decode batch never formed");
      PD_RETURN_IF_ERROR(timedStep().status());
    }
  }

  Result<uint64_t> submit(int promptTokens, int maxTokens) {
    std::vector<int32_t> prompt(static_cast<size_t>(promptTokens));
    for (auto& t : prompt) {
      do nextToken_ = (nextToken_ + 1) % vocab_;
      while (std::find(eos_.begin(), eos_.end(), nextToken_) != eos_.end());
      t = nextToken_;
    }
    engine::SamplingParams sp;
    sp.temperature = 0;
    sp.maxTokens = maxTokens;
    sp.ignoreEos = true;
    const uint64_t id = nextId_++;
    PD_ASSIGN_OR_RETURN(auto r, engine::Request::create(id, std::move(prompt), sp, SystemClock::instance(), vocab_));
    PD_RETURN_IF_ERROR(engine_->submit(std::move(r)));
    return id;
  }

  Result<double> timedStep() {
    events_.clear();
    const auto t0 = std::chrono::steady_clock::now();
    PD_RETURN_IF_ERROR(engine_->step(&events_));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  Shape shape_;
  int vocab_;
  std::vector<int> eos_;
  std::unique_ptr<engine::Engine> engine_;
  std::vector<engine::EngineEvent> events_;
  uint64_t nextId_ = 1;
  int32_t nextToken_ = 0;
};

}  // namespace

Result<Calibration> calibrateCpu(const std::string& modelDir, int threads) {
  auto weights = engine::loadModel(modelDir);
  if (!weights.ok()) return weights.status();
  const engine::ModelConfig& cfg = (*weights)->config;
  std::vector<std::unique_ptr<ShapeRunner>> runners;
  for (const Shape& s : kShapes) {
    PD_ASSIGN_OR_RETURN(auto r, ShapeRunner::create(*weights, s, threads));
    runners.push_back(std::move(r));
  }
  // Rounds over every shape, not each shape's runs back to back: the machine's pace drifts
  // over seconds (a shared host, clocks), and the fit needs the shapes measured alike.
  std::vector<std::vector<double>> times(runners.size());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < runners.size(); ++i) {
      PD_ASSIGN_OR_RETURN(double dt, runners[i]->sample());
      if (round > 0) times[i].push_back(dt);
    }
  }

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
  for (size_t k = 0; k < std::size(kShapes); ++k) {
    const Shape& s = kShapes[k];
    CalibrationPoint p;
    p.batch = s.batch;
    p.tokensPerSeq = s.tokensPerSeq;
    p.context = s.context;
    std::nth_element(times[k].begin(), times[k].begin() + long(times[k].size() / 2), times[k].end());
    p.seconds = times[k][times[k].size() / 2];
    c.points.push_back(p);
    // The work of that step as the cost model counts it: the same sequences and lengths.
    std::vector<std::vector<int32_t>> tables(size_t(s.batch));
    std::vector<engine::SeqChunk> batch(size_t(s.batch));
    const int perSeq = (s.context + s.tokensPerSeq + kBlockSize - 1) / kBlockSize;
    for (int i = 0; i < s.batch; ++i) {
      tables[size_t(i)].resize(size_t(perSeq));
      engine::SeqChunk& ch = batch[size_t(i)];
      ch.numTokens = s.tokensPerSeq;
      ch.startPos = s.context;
      ch.blockTable = tables[size_t(i)].data();
      ch.numBlocks = perSeq;
      ch.wantLogits = true;
    }
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
    if (!withOverhead) ata[0][0] = 1;   // o = 0
    if (kvAtWeightRate) ata[3][3] = 1;  // k = 0 here, b below
    if (!solve(ata, atb, f->x)) return false;
    if (kvAtWeightRate) f->x[3] = f->x[2];
    if (!(f->x[0] >= 0) || !(f->x[1] > 0) || !(f->x[2] > 0) || !(f->x[3] > 0)) return false;
    f->halfRate = halfRate;
    f->sq = 0;
    for (size_t i = 0; i < c.points.size(); ++i) f->sq += std::pow(predict(*f, i) / c.points[i].seconds - 1, 2);
    return true;
  };
  Fit best;
  for (double halfRate : {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0, 256.0}) {
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
  // Measured over fitted at each point; points of one row count (decode at two contexts)
  // share their geometric mean.
  std::map<int, std::pair<double, int>> decode, prefill;  // rows -> (sum of log scale, points)
  for (const auto& p : c.points) {
    if (!(p.seconds > 0 && p.predicted > 0)) continue;
    auto& slot = p.tokensPerSeq == 1 ? decode[p.batch] : prefill[p.batch * p.tokensPerSeq];
    slot.first += std::log(p.seconds / p.predicted);
    ++slot.second;
  }
  for (auto [curve, points] : {std::pair{&d.decodeScale, &decode}, std::pair{&d.prefillScale, &prefill}})
    for (const auto& [rows, sum] : *points) curve->push_back({double(rows), std::exp(sum.first / sum.second)});
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
    j["points"].push_back({{"batch", p.batch},
                           {"tokens_per_seq", p.tokensPerSeq},
                           {"context", p.context},
                           {"seconds", p.seconds},
                           {"predicted", p.predicted}});
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
  if (j.contains("points")) {  // each point's measured and fitted time: the device's scale curves
    if (!j["points"].is_array()) return invalidArgument("--calibration " + path + ": \"points\" must be an array");
    for (const auto& p : j["points"]) {
      const auto positive = [&](const char* key) {
        return p.is_object() && p.contains(key) && p[key].is_number() && p[key].get<double>() > 0;
      };
      if (!positive("batch") || !positive("tokens_per_seq") || !positive("seconds") || !positive("predicted") ||
          !p.contains("context") || !p["context"].is_number_integer()) {
        return invalidArgument("--calibration " + path +
                               ": each of \"points\" needs positive batch, tokens_per_seq, seconds, predicted "
                               "and an integer context");
      }
      c.points.push_back({p["batch"].get<int>(), p["tokens_per_seq"].get<int>(), p["context"].get<int>(),
                          p["seconds"].get<double>(), p["predicted"].get<double>()});
    }
  }
  return c;
}

}  // namespace pd::plan
