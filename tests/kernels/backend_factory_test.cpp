// Runs in every build, with or without a GPU: `backend: cuda` is either served or refused
// with a message naming why; the tensor-parallel plan checks the model's shape.
#include <catch2/catch.hpp>

#include "common/engine/cuda_backend.h"
#include "common/engine/tensor_parallel.h"

using namespace pd;
using namespace pd::engine;

TEST_CASE("createBackend: cuda without a device (or without CUDA) is a clear error",
          "[backend][factory]") {
  const Status avail = cudaDeviceAvailable();
  if (avail.isOk()) {
    WARN("a CUDA device is present: the refusal path is not exercised here");
    return;
  }
#if defined(PD_HAVE_CUDA)
  CHECK(avail.code() == StatusCode::kUnavailable);
  CHECK(avail.message().rfind("cuda backend: no CUDA device found (cudaGetDeviceCount: ", 0) == 0);
#else
  CHECK(avail.code() == StatusCode::kUnimplemented);
  CHECK(avail.message().find("no CUDA support") != std::string::npos);
#endif
  // The factory refuses before it looks at the model.
  KvLayout layout;
  auto b = createBackend("cuda", nullptr, layout, nullptr);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().message() == avail.message());
}

TEST_CASE("createBackend: unknown backend names list the allowed values", "[backend][factory]") {
  auto b = createBackend("tpu", nullptr, KvLayout{}, nullptr);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == StatusCode::kInvalidArgument);
  CHECK(b.status().message() == "backend \"tpu\" is not known (allowed: cpu, cuda)");
}

TEST_CASE("tensor-parallel plan splits heads, kv heads and ffn and the KV layout is per rank",
          "[backend][tp]") {
  ModelConfig c;
  c.numHeads = 32;
  c.numKvHeads = 8;
  c.headDim = 128;
  c.intermediateSize = 14336;
  auto p = planTensorParallel(c, 4);
  REQUIRE(p.ok());
  CHECK(p->headsPerRank == 8);
  CHECK(p->kvHeadsPerRank == 2);
  CHECK(p->ffnPerRank == 3584);
  CHECK(p->qRowBegin(3) == 3 * 8 * 128);
  KvLayout full;
  full.numLayers = 2;
  full.numBlocks = 10;
  full.numKvHeads = 8;
  full.headDim = 128;
  const KvLayout r = perRankKvLayout(full, *p);
  CHECK(r.numKvHeads == 2);
  CHECK(r.totalBytes() * 4 == full.totalBytes());
  CHECK(r.fingerprint() == "L2.B16.H2.D128.f32");

  CHECK(planTensorParallel(c, 3).status().message() ==
        "tensor_parallel_size 3 is not supported (allowed: 1, 2, 4, 8)");
  c.numKvHeads = 4;
  CHECK(planTensorParallel(c, 8).status().message().find(
            "does not divide the model's 4 kv heads") != std::string::npos);
  CHECK(planTensorParallel(c, 1).ok());
}
