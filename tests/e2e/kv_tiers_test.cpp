// End to end: a decode worker with the host and disk KV tiers (docs/kv_cache.md) is killed and
// started again over the same disk directory; it announces what its disk holds and serves a
// repeated prompt from it: usage.prompt_tokens_details.cached_tokens > 0 and the greedy ids of
// a cold recompute. A block file corrupted while the worker was down is dropped, not loaded.
#include <filesystem>
#include <fstream>
#include <thread>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/base/hash.h"
#include "tests/e2e/completions.h"
#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"

using namespace pd;
using namespace pd::tools;
using nlohmann::json;
using pd::test::complete;
using pd::test::Completion;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e";

std::string yaml(const std::string& diskPath) {
  return "model: {path: " + pd::test::e2eModelDir() +
         ", name: small}\n"
         "router: {routing: {prefix_aware_routing: true}, requests: {request_timeout_ms: 60000}}\n"
         "pools: {prefill: {replicas: 0}, decode: {replicas: 1}}\n"
         "engine: {backend: cpu, threads: 2, num_blocks: 96, max_batch_tokens: 512,\n"
         "         kv_tiers: {host_bytes: 67108864, disk_bytes: 268435456, disk_path: " +
         diskPath +
         "}}\n"
         "logging: {level: warn}\n";
}

}  // namespace

TEST_CASE("e2e kv tiers: a restarted decode worker serves a repeated prompt from its disk tier") {
  const std::string disk = kWork + "/kv_tiers.disk";
  fs::remove_all(disk);
  const auto prompt = pd::test::randomPrompt(300, 37);  // 18 full blocks of 16
  const int fullBlocks = (int(prompt.size()) - 1) / 16;
  const auto cold = pd::test::generateCli(prompt, 8, 2);
  REQUIRE(cold.size() == 8);

  {
    auto c = pd::test::startLocalCluster(kWork, "kv_tiers_1", yaml(disk));
    const Completion first = complete(*c, prompt, 8);
    CHECK(first.ids == cold);
    CHECK(first.cachedTokens == 0);
    // Written through to disk off the loop: wait for the writer, then kill the worker hard.
    CHECK(pd::test::waitWorkerMetric(*c, "decode-0", "pdserve_kv_tier_blocks{tier=\"disk\"}", fullBlocks) >=
          fullBlocks);
    REQUIRE(c->kill("decode-0").isOk());
    c->stop();
  }
  // Corrupt the file of block 12 while the worker is down: promotion must stop before it.
  const uint64_t block12 = blockHashChain(prompt, 16)[12];
  char name[32];
  std::snprintf(name, sizeof name, "%016llx.kvb", static_cast<unsigned long long>(block12));
  fs::path corrupted;
  for (const auto& dir : fs::directory_iterator(fs::path(disk) / "decode-0")) {
    if (fs::exists(dir.path() / name)) corrupted = dir.path() / name;
  }
  REQUIRE(!corrupted.empty());
  {
    std::fstream f(corrupted, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-64, std::ios::end);
    const char junk[4] = {1, 2, 3, 4};
    f.write(junk, 4);
  }

  auto c = pd::test::startLocalCluster(kWork, "kv_tiers_2", yaml(disk));
  CHECK(pd::test::workerMetric(*c, "decode-0", "pdserve_kv_tier_blocks{tier=\"disk\"}") >= fullBlocks);
  // ... and announced them: the router's exact index holds the blocks before any request.
  CHECK(pd::test::waitIndexed(*c, "decode-0", fullBlocks));
  const Completion again = complete(*c, prompt, 8);
  CHECK(again.ids == cold);
  CHECK(again.cachedTokens == 12 * 16);  // blocks 0-11 from disk; 12 corrupt: recomputed from there
  CHECK(pd::test::workerMetric(*c, "decode-0", "pdserve_kv_tier_promotions_total{from=\"disk\"}") == 12);
  CHECK(pd::test::workerMetric(*c, "decode-0", "pdserve_kv_tier_disk_files_dropped_total{reason=\"corrupt\"}") == 1);
  // The recomputed blocks are named again and the whole prefix is cached now.
  const Completion third = complete(*c, prompt, 8);
  CHECK(third.ids == cold);
  CHECK(third.cachedTokens == fullBlocks * 16);
}
