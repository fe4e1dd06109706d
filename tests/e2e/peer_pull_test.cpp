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
#include <thread>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"

using namespace pd;
using namespace pd::tools;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e";
constexpr int kPullDeadlineMs = 1500;

struct Completion {
  std::vector<int32_t> ids;
  int cachedTokens = -1;
  std::string headers;
  double seconds = 0;
};

Completion complete(LocalCluster& c, const std::vector<int32_t>& p, int maxTokens) {
  json req{{"model", "small"}, {"prompt", p},        {"max_tokens", maxTokens},
           {"temperature", 0}, {"ignore_eos", true}, {"return_token_ids", true}};
  const auto t0 = std::chrono::steady_clock::now();
  auto r = httpRequest(c.httpPort(), "POST", "/v1/completions", req.dump(), 120s);
  REQUIRE(r.ok());
  INFO(r->body);
  REQUIRE(r->status == 200);
  json body = json::parse(r->body);
  Completion out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.ids = body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  if (body["usage"].contains("prompt_tokens_details"))
    out.cachedTokens = body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  out.headers = r->headers;
  return out;
}

std::string header(const std::string& headers, const std::string& name) {
  const size_t at = headers.find(name + ": ");
  if (at == std::string::npos) return "";
  const size_t end = headers.find("\r\n", at);
  return headers.substr(at + name.size() + 2,
                        end == std::string::npos ? std::string::npos : end - at - name.size() - 2);
}

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

// Waits until `pred` holds (or `timeout` passes); returns whether it held.
template <typename F>
bool waitFor(F pred, std::chrono::milliseconds timeout) {
  for (const auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;) {
    if (pred()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return pred();
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
  REQUIRE(waitFor(
      [&] {
        return pd::test::routerMetric(
                   c, "pdserve_router_prefix_index_blocks{index=\"exact\",worker=\"" + s.source + "\"}") >= pulled / 16;
      },
      10s));
  return s;
}

// Runs `body` while a stream of W's first 256 tokens + 10 runs on the source (a cached prefix there), so
// the router sends Q to the less loaded target.
template <typename F>
void whileBusy(LocalCluster& c, const Setup& s, F body, bool sourceSurvives = true) {
  std::vector<int32_t> r(s.w.begin(), s.w.begin() + std::min<size_t>(s.w.size(), 256));
  const auto more = pd::test::randomPrompt(10, 99);
  r.insert(r.end(), more.begin(), more.end());
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
    json req{{"model", "small"}, {"prompt", r}, {"max_tokens", 400}, {"temperature", 0}, {"ignore_eos", true}};
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
