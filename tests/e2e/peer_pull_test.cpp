// End to end: peer pulls (docs/kv_cache.md, "Peer pulls") on a local cluster of a router, one
// prefill worker and two decode workers with kv_transfer.peer_pulls on, over cma and over tcp.
//
// A long prompt W is prefilled on prefill-0 and lands on one decode worker (the source), whose
// KV region then holds W's blocks; prefill-0's pushes gave the fleet its measured lane figure.
// While the source is busy with a stream, a prompt Q sharing W's first 256 tokens goes to the
// other decode worker (the target), which pulls those 256 tokens from the source and computes
// only the rest: route reason "pull", cached_tokens 256, the greedy ids
// of a cold `pdserve generate`, the pull in server-timing and in the pull metrics. Then the
// failures: the source SIGSTOPped or killed (the pull falls back within the pull deadline,
// the request recomputes with the same ids, no block stays quarantined or pinned on either
// side), and a source that no longer holds the blocks (refused, recomputed).
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
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
using pd::test::header;
using pd::test::waitFor;
using namespace std::chrono_literals;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e";
constexpr int kPullDeadlineMs = 1500;

std::string yaml(const std::string& transport, int numBlocks = 128) {
  return "model: {path: " + pd::test::e2eModelDir() +
         ", name: small}\n"
         "router: {routing: {short_prompt_tokens: 64}, requests: {request_timeout_ms: 60000},\n"
         "         workers: {worker_report_timeout_ms: 5000}}\n"
         "pools: {prefill: {replicas: 1}, decode: {replicas: 2}}\n"
         "engine: {backend: cpu, threads: 1, num_blocks: " +
         std::to_string(numBlocks) +
         ", max_batch_tokens: 512}\n"
         "kv_transfer: {transports: [" +
         transport + "], peer_pulls: true, pull_timeout_ms: " + std::to_string(kPullDeadlineMs) +
         "}\n"
         "logging: {level: warn}\n";
}

double decodeMetric(LocalCluster& c, const std::string& worker, const std::string& series) {
  return pd::test::workerMetric(c, worker, series);
}

struct Setup {
  std::string source, target;  // the decode worker W landed on, and the other
  std::vector<int32_t> w;
  std::vector<int32_t> q;  // W's first 256 tokens + 30 of its own
  std::vector<int32_t> cold;
};

// A prompt W computed on prefill-0 and pushed to a decode worker (the source), whose region
// then holds it.
Setup prefix(LocalCluster& c, uint64_t seed, int pulled = 256, bool reference = true) {
  Setup s;
  s.w = pd::test::randomPrompt(pulled + 48, seed);
  const Completion w = complete(c, s.w, 2);
  REQUIRE(header(w.headers, "x-pdserve-route") == "disaggregated");
  s.source = header(w.headers, "x-pdserve-decode-worker");
  REQUIRE((s.source == "decode-0" || s.source == "decode-1"));
  s.target = s.source == "decode-0" ? "decode-1" : "decode-0";
  s.q.assign(s.w.begin(), s.w.begin() + pulled);
  const auto tail = pd::test::randomPrompt(30, seed + 1000);
  s.q.insert(s.q.end(), tail.begin(), tail.end());
  if (reference) {
    s.cold = pd::test::generateCli(s.q, 8, 1);
    REQUIRE(s.cold.size() == 8);
  }
  // The router knows the source's blocks (exact index).
  REQUIRE(pd::test::waitIndexed(c, s.source, pulled / 16));
  return s;
}

// Runs `body` while a stream of W's first 256 tokens + 10 runs on the source (a cached prefix there), so
// the router sends Q to the less loaded target.
// `stream`, when given, is the stream's prompt instead (one whose cached prefix is on the source).
template <typename F>
void whileBusy(LocalCluster& c, const Setup& s, F body, bool sourceSurvives = true, std::vector<int32_t> stream = {},
               int streamTokens = 400) {
  std::vector<int32_t> r(s.w.begin(), s.w.begin() + std::min<size_t>(s.w.size(), 256));
  const auto more = pd::test::randomPrompt(10, 99);
  r.insert(r.end(), more.begin(), more.end());
  if (!stream.empty()) r = std::move(stream);
  std::string decodeWorker;
  // Both idle in the router's eyes first (reports every 100 ms): a stale "running" on the
  // source would send the stream to the target instead.
  REQUIRE(waitFor(
      [&] {
        return decodeMetric(c, "decode-0", "pdserve_num_requests_running") == 0 &&
               decodeMetric(c, "decode-1", "pdserve_num_requests_running") == 0;
      },
      20s));
  std::this_thread::sleep_for(300ms);
  std::thread busy([&] {
    json req{{"model", "small"}, {"prompt", r}, {"max_tokens", streamTokens}, {"temperature", 0}, {"ignore_eos", true}};
    auto reply = httpRequest(c.httpPort(), "POST", "/v1/completions", req.dump(), 180s);
    if (reply.ok()) decodeWorker = header(reply->headers, "x-pdserve-decode-worker");
  });
  // Its report says the source runs it (reports every 100 ms).
  const bool running = waitFor([&] { return decodeMetric(c, s.source, "pdserve_num_requests_running") >= 1; }, 20s);
  std::this_thread::sleep_for(300ms);
  if (running) body();
  busy.join();
  REQUIRE(running);
  if (sourceSurvives) CHECK(decodeWorker == s.source);
}

double pulls(LocalCluster& c, const std::string& worker, const std::string& outcome, const std::string& transport) {
  return std::max(
      0.0,
      decodeMetric(c, worker, "pdserve_kv_pulls_total{outcome=\"" + outcome + "\",transport=\"" + transport + "\"}"));
}

void pullServesPrefix(const std::string& transport) {
  auto c = pd::test::startLocalCluster(kWork, "peer_pull_" + transport, yaml(transport));
  const Setup s = prefix(*c, 4100);
  Completion q;
  whileBusy(*c, s, [&] { q = complete(*c, s.q, 8); });
  INFO(q.headers);
  CHECK(header(q.headers, "x-pdserve-decode-worker") == s.target);
  CHECK(q.ids == s.cold);
  CHECK(q.cachedTokens == 256);
  CHECK(header(q.headers, "server-timing").find("kv_pull;dur=") != std::string::npos);
  CHECK(pd::test::routerMetric(*c, "pdserve_route_decisions_total{reason=\"pull\",route=\"colocated\"}") == 1);
  CHECK(pulls(*c, s.target, "done", transport) == 1);
  CHECK(decodeMetric(*c, s.target, "pdserve_kv_pull_bytes_total{transport=\"" + transport + "\"}") ==
        256.0 * 16 * 1024);
  CHECK(decodeMetric(*c, s.target, "pdserve_kv_blocks_quarantined") == 0);
  c->stop();
}

}  // namespace

TEST_CASE("e2e peer pull: a prefix computed on one decode worker is pulled by the other over cma") {
#if !PD_HAVE_CMA
  SKIP("no cma on this platform");
#endif
  pullServesPrefix("cma");
}

TEST_CASE("e2e peer pull: a prefix computed on one decode worker is pulled by the other over tcp") {
  pullServesPrefix("tcp");
}

// The source stops (SIGSTOP: a hung host) or dies after the router chose it: the target's
// pull falls back within the pull deadline and recomputes the whole prompt, same ids; once the
// stopped source runs again it answers the Cancel and nothing stays quarantined or pinned.
TEST_CASE("e2e peer pull: a stopped or killed source costs at most the pull deadline, then a recompute") {
  const std::string transport = GENERATE(std::string("cma"), std::string("tcp"));
#if !PD_HAVE_CMA
  if (transport == "cma") SKIP("no cma on this platform");
#endif
  auto c = pd::test::startLocalCluster(kWork, "peer_pull_fail_" + transport, yaml(transport));
  // One good pull first: when the next prefix lands on the same source, the link target ->
  // source is up and the next PullRequest reaches the stopped source's socket (mid-pull).
  {
    const Setup s = prefix(*c, 4200);
    Completion q;
    whileBusy(*c, s, [&] { q = complete(*c, s.q, 8); });
    REQUIRE(q.cachedTokens == 256);
  }
  const Setup s = prefix(*c, 4300);
  const double fellBack = pulls(*c, s.target, "fell_back", "none");
  Completion q;
  whileBusy(*c, s, [&] {
    REQUIRE(c->processes().signal(s.source, SIGSTOP).isOk());
    q = complete(*c, s.q, 8);
    REQUIRE(c->processes().signal(s.source, SIGCONT).isOk());
  });
  CHECK(header(q.headers, "x-pdserve-decode-worker") == s.target);
  CHECK(q.ids == s.cold);
  CHECK(q.cachedTokens == 0);
  CHECK(pulls(*c, s.target, "fell_back", "none") == fellBack + 1);
  CHECK(q.seconds >= kPullDeadlineMs / 1e3);
  // Once the source runs again: its Cancel{ack} releases any quarantine on the target, and the
  // source unpinned what it pinned (every block free again when idle).
  CHECK(waitFor([&] { return decodeMetric(*c, s.target, "pdserve_kv_blocks_quarantined") == 0; }, 10s));
  CHECK(waitFor(
      [&] {
        return decodeMetric(*c, s.source, "pdserve_kv_cache_free_blocks") ==
               decodeMetric(*c, s.source, "pdserve_kv_cache_num_blocks");
      },
      10s));

  // Killed mid-pull: stopped first, so the router still routes to it and the PullRequest is
  // on its way, then killed: the link goes down and the target recomputes, before the deadline
  // ends.
  const Setup k = prefix(*c, 4400);
  const double fellBackK = pulls(*c, k.target, "fell_back", "none");
  Completion kq;
  whileBusy(
      *c, k,
      [&] {
        REQUIRE(c->processes().signal(k.source, SIGSTOP).isOk());
        std::thread killer([&] {
          std::this_thread::sleep_for(300ms);
          (void)c->kill(k.source);
        });
        kq = complete(*c, k.q, 8);
        killer.join();
      },
      /*sourceSurvives=*/false);
  CHECK(header(kq.headers, "x-pdserve-decode-worker") == k.target);
  CHECK(kq.ids == k.cold);
  CHECK(kq.cachedTokens == 0);
  CHECK(pulls(*c, k.target, "fell_back", "none") == fellBackK + 1);
  CHECK(decodeMetric(*c, k.target, "pdserve_kv_blocks_quarantined") == 0);
  c->stop();
}

// A multi-turn conversation across the split, served by a pull: turn 1's long prompt is
// prefilled on prefill-0 and decoded on one decode worker (the source), which names the blocks
// of its prompt and its answer. Turn 2 (turn 1's prompt, the ids it generated and a new message,
// as `pdserve bench --multi-turn` sends them) comes while the source is busy with a stream: the
// router sends it to the other decode worker, which pulls the history's full blocks (prompt and
// answer) from the source and computes only the new message: route reason "pull", cached_tokens
// every full block of the history, the greedy ids of a cold run that caches nothing.
TEST_CASE("e2e peer pull: a multi-turn conversation's next turn pulls the history from its decoder") {
  const std::string transport = GENERATE(std::string("cma"), std::string("tcp"));
#if !PD_HAVE_CMA
  if (transport == "cma") SKIP("no cma on this platform");
#endif
  auto c = pd::test::startLocalCluster(kWork, "peer_pull_turn_" + transport, yaml(transport));
  Setup s;
  s.w = pd::test::randomPrompt(300, 4500);
  const Completion t1 = complete(*c, s.w, 40);
  REQUIRE(header(t1.headers, "x-pdserve-route") == "disaggregated");
  REQUIRE(t1.ids.size() == 40);
  s.source = header(t1.headers, "x-pdserve-decode-worker");
  REQUIRE((s.source == "decode-0" || s.source == "decode-1"));
  s.target = s.source == "decode-0" ? "decode-1" : "decode-0";

  // The history: turn 1's prompt and answer; the answer's last token's KV was never computed,
  // so the source names every full block of the rest, answer blocks included.
  std::vector<int32_t> history = s.w;
  history.insert(history.end(), t1.ids.begin(), t1.ids.end());
  const int historyBlocks = int(history.size() - 1) / 16;
  REQUIRE(historyBlocks * 16 > int(s.w.size()));  // at least one block of the answer is pulled
  REQUIRE(pd::test::waitIndexed(*c, s.source, historyBlocks));
  std::vector<int32_t> turn2 = history;
  const auto message = pd::test::randomPrompt(31, 4501);
  turn2.insert(turn2.end(), message.begin() + 1, message.end());
  const std::vector<int32_t> cold = pd::test::generateCli(turn2, 8, 1);
  REQUIRE(cold.size() == 8);

  const double pullRoutes =
      pd::test::routerMetric(*c, "pdserve_route_decisions_total{reason=\"pull\",route=\"colocated\"}");
  const double done = pulls(*c, s.target, "done", transport);
  Completion t2;
  whileBusy(*c, s, [&] { t2 = complete(*c, turn2, 8); });
  INFO(t2.headers);
  CHECK(header(t2.headers, "x-pdserve-decode-worker") == s.target);
  CHECK(pd::test::routerMetric(*c, "pdserve_route_decisions_total{reason=\"pull\",route=\"colocated\"}") ==
        std::max(0.0, pullRoutes) + 1);
  CHECK(t2.cachedTokens == historyBlocks * 16);
  CHECK(t2.ids == cold);
  CHECK(pulls(*c, s.target, "done", transport) == done + 1);
  CHECK(decodeMetric(*c, s.target, "pdserve_kv_blocks_quarantined") == 0);
  // Nothing stays pinned on the source once idle.
  CHECK(waitFor(
      [&] {
        return decodeMetric(*c, s.source, "pdserve_kv_cache_free_blocks") ==
               decodeMetric(*c, s.source, "pdserve_kv_cache_num_blocks");
      },
      10s));
  c->stop();
}

// The source evicts the blocks after the router named it and before the pull reaches it: the
// source answers "not found", the pull is refused and the target computes the whole prompt, with
// the ids of a cold run and no block left reserved, quarantined or pinned on either side. Made
// deterministic with real processes: the target is SIGSTOPped while the router routes Q to it
// (the router's pull decision is counted before Q's Generate is read), and the source's region
// is exactly as large as the stream that keeps it busy will grow to, so when that stream ends
// every other block of the region -- W's included -- was evicted. Only then does the target run
// and send its PullRequest.
TEST_CASE("e2e peer pull: a source that evicted the blocks before the pull refuses, then a recompute") {
  const std::string transport = GENERATE(std::string("cma"), std::string("tcp"));
#if !PD_HAVE_CMA
  if (transport == "cma") SKIP("no cma on this platform");
#endif
  // 24 blocks (384 tokens) a decode worker; the stream below needs all 24 by its end. The
  // router waits for a stopped worker's reports for longer than the stream takes.
  std::string config = yaml(transport, 24);
  const std::string report = "worker_report_timeout_ms: 5000";
  config.replace(config.find(report), report.size(), "worker_report_timeout_ms: 60000");
  auto c = pd::test::startLocalCluster(kWork, "peer_pull_evicted_" + transport, config);

  // W (112 tokens) on the source; Q is W's first 64 tokens and 30 of its own (94 tokens: past
  // short_prompt_tokens unless the 64 are pulled).
  Setup s = prefix(*c, 4600, /*pulled=*/64);
  // P lands on the source too (the disaggregated route picks either decode worker): the stream
  // that keeps the source busy is P's first 64 tokens and 10 more, sent to the source, which
  // holds P, and sharing none of Q's blocks.
  std::vector<int32_t> p;
  for (uint64_t seed = 4700; seed < 4716 && p.empty(); ++seed) {
    auto candidate = pd::test::randomPrompt(80, seed);
    const Completion landed = complete(*c, candidate, 2);
    REQUIRE(header(landed.headers, "x-pdserve-route") == "disaggregated");
    if (header(landed.headers, "x-pdserve-decode-worker") == s.source) p = candidate;
  }
  REQUIRE(!p.empty());
  // The stream: 74 prompt tokens + 300 generated = 374 tokens, whose KV (all but the last
  // token's) fills 24 blocks: the whole region.
  constexpr int kStreamTokens = 300;
  std::vector<int32_t> stream(p.begin(), p.begin() + 64);
  const auto more = pd::test::randomPrompt(10, 4799);
  stream.insert(stream.end(), more.begin(), more.end());
  REQUIRE((int(stream.size()) + kStreamTokens - 1 + 15) / 16 == 24);

  REQUIRE(waitFor(
      [&] {
        return decodeMetric(*c, "decode-0", "pdserve_num_requests_running") == 0 &&
               decodeMetric(*c, "decode-1", "pdserve_num_requests_running") == 0;
      },
      20s));
  std::this_thread::sleep_for(300ms);
  std::string streamWorker, streamUsage;
  std::thread busy([&] {
    json req{{"model", "small"},
             {"prompt", stream},
             {"max_tokens", kStreamTokens},
             {"temperature", 0},
             {"ignore_eos", true}};
    auto reply = httpRequest(c->httpPort(), "POST", "/v1/completions", req.dump(), 180s);
    if (reply.ok() && reply->status == 200) {
      streamWorker = header(reply->headers, "x-pdserve-decode-worker");
      streamUsage = json::parse(reply->body)["usage"].dump();
    }
  });
  REQUIRE(waitFor([&] { return decodeMetric(*c, s.source, "pdserve_num_requests_running") >= 1; }, 20s));
  std::this_thread::sleep_for(300ms);

  const std::string pullRoute = "pdserve_route_decisions_total{reason=\"pull\",route=\"colocated\"}";
  const double pullRoutes = std::max(0.0, pd::test::routerMetric(*c, pullRoute));
  const double refused = pulls(*c, s.target, "refused", "none");
  REQUIRE(c->processes().signal(s.target, SIGSTOP).isOk());
  Completion q;
  std::thread client([&] { q = complete(*c, s.q, 8); });
  // The router named the source: Q's Generate waits in the stopped target's socket.
  const bool routed = waitFor([&] { return pd::test::routerMetric(*c, pullRoute) == pullRoutes + 1; }, 20s);
  // The stream ends on the source having taken every block of its region.
  busy.join();
  // What the source holds now, as the router's exact index sees it: the stream's 23 named blocks
  // (its last block holds the token whose KV is never computed), nothing of W.
  const std::string sourceIndex = "pdserve_router_prefix_index_blocks{index=\"exact\",worker=\"" + s.source + "\"}";
  const bool onlyStream = waitFor([&] { return pd::test::routerMetric(*c, sourceIndex) == 23; }, 5s);
  const std::string diag = "source " + s.source + ": num_blocks " +
                           std::to_string(decodeMetric(*c, s.source, "pdserve_kv_cache_num_blocks")) +
                           ", router index " + std::to_string(pd::test::routerMetric(*c, sourceIndex)) +
                           ", stream usage " + streamUsage;
  REQUIRE(c->processes().signal(s.target, SIGCONT).isOk());
  const auto resumed = std::chrono::steady_clock::now();
  client.join();
  const double afterResume = std::chrono::duration<double>(std::chrono::steady_clock::now() - resumed).count();
  REQUIRE(routed);
  INFO(diag);
  CHECK(streamWorker == s.source);
  CHECK(onlyStream);
  INFO(q.headers);
  CHECK(header(q.headers, "x-pdserve-decode-worker") == s.target);
  CHECK(q.ids == s.cold);
  CHECK(q.cachedTokens == 0);
  CHECK(pulls(*c, s.target, "refused", "none") == refused + 1);
  CHECK(pulls(*c, s.target, "done", transport) == 0);
  // A refusal is an answer, not a wait: Q took less than the pull deadline after the target ran
  // again, recomputing included.
  CHECK(afterResume < kPullDeadlineMs / 1e3);
  CHECK(waitFor([&] { return decodeMetric(*c, s.target, "pdserve_kv_blocks_quarantined") == 0; }, 10s));
  for (const std::string& w : {s.source, s.target}) {
    INFO(w);
    CHECK(waitFor(
        [&] {
          return decodeMetric(*c, w, "pdserve_kv_cache_free_blocks") ==
                 decodeMetric(*c, w, "pdserve_kv_cache_num_blocks");
        },
        10s));
  }
  c->stop();
}

namespace {

// The ceiling of moving `bytes` of KV between two buffers of this host: the best of 5 memcpys
// (a pull moves them between two processes, over cma or loopback tcp).
double memcpyMs(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 1e9;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return b[bytes / 2] == 1 ? best : -1;
}

double phaseMs(const std::string& serverTiming, const std::string& phase) {
  const std::string key = phase + ";dur=";
  for (size_t at = serverTiming.find(key); at != std::string::npos; at = serverTiming.find(key, at + 1)) {
    if (at == 0 || serverTiming[at - 1] == ' ' || serverTiming[at - 1] == ',')
      return std::atof(serverTiming.c_str() + at + key.size());
  }
  return -1;
}

}  // namespace

// The crossover benchmark (not a timed test; docs/performance.md "Peer pulls"): per lane and
// prefix length N, the TTFT of a prompt whose N-token prefix is pulled from a peer, against
// computing N + 30 tokens from scratch on an identical engine (a fresh prompt of the same
// length, prefilled on prefill-0: its prefill_compute phase, and its whole TTFT, which adds
// the KV push). Run: build/tests/e2e/test_e2e_peer_pull "[.bench]"
TEST_CASE("bench peer pull: pulled vs recomputed prefix, by length and lane", "[.bench]") {
  for (const std::string transport : {"cma", "tcp"}) {
    auto c = pd::test::startLocalCluster(kWork, "peer_pull_bench_" + transport, yaml(transport, 1200));
    std::printf(
        "\n%s: N | pulled: ttft ms, kv_pull ms, rest computed ms | recomputed: ttft ms, prefill_compute ms | "
        "ceiling: memcpy of the pulled KV ms\n",
        transport.c_str());
    uint64_t seed = 5000;
    for (int n : {256, 512, 1024, 2048, 3072, 4032}) {
      const Setup s = prefix(*c, seed++, n, /*reference=*/false);
      Completion q;
      whileBusy(*c, s, [&] { q = complete(*c, s.q, 1); });
      const std::string pulledTiming = header(q.headers, "server-timing");
      const bool pulled = q.cachedTokens == n && header(q.headers, "x-pdserve-decode-worker") == s.target;
      const Completion fresh = complete(*c, pd::test::randomPrompt(n + 30, seed++ + 90000), 1);
      const std::string freshTiming = header(fresh.headers, "server-timing");
      std::printf("%s: %5d | %8.1f %8.1f %8.1f%s | %8.1f %8.1f | %6.2f\n", transport.c_str(), n,
                  phaseMs(pulledTiming, "ttft"), phaseMs(pulledTiming, "kv_pull"),
                  phaseMs(pulledTiming, "prefill_compute"), pulled ? "" : " (not pulled)", phaseMs(freshTiming, "ttft"),
                  phaseMs(freshTiming, "prefill_compute"), memcpyMs(size_t(n) * 16 * 1024));
      std::fflush(stdout);
    }
    c->stop();
  }
}

namespace {

// Both lower tiers on every worker, as the shipped configs have them; a 32-block region on the
// decode workers so that one stream evicts a prompt from it.
std::string tieredYaml(const std::string& disk) {
  return "model: {path: " + pd::test::e2eModelDir() +
         ", name: small}\n"
         "router: {routing: {short_prompt_tokens: 64}, requests: {request_timeout_ms: 60000},\n"
         "         workers: {worker_report_timeout_ms: 5000}}\n"
         "pools: {prefill: {replicas: 1}, decode: {replicas: 2}}\n"
         "engine: {backend: cpu, threads: 1, num_blocks: 32, max_batch_tokens: 512,\n"
         "         kv_tiers: {host_bytes: 67108864, disk_bytes: 268435456, disk_path: " +
         disk +
         "}}\n"
         "kv_transfer: {transports: [tcp], peer_pulls: true, pull_timeout_ms: " +
         std::to_string(kPullDeadlineMs) +
         "}\n"
         "logging: {level: warn}\n";
}

constexpr int kTierPulled = 128;  // Q's prefix: W's first 8 blocks

// W[0:16] and `n` tokens of its own: a short prompt whose only cached block (W's first) is on
// the source, so the router sends it there, and which leaves W's other blocks alone.
std::vector<int32_t> onSource(const Setup& s, int n, uint64_t seed) {
  std::vector<int32_t> p(s.w.begin(), s.w.begin() + 16);
  const auto more = pd::test::randomPrompt(n, seed);
  p.insert(p.end(), more.begin(), more.end());
  return p;
}

double promotions(LocalCluster& c, const std::string& worker, const std::string& tier) {
  return std::max(0.0, decodeMetric(c, worker, "pdserve_kv_tier_promotions_total{from=\"" + tier + "\"}"));
}

// Q is served by a pull from `s.source`, whose region holds only W's first block and `tier`
// the next 7 (the stream keeping the source busy attaches the first): route reason "pull",
// cached_tokens 128, the greedy ids of a cold run, the 7 blocks promoted on the source.
void pullsFromTier(LocalCluster& c, const Setup& s, const std::string& tier) {
  const double pullRoutes =
      std::max(0.0, pd::test::routerMetric(c, "pdserve_route_decisions_total{reason=\"pull\",route=\"colocated\"}"));
  const double done = pulls(c, s.target, "done", "tcp");
  Completion q;
  double promotedBefore = 0;
  whileBusy(
      c, s,
      [&] {
        promotedBefore = promotions(c, s.source, tier);
        q = complete(c, s.q, 8);
      },
      true, onSource(s, 10, 4650), 300);
  INFO(q.headers);
  CHECK(header(q.headers, "x-pdserve-decode-worker") == s.target);
  CHECK(q.ids == s.cold);
  CHECK(q.cachedTokens == kTierPulled);
  CHECK(pd::test::routerMetric(c, "pdserve_route_decisions_total{reason=\"pull\",route=\"colocated\"}") ==
        pullRoutes + 1);
  CHECK(pulls(c, s.target, "done", "tcp") == done + 1);
  CHECK(promotions(c, s.source, tier) == promotedBefore + kTierPulled / 16 - 1);
  CHECK(decodeMetric(c, s.target, "pdserve_kv_blocks_quarantined") == 0);
  // Nothing stays pinned on the source once idle.
  CHECK(waitFor(
      [&] {
        return decodeMetric(c, s.source, "pdserve_kv_cache_free_blocks") ==
               decodeMetric(c, s.source, "pdserve_kv_cache_num_blocks");
      },
      10s));
}

}  // namespace

// The source's region is small: after W, a stream on the source that grows to fill its whole
// region evicts W's blocks but the first to its host tier. Q (W's first 128 tokens and 30 of
// its own) is then pulled from the source's host tier (docs/kv_cache.md, "Peer pulls").
TEST_CASE("e2e peer pull: a prefix its source demoted to its host tier is pulled") {
  const std::string disk = kWork + "/peer_pull_host.disk";
  std::filesystem::remove_all(disk);
  auto c = pd::test::startLocalCluster(kWork, "peer_pull_host", tieredYaml(disk));
  const Setup s = prefix(*c, 4600, kTierPulled);
  const double demoted = decodeMetric(*c, s.source, "pdserve_kv_tier_demotions_total{to=\"host\"}");
  // 56 tokens and 450 generated: all 32 blocks of the source's region.
  const Completion fill = complete(*c, onSource(s, 40, 4610), 450);
  REQUIRE(header(fill.headers, "x-pdserve-decode-worker") == s.source);
  CHECK(waitFor(
      [&] { return decodeMetric(*c, s.source, "pdserve_kv_tier_demotions_total{to=\"host\"}") >= demoted + 7; }, 10s));
  pullsFromTier(*c, s, "host");
  c->stop();
}

// The source's disk tier holds W after the cluster restarted (its region and host tier empty):
// Q is pulled from the source's disk tier.
TEST_CASE("e2e peer pull: a prefix only its restarted source's disk tier holds is pulled") {
  const std::string disk = kWork + "/peer_pull_disk.disk";
  std::filesystem::remove_all(disk);
  Setup s;
  {
    auto c = pd::test::startLocalCluster(kWork, "peer_pull_disk_1", tieredYaml(disk));
    s = prefix(*c, 4700, kTierPulled);
    // Written through to disk off the loop: wait for the writer before stopping.
    REQUIRE(waitFor(
        [&] { return decodeMetric(*c, s.source, "pdserve_kv_tier_blocks{tier=\"disk\"}") >= kTierPulled / 16; }, 30s));
    c->stop();
  }
  auto c = pd::test::startLocalCluster(kWork, "peer_pull_disk_2", tieredYaml(disk));
  REQUIRE(decodeMetric(*c, s.source, "pdserve_kv_tier_blocks{tier=\"disk\"}") >= kTierPulled / 16);
  REQUIRE(decodeMetric(*c, s.source, "pdserve_kv_tier_blocks{tier=\"host\"}") <= 0);
  // Long prompts of their own, prefilled on prefill-0: the pushes give the fleet its lane figure
  // (the best of its samples: one push on a loaded machine can be slow enough that no pull pays
  // with the disk read on top).
  for (uint64_t seed = 4710; seed < 4713; ++seed) {
    const Completion warm = complete(*c, pd::test::randomPrompt(200, seed), 2);
    REQUIRE(header(warm.headers, "x-pdserve-route") == "disaggregated");
  }
  REQUIRE(pd::test::waitIndexed(*c, s.source, kTierPulled / 16));
  pullsFromTier(*c, s, "disk");
  c->stop();
}
