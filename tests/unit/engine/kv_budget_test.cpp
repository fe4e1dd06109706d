// kvBudgetFromUtilization: engine.gpu_memory_utilization's arithmetic, with a GPU's numbers.
#include "engine/kv_budget.h"

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::engine;

namespace {
constexpr uint64_t kGiB = uint64_t(1) << 30, kMiB = uint64_t(1) << 20;

// An 80 GiB GPU serving an 8B model in bf16: 16 GiB of weights, a 2 GiB activation peak, and
// Llama-3-8B's KV block (32 layers x K,V x 8 kv heads x 128 dims x 16 tokens x 2 bytes = 2 MiB).
KvBudgetInput eightB() {
  KvBudgetInput in;
  in.deviceTotalBytes = 80 * kGiB;
  in.utilization = 0.9;
  in.weightBytes = 16 * kGiB;
  in.activationBytes = 2 * kGiB;
  in.bytesPerBlock = 2 * kMiB;
  in.blockSize = 16;
  return in;
}
}  // namespace

TEST_CASE("the KV cache is the utilization share less weights and activations, in whole blocks") {
  auto b = kvBudgetFromUtilization(eightB());
  REQUIRE(b.ok());
  CHECK(b->shareBytes == 72 * kGiB);  // 0.9 x 80 GiB
  CHECK(b->kvBytes == 54 * kGiB);     // 72 - 16 - 2
  CHECK(b->numBlocks == 54 * 512);    // 2 MiB blocks
  CHECK(b->tokens == 54 * 512 * 16);  // 442,368 tokens of context
  KvBudgetInput odd = eightB();
  odd.activationBytes = 2 * kGiB + 1;  // one byte more: one block fewer, never a part
  auto c = kvBudgetFromUtilization(odd);
  REQUIRE(c.ok());
  CHECK(c->numBlocks == 54 * 512 - 1);
  CHECK(c->kvBytes == uint64_t(c->numBlocks) * odd.bytesPerBlock);
  KvBudgetInput all = eightB();
  all.utilization = 1.0;
  CHECK(kvBudgetFromUtilization(all)->numBlocks == 62 * 512);
}

TEST_CASE("a share the weights and activations fill holds no KV and says what it is made of") {
  KvBudgetInput in = eightB();
  in.utilization = 0.2;  // 16 GiB: the weights alone
  auto b = kvBudgetFromUtilization(in);
  REQUIRE(!b.ok());
  CHECK(b.status().code() == StatusCode::kResourceExhausted);
  CHECK(b.status().message() ==
        "engine.gpu_memory_utilization: 0.2 of 80.00 GiB is 16.00 GiB, which after the weights "
        "(16.00 GiB) and the activation peak (2.00 GiB) holds no KV block of 2097152 bytes: raise "
        "it, or shrink the model, model.dtype or engine.max_batch_tokens");
}

TEST_CASE("utilization outside 0 to 1 and empty blocks are refused, block ids stay int32") {
  KvBudgetInput in = eightB();
  for (double u : {0.0, -0.5, 1.01}) {
    in.utilization = u;
    auto b = kvBudgetFromUtilization(in);
    REQUIRE(!b.ok());
    CHECK(b.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(b.status().message(), Catch::Contains("is outside (0, 1]"));
  }
  in = eightB();
  in.bytesPerBlock = 0;
  CHECK(kvBudgetFromUtilization(in).status().code() == StatusCode::kInvalidArgument);
  in = eightB();
  in.bytesPerBlock = 1;  // 54 Gi blocks would not fit an int32 block id
  CHECK(kvBudgetFromUtilization(in)->numBlocks == kMaxKvBlocks);
}
