// End to end: a multi-turn conversation across the prefill/decode split (docs/kv_cache.md,
// "Multi-turn"). Turn 1's long prompt is prefilled on the prefill worker and decoded on the
// decode worker, which names the blocks of prompt and answer alike and announces them in KV
// events. Turn 2's prompt is turn 1's prompt, its answer and a new message: the router finds
// most of it on the decode worker and keeps it there ("cached_prefix"), whose cache serves
// every full block of turn 1's prompt and answer (usage.prompt_tokens_details.cached_tokens);
// turn 3 does the same with turn 2's answer, decoded colocated. Every turn's greedy ids equal
// one process computing the whole prompt with nothing cached.
#include <thread>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/e2e/completions.h"
#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"

using namespace pd;
using namespace pd::tools;
using nlohmann::json;
using pd::test::complete;
using pd::test::Completion;
using namespace std::chrono_literals;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e";
constexpr int kBlock = 16;

double routed(LocalCluster& c, const std::string& route, const std::string& reason) {
  const double v =
      pd::test::routerMetric(c, "pdserve_route_decisions_total{reason=\"" + reason + "\",route=\"" + route + "\"}");
  return std::max(0.0, v);
}

}  // namespace

TEST_CASE("e2e multi-turn: the next turn hits the decode worker's prompt and answer blocks") {
  const std::string yaml = "model: {path: " + pd::test::e2eModelDir() +
                           ", name: small}\n"
                           "router: {routing: {short_prompt_tokens: 64}, requests: {request_timeout_ms: 60000}}\n"
                           "pools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"
                           "engine: {backend: cpu, threads: 1, num_blocks: 256, max_batch_tokens: 512}\n"
                           "kv_transfer: {transports: [tcp], listen_host: 127.0.0.1}\n"
                           "logging: {level: warn}\n";
  auto c = pd::test::startLocalCluster(kWork, "multiturn", yaml);

  // Turn 1: 400 prompt tokens, past short_prompt_tokens: disaggregated.
  const std::vector<int32_t> first = pd::test::randomPrompt(400, 41);
  const Completion t1 = complete(*c, first, 40);
  CHECK(t1.ids == pd::test::generateCli(first, 40, 2));
  CHECK(t1.cachedTokens == 0);
  CHECK(routed(*c, "disaggregated", "long_prompt") == 1);
  std::vector<int32_t> history = first;
  history.insert(history.end(), t1.ids.begin(), t1.ids.end());

  for (int turn = 2; turn <= 3; ++turn) {
    INFO("turn " << turn);
    // The history (prompts and answers; the last answer token's KV was never computed) and a
    // new message of 30 tokens: the decode worker holds every full block of the history.
    const int historyBlocks = int(history.size() - 1) / kBlock;
    // The KV events of a turn travel ahead of its last token (docs/kv_events.md): this only
    // bounds a lost batch.
    CHECK(pd::test::waitIndexed(*c, "decode-0", historyBlocks));
    std::vector<int32_t> prompt = history;
    const auto message = pd::test::randomPrompt(31, 100 + turn);
    prompt.insert(prompt.end(), message.begin() + 1, message.end());
    const double colocatedBefore = routed(*c, "colocated", "cached_prefix");
    const Completion t = complete(*c, prompt, 24);
    CHECK(routed(*c, "colocated", "cached_prefix") == colocatedBefore + 1);
    CHECK(t.cachedTokens == historyBlocks * kBlock);
    CHECK(t.ids == pd::test::generateCli(prompt, 24, 2));
    history = prompt;
    history.insert(history.end(), t.ids.begin(), t.ids.end());
  }
}
