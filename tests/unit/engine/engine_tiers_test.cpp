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

std::vector<int32_t> promptOf(int seed, int n) {
  std::vector<int32_t> p(static_cast<size_t>(n), 0);
  const int vocab = model()->config.vocabSize;
  for (int i = 0; i < n; ++i) p[size_t(i)] = (seed * 131 + i * 37 + i * i) % vocab;
  return p;
}

struct Run {
  std::vector<int32_t> ids;
  int cachedTokens = 0;
};

Run generate(Engine& engine, uint64_t id, const std::vector<int32_t>& prompt) {
  SamplingParams p;
  p.temperature = 0;
  p.maxTokens = 8;
  p.ignoreEos = true;
  auto r = Request::create(id, prompt, p, SystemClock::instance(), model()->config.vocabSize);
  REQUIRE(r.ok());
  REQUIRE(engine.submit(std::move(r).value()).isOk());
  Run out;
  for (int guard = 0; engine.hasWork() && guard < 10000; ++guard) {
    if (const Request* req = engine.find(id)) out.cachedTokens = req->numCachedPromptTokens();
    std::vector<EngineEvent> events;
    REQUIRE(engine.step(&events).isOk());
    for (auto& e : events) {
      if (e.kind == EngineEvent::Kind::kToken && e.requestId == id) out.ids.push_back(e.token.id);
      if (e.kind == EngineEvent::Kind::kFinished && e.requestId == id) out.cachedTokens = e.timings.cachedPromptTokens;
    }
  }
  REQUIRE(out.ids.size() == 8);
  return out;
}

}  // namespace

TEST_CASE(
    "engine tiers: a demoted prefix promoted from host, and one restored from disk after a restart, "
    "generate the cold recompute's greedy ids") {
  const auto prompt = promptOf(1, 5 * 16 + 3);  // 5 full blocks
  const auto other = promptOf(2, 8 * 16 + 5);
  const Run cold = generate(*makeEngine(64), 1, prompt);
  CHECK(cold.cachedTokens == 0);

  SECTION("host tier") {
    KvTierOptions o;
    o.hostBytes = 64 << 20;
    auto e = makeEngine(10, o);  // room for one prompt at a time
    CHECK(generate(*e, 1, prompt).ids == cold.ids);
    generate(*e, 2, other);  // evicts the prompt's later blocks (tail first): they demote to host
    const int inRegion = e->kv().findCachedPrefix(prompt, int(prompt.size()) - 1).numTokens / 16;
    REQUIRE(inRegion < 4);
    REQUIRE(e->kvTiers()->host()->size() >= 5 - inRegion);
    const Run warm = generate(*e, 3, prompt);
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
      CHECK(generate(*e, 1, prompt).ids == cold.ids);
      REQUIRE(e->kvTiers()->disk()->drain(std::chrono::seconds(10)));
      e->pollKvTiers();
      CHECK(e->kvTiers()->disk()->size() >= 5);
    }  // the "worker" stops; its files stay
    auto e = makeEngine(16, o);
    CHECK(e->kvTiers()->disk()->size() >= 5);
    const Run warm = generate(*e, 1, prompt);
    CHECK(warm.ids == cold.ids);
    CHECK(warm.cachedTokens == 5 * 16);
    CHECK(e->kv().stats().promotedBlocks[int(KvTier::kDisk)] == 5);
    REQUIRE(e->kvTiers()->checkInvariants().isOk());
  }
}
