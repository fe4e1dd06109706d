// streamWeightsToDevice: a bf16 checkpoint streamed through a bounded staging buffer to a
// "device" (host-memory copiers) arrives as the f32 loader's weights would in that dtype,
// sliced per tensor-parallel rank as tensor_parallel.h slices them, with the loader's host
// memory bounded by the staging size.
#include "engine/weight_stream.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include <catch2/catch.hpp>

#include "engine/model_weights.h"
#include "engine/tensor_parallel.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd;
using namespace pd::engine;

namespace {

std::string bf16Model(const std::string& name, const std::string& preset, bool bias) {
  MakeModelOptions o;
  o.preset = preset;
  o.dtype = "bf16";
  o.qkvBias = bias;
  o.seed = 11;
  return test::makeTestModel(name, o);
}

// The f32 host loader's weights: what the streamed images are compared with. Made once per
// directory for the life of the test process.
std::shared_ptr<const ModelWeights> hostWeights(const std::string& dir) {
  static std::map<std::string, std::shared_ptr<const ModelWeights>> made;
  auto& m = made[dir];
  if (!m) {
    auto r = loadModel(dir);
    REQUIRE(r.ok());
    m = *r;
  }
  return m;
}

// The device image must be `want` (host f32, exactly representable in bf16) in bf16.
void checkBf16(const DeviceTensor& t, const float* want, size_t n, const std::string& what) {
  INFO(what);
  REQUIRE(t.data != nullptr);
  REQUIRE(t.dtype == TensorDtype::kBF16);
  REQUIRE(t.bytes == n * 2);
  const auto* got = static_cast<const uint16_t*>(t.data);
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += got[i] != f32ToBf16(want[i]);
  CHECK(bad == 0);
}
void checkF32(const DeviceTensor& t, const float* want, size_t n, const std::string& what) {
  INFO(what);
  REQUIRE(t.data != nullptr);
  REQUIRE(t.dtype == TensorDtype::kF32);
  REQUIRE(t.bytes == n * 4);
  CHECK(std::memcmp(t.data, want, n * 4) == 0);
}
void checkBf16(const DeviceTensor& t, const std::vector<float>& want, const std::string& what) {
  checkBf16(t, want.data(), want.size(), what);
}

int64_t procStatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key));
  return -1;
}
// Resets the peak resident set (VmHWM) to the current one; false where the kernel refuses.
bool resetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.close();
  return bool(f);
}

// A device that keeps nothing: it counts and checksums what arrives, so the process's
// resident set during the load is the loader's own memory.
class DiscardingCopier final : public DeviceWeightCopier {
 public:
  Result<void*> allocStaging(size_t bytes) override { return host_.allocStaging(bytes); }
  void freeStaging(void* p) override { host_.freeStaging(p); }
  Result<void*> allocDevice(size_t bytes) override {
    void* fake = reinterpret_cast<void*>(uintptr_t(1) << 40 | next_);
    next_ += (bytes + 255) / 256 * 256;
    return fake;
  }
  Status copyAsync(void*, const void* src, size_t bytes) override {
    const auto* p = static_cast<const uint8_t*>(src);
    for (size_t i = 0; i < bytes; ++i) sum_ = sum_ * 1099511628211ull ^ p[i];
    copied_ += bytes;
    return Status::ok();
  }
  Status waitCopies() override { return Status::ok(); }
  uint64_t copied_ = 0, sum_ = 1469598103934665603ull;

 private:
  HostWeightCopier host_;
  uintptr_t next_ = 0;
};

}  // namespace

TEST_CASE("a bf16 model streams to the device in bf16: the bytes the f32 loader reads, fused") {
  const std::string dir = bf16Model("stream_tiny_bf16_bias", "tiny", true);
  const ModelWeights& w = *hostWeights(dir);
  const ModelConfig& c = w.config;

  HostWeightCopier dev;
  WeightStreamOptions o;
  o.stagingBytes = 64 << 10;  // the minimum: many chunks per tensor, both halves in use
  WeightLoadStats stats;
  auto m = streamWeightsToDevice(dir, c, o, dev, &stats);
  REQUIRE(m.ok());
  checkBf16(m->embed, w.embed.data(), w.embed.size(), "embed");
  checkBf16(m->lmHead, w.lmHead.data(), w.lmHead.size(), "lm_head");
  checkF32(m->finalNorm, w.finalNorm.data(), w.finalNorm.size(), "model.norm");
  REQUIRE(m->layers.size() == size_t(c.numLayers));
  for (int l = 0; l < c.numLayers; ++l) {
    const LayerWeights& hl = w.layers[l];
    const DeviceLayer& dl = m->layers[l];
    const std::string at = "layer " + std::to_string(l);
    checkF32(dl.inputNorm, hl.inputNorm.data(), hl.inputNorm.size(), at + " input norm");
    checkF32(dl.postNorm, hl.postNorm.data(), hl.postNorm.size(), at + " post norm");
    checkBf16(dl.qkv, hl.qkv.data(), hl.qkv.size(), at + " q|k|v");
    checkF32(dl.qkvBias, hl.qkvBias.data(), hl.qkvBias.size(), at + " q|k|v bias");
    checkBf16(dl.o, hl.o.data(), hl.o.size(), at + " o_proj");
    checkBf16(dl.gateUp, hl.gateUp.data(), hl.gateUp.size(), at + " gate|up");
    checkBf16(dl.down, hl.down.data(), hl.down.size(), at + " down_proj");
    CHECK(dl.oBias.data == nullptr);  // the model has none
  }
  // Everything that arrived was copied through the staging buffer; nothing else was held.
  CHECK(stats.deviceBytes == dev.bytesCopied());
  CHECK(m->deviceBytes == dev.deviceBytesAllocated());
  // bf16 in, bf16 matrices and f32 norms/biases out: every stored byte was read once.
  auto file = SafetensorsFile::open(dir + "/model.safetensors");
  REQUIRE(file.ok());
  uint64_t stored = 0, storedVectors = 0;
  for (const auto& [name, info] : file->tensors()) {
    stored += info.end - info.begin;
    if (info.shape.size() == 1) storedVectors += info.end - info.begin;
  }
  CHECK(stats.fileBytesRead == stored);
  CHECK(stats.deviceBytes == stored + storedVectors);  // the vectors doubled to f32
  CHECK(dev.stagingBytesAllocated() == stats.stagingBytes);
  CHECK(stats.stagingBytes <= o.stagingBytes);
  CHECK(stats.copies > int64_t(7 * c.numLayers));
  CHECK(stats.seconds > 0);
}

// Qwen3's q/k norms and the mixture-of-experts layers (Mixtral's block_sparse_moe names,
// Qwen3-MoE's mlp names and its dense layer 0): router in f32, each expert's gate|up and down
// in bf16, every value the f32 loader's; a MoE layer has no dense MLP. At
// tensor_parallel_size 2 a MoE model is refused by name (no expert parallelism).
TEST_CASE("qwen3 norms and mixture-of-experts layers stream as the f32 loader reads them") {
  for (const char* arch : {"qwen3", "qwen3_moe", "mixtral"}) {
    DYNAMIC_SECTION(arch) {
      MakeModelOptions mo;
      mo.preset = "tiny";
      mo.dtype = "bf16";
      mo.arch = arch;
      mo.seed = 11;
      const std::string dir = test::makeTestModel(std::string("stream_tiny_bf16_") + arch, mo);
      const ModelWeights& w = *hostWeights(dir);
      const ModelConfig& c = w.config;
      HostWeightCopier dev;
      WeightStreamOptions o;
      o.stagingBytes = 64 << 10;
      WeightLoadStats stats;
      auto m = streamWeightsToDevice(dir, c, o, dev, &stats);
      REQUIRE(m.status().toString() == "OK");
      int moeLayers = 0;
      for (int l = 0; l < c.numLayers; ++l) {
        const LayerWeights& hl = w.layers[l];
        const DeviceLayer& dl = m->layers[l];
        const std::string at = std::string(arch) + " layer " + std::to_string(l);
        if (c.qkNorm) {
          checkF32(dl.qNorm, hl.qNorm.data(), hl.qNorm.size(), at + " q_norm");
          checkF32(dl.kNorm, hl.kNorm.data(), hl.kNorm.size(), at + " k_norm");
        } else {
          CHECK(dl.qNorm.data == nullptr);
        }
        if (!c.isMoeLayer(l)) {
          CHECK(dl.experts.empty());
          checkBf16(dl.gateUp, hl.gateUp.data(), hl.gateUp.size(), at + " gate|up");
          continue;
        }
        ++moeLayers;
        checkF32(dl.router, hl.router.data(), hl.router.size(), at + " router");
        CHECK(dl.routerBias.empty());
        CHECK(dl.gateUp.data == nullptr);  // no shared experts
        REQUIRE(dl.experts.size() == size_t(c.moe.numExperts));
        for (int e = 0; e < c.moe.numExperts; ++e) {
          // The loader keeps experts rows8 (model_weights.h); the stream row-major.
          const auto gateUp = hl.experts[e].gateUpRowMajor(c.hiddenSize),
                     down = hl.experts[e].downRowMajor(c.hiddenSize);
          checkBf16(dl.experts[e].gateUp, gateUp.data(), gateUp.size(), at + " expert gate|up");
          checkBf16(dl.experts[e].down, down.data(), down.size(), at + " expert down");
        }
      }
      CHECK(moeLayers == (std::string(arch) == "qwen3" ? 0 : std::string(arch) == "qwen3_moe" ? 1 : 2));
      if (c.isMoe()) {
        o.tensorParallelSize = 2;
        HostWeightCopier dev2;
        auto tp = streamWeightsToDevice(dir, c, o, dev2, &stats);
        REQUIRE_FALSE(tp.ok());
        CHECK(tp.status().code() == StatusCode::kUnimplemented);
        CHECK(tp.status().message().find("expert parallelism is not implemented") != std::string::npos);
      }
    }
  }
}

// An FP8 block-scaled Mixtral streamed with keepFp8 (as the CUDA backend loads it): the
// attention projections stay FP8 codes, the experts arrive dequantized in bf16 -- the f32
// loader's dequantized values rounded once -- since the expert GEMMs take the weight dtype only.
TEST_CASE("an fp8 mixtral keeps its attention fp8 and streams its experts dequantized") {
  MakeModelOptions mo;
  mo.preset = "tiny";
  mo.dtype = "bf16";
  mo.arch = "mixtral";
  mo.quantization = "fp8";
  mo.seed = 11;
  const std::string dir = test::makeTestModel("stream_tiny_fp8_mixtral", mo);
  const ModelWeights& w = *hostWeights(dir);
  const ModelConfig& c = w.config;
  REQUIRE(c.quantization.fp8);
  HostWeightCopier dev;
  WeightStreamOptions o;
  o.keepFp8 = true;
  WeightLoadStats stats;
  auto m = streamWeightsToDevice(dir, c, o, dev, &stats);
  REQUIRE(m.status().toString() == "OK");
  for (int l = 0; l < c.numLayers; ++l) {
    const DeviceLayer& dl = m->layers[l];
    const std::string at = "layer " + std::to_string(l);
    CHECK(dl.qkv.dtype == TensorDtype::kF8E4M3);
    checkF32(dl.router, w.layers[l].router.data(), w.layers[l].router.size(), at + " router");
    REQUIRE(dl.experts.size() == size_t(c.moe.numExperts));
    for (int e = 0; e < c.moe.numExperts; ++e) {
      const ExpertWeights& he = w.layers[l].experts[e];  // rows8 (model_weights.h): row-major copies
      const auto gateUp = he.gateUpRowMajor(c.hiddenSize), down = he.downRowMajor(c.hiddenSize);
      checkBf16(dl.experts[e].gateUp, gateUp.data(), gateUp.size(), at + " expert gate|up");
      checkBf16(dl.experts[e].down, down.data(), down.size(), at + " expert down");
    }
  }
}

TEST_CASE("matrices stream in the dtype the device asks for: bf16 widened to f32 exactly") {
  const std::string dir = bf16Model("stream_tiny_bf16", "tiny", false);
  auto host = loadModel(dir);
  REQUIRE(host.ok());
  HostWeightCopier dev;
  WeightStreamOptions o;
  o.matrixDtype = TensorDtype::kF32;
  o.stagingBytes = 64 << 10;
  WeightLoadStats stats;
  auto m = streamWeightsToDevice(dir, (*host)->config, o, dev, &stats);
  REQUIRE(m.ok());
  const LayerWeights& hl = (*host)->layers[1];
  checkF32(m->layers[1].qkv, hl.qkv.data(), hl.qkv.size(), "q|k|v");
  checkF32(m->layers[1].down, hl.down.data(), hl.down.size(), "down_proj");
  checkF32(m->embed, (*host)->embed.data(), (*host)->embed.size(), "embed");
  // Read in bf16, sent in f32: the device got twice the bytes of the file's matrices.
  CHECK(stats.deviceBytes > stats.fileBytesRead);
}

TEST_CASE("a tensor-parallel rank streams only its slices, as tensor_parallel.h cuts them") {
  const std::string dir = bf16Model("stream_tiny_bf16_bias", "tiny", true);
  const ModelWeights& w = *hostWeights(dir);
  const ModelConfig& c = w.config;
  auto plan = planTensorParallel(c, 2);
  REQUIRE(plan.ok());
  WeightLoadStats whole;
  {
    HostWeightCopier dev;
    WeightStreamOptions o;
    REQUIRE(streamWeightsToDevice(dir, c, o, dev, &whole).ok());
  }
  uint64_t readByRanks = 0;
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    HostWeightCopier dev;
    WeightStreamOptions o;
    o.tensorParallelSize = 2;
    o.rank = r;
    o.stagingBytes = 64 << 10;
    WeightLoadStats stats;
    auto m = streamWeightsToDevice(dir, c, o, dev, &stats);
    REQUIRE(m.ok());
    const size_t h = size_t(c.hiddenSize);
    for (int l = 0; l < c.numLayers; ++l) {
      const LayerWeights& hl = w.layers[l];
      const DeviceLayer& dl = m->layers[l];
      const auto qkvRows = plan->qkvRows(r);
      const auto guRows = plan->gateUpRows(r);
      checkBf16(dl.qkv, sliceRows(hl.qkv.data(), h, qkvRows), "q|k|v rows");
      checkBf16(dl.gateUp, sliceRows(hl.gateUp.data(), h, guRows), "gate|up rows");
      checkBf16(dl.o, sliceColumns(hl.o.data(), h, plan->qDim(), plan->oColumns(r)), "o_proj columns");
      checkBf16(dl.down, sliceColumns(hl.down.data(), h, plan->ffn(), plan->downColumns(r)), "down columns");
      const auto bias = sliceRows(hl.qkvBias.data(), 1, qkvRows);
      checkF32(dl.qkvBias, bias.data(), bias.size(), "q|k|v bias rows");
    }
    checkBf16(m->embed, w.embed.data(), w.embed.size(), "embed (replicated)");
    CHECK((m->finalNorm.data != nullptr) == (r == 0));
    CHECK((m->lmHead.data != nullptr) == (r == 0));
    readByRanks += stats.fileBytesRead;
    // A rank reads its half of the layers plus the replicated embedding, not the model.
    CHECK(stats.fileBytesRead < whole.fileBytesRead * 3 / 4);
  }
  // Together the ranks read every byte once, plus what both hold: the embedding and the
  // two norms of every layer (bf16).
  CHECK(readByRanks == whole.fileBytesRead + w.embed.size() * 2 + uint64_t(c.numLayers) * 2 * c.hiddenSize * 2);
}

TEST_CASE("the loader's host memory stays within its staging buffer (peak resident set measured)") {
  // The small preset in bf16: ~46 MB of weights (~92 MB once in f32), against 4 MiB staging.
  const std::string dir = bf16Model("stream_small_bf16", "small", false);
  auto config = loadModelConfig(dir);
  REQUIRE(config.ok());
  if (!resetPeakRss()) {
    WARN("/proc/self/clear_refs refused: peak RSS not measured");
    return;
  }
  const int64_t baseKb = procStatusKb("VmRSS:");
  DiscardingCopier dev;
  WeightStreamOptions o;
  o.stagingBytes = 4 << 20;
  WeightLoadStats stats;
  auto m = streamWeightsToDevice(dir, *config, o, dev, &stats);
  REQUIRE(m.ok());
  const int64_t streamPeakKb = procStatusKb("VmHWM:") - baseKb;
  CHECK(dev.copied_ == stats.deviceBytes);

  // The f32 host loader, for contrast: the whole model in host memory.
  REQUIRE(resetPeakRss());
  const int64_t base2Kb = procStatusKb("VmRSS:");
  int64_t hostPeakKb = 0;
  {
    auto host = loadModel(dir);
    REQUIRE(host.ok());
    hostPeakKb = procStatusKb("VmHWM:") - base2Kb;
  }
  std::printf(
      "weight stream: %.1f MiB of bf16 weights in %.3f s, staging %zu KiB, peak RSS growth %lld KiB "
      "(f32 host loader: %lld KiB)\n",
      double(stats.deviceBytes) / (1 << 20), stats.seconds, stats.stagingBytes >> 10, (long long)streamPeakKb,
      (long long)hostPeakKb);
  CHECK(stats.deviceBytes > uint64_t(40) << 20);
  CHECK(streamPeakKb * 1024 < int64_t(o.stagingBytes) + (4 << 20));  // staging + bookkeeping
  CHECK(hostPeakKb * 1024 > int64_t(stats.deviceBytes) * 3 / 2);     // the f32 copy, for scale
}

TEST_CASE("streaming errors name the tensor, the shapes or the staging size") {
  const std::string dir = bf16Model("stream_tiny_bf16", "tiny", false);
  auto config = loadModelConfig(dir);
  REQUIRE(config.ok());
  HostWeightCopier dev;
  {
    ModelConfig wrong = *config;
    wrong.intermediateSize += 2;
    auto m = streamWeightsToDevice(dir, wrong, {}, dev, nullptr);
    REQUIRE(!m.ok());
    CHECK_THAT(m.status().message(), Catch::Contains("mlp.gate_proj.weight has shape"));
  }
  {
    ModelConfig bias = *config;
    bias.qkvBias = true;
    auto m = streamWeightsToDevice(dir, bias, {}, dev, nullptr);
    REQUIRE(!m.ok());
    CHECK_THAT(m.status().message(), Catch::Contains("missing tensor model.layers.0.self_attn.q_proj.bias"));
  }
  {
    WeightStreamOptions o;
    o.stagingBytes = 1000;
    auto m = streamWeightsToDevice(dir, *config, o, dev, nullptr);
    REQUIRE(!m.ok());
    CHECK(m.status().message() == "weight stream: stagingBytes 1000 is below the 64 KiB minimum");
  }
  {
    WeightStreamOptions o;
    o.tensorParallelSize = 3;
    auto m = streamWeightsToDevice(dir, *config, o, dev, nullptr);
    REQUIRE(!m.ok());
    CHECK_THAT(m.status().message(), Catch::Contains("tensor_parallel_size 3"));
  }
}
