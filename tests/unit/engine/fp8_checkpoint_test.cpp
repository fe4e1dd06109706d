// FP8 block-scaled checkpoints (engine/fp8_blocks.h; docs/models.md, "FP8 checkpoints"): the
// e4m3 codec against the format's definition (all 256 codes, rounding, saturation, NaN), block
// dequantization against a reference with partial edge blocks, the quantization_config
// refusals, Checkpoint's errors, a model loaded from an FP8 checkpoint against the same
// weights dequantized by this test into an f32 checkpoint (identical logits), its greedy
// agreement with the f32 original (measured, bounded), and the streaming loader's images of an
// FP8 checkpoint (bf16 and f32, tensor-parallel slices) against the host loader's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/fp8_blocks.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/tensor_parallel.h"
#include "engine/weight_stream.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd;
using namespace pd::engine;
using namespace pd::engine::test;

namespace {

// The e4m3fn value of a code from the format's definition, computed independently of the
// library (double arithmetic, std::pow): NaN for S.1111.111.
double e4m3Reference(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

// The code f32ToE4m3 must give: the nearest finite value, ties to the even code (mantissa
// LSB 0), magnitudes past 448 saturated. Brute force over the 127 non-negative finite codes.
int nearestCode(double x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= 448) return sign | 0x7e;
  int best = 0;
  double bestErr = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x7f; ++c) {
    const double err = std::fabs(e4m3Reference(c) - a);
    if (err < bestErr || (err == bestErr && (c & 1) == 0)) {
      best = c;
      bestErr = err;
    }
  }
  return sign | best;
}

std::string readText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string fp8Model(const std::string& name, const std::string& preset, const std::string& dtype, uint64_t seed) {
  MakeModelOptions o;
  o.preset = preset;
  o.dtype = dtype;
  o.seed = seed;
  o.quantization = "fp8";
  return makeTestModel(name, o);
}

// Writes `dir` (once): the FP8 checkpoint `src` with every F8_E4M3 tensor dequantized by this
// test (e4m3Reference * its block's scale, rounded to f32 once) and stored F32, the scales
// dropped, and config.json without quantization_config.
std::string dequantizedCopy(const std::string& src, const std::string& name) {
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/" + name;
  if (std::filesystem::exists(dir + "/config.json")) return dir;
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  std::filesystem::create_directories(tmp);
  std::vector<std::string> files{"model.safetensors"};
  if (std::filesystem::exists(src + "/model.safetensors.index.json")) {
    files.clear();
    std::set<std::string> shards;
    const auto index = nlohmann::json::parse(readText(src + "/model.safetensors.index.json"));
    for (const auto& [t, file] : index.at("weight_map").items()) shards.insert(file.get<std::string>());
    files.assign(shards.begin(), shards.end());
  }
  std::vector<SafetensorsFile> opened;
  for (const auto& file : files) {
    auto f = SafetensorsFile::open(src + "/" + file);
    REQUIRE(f.ok());
    opened.push_back(std::move(*f));
  }
  // A tensor's file, wherever the shards put it (a weight and its scales may be apart).
  auto fileOf = [&](const std::string& tname) -> const SafetensorsFile& {
    for (const auto& f : opened)
      if (f.find(tname)) return f;
    FAIL("no tensor " << tname);
    return opened[0];
  };
  auto cfg = nlohmann::json::parse(readText(src + "/config.json"));
  const std::vector<int> block = cfg.at("quantization_config").at("weight_block_size").get<std::vector<int>>();
  cfg.erase("quantization_config");
  std::vector<TensorToWrite> out;
  int quantized = 0;
  for (const auto& f : opened)
    for (const auto& [tname, info] : f.tensors()) {
      if (tname.size() > 10 && tname.compare(tname.size() - 10, 10, "_scale_inv") == 0) continue;
      TensorToWrite t{tname, info.dtype, info.shape, std::vector<uint8_t>(info.end - info.begin)};
      REQUIRE(f.readBytes(tname, 0, t.bytes.size(), t.bytes.data()).isOk());
      if (info.dtype == TensorDtype::kF8E4M3) {
        ++quantized;
        const SafetensorsFile& sf = fileOf(tname + "_scale_inv");
        std::vector<float> scales(size_t(sf.find(tname + "_scale_inv")->numel()));
        REQUIRE(sf.readF32(tname + "_scale_inv", scales.data()).isOk());
        const int64_t rows = info.shape[0], cols = info.shape[1], bpr = (cols + block[1] - 1) / block[1];
        std::vector<uint8_t> wide(t.bytes.size() * 4);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const double sc = scales[size_t((r / block[0]) * bpr + c / block[1])];
            const float v = float(e4m3Reference(t.bytes[size_t(r * cols + c)]) * sc);
            std::memcpy(wide.data() + size_t(r * cols + c) * 4, &v, 4);
          }
        t.dtype = TensorDtype::kF32;
        t.bytes = std::move(wide);
      }
      out.push_back(std::move(t));
    }
  REQUIRE(quantized > 0);
  REQUIRE(writeSafetensors(tmp + "/model.safetensors", out, {}).isOk());
  std::ofstream(tmp + "/config.json") << cfg.dump(2);
  std::error_code ec;
  std::filesystem::rename(tmp, dir, ec);
  if (ec) std::filesystem::remove_all(tmp);
  return dir;
}

// Prefills `prompt`, then feeds `forced` one token a step: the logits rows (1 + forced.size()).
std::vector<std::vector<float>> runForced(Backend& backend, TestKv& kv, const std::vector<int32_t>& prompt,
                                          const std::vector<int32_t>& forced) {
  const int vocab = backend.config().vocabSize;
  const int total = int(prompt.size() + forced.size());
  auto table = kv.take((total + kv.layout.blockSize - 1) / kv.layout.blockSize);
  std::vector<std::vector<float>> rows;
  std::vector<float> logits(vocab);
  SeqChunk c{prompt.data(), int(prompt.size()), 0, table.data(), int(table.size()), true};
  REQUIRE(backend.forward({&c, 1}, logits.data()).toString() == "OK");
  rows.push_back(logits);
  for (size_t i = 0; i < forced.size(); ++i) {
    SeqChunk d{&forced[i], 1, int(prompt.size() + i), table.data(), int(table.size()), true};
    REQUIRE(backend.forward({&d, 1}, logits.data()).toString() == "OK");
    rows.push_back(logits);
  }
  return rows;
}

// Four fixed prompts of 24 tokens, prefill + 16 greedy steps on each model. Free-running (the
// measure of quantized_weights_test.cpp): agreement = generated tokens equal at the same
// position; logit error = max |b - a| / max |a| over the rows computed from the same tokens
// (to the first divergence). Teacher-forced: model b is fed a's tokens, so every one of the
// 4 x 17 rows compares the two on the same input: top-1 agreement and the logit error over
// all rows.
struct Agreement {
  int same = 0, total = 0;
  double worst = 0;
  int forcedSame = 0, forcedTotal = 0;
  double forcedWorst = 0, forcedMaxAbs = 0;
};
Agreement agreement(std::shared_ptr<const ModelWeights> a, std::shared_ptr<const ModelWeights> b,
                    CpuBackendOptions bOptions = {}) {
  Agreement r;
  auto argmax = [](const std::vector<float>& v) { return std::max_element(v.begin(), v.end()) - v.begin(); };
  for (uint64_t seed : {11, 12, 13, 14}) {
    const auto prompt = testPrompt(24, seed);
    TestKv kv1(a->config, 16), kv2(b->config, 16);
    auto ba = makeBackend(a, kv1);
    auto bb = makeBackend(b, kv2, bOptions);
    std::vector<int32_t> g1, g2;
    const auto r1 = runGreedy(*ba, kv1, prompt, 0, 16, &g1);
    const auto r2 = runGreedy(*bb, kv2, prompt, 0, 16, &g2);
    size_t diverge = 0;
    while (diverge < g1.size() && g1[diverge] == g2[diverge]) ++diverge;
    for (size_t i = 0; i < g1.size(); ++i) r.same += g1[i] == g2[i];
    r.total += int(g1.size());
    for (size_t i = 0; i <= diverge && i < r1.size(); ++i) r.worst = std::max(r.worst, relError(r2[i], r1[i]));
    const auto f2 = runForced(*bb, kv2, prompt, g1);
    REQUIRE(f2.size() == r1.size());
    for (size_t i = 0; i < r1.size(); ++i) {
      r.forcedSame += argmax(r1[i]) == argmax(f2[i]);
      ++r.forcedTotal;
      r.forcedWorst = std::max(r.forcedWorst, relError(f2[i], r1[i]));
      for (size_t v = 0; v < r1[i].size(); ++v)
        r.forcedMaxAbs = std::max(r.forcedMaxAbs, double(std::fabs(r1[i][v] - f2[i][v])));
    }
  }
  return r;
}

std::string configWith(const std::string& quantizationConfig, const std::string& arch = "LlamaForCausalLM") {
  return R"({"architectures": [")" + arch +
         R"("], "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259,
             "quantization_config": )" +
         quantizationConfig + "}";
}

std::string configError(const std::string& quantizationConfig) {
  auto c = parseModelConfig(configWith(quantizationConfig), "config.json");
  REQUIRE(!c.ok());
  return c.status().toString();
}

}  // namespace

TEST_CASE("e4m3: every code decodes to the format's value and encodes back to itself") {
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    INFO("code " << code);
    const double want = e4m3Reference(code);
    const float got = e4m3ToF32(uint8_t(code));
    if (std::isnan(want)) {
      ++nans;
      CHECK(std::isnan(got));
      CHECK((f32ToE4m3(got) & 0x7f) == 0x7f);  // NaN stays NaN
      continue;
    }
    CHECK(double(got) == want);
    CHECK(f32ToE4m3(got) == code);  // incl. -0 (0x80) keeping its sign
  }
  CHECK(nans == 2);
  // Strictly increasing over the non-negative finite codes; the extremes are the format's.
  for (int code = 1; code < 0x7f; ++code) CHECK(e4m3ToF32(uint8_t(code)) > e4m3ToF32(uint8_t(code - 1)));
  CHECK(e4m3ToF32(0x7e) == 448.0f);
  CHECK(e4m3ToF32(0x01) == std::ldexp(1.0f, -9));
  CHECK(e4m3ToF32(0x08) == std::ldexp(1.0f, -6));
}

TEST_CASE("e4m3 rounding: nearest, ties to even, saturation past 448, NaN kept") {
  // Every midpoint between neighbouring codes (a tie) and points just either side of it.
  for (int code = 0; code < 0x7e; ++code) {
    const double lo = e4m3Reference(code), hi = e4m3Reference(code + 1), mid = (lo + hi) / 2;
    INFO("between codes " << code << " and " << code + 1);
    const int even = (code & 1) == 0 ? code : code + 1;
    CHECK(f32ToE4m3(float(mid)) == even);
    CHECK(f32ToE4m3(float(-mid)) == (0x80 | even));
    CHECK(f32ToE4m3(std::nextafter(float(mid), 0.0f)) == code);
    CHECK(f32ToE4m3(std::nextafter(float(mid), 1000.0f)) == code + 1);
  }
  // Random values across the whole range, subnormals included, against the brute force.
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> expo(-12, 9.5);
  int bad = 0;
  for (int i = 0; i < 20000; ++i) {
    const float x = float((rng() & 1 ? -1 : 1) * std::pow(2.0, expo(rng)));
    bad += f32ToE4m3(x) != nearestCode(x);
  }
  CHECK(bad == 0);
  // Saturation: past 448 (464 would round up to 480, which e4m3fn does not have) and infinity.
  for (float x : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::max()}) {
    INFO(x);
    CHECK(f32ToE4m3(x) == 0x7e);
    CHECK(f32ToE4m3(-x) == 0xfe);
  }
  CHECK(std::isnan(e4m3ToF32(f32ToE4m3(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(e4m3ToF32(f32ToE4m3(-std::numeric_limits<float>::quiet_NaN()))));
  CHECK(f32ToE4m3(std::ldexp(1.0f, -10)) == 0x00);      // half the smallest subnormal: tie to 0
  CHECK(f32ToE4m3(3 * std::ldexp(1.0f, -10)) == 0x02);  // 1.5 subnormal steps: tie to even 2
  CHECK(f32ToE4m3(std::ldexp(1.0f, -30)) == 0x00);
  CHECK(f32ToE4m3(-std::ldexp(1.0f, -30)) == 0x80);
}

TEST_CASE("block quantization and dequantization against a reference, partial edge blocks") {
  struct Case {
    int64_t rows, cols;
    int br, bc;
  };
  for (const Case& k : {Case{1, 1, 128, 128}, Case{127, 129, 128, 128}, Case{300, 257, 128, 128},
                        Case{256, 128, 128, 128}, Case{70, 45, 32, 16}}) {
    INFO(k.rows << " x " << k.cols << " in " << k.br << " x " << k.bc << " blocks");
    const WeightQuantization q{true, k.br, k.bc};
    std::mt19937_64 rng(uint64_t(k.rows * 1000 + k.cols));
    std::normal_distribution<float> d(0, 1);
    std::vector<float> w(size_t(k.rows * k.cols));
    for (auto& v : w) v = d(rng) * 0.05f;
    for (int64_t c = 0; c < std::min<int64_t>(k.cols, k.bc); ++c) w[size_t(c)] = 0;  // row 0 of block 0 zero
    if (k.rows <= k.br && k.cols <= k.bc) w.assign(w.size(), 0.0f);                  // one block, all zero
    const auto shape = fp8ScaleShape(k.rows, k.cols, q);
    CHECK(shape == std::vector<int64_t>{(k.rows + k.br - 1) / k.br, (k.cols + k.bc - 1) / k.bc});
    std::vector<uint8_t> codes(w.size());
    std::vector<float> scales(size_t(shape[0] * shape[1]));
    fp8QuantizeBlocks(w.data(), k.rows, k.cols, q, codes.data(), scales.data());

    Fp8BlockScales s{k.rows, k.cols, k.br, k.bc, scales};
    // The reference: each element's block scale by its own indices, one f32 rounding.
    std::vector<float> want(w.size());
    for (int64_t r = 0; r < k.rows; ++r)
      for (int64_t c = 0; c < k.cols; ++c)
        want[size_t(r * k.cols + c)] =
            float(e4m3Reference(codes[size_t(r * k.cols + c)]) * scales[size_t((r / k.br) * shape[1] + c / k.bc)]);
    // Dequantized in runs of odd lengths that start mid-row and span rows.
    std::vector<float> got(w.size(), std::numeric_limits<float>::quiet_NaN());
    for (size_t at = 0; at < w.size();) {
      const size_t n = std::min<size_t>(w.size() - at, 1 + (at * 7919 + 13) % 301);
      fp8DequantRun(codes.data() + at, n, int64_t(at), s, got.data() + at);
      at += n;
    }
    CHECK(std::memcmp(got.data(), want.data(), w.size() * 4) == 0);

    // Quantization error: <= 2^-4 relative (3 mantissa bits, nearest) in the normal range,
    // <= 2^-10 * scale in the subnormal range; each nonzero block uses the top of the range.
    int bad = 0;
    for (int64_t r = 0; r < k.rows; ++r)
      for (int64_t c = 0; c < k.cols; ++c) {
        const size_t i = size_t(r * k.cols + c);
        const double sc = scales[size_t((r / k.br) * shape[1] + c / k.bc)];
        const double err = std::fabs(double(got[i]) - w[i]);
        bad += !(err <= std::fabs(w[i]) * std::ldexp(1.0, -4) * (1 + 1e-6) + std::ldexp(1.0, -10) * sc);
      }
    CHECK(bad == 0);
    for (int64_t bi = 0; bi < shape[0]; ++bi)
      for (int64_t bj = 0; bj < shape[1]; ++bj) {
        int maxCode = 0;
        for (int64_t r = bi * k.br; r < std::min(k.rows, (bi + 1) * k.br); ++r)
          for (int64_t c = bj * k.bc; c < std::min(k.cols, (bj + 1) * k.bc); ++c)
            maxCode = std::max(maxCode, codes[size_t(r * k.cols + c)] & 0x7f);
        if (scales[size_t(bi * shape[1] + bj)] == 1.0f) {
          CHECK(maxCode == 0);  // an all-zero block: scale 1, codes 0
        } else {
          CHECK(maxCode == 0x7e);  // the block's largest weight maps to 448
        }
      }
  }
}

TEST_CASE("quantization_config: the FP8 block format parses, anything else is refused by name") {
  // DeepSeek-V3's block, and Qwen3-FP8's (modules_to_not_convert null), parse.
  auto ds = parseModelConfig(
      configWith(
          R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})"),
      "config.json");
  REQUIRE(ds.ok());
  CHECK(ds->quantization == WeightQuantization{true, 128, 128});
  auto qwen = parseModelConfig(configWith(R"({"activation_scheme": "dynamic", "modules_to_not_convert": null,
                                               "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})",
                                          "Qwen3ForCausalLM"),
                               "config.json");
  REQUIRE(qwen.ok());
  CHECK(qwen->quantization.fp8);
  auto other = parseModelConfig(configWith(R"({"quant_method": "fp8", "weight_block_size": [64, 32]})"), "c");
  REQUIRE(other.ok());
  CHECK(other->quantization == WeightQuantization{true, 64, 32});
  auto none = parseModelConfig(configWith("null"), "c");
  REQUIRE(none.ok());
  CHECK(!none->quantization.fp8);

  CHECK(configError(R"({"quant_method": "awq", "bits": 4})") ==
        "UNIMPLEMENTED: config.json: quantization_config key \"bits\" is not implemented (refused rather than "
        "ignored)");
  CHECK(configError(R"({"quant_method": "gptq"})") ==
        "UNIMPLEMENTED: config.json: quantization_config quant_method \"gptq\" is not implemented (supported: fp8)");
  CHECK(configError(R"({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})") ==
        "UNIMPLEMENTED: config.json: quantization_config fmt \"e5m2\" is not implemented (supported: e4m3)");
  CHECK(configError(R"({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]})") ==
        "UNIMPLEMENTED: config.json: quantization_config activation_scheme \"static\" is not implemented "
        "(supported: dynamic; static input scales are not applied)");
  CHECK(configError(R"({"quant_method": "fp8", "activation_scheme": "dynamic"})") ==
        "UNIMPLEMENTED: config.json: quantization_config without weight_block_size (per-tensor FP8 scales) is not "
        "implemented (supported: block scales, e.g. [128, 128])");
  CHECK(configError(R"({"quant_method": "fp8", "weight_block_size": [128]})") ==
        "INVALID_ARGUMENT: config.json: quantization_config weight_block_size must be two integers [rows, "
        "columns], got [128]");
  CHECK(configError(R"({"quant_method": "fp8", "weight_block_size": [0, 128]})") ==
        "INVALID_ARGUMENT: config.json: quantization_config weight_block_size [0,128] is out of range (1..4096 "
        "each)");
  CHECK(configError(R"({"quant_method": "fp8", "weight_block_size": [128, 128], "kv_cache_scheme": {}})") ==
        "UNIMPLEMENTED: config.json: quantization_config key \"kv_cache_scheme\" is not implemented (refused "
        "rather than ignored)");
  CHECK(configError(R"({"weight_block_size": [128, 128]})") ==
        "INVALID_ARGUMENT: config.json: quantization_config is missing \"quant_method\"");
  CHECK(configError(R"("fp8")") == "INVALID_ARGUMENT: config.json: quantization_config must be an object, got \"fp8\"");
}

TEST_CASE("Checkpoint reads F8_E4M3 weights with BF16 or F32 scales and names what is wrong") {
  const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/fp8_ckpt_errors." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const WeightQuantization q{true, 128, 128};
  // A 130 x 200 weight (2 x 2 blocks, three of them partial) with BF16 scales, as the Qwen3 FP8
  // releases store them; powers of two so bf16 holds them exactly.
  const int64_t rows = 130, cols = 200;
  std::vector<uint8_t> codes(size_t(rows * cols));
  std::mt19937_64 rng(9);
  for (auto& c : codes) {
    c = uint8_t(rng() & 0xff);
    if ((c & 0x7f) == 0x7f) c = 0x3f;  // no NaN codes in a weight
  }
  const float scaleVals[4] = {0.5f, 0.25f, 2.0f, 0.0625f};
  std::vector<uint8_t> bf16Scales(8);
  for (int i = 0; i < 4; ++i) {
    const uint16_t b = f32ToBf16(scaleVals[i]);
    std::memcpy(bf16Scales.data() + 2 * i, &b, 2);
  }
  auto write = [&](std::vector<TensorToWrite> ts) {
    REQUIRE(writeSafetensors(dir + "/model.safetensors", ts, {}).isOk());
  };
  write({{"w.weight", TensorDtype::kF8E4M3, {rows, cols}, codes},
         {"w.weight_scale_inv", TensorDtype::kBF16, {2, 2}, bf16Scales}});
  {
    auto ck = Checkpoint::open(dir, q);
    REQUIRE(ck.ok());
    std::vector<float> got(codes.size());
    REQUIRE(ck->readF32("w.weight", {rows, cols}, got.data()).isOk());
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        bad += double(got[size_t(r * cols + c)]) !=
               e4m3Reference(codes[size_t(r * cols + c)]) * scaleVals[(r / 128) * 2 + c / 128];
    CHECK(bad == 0);
    // The raw file reader refuses the codes: they mean nothing without their scales.
    auto f = SafetensorsFile::open(dir + "/model.safetensors");
    REQUIRE(f.ok());
    CHECK(f->readF32("w.weight", got.data()).toString().find("is F8_E4M3: its values need their block scales") !=
          std::string::npos);
    // Opened without the config's quantization: refused naming the tensor.
    auto plain = Checkpoint::open(dir);
    REQUIRE(plain.ok());
    CHECK(plain->readF32("w.weight", {rows, cols}, got.data())
              .toString()
              .find("tensor w.weight is F8_E4M3 but config.json has no FP8 quantization_config") != std::string::npos);
  }
  // Scales of the wrong shape, then none at all.
  write({{"w.weight", TensorDtype::kF8E4M3, {rows, cols}, codes},
         {"w.weight_scale_inv", TensorDtype::kBF16, {4, 1}, bf16Scales}});
  {
    auto ck = Checkpoint::open(dir, q);
    REQUIRE(ck.ok());
    std::vector<float> got(codes.size());
    CHECK(ck->readF32("w.weight", {rows, cols}, got.data())
              .toString()
              .find("tensor w.weight_scale_inv has shape [4, 1] but the config implies [2, 2]") != std::string::npos);
  }
  write({{"w.weight", TensorDtype::kF8E4M3, {rows, cols}, codes}});
  {
    auto ck = Checkpoint::open(dir, q);
    REQUIRE(ck.ok());
    std::vector<float> got(codes.size());
    CHECK(ck->readF32("w.weight", {rows, cols}, got.data())
              .toString()
              .find("F8_E4M3 tensor w.weight has no w.weight_scale_inv (expected shape [2, 2])") != std::string::npos);
  }
  // Another FP8 dtype is refused by name at open.
  {
    std::string header = R"({"x": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}})";
    while (header.size() % 8) header += ' ';
    std::ofstream out(dir + "/model.safetensors", std::ios::binary | std::ios::trunc);
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header << "ab";
  }
  auto e5 = Checkpoint::open(dir, q);
  CHECK(e5.status().toString().find("tensor x has dtype F8_E5M2 (supported: F32, F16, BF16, F8_E4M3)") !=
        std::string::npos);
  std::filesystem::remove_all(dir);
}

// Loads `fp8` and its test-dequantized copy and checks the logits of two prompts (chunked
// prefill + greedy decode) are bit-identical.
void checkExactAgainstDequantized(const std::string& fp8, const std::string& copyName) {
  const std::string deq = dequantizedCopy(fp8, copyName);
  auto a = loadModel(fp8);
  REQUIRE(a.status().toString() == "OK");
  auto b = loadModel(deq);
  REQUIRE(b.status().toString() == "OK");
  CHECK((*a)->weightsFingerprint != (*b)->weightsFingerprint);  // different files, same values
  for (uint64_t seed : {21, 22}) {
    const auto prompt = testPrompt(30, seed);
    TestKv kv1((*a)->config, 8), kv2((*b)->config, 8);
    auto ba = makeBackend(*a, kv1);
    auto bb = makeBackend(*b, kv2);
    std::vector<int32_t> g1, g2;
    const auto r1 = runGreedy(*ba, kv1, prompt, 7, 10, &g1);
    const auto r2 = runGreedy(*bb, kv2, prompt, 7, 10, &g2);
    CHECK(g1 == g2);
    REQUIRE(r1.size() == r2.size());
    for (size_t i = 0; i < r1.size(); ++i) CHECK(r1[i] == r2[i]);
  }
}

TEST_CASE("a model from an FP8 checkpoint gives the logits of its weights dequantized to f32, exactly") {
  const std::string fp8 = fp8Model("fp8_tiny", "tiny", "f32", 1);
  auto cfg = loadModelConfig(fp8);
  REQUIRE(cfg.ok());
  CHECK(cfg->quantization == WeightQuantization{true, 128, 128});
  checkExactAgainstDequantized(fp8, "fp8_tiny_dequantized");
  // The codes really were dequantized: not the f32 original's weights.
  MakeModelOptions o;
  const auto f32 = loadModel(makeTestModel("llama_tiny", o));
  REQUIRE(f32.ok());
  const auto a = loadModel(fp8);
  REQUIRE(a.ok());
  CHECK(std::memcmp((*a)->layers[0].qkv.data(), (*f32)->layers[0].qkv.data(), (*a)->layers[0].qkv.size() * 4) != 0);
  CHECK(std::memcmp((*a)->embed.data(), (*f32)->embed.data(), (*a)->embed.size() * 4) == 0);  // not quantized
}

TEST_CASE("FP8 checkpoints of every architecture, sharded or with bf16 tensors, load exactly") {
  struct Variant {
    const char* name;
    const char* arch;
    const char* dtype;
    int shards;
  };
  for (const Variant& v :
       {Variant{"fp8_tiny_qwen2_bf16", "qwen2", "bf16", 1}, Variant{"fp8_tiny_qwen3", "qwen3", "f32", 1},
        Variant{"fp8_tiny_mixtral_sharded", "mixtral", "f32", 3}, Variant{"fp8_tiny_qwen3_moe", "qwen3_moe", "bf16", 2},
        Variant{"fp8_tiny_deepseek_v3", "deepseek_v3", "bf16", 1}}) {
    INFO(v.name);
    MakeModelOptions o;
    o.arch = v.arch;
    o.dtype = v.dtype;
    o.shards = v.shards;
    o.seed = 8;
    o.quantization = "fp8";
    checkExactAgainstDequantized(makeTestModel(v.name, o), std::string(v.name) + "_dequantized");
  }
}

// Measured against the f32 model of the same seed (make-model's default: seed 1).
void checkFp8Agreement(const std::string& preset, double minForcedTop1, double maxLogitErr) {
  MakeModelOptions o;
  o.preset = preset;
  auto f32 = loadModel(makeTestModel("llama_" + preset, o));
  REQUIRE(f32.ok());
  auto fp8 = loadModel(fp8Model("fp8_" + preset, preset, "f32", 1));
  REQUIRE(fp8.ok());
  const Agreement r = agreement(*f32, *fp8);
  std::printf(
      "fp8 checkpoint (128x128 blocks), %s preset vs f32: free-running greedy agreement %d/%d = %.3f, max "
      "logit error %.2e; teacher-forced top-1 %d/%d = %.3f, max logit error %.2e (max |delta logit| %.3f)\n",
      preset.c_str(), r.same, r.total, double(r.same) / r.total, r.worst, r.forcedSame, r.forcedTotal,
      double(r.forcedSame) / r.forcedTotal, r.forcedWorst, r.forcedMaxAbs);
  CHECK(double(r.forcedSame) / r.forcedTotal >= minForcedTop1);
  CHECK(r.forcedWorst <= maxLogitErr);
  CHECK(r.worst <= r.forcedWorst);  // the free-running rows are a subset of the forced ones
  CHECK(r.forcedWorst > 0);         // the weights really were quantized
}

TEST_CASE("an FP8 checkpoint agrees with the f32 original on the tiny preset") { checkFp8Agreement("tiny", 0.8, 0.12); }
TEST_CASE("an FP8 checkpoint agrees with the f32 original on the small preset") {
  checkFp8Agreement("small", 0.7, 0.2);
}

TEST_CASE("an FP8 checkpoint runs with the cpu backend's bf16 and q8_0 weight formats") {
  auto fp8 = loadModel(fp8Model("fp8_tiny", "tiny", "f32", 1));
  REQUIRE(fp8.ok());
  for (const char* format : {"bf16", "q8_0"}) {
    CpuBackendOptions o;
    o.weightFormat = format;
    const Agreement r = agreement(*fp8, *fp8, o);
    std::printf("fp8 checkpoint held as %s vs held as f32 (tiny): teacher-forced top-1 %d/%d, max logit error %.2e\n",
                format, r.forcedSame, r.forcedTotal, r.forcedWorst);
    CHECK(r.forcedWorst > 0);
    CHECK(r.forcedWorst <= 4e-2);
  }
}

TEST_CASE("an FP8 checkpoint streams dequantized: the host loader's values in bf16 and f32, per rank") {
  // The small preset: 128 x 128 blocks with partial ones (ffn 1376 = 10 x 128 + 96), and
  // tensor-parallel column slices (down_proj's 688 columns a rank) that start mid-block.
  const std::string dir = fp8Model("fp8_small_bf16", "small", "bf16", 5);
  auto host = loadModel(dir);
  REQUIRE(host.ok());
  const ModelWeights& w = **host;
  const ModelConfig& c = w.config;
  auto checkImage = [](const DeviceTensor& t, const std::vector<float>& want, TensorDtype dt, const std::string& what) {
    INFO(what);
    REQUIRE(t.dtype == dt);
    REQUIRE(t.bytes == want.size() * tensorDtypeBytes(dt));
    size_t bad = 0;
    if (dt == TensorDtype::kF32) {
      bad = std::memcmp(t.data, want.data(), t.bytes) != 0;
    } else {
      const auto* got = static_cast<const uint16_t*>(t.data);
      for (size_t i = 0; i < want.size(); ++i) bad += got[i] != f32ToBf16(want[i]);
    }
    CHECK(bad == 0);
  };
  auto plan = planTensorParallel(c, 2);
  REQUIRE(plan.ok());
  for (TensorDtype dt : {TensorDtype::kBF16, TensorDtype::kF32})
    for (int tp : {1, 2})
      for (int r = 0; r < tp; ++r) {
        INFO("dtype " << tensorDtypeName(dt) << ", rank " << r << " of " << tp);
        HostWeightCopier dev;
        WeightStreamOptions o;
        o.matrixDtype = dt;
        o.tensorParallelSize = tp;
        o.rank = r;
        o.stagingBytes = 96 << 10;  // chunks that start mid-row and mid-block
        WeightLoadStats stats;
        auto m = streamWeightsToDevice(dir, c, o, dev, &stats);
        REQUIRE(m.status().toString() == "OK");
        if (tp == 1) {
          // Every stored byte read once: the codes, their scales, the bf16 tensors.
          auto f = SafetensorsFile::open(dir + "/model.safetensors");
          REQUIRE(f.ok());
          uint64_t stored = 0;
          for (const auto& [name, info] : f->tensors()) stored += info.end - info.begin;
          CHECK(stats.fileBytesRead == stored);
        }
        const size_t h = size_t(c.hiddenSize);
        const std::vector<float> embed(w.embed.data(), w.embed.data() + w.embed.size());
        checkImage(m->embed, embed, dt, "embed");
        for (int l = 0; l < c.numLayers; l += 3) {
          const LayerWeights& hl = w.layers[size_t(l)];
          const DeviceLayer& dl = m->layers[size_t(l)];
          const std::string at = "layer " + std::to_string(l);
          if (tp == 1) {
            checkImage(dl.qkv, std::vector<float>(hl.qkv.data(), hl.qkv.data() + hl.qkv.size()), dt, at + " qkv");
            checkImage(dl.down, std::vector<float>(hl.down.data(), hl.down.data() + hl.down.size()), dt, at + " down");
            continue;
          }
          checkImage(dl.qkv, sliceRows(hl.qkv.data(), h, plan->qkvRows(r)), dt, at + " q|k|v rows");
          checkImage(dl.gateUp, sliceRows(hl.gateUp.data(), h, plan->gateUpRows(r)), dt, at + " gate|up rows");
          checkImage(dl.o, sliceColumns(hl.o.data(), h, plan->qDim(), plan->oColumns(r)), dt, at + " o columns");
          checkImage(dl.down, sliceColumns(hl.down.data(), h, plan->ffn(), plan->downColumns(r)), dt,
                     at + " down columns");
        }
      }
  // F8_E4M3 device matrices are refused by name.
  HostWeightCopier dev;
  WeightStreamOptions o;
  o.matrixDtype = TensorDtype::kF8E4M3;
  auto m = streamWeightsToDevice(dir, c, o, dev, nullptr);
  CHECK(m.status().toString().find("F8_E4M3 device matrices") != std::string::npos);
}

TEST_CASE("row-expanded FP8 scales: every element of any slice finds its block's scale") {
  // Slices that start on and off block boundaries, partial edge blocks, blocks of 128 and 16.
  struct Case {
    int64_t rows, cols;
    int br, bc;
    int64_t rb, rc, cb, cc;
  };
  for (const Case& k : {Case{300, 257, 128, 128, 0, 300, 0, 257}, Case{300, 257, 128, 128, 100, 150, 100, 157},
                        Case{300, 257, 128, 128, 129, 3, 128, 129}, Case{70, 45, 32, 16, 5, 60, 17, 20},
                        Case{1376, 512, 128, 128, 688, 688, 0, 512}, Case{512, 1376, 128, 128, 0, 512, 688, 688}}) {
    INFO(k.rows << " x " << k.cols << " in " << k.br << " x " << k.bc << ", rows " << k.rb << "+" << k.rc << " cols "
                << k.cb << "+" << k.cc);
    const WeightQuantization q{true, k.br, k.bc};
    const auto shape = fp8ScaleShape(k.rows, k.cols, q);
    Fp8BlockScales s{k.rows, k.cols, k.br, k.bc, std::vector<float>(size_t(shape[0] * shape[1]))};
    for (size_t i = 0; i < s.scaleInv.size(); ++i) s.scaleInv[i] = float(i + 1);  // distinct per block
    const int64_t off = k.cb % k.bc;
    const int64_t n = fp8RowScaleCols(off, k.cc, k.bc);
    CHECK(n == (k.cb + k.cc - 1) / k.bc - k.cb / k.bc + 1);  // the blocks the slice touches
    std::vector<float> out(size_t(k.rc * n), -1.0f);
    fp8ExpandRowScales(s, k.rb, k.rc, k.cb, k.cc, out.data());
    size_t bad = 0;
    for (int64_t i = 0; i < k.rc; ++i)
      for (int64_t c = 0; c < k.cc; ++c) bad += out[size_t(i * n + (off + c) / k.bc)] != s.at(k.rb + i, k.cb + c);
    CHECK(bad == 0);
    CHECK(std::count(out.begin(), out.end(), -1.0f) == 0);  // every entry written
  }
}

TEST_CASE("keepFp8 streams the projections as codes plus row-expanded scales, per rank") {
  // The small preset: partial blocks (ffn 1376), and at tensor_parallel_size 2 and 4 column
  // slices of o_proj / down_proj that start mid-block (688, 344 columns a rank).
  const std::string dir = fp8Model("fp8_small_bf16", "small", "bf16", 5);
  auto host = loadModel(dir);
  REQUIRE(host.ok());
  const ModelWeights& w = **host;
  const ModelConfig& c = w.config;
  const int bc = c.quantization.blockCols;
  const size_t h = size_t(c.hiddenSize);
  // Dequantizes a device image the way the CUDA kernels do and compares with the host
  // loader's f32 weights (the same e4m3 * scale product, so exactly).
  auto checkImage = [&](const DeviceTensor& t, const std::vector<float>& want, size_t cols, int colBegin,
                        const std::string& what) {
    INFO(what);
    REQUIRE(t.dtype == TensorDtype::kF8E4M3);
    const size_t rows = want.size() / cols;
    REQUIRE(t.bytes == rows * cols);
    CHECK(t.scaleColOffset == colBegin % bc);
    const size_t n = size_t(fp8RowScaleCols(t.scaleColOffset, int64_t(cols), bc));
    REQUIRE(t.scaleBytes == rows * n * sizeof(float));
    const auto* codes = static_cast<const uint8_t*>(t.data);
    const auto* sc = static_cast<const float*>(t.scales);
    size_t bad = 0;
    for (size_t r = 0; r < rows; ++r)
      for (size_t k = 0; k < cols; ++k)
        bad += e4m3ToF32(codes[r * cols + k]) * sc[r * n + (size_t(t.scaleColOffset) + k) / size_t(bc)] !=
               want[r * cols + k];
    CHECK(bad == 0);
  };
  for (int tp : {1, 2, 4}) {
    auto plan = planTensorParallel(c, tp);
    REQUIRE(plan.ok());
    for (int r = 0; r < tp; ++r) {
      INFO("rank " << r << " of " << tp);
      HostWeightCopier dev;
      WeightStreamOptions o;
      o.keepFp8 = true;
      o.tensorParallelSize = tp;
      o.rank = r;
      o.stagingBytes = 96 << 10;  // the codes and the scales both take several chunks
      WeightLoadStats stats;
      auto m = streamWeightsToDevice(dir, c, o, dev, &stats);
      REQUIRE(m.status().toString() == "OK");
      CHECK(m->embed.dtype == TensorDtype::kBF16);  // stored bf16: not a projection, as before
      CHECK(m->embed.scales == nullptr);
      if (tp == 1) {
        // Every stored byte read once, and the projections cost 1 + 4/128 bytes a weight.
        auto f = SafetensorsFile::open(dir + "/model.safetensors");
        REQUIRE(f.ok());
        uint64_t stored = 0;
        for (const auto& [name, info] : f->tensors()) stored += info.end - info.begin;
        CHECK(stats.fileBytesRead == stored);
        const DeviceLayer& l0 = m->layers[0];
        const size_t elems = l0.qkv.bytes + l0.o.bytes + l0.gateUp.bytes + l0.down.bytes;
        const size_t bytes = elems + l0.qkv.scaleBytes + l0.o.scaleBytes + l0.gateUp.scaleBytes + l0.down.scaleBytes;
        CHECK(bytes < elems * 2 * 53 / 100);  // under 53% of bf16's 2 bytes a weight
      }
      for (int l = 0; l < c.numLayers; l += 3) {
        const LayerWeights& hl = w.layers[size_t(l)];
        const DeviceLayer& dl = m->layers[size_t(l)];
        const std::string at = "layer " + std::to_string(l);
        checkImage(dl.qkv, sliceRows(hl.qkv.data(), h, plan->qkvRows(r)), h, 0, at + " q|k|v rows");
        checkImage(dl.gateUp, sliceRows(hl.gateUp.data(), h, plan->gateUpRows(r)), h, 0, at + " gate|up rows");
        checkImage(dl.o, sliceColumns(hl.o.data(), h, plan->qDim(), plan->oColumns(r)), size_t(plan->oColumns(r).count),
                   plan->oColumns(r).begin, at + " o columns");
        checkImage(dl.down, sliceColumns(hl.down.data(), h, plan->ffn(), plan->downColumns(r)),
                   size_t(plan->downColumns(r).count), plan->downColumns(r).begin, at + " down columns");
      }
    }
  }
}

TEST_CASE("make-model writes the FP8 block format: F8_E4M3 projections, F32 scales, the rest as --dtype") {
  const std::string dir = fp8Model("fp8_tiny_bf16", "tiny", "bf16", 3);
  auto f = SafetensorsFile::open(dir + "/model.safetensors");
  REQUIRE(f.ok());
  int fp8 = 0;
  for (const auto& [name, info] : f->tensors()) {
    INFO(name);
    const bool proj = name.find("_proj.weight") != std::string::npos;
    const bool scale = name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0;
    if (scale) {
      CHECK(info.dtype == TensorDtype::kF32);
    } else if (proj) {
      CHECK(info.dtype == TensorDtype::kF8E4M3);
      CHECK(f->find(name + "_scale_inv") != nullptr);
      ++fp8;
    } else {
      CHECK(info.dtype == TensorDtype::kBF16);  // embeddings, norms, lm_head
    }
  }
  CHECK(fp8 == 2 * 7);
  const auto cfg = nlohmann::json::parse(readText(dir + "/config.json"));
  CHECK(
      cfg.at("quantization_config") ==
      nlohmann::json::parse(
          R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})"));
  MakeModelOptions bad;
  bad.quantization = "int4";
  CHECK(makeModel(bad, dir + ".never").toString() ==
        "INVALID_ARGUMENT: make-model: unknown quantization \"int4\" (fp8, or none)");
}
