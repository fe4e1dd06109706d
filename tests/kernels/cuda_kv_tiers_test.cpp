// KV tiers on the cuda backend (engine/cuda_kv_copier.h, docs/kv_cache.md "Tiers on cuda"):
// the block copier against a real backend's device regions (TP 1, and TP 2 with both ranks
// on one GPU) byte for byte, and an Engine over the CUDA backend whose prompt, demoted to the
// host tier by other traffic and promoted back, generates the greedy ids of a cold run while
// its blocks keep every byte through the round trip. A skip without a device (a failure under
// PD_REQUIRE_GPU=1: kernels/check-gpu.sh).
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_kv_copier.h"
#include "engine/engine.h"
#include "engine/kv_tiers.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"
#include "gpu_test_util.h"
#include "tests/unit/engine/greedy_run.h"

using namespace pd;
using namespace pd::engine;
using namespace pd::engine::test;
using pd::kernels::cuda::test::haveGpu;

namespace {

#define REQUIRE_OK(expr)            \
  do {                              \
    const ::pd::Status s_ = (expr); \
    INFO(s_.toString());            \
    REQUIRE(s_.isOk());             \
  } while (0)

std::shared_ptr<const ModelWeights> tinyModel() {
  static auto m = [] {
    const std::string dir = std::string(PD_TEST_MODEL_DIR) + "/cuda_kv_tiers_tiny";
    if (!std::filesystem::exists(dir + "/config.json")) {
      std::filesystem::create_directories(PD_TEST_MODEL_DIR);
      const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
      MakeModelOptions o;
      o.preset = "tiny";
      o.seed = 23;
      REQUIRE(makeModel(o, tmp).toString() == "OK");
      std::error_code ec;
      std::filesystem::rename(tmp, dir, ec);
      if (ec) std::filesystem::remove_all(tmp);
    }
    auto r = loadModel(dir);
    REQUIRE(r.status().toString() == "OK");
    return r.value();
  }();
  return m;
}

// f32 weights and KV: plain f32 GEMMs, so a different chunking of the same prompt cannot flip
// a greedy near-tie.
std::unique_ptr<CudaBackend> makeBackend(int numBlocks, int tp) {
  CudaBackendOptions o;
  o.weightDtype = KvDtype::kF32;
  o.tensorParallelSize = tp;
  o.tpRanksShareDevice = tp > 1;
  auto b = createCudaBackend(tinyModel(), kvLayoutFor(tinyModel()->config, numBlocks, 16, KvDtype::kF32), o);
  REQUIRE(b.status().toString() == "OK");
  return std::move(b).value();
}

// Block b as the tiers hold it: every rank's share, each its layers in order.
std::vector<uint8_t> deviceBlock(const KvLayout& rank, const std::vector<MemDesc>& regions, BlockId b) {
  const size_t bb = rank.blockBytes();
  std::vector<uint8_t> out(bb * size_t(rank.numLayers) * regions.size());
  PD_CUDA_CHECK(cudaDeviceSynchronize());
  for (size_t r = 0; r < regions.size(); ++r) {
    for (int l = 0; l < rank.numLayers; ++l) {
      const auto* src = static_cast<const uint8_t*>(regions[r].ptr()) + rank.blockOffset(l, b);
      PD_CUDA_CHECK(
          cudaMemcpy(out.data() + (r * size_t(rank.numLayers) + size_t(l)) * bb, src, bb, cudaMemcpyDeviceToHost));
    }
  }
  return out;
}

// An Engine over the CUDA backend as the worker builds one (worker/engine_setup.cpp): the
// books over rank 0's region in the per-rank layout, tiers copied by the CUDA copier.
std::unique_ptr<Engine> makeEngine(int numBlocks, int tp, const KvTierOptions& tiers,
                                   std::vector<MemDesc>* regionsOut = nullptr) {
  auto backend = makeBackend(numBlocks, tp);
  const std::vector<MemDesc> regions = backend->kvRegions();
  if (regionsOut) *regionsOut = regions;
  const KvLayout rank = backend->rankKvLayout();
  auto kv = KvCacheManager::createOver(rank, regions[0]);
  REQUIRE(kv.ok());
  EngineOptions opts;
  opts.scheduler.maxBatchTokens = 64;  // several chunks per prompt
  opts.scheduler.maxNumSeqs = 4;
  auto e = std::make_unique<Engine>(std::move(backend), std::move(kv).value(), opts);
  if (tiers.hostBytes > 0 || tiers.diskBytes > 0) {
    auto copier = createCudaKvBlockCopier(rank, regions);
    REQUIRE(copier.status().toString() == "OK");
    CHECK((*copier)->strideBytes() == rank.blockBytes() * size_t(rank.numLayers) * regions.size());
    auto t = KvTierStore::create(e->kv(), tiers, "tiny/cuda/wtest", std::move(copier).value());
    REQUIRE(t.status().toString() == "OK");
    e->setKvTiers(std::move(t).value());
  }
  return e;
}

}  // namespace

TEST_CASE("cuda kv tiers: the copier moves every byte of a block between device regions and host", "[cuda][kv_tiers]") {
  if (!haveGpu()) return;
  for (int tp : {1, 2}) {
    DYNAMIC_SECTION("tp " << tp) {
      auto backend = makeBackend(16, tp);
      const std::vector<MemDesc> regions = backend->kvRegions();
      const KvLayout rank = backend->rankKvLayout();
      // Random bytes everywhere: a copy of the wrong layer, rank or block shows.
      std::mt19937_64 rng(uint64_t(7 + tp));
      for (const MemDesc& m : regions) {
        std::vector<uint8_t> fill(m.len);
        for (auto& x : fill) x = uint8_t(rng());
        PD_CUDA_CHECK(cudaMemcpy(m.ptr(), fill.data(), m.len, cudaMemcpyHostToDevice));
      }
      CudaKvCopierOptions o;
      o.stagingBytes = 0;  // the minimum: 2 slots, so slots are reused
      auto made = createCudaKvBlockCopier(rank, regions, o);
      REQUIRE(made.status().toString() == "OK");
      KvBlockCopier& c = **made;
      REQUIRE(c.asynchronous());
      REQUIRE(c.numSlots() == 2);
      const size_t stride = c.strideBytes();

      // Asynchronous copies out, polled without waiting until they complete, in order.
      for (BlockId b : {3, 0, 15, 7}) {
        auto slot = c.startCopyOut(b);
        REQUIRE(slot.status().toString() == "OK");
        std::vector<KvBlockCopier::Done> done;
        for (int i = 0; i < 100000 && done.empty(); ++i) c.completed(false, &done);
        REQUIRE(done.size() == 1);
        CHECK(done[0].slot == *slot);
        REQUIRE_OK(done[0].status);
        const std::vector<uint8_t> want = deviceBlock(rank, regions, b);
        CHECK(std::memcmp(c.slotData(*slot), want.data(), stride) == 0);
        c.releaseSlot(*slot);
      }
      // Two in flight, then one wait takes both.
      auto s1 = c.startCopyOut(1), s2 = c.startCopyOut(2);
      REQUIRE((s1.ok() && s2.ok()));
      CHECK(c.freeSlots() == 0);
      CHECK(c.startCopyOut(4).status().code() == StatusCode::kResourceExhausted);
      std::vector<KvBlockCopier::Done> done;
      c.completed(true, &done);
      REQUIRE(done.size() == 2);
      CHECK(std::memcmp(c.slotData(*s1), deviceBlock(rank, regions, 1).data(), stride) == 0);
      CHECK(std::memcmp(c.slotData(*s2), deviceBlock(rank, regions, 2).data(), stride) == 0);
      c.releaseSlot(*s1);
      c.releaseSlot(*s2);

      // Synchronous out, and in: block 5's bytes written into block 9 of every rank, its
      // neighbours untouched.
      std::vector<uint8_t> five(stride), eight = deviceBlock(rank, regions, 8), ten = deviceBlock(rank, regions, 10);
      REQUIRE_OK(c.copyOut(5, five.data()));
      CHECK(five == deviceBlock(rank, regions, 5));
      REQUIRE_OK(c.copyIn(five.data(), 9));
      CHECK(deviceBlock(rank, regions, 9) == five);
      CHECK(deviceBlock(rank, regions, 8) == eight);
      CHECK(deviceBlock(rank, regions, 10) == ten);
      CHECK(c.copyIn(five.data(), 16).code() == StatusCode::kInvalidArgument);
    }
  }
}

TEST_CASE("cuda kv tiers: a prompt demoted to host and promoted back keeps its bytes and the cold run's greedy ids",
          "[cuda][kv_tiers]") {
  if (!haveGpu()) return;
  for (int tp : {1, 2}) {
    DYNAMIC_SECTION("tp " << tp) {
      const int vocab = tinyModel()->config.vocabSize;
      const auto prompt = tierPrompt(1, 5 * 16 + 3, vocab);  // 5 full blocks
      const auto other = tierPrompt(2, 8 * 16 + 5, vocab);
      const GreedyRun cold = generateGreedy(*makeEngine(64, tp, {}), 1, prompt, vocab);
      CHECK(cold.cachedTokens == 0);

      KvTierOptions o;
      o.hostBytes = 64 << 20;
      std::vector<MemDesc> regions;
      auto e = makeEngine(10, tp, o, &regions);  // room for one prompt at a time
      KvTierStore& t = *e->kvTiers();
      CHECK(t.copier().asynchronous());
      CHECK(generateGreedy(*e, 1, prompt, vocab).ids == cold.ids);
      // The prompt's blocks as computed, by name.
      const KvLayout rank = e->kv().layout();
      const std::vector<uint64_t> names = blockHashChain(prompt, 16);
      std::map<uint64_t, std::vector<uint8_t>> computed;
      PrefixMatch before = e->kv().findCachedPrefix(prompt, int(prompt.size()) - 1);
      REQUIRE(before.blocks.size() == 5);
      for (size_t i = 0; i < 5; ++i) computed[names[i]] = deviceBlock(rank, regions, before.blocks[i]);

      generateGreedy(*e, 2, other, vocab);  // evicts the prompt's later blocks (tail first): they demote to host
      t.finishCopies();                     // what a later poll() would see: every copy completed
      REQUIRE_OK(t.checkInvariants());
      CHECK(e->kv().numHeldBlocks() == 0);
      const int inRegion = e->kv().findCachedPrefix(prompt, int(prompt.size()) - 1).numTokens / 16;
      REQUIRE(inRegion < 4);
      REQUIRE(t.host()->size() >= 5 - inRegion);
      // The host copies are the device bytes, every rank's share.
      for (size_t i = size_t(inRegion); i < 5; ++i) {
        INFO("block " << i);
        REQUIRE(t.host()->contains(names[i]));
        CHECK(std::memcmp(t.host()->data(names[i]), computed[names[i]].data(), computed[names[i]].size()) == 0);
      }
      INFO("demotions " << t.stats().demotionsToHost << ", evictions that waited for a copy "
                        << t.stats().waitedEvictions);

      const GreedyRun warm = generateGreedy(*e, 3, prompt, vocab);
      CHECK(warm.ids == cold.ids);
      CHECK(warm.cachedTokens == 5 * 16);
      CHECK(e->kv().stats().promotedBlocks[int(KvTier::kHost)] == uint64_t(5 - inRegion));
      // Promoted into fresh device blocks: the same bytes again.
      PrefixMatch after = e->kv().findCachedPrefix(prompt, int(prompt.size()) - 1);
      REQUIRE(after.blocks.size() == 5);
      for (size_t i = 0; i < 5; ++i) {
        INFO("block " << i);
        CHECK(deviceBlock(rank, regions, after.blocks[i]) == computed[names[i]]);
      }
      REQUIRE_OK(t.checkInvariants());
    }
  }
}
