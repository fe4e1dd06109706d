// engine::Engine with KV tiers (engine/kv_tiers.h) on the tiny model: a prompt whose prefix
// was demoted to the host tier, and one restored from the disk tier by a new engine (a
// restarted worker), generate the greedy ids of a cold recompute, and say how many prompt
// tokens came from the cache.
#include <map>

#include <catch2/catch.hpp>

#include "engine/engine.h"
#include "engine/kv_tiers.h"
#include "model_test_util.h"
#include "tests/scratch_dir.h"
#include "tests/unit/engine/greedy_run.h"

using namespace pd;
using namespace pd::engine;
using namespace pd::engine::test;

namespace {

std::shared_ptr<const ModelWeights> model() {
  static auto m = [] {
    auto r = loadModel(makeTestModel("engine_tiers_tiny", MakeModelOptions{}));
    REQUIRE(r.ok());
    return r.value();
  }();
  return m;
}

const std::string kIdentity = "tiny/layout/wtest";

std::unique_ptr<Engine> makeEngine(int numBlocks, KvTierOptions tiers = {}) {
  auto layout = kvLayoutFor(model()->config, numBlocks, 16);
  auto kv = KvCacheManager::create(layout);
  REQUIRE(kv.ok());
  auto backend = createCpuBackend(model(), layout, kv.value()->data(), {1});
  REQUIRE(backend.ok());
  EngineOptions opts;
  opts.scheduler.maxBatchTokens = 64;  // several chunks per prompt
  opts.scheduler.maxNumSeqs = 4;
  auto e = std::make_unique<Engine>(std::move(backend).value(), std::move(kv).value(), opts);
  if (tiers.hostBytes > 0 || tiers.diskBytes > 0) {
    auto t = KvTierStore::create(e->kv(), tiers, kIdentity);
    REQUIRE(t.ok());
    e->setKvTiers(std::move(t).value());
  }
  return e;
}

}  // namespace

TEST_CASE(
    "engine tiers: a demoted prefix promoted from host, and one restored from disk after a restart, "
    "generate the cold recompute's greedy ids") {
  const int vocab = model()->config.vocabSize;
  const auto prompt = tierPrompt(1, 5 * 16 + 3, vocab);  // 5 full blocks
  const auto other = tierPrompt(2, 8 * 16 + 5, vocab);
  const GreedyRun cold = generateGreedy(*makeEngine(64), 1, prompt, vocab);
  CHECK(cold.cachedTokens == 0);

  SECTION("host tier") {
    KvTierOptions o;
    o.hostBytes = 64 << 20;
    auto e = makeEngine(10, o);  // room for one prompt at a time
    CHECK(generateGreedy(*e, 1, prompt, vocab).ids == cold.ids);
    generateGreedy(*e, 2, other, vocab);  // evicts the prompt's later blocks (tail first): they demote to host
    const int inRegion = e->kv().findCachedPrefix(prompt, int(prompt.size()) - 1).numTokens / 16;
    REQUIRE(inRegion < 4);
    REQUIRE(e->kvTiers()->host()->size() >= 5 - inRegion);
    const GreedyRun warm = generateGreedy(*e, 3, prompt, vocab);
    CHECK(warm.ids == cold.ids);
    CHECK(warm.cachedTokens == 5 * 16);
    CHECK(e->kv().stats().promotedBlocks[int(KvTier::kHost)] == uint64_t(5 - inRegion));
    CHECK(e->kv().stats().hitBlocks[int(KvTier::kHost)] == uint64_t(5 - inRegion));
    REQUIRE(e->kvTiers()->checkInvariants().isOk());
  }
  SECTION("disk tier across a restart") {
    KvTierOptions o;
    o.diskBytes = 64 << 20;
    o.diskPath = (pd::test::scratchDir() / "engine-disk").string();
    {
      auto e = makeEngine(16, o);
      CHECK(generateGreedy(*e, 1, prompt, vocab).ids == cold.ids);
      REQUIRE(e->kvTiers()->disk()->drain(std::chrono::seconds(10)));
      e->pollKvTiers();
      CHECK(e->kvTiers()->disk()->size() >= 5);
    }  // the "worker" stops; its files stay
    auto e = makeEngine(16, o);
    CHECK(e->kvTiers()->disk()->size() >= 5);
    const GreedyRun warm = generateGreedy(*e, 1, prompt, vocab);
    CHECK(warm.ids == cold.ids);
    CHECK(warm.cachedTokens == 5 * 16);
    CHECK(e->kv().stats().promotedBlocks[int(KvTier::kDisk)] == 5);
    REQUIRE(e->kvTiers()->checkInvariants().isOk());
  }
}
