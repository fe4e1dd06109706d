// End to end: the prefill worker pulls a multi-turn history from the decode worker
// (docs/kv_cache.md, "Peer pulls", prefill side). Turn 1 is short and served colocated on the
// decode worker, which then holds its prompt and its long answer. Turn 2 is that history and a
// long new message: past short_prompt_tokens even after the decode worker's hit, so it goes
// disaggregated, and the router names the decode worker as the prefill worker's pull source
// (reason "prefill_pull"). The prefill worker pulls the history's full blocks over the link the
// decode worker keeps to it, computes only the new message, and pushes every block back. The
// greedy ids equal `pdserve generate` of the same prompt with nothing cached. Then the same
// with the decode worker stopped (SIGSTOP) while the prefill worker's PullRequest waits in its
// socket: the pull falls back at its deadline, the prefill worker computes the whole prompt,
// and once the decode worker runs again the ids are the same and no block stays held.
#include <signal.h>

#include <thread>

#include <catch2/catch.hpp>

#include "tests/e2e/completions.h"
#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"

using namespace pd;
using namespace pd::tools;
using namespace std::chrono_literals;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e";
constexpr int kBlock = 16;
constexpr int kPullDeadlineMs = 800;

using pd::test::complete;
using pd::test::Completion;
using pd::test::header;
using pd::test::waitFor;

double metric(LocalCluster& c, const std::string& worker, const std::string& series) {
  return std::max(0.0, pd::test::workerMetric(c, worker, series));
}

// The prefill worker's pulls by outcome: a done one's lane is tcp, the others' "none".
double pulls(LocalCluster& c, const std::string& outcome) {
  const std::string lane = outcome == "done" ? "tcp" : "none";
  return metric(c, "prefill-0", "pdserve_kv_pulls_total{outcome=\"" + outcome + "\",transport=\"" + lane + "\"}");
}

double prefillPullRoutes(LocalCluster& c) {
  return std::max(
      0.0, pd::test::routerMetric(c, "pdserve_route_decisions_total{reason=\"prefill_pull\",route=\"disaggregated\"}"));
}

struct Conversation {
  std::vector<int32_t> turn2;
  int historyBlocks = 0;
};

// A warm-up that measures the prefill worker's rate and the tcp lane (no figure, no pull:
// router/pull_cost.h), then turn 1: 48 tokens (colocated) and a 400-token answer, whose full
// blocks the router then knows on decode-0. Turn 2 adds a 120-token message.
Conversation converse(LocalCluster& c, uint64_t seed) {
  for (uint64_t i = 0; i < 3; ++i) {  // the lane's figures are the best of its recent transfers
    const Completion warm = complete(c, pd::test::randomPrompt(300, seed + 7 + i), 2);
    REQUIRE(header(warm.headers, "x-pdserve-route") == "disaggregated");
  }
  const std::vector<int32_t> first = pd::test::randomPrompt(48, seed);
  const Completion t1 = complete(c, first, 400);
  REQUIRE(header(t1.headers, "x-pdserve-route") == "colocated");
  std::vector<int32_t> history = first;
  history.insert(history.end(), t1.ids.begin(), t1.ids.end());
  Conversation conv;
  conv.historyBlocks = int(history.size() - 1) / kBlock;
  REQUIRE(waitFor(
      [&] {
        return pd::test::routerMetric(c, "pdserve_router_prefix_index_blocks{index=\"exact\",worker=\"decode-0\"}") >=
               conv.historyBlocks;
      },
      10s));
  std::this_thread::sleep_for(300ms);  // load reports (every 100 ms) carry the measured figures
  conv.turn2 = history;
  const auto message = pd::test::randomPrompt(121, seed + 1);
  conv.turn2.insert(conv.turn2.end(), message.begin() + 1, message.end());
  return conv;
}

std::unique_ptr<LocalCluster> cluster(const std::string& name) {
  const std::string yaml = "model: {path: " + pd::test::e2eModelDir() +
                           ", name: small}\n"
                           "router: {routing: {short_prompt_tokens: 64}, requests: {request_timeout_ms: 60000},\n"
                           "         workers: {worker_report_timeout_ms: 15000}}\n"
                           "pools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"
                           "engine: {backend: cpu, threads: 1, num_blocks: 256, max_batch_tokens: 512}\n"
                           "kv_transfer: {transports: [tcp], listen_host: 127.0.0.1, peer_pulls: true, "
                           "pull_timeout_ms: " +
                           std::to_string(kPullDeadlineMs) +
                           "}\n"
                           "logging: {level: warn}\n";
  return pd::test::startLocalCluster(kWork, name, yaml);
}

}  // namespace

TEST_CASE("e2e prefill pull: the next turn's history is pulled by the prefill worker from the decode worker") {
  auto c = cluster("prefill_pull");
  const Conversation conv = converse(*c, 5100);
  const std::vector<int32_t> cold = pd::test::generateCli(conv.turn2, 8, 1);
  REQUIRE(cold.size() == 8);
  const double routes = prefillPullRoutes(*c);
  const Completion t2 = complete(*c, conv.turn2, 8);
  INFO(t2.headers);
  CHECK(header(t2.headers, "x-pdserve-route") == "disaggregated");
  CHECK(prefillPullRoutes(*c) == routes + 1);
  CHECK(pulls(*c, "done") == 1);
  CHECK(metric(*c, "prefill-0", "pdserve_kv_pull_bytes_total{transport=\"tcp\"}") > 0);
  CHECK(t2.cachedTokens == conv.historyBlocks * kBlock);
  CHECK(header(t2.headers, "server-timing").find("kv_pull;dur=") != std::string::npos);
  CHECK(t2.ids == cold);
  CHECK(metric(*c, "prefill-0", "pdserve_kv_blocks_quarantined") == 0);
  // Nothing stays pinned on the source or held on the prefill worker once idle.
  CHECK(waitFor(
      [&] {
        return metric(*c, "decode-0", "pdserve_kv_cache_free_blocks") ==
                   metric(*c, "decode-0", "pdserve_kv_cache_num_blocks") &&
               metric(*c, "prefill-0", "pdserve_kv_cache_free_blocks") ==
                   metric(*c, "prefill-0", "pdserve_kv_cache_num_blocks");
      },
      10s));
  c->stop();
}

TEST_CASE("e2e prefill pull: a source stopped mid-pull costs the pull deadline, then the prefill computes it") {
  auto c = cluster("prefill_pull_stop");
  const Conversation conv = converse(*c, 5200);
  const std::vector<int32_t> cold = pd::test::generateCli(conv.turn2, 8, 1);
  REQUIRE(cold.size() == 8);
  const std::string decode = "decode-0", prefill = "prefill-0";
  // The prefill worker is stopped first, so the decode worker's PrefillRequest (naming the
  // pull) waits in its socket; then the decode worker is stopped and the prefill worker runs:
  // its PullRequest meets a stopped source.
  REQUIRE(c->processes().signal(prefill, SIGSTOP).isOk());
  Completion t2;
  std::thread client([&] { t2 = complete(*c, conv.turn2, 8); });
  const bool requested =
      waitFor([&] { return metric(*c, decode, "pdserve_remote_prefills{state=\"requested\"}") >= 1; }, 20s);
  // The router named the pull (counted when it routed): else there is no pull to stop.
  const bool named = prefillPullRoutes(*c) >= 1;
  // The PrefillRequest leaves the decode worker's io thread for the stopped prefill worker's
  // socket buffer before the decode worker stops too (a second on a loaded machine; the
  // decode worker's lease on the stopped prefill worker is 3 s).
  std::this_thread::sleep_for(1s);
  REQUIRE(c->processes().signal(decode, SIGSTOP).isOk());
  REQUIRE(c->processes().signal(prefill, SIGCONT).isOk());
  const auto resumed = std::chrono::steady_clock::now();
  // The prefill worker took the request (its job, pulling, counts as computing).
  const bool accepted =
      waitFor([&] { return metric(*c, prefill, "pdserve_remote_prefills{state=\"computing\"}") >= 1; }, 2s);
  const bool fellBack = waitFor([&] { return pulls(*c, "fell_back") >= 1; }, 2500ms);  // within the lease (3 s)
  const double waitedMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - resumed).count();
  REQUIRE(c->processes().signal(decode, SIGCONT).isOk());
  client.join();
  CHECK(requested);
  CHECK(named);
  CHECK(accepted);
  CHECK(fellBack);
  CHECK(waitedMs < kPullDeadlineMs + 1500);  // the pull deadline, not kv_transfer.timeout_ms (10 s)
  CHECK(pulls(*c, "done") == 0);
  CHECK(t2.ids == cold);
  // Nothing held or pinned on either side once the decode worker answered the Cancel.
  CHECK(waitFor(
      [&] {
        return metric(*c, prefill, "pdserve_kv_blocks_quarantined") == 0 &&
               metric(*c, decode, "pdserve_kv_cache_free_blocks") ==
                   metric(*c, decode, "pdserve_kv_cache_num_blocks") &&
               metric(*c, prefill, "pdserve_kv_cache_free_blocks") ==
                   metric(*c, prefill, "pdserve_kv_cache_num_blocks");
      },
      10s));
  c->stop();
}
