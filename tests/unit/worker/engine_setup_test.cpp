// buildEngine: the engine a worker builds from its config, on the cpu backend and on cuda.
#include "worker/engine_setup.h"

#include <fstream>
#include <tuple>

#include <catch2/catch.hpp>

#include "common/constraint/constraint.h"
#include "engine/cuda_backend.h"
#include "engine/kv_tiers.h"
#include "engine/model_maker.h"
#include "tests/unit/engine/model_test_util.h"
#include "worker/proto_convert.h"

using namespace pd;

namespace {

config::ClusterConfig configFor(const std::string& backend, const std::string& extraEngineKeys = "") {
  const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
  auto c = config::parseClusterConfig(
      "model: {path: " + model + "}\nengine: {backend: " + backend + ", num_blocks: 64" + extraEngineKeys + "}\n",
      "test.yaml");
  REQUIRE(c.ok());
  return std::move(c).value();
}

}  // namespace

TEST_CASE("a cpu worker keeps its KV cache in host memory, in f32") {
  auto b = worker::buildEngine(configFor("cpu"), true);
  REQUIRE(b.ok());
  const MemDesc region = b->engine->kv().region();
  CHECK(region.kind == MemKind::kHost);
  CHECK(region.addr != 0);
  CHECK(b->engine->kv().layout().dtype == engine::KvDtype::kF32);
  CHECK(b->engine->kv().numTotalBlocks() == 64);
  CHECK_THAT(b->fingerprint, Catch::Contains(".f32/w"));  // KV layout, then the weights
  CHECK(b->model->weightsFingerprint.size() == 16);
  CHECK_THAT(b->fingerprint, Catch::EndsWith("/w" + b->model->weightsFingerprint));
  REQUIRE(b->kvRegions.size() == 1);  // what the transfer agent registers
  CHECK(b->kvRegions[0].addr == region.addr);
  CHECK(b->kvRegions[0].len == region.len);
}

TEST_CASE(
    "engine.kv_cache_dtype: the cpu cache in bf16, int8 or fp8, named in the fingerprint; 8-bit refused on cuda") {
  for (const auto& [key, dtype, name] : {std::tuple{"bf16", engine::KvDtype::kBF16, ".bf16/w"},
                                         std::tuple{"int8", engine::KvDtype::kInt8, ".int8-tks32/w"},
                                         std::tuple{"fp8", engine::KvDtype::kFp8, ".fp8-tks32/w"}}) {
    INFO(key);
    auto b = worker::buildEngine(configFor("cpu", std::string(", kv_cache_dtype: ") + key), true);
    REQUIRE(b.ok());
    CHECK(b->engine->kv().layout().dtype == dtype);
    CHECK(b->engine->kv().numTotalBlocks() == 64);
    CHECK(b->kvRegions[0].len == b->engine->kv().layout().totalBytes());
    CHECK_THAT(b->fingerprint, Catch::Contains(name));
  }
  auto bad = config::parseClusterConfig("model: {path: /m}\nengine: {kv_cache_dtype: int4}\n", "test.yaml");
  CHECK_THAT(bad.status().message(), Catch::Contains("engine.kv_cache_dtype: 'int4' is not a KV cache dtype"));
  auto cuda =
      config::parseClusterConfig("model: {path: /m}\nengine: {backend: cuda, kv_cache_dtype: int8}\n", "test.yaml");
  CHECK_THAT(cuda.status().message(), Catch::Contains("engine.kv_cache_dtype: int8 needs backend cpu"));
}

TEST_CASE("a cuda worker keeps its KV cache in device memory, or says why it cannot start") {
  auto b = worker::buildEngine(configFor("cuda"), true);
  const Status device = engine::cudaDeviceAvailable();
  if (!device.isOk()) {
    // No GPU here (or a build without CUDA): the worker refuses with the backend's reason.
    REQUIRE(!b.ok());
    CHECK(b.status().code() == device.code());
    CHECK(b.status().message() == "engine.backend: cuda: " + device.message());
    return;
  }
  REQUIRE(b.ok());
  const MemDesc region = b->engine->kv().region();
  CHECK(region.kind == MemKind::kCuda);
  CHECK(region.len == b->engine->kv().layout().totalBytes());
  CHECK(b->engine->kv().layout().dtype == engine::KvDtype::kBF16);  // model.dtype auto
  CHECK_THAT(b->fingerprint, Catch::Contains(".bf16/w"));
  REQUIRE(b->kvRegions.size() == 1);
  CHECK(b->kvRegions[0].addr == region.addr);
}

TEST_CASE("a cuda worker's KV tiers copy its device blocks with the CUDA copier") {
  const config::ClusterConfig c = configFor("cuda", ", kv_tiers: {host_bytes: 16777216}");
  auto b = worker::buildEngine(c, true);
  const Status device = engine::cudaDeviceAvailable();
  if (!device.isOk()) {
    // The config takes tiers on cuda; without a device the worker refuses at the backend.
    REQUIRE(!b.ok());
    CHECK(b.status().message() == "engine.backend: cuda: " + device.message());
    return;
  }
  REQUIRE(b.ok());
  const Status st = worker::attachKvTiers(c, "w0", *b);
  INFO(st.toString());
  REQUIRE(st.isOk());
  engine::KvTierStore* t = b->engine->kvTiers();
  REQUIRE(t != nullptr);
  CHECK(t->copier().asynchronous());
  CHECK(t->copier().strideBytes() == b->engine->kv().blockStrideBytes());
  CHECK(t->host()->capacity() == int((int64_t{16} << 20) / int64_t(b->engine->kv().blockStrideBytes())));
  CHECK(t->checkInvariants().isOk());
}

TEST_CASE("a tensor-parallel cuda worker has one KV region per GPU, or says how many it needs") {
  auto b = worker::buildEngine(configFor("cuda", ", tensor_parallel_size: 2"), true);
  const Status device = engine::cudaDeviceAvailable();
  if (!device.isOk()) {
    REQUIRE(!b.ok());
    CHECK(b.status().message() == "engine.backend: cuda: " + device.message());
    return;
  }
  if (!b.ok()) {  // one GPU: the backend names the shortfall
    CHECK(b.status().code() == StatusCode::kUnavailable);
    CHECK_THAT(b.status().message(), Catch::Contains("requires 2 GPUs"));
    return;
  }
  REQUIRE(b->kvRegions.size() == 2);
  CHECK(b->kvRegions[0].device != b->kvRegions[1].device);
  // The books are kept in the per-rank layout: half of the tiny model's 2 kv heads.
  CHECK(b->engine->kv().layout().numKvHeads == 1);
  CHECK(b->kvRegions[1].len == b->engine->kv().layout().totalBytes());
  CHECK_THAT(b->fingerprint, Catch::Contains(".tp2/w"));
}

TEST_CASE("a cuda worker sizes its KV cache by engine.gpu_memory_utilization, or says why it cannot start") {
  const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
  auto c = config::parseClusterConfig(
      "model: {path: " + model + "}\nengine: {backend: cuda, gpu_memory_utilization: 0.5, max_batch_tokens: 512}\n",
      "test.yaml");
  REQUIRE(c.ok());
  auto b = worker::buildEngine(*c, true);
  const Status device = engine::cudaDeviceAvailable();
  if (!device.isOk()) {
    REQUIRE(!b.ok());
    CHECK(b.status().message() == "engine.backend: cuda: " + device.message());
    return;
  }
  REQUIRE(b.ok());
  // Half of a GPU for a 64-wide model: far more blocks than the 256 MiB default would give.
  const auto& layout = b->engine->kv().layout();
  CHECK(b->engine->kv().numTotalBlocks() == layout.numBlocks);
  CHECK(int64_t(layout.totalBytes()) > int64_t{1} << 30);
  CHECK(b->kvRegions[0].len == layout.totalBytes());
  CHECK(b->loadSeconds > 0);
}

namespace {
// This process's resident set, in bytes (VmRSS of /proc/self/status).
int64_t residentBytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  return -1;
}
}  // namespace

TEST_CASE("engine.kv_cache_bytes is the size of the whole KV cache, and what stays resident") {
  const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
  const int64_t setting = 32 << 20;
  auto config = config::parseClusterConfig(
      "model: {path: " + model + "}\nengine: {backend: cpu, kv_cache_bytes: " + std::to_string(setting) + "}\n",
      "test.yaml");
  REQUIRE(config.ok());
  const int64_t before = residentBytes();
  auto b = worker::buildEngine(*config, true);
  REQUIRE(b.ok());
  const auto& layout = b->engine->kv().layout();
  const int64_t cache = int64_t(layout.totalBytes());
  const int64_t oneBlock = int64_t(layout.blockBytes()) * layout.numLayers;  // a block id in every layer
  CHECK(cache <= setting);
  CHECK(cache > setting - oneBlock);
  CHECK(int64_t(b->kvRegions[0].len) == cache);
  // The cache is resident from the start (KvCacheManager::create populates it): the process
  // grew by the setting (plus the model and the engine's buffers), not by a multiple of it.
  const int64_t grew = residentBytes() - before;
  INFO("resident growth " << grew << " bytes for kv_cache_bytes " << setting);
  CHECK(grew >= cache);
  CHECK(grew < setting + (16 << 20));
  CHECK(b->loadSeconds > 0);  // pdserve_model_load_seconds
}

TEST_CASE("a worker's engine masks constrained requests with its model's token bytes") {
  auto b = worker::buildEngine(configFor("cpu"), true);
  REQUIRE(b.ok());
  REQUIRE(b->engine->constraintCache() != nullptr);  // read from the model's tokenizer.json
  CHECK(b->engine->constraintCache()->vocabulary()->bytes('{') == "{");
  // The spec crosses the proto both ways, field for field.
  engine::SamplingParams p;
  p.constraint = {constraint::SpecKind::kJsonSchema, R"({"type": "null"})", "<tool_call>", "</tool_call>"};
  const auto back = worker::fromProto(worker::toProto(p));
  CHECK(back.constraint == p.constraint);
  CHECK_FALSE(worker::fromProto(worker::toProto(engine::SamplingParams{})).constraint.active());
  // A constrained request runs to the constraint's end: "<tool_call>null</tool_call>", then stop.
  p.temperature = 0;
  p.maxTokens = 100;
  auto r = engine::Request::create(1, {72, 105}, p, SystemClock::instance(), b->engine->modelConfig().vocabSize);
  REQUIRE(r.ok());
  REQUIRE(b->engine->submit(std::move(r).value()).isOk());
  std::string text;
  engine::FinishReason reason = engine::FinishReason::kNone;
  for (int guard = 0; b->engine->hasWork() && guard < 200; ++guard) {
    std::vector<engine::EngineEvent> events;
    REQUIRE(b->engine->step(&events).isOk());
    for (const auto& e : events) {
      if (e.kind == engine::EngineEvent::Kind::kToken) text += char(e.token.id);
      if (e.kind == engine::EngineEvent::Kind::kFinished) reason = e.reason;
    }
  }
  CHECK(text == "<tool_call>null</tool_call>");
  CHECK(reason == engine::FinishReason::kStop);
}
