// buildEngine: the engine a worker builds from its config, on the cpu backend and on cuda.
#include "worker/engine_setup.h"

#include <catch2/catch.hpp>

#include "common/engine/cuda_backend.h"
#include "common/engine/model_maker.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd;

namespace {

config::ClusterConfig configFor(const std::string& backend, const std::string& extraEngineKeys = "") {
  const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
  auto c = config::parseClusterConfig("model: {path: " + model + "}\nengine: {backend: " + backend +
                                          ", num_blocks: 64" + extraEngineKeys + "}\n",
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
  CHECK_THAT(b->fingerprint, Catch::EndsWith("f32"));
  REQUIRE(b->kvRegions.size() == 1);  // what the transfer agent registers
  CHECK(b->kvRegions[0].addr == region.addr);
  CHECK(b->kvRegions[0].len == region.len);
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
  CHECK_THAT(b->fingerprint, Catch::EndsWith("bf16"));
  REQUIRE(b->kvRegions.size() == 1);
  CHECK(b->kvRegions[0].addr == region.addr);
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
  CHECK_THAT(b->fingerprint, Catch::EndsWith(".tp2"));
}
