#include "router/routing_policy.h"

#include <catch2/catch.hpp>

using namespace pd::router;

namespace {
WorkerView decode(std::string id, int running, int64_t freeBlocks, bool healthy = true) {
  WorkerView w;
  w.id = std::move(id);
  w.role = WorkerRole::kDecode;
  w.running = running;
  w.freeBlocks = freeBlocks;
  w.totalBlocks = 1000;
  w.healthy = healthy;
  return w;
}
WorkerView prefill(std::string id, int64_t queued, bool healthy = true) {
  WorkerView w;
  w.id = std::move(id);
  w.role = WorkerRole::kPrefill;
  w.queuedPrefillTokens = queued;
  w.healthy = healthy;
  return w;
}
}  // namespace

TEST_CASE("short prompts go colocated to the least-loaded decode worker") {
  RoutingPolicy policy({/*shortPromptTokens=*/256});
  std::vector<WorkerView> ws{decode("d0", 5, 900), decode("d1", 2, 100), prefill("p0", 0)};
  auto plan = policy.select(256, ws);
  REQUIRE(plan);
  CHECK(plan->route == Route::kColocated);
  CHECK(plan->decodeWorker == "d1");
  CHECK(plan->prefillWorker.empty());
  CHECK(plan->reason == "short_prompt");
}

TEST_CASE("long prompts pair the least-queued prefill with the decode worker with most free blocks") {
  RoutingPolicy policy({256});
  std::vector<WorkerView> ws{decode("d0", 5, 900), decode("d1", 2, 100), prefill("p0", 4096), prefill("p1", 100),
                             prefill("p2", 0, /*healthy=*/false)};
  auto plan = policy.select(257, ws);
  REQUIRE(plan);
  CHECK(plan->route == Route::kDisaggregated);
  CHECK(plan->prefillWorker == "p1");
  CHECK(plan->decodeWorker == "d0");
  CHECK(plan->reason == "long_prompt");
}

TEST_CASE("unhealthy workers get no work; no decode worker means no route") {
  RoutingPolicy policy({256});
  std::vector<WorkerView> ws{decode("d0", 0, 900, false), decode("d1", 9, 10), prefill("p0", 0, false)};
  auto plan = policy.select(4000, ws);
  REQUIRE(plan);
  CHECK(plan->route == Route::kColocated);
  CHECK(plan->decodeWorker == "d1");
  CHECK(plan->reason == "no_prefill_worker");
  CHECK_FALSE(policy.select(10, {decode("d0", 0, 1, false), prefill("p0", 0)}).has_value());
}

TEST_CASE("a cached prefix draws a prompt to the worker holding it, within the load slack") {
  RoutingPolicy policy({/*shortPromptTokens=*/256, /*cacheLoadSlack=*/4});
  auto d0 = decode("d0", 1, 900), d1 = decode("d1", 4, 900), d2 = decode("d2", 9, 900);
  d1.cachedTokens = 128;
  d2.cachedTokens = 1024;  // holds more, but 8 requests busier than d0: beyond the slack
  auto plan = policy.select(200, {d0, d1, d2, prefill("p0", 0)});
  REQUIRE(plan);
  CHECK(plan->decodeWorker == "d1");
  CHECK(plan->reason == "short_prompt");
  CHECK(plan->cachedTokens == 128);

  // 1,100 tokens with 1,024 of them cached on d2 (now within the slack): 76 uncached tokens
  // are short work there, so it stays colocated instead of being prefilled from scratch.
  d2.running = 5;
  plan = policy.select(1100, {d0, d1, d2, prefill("p0", 0)});
  REQUIRE(plan);
  CHECK(plan->route == Route::kColocated);
  CHECK(plan->decodeWorker == "d2");
  CHECK(plan->reason == "cached_prefix");
  // With 300 uncached tokens it is long work: disaggregated.
  plan = policy.select(1324, {d0, d1, d2, prefill("p0", 0)});
  REQUIRE(plan);
  CHECK(plan->route == Route::kDisaggregated);
  CHECK(plan->reason == "long_prompt");
}

TEST_CASE("the prefill worker with the least work ahead wins: queued tokens plus uncached ones") {
  RoutingPolicy policy({256});
  auto p0 = prefill("p0", 100), p1 = prefill("p1", 900);
  p1.cachedTokens = 1536;  // 2,000-token prompt: p0 has 100 + 2000 ahead, p1 900 + 464
  auto plan = policy.select(2000, {decode("d0", 0, 900), p0, p1});
  REQUIRE(plan);
  CHECK(plan->prefillWorker == "p1");
  CHECK(plan->cachedTokens == 1536);
  p1.cachedTokens = 512;  // 900 + 1488 > 100 + 2000? no: 2388 > 2100 -> p0
  plan = policy.select(2000, {decode("d0", 0, 900), p0, p1});
  REQUIRE(plan);
  CHECK(plan->prefillWorker == "p0");
  CHECK(plan->cachedTokens == 0);
}

TEST_CASE(
    "protect_itl: a short prompt goes to the prefill pool when prefilling it beside the streams would break ITL") {
  RoutingPolicy policy({/*shortPromptTokens=*/256, /*cacheLoadSlack=*/4, /*itlTargetMs=*/100});
  auto d0 = decode("d0", 10, 900);
  d0.decodeStepBaseMs = 20;
  d0.decodeStepPerStreamMs = 4;  // 11 streams: 64 ms
  d0.decodeSmallChunkMs = 30;    // + the smallest chunk: 94 ms, within the target
  auto plan = policy.select(100, {d0, prefill("p0", 0)});
  REQUIRE(plan);
  CHECK(plan->route == Route::kColocated);
  CHECK(plan->reason == "short_prompt");
  d0.decodeSmallChunkMs = 40;  // 104 ms: every stream there would miss while it prefills
  plan = policy.select(100, {d0, prefill("p0", 0)});
  REQUIRE(plan);
  CHECK(plan->route == Route::kDisaggregated);
  CHECK(plan->reason == "protect_itl");
  CHECK(plan->prefillWorker == "p0");
  CHECK(plan->decodeWorker == "d0");
  // No prefill worker: colocated still (refusing is admission's call, not routing's).
  plan = policy.select(100, {d0});
  REQUIRE(plan);
  CHECK(plan->route == Route::kColocated);
  // No stream there, no fitted line, or the rule off: colocated.
  auto idle = d0;
  idle.running = 0;
  CHECK(policy.select(100, {idle, prefill("p0", 0)})->route == Route::kColocated);
  auto unknown = d0;
  unknown.decodeStepPerStreamMs = -1;
  CHECK(policy.select(100, {unknown, prefill("p0", 0)})->route == Route::kColocated);
  RoutingPolicy off({256, 4, 0});
  CHECK(off.select(100, {d0, prefill("p0", 0)})->route == Route::kColocated);
  // The ITL prediction scale (gaps run 20% over the predictions): 94 ms x 1.2 passes 100.
  d0.decodeSmallChunkMs = 30;
  CHECK(policy.select(100, {d0, prefill("p0", 0)})->reason == "short_prompt");
  policy.setItlPredictionScale(1.2);
  CHECK(policy.select(100, {d0, prefill("p0", 0)})->reason == "protect_itl");
}

TEST_CASE("prefill_overflow: the plan admission makes when the prefill pool cannot serve a prompt in time") {
  RoutingPolicy policy({/*shortPromptTokens=*/256, /*cacheLoadSlack=*/4, /*itlTargetMs=*/100});
  auto d0 = decode("d0", 10, 900);
  d0.decodeStepBaseMs = 20;
  d0.decodeStepPerStreamMs = 4;
  d0.decodeSmallChunkMs = 30;  // 94 ms with one more stream: its chunks fit beside the streams
  d0.cachedTokens = 48;
  CHECK(policy.fitsBesideStreams(d0));
  const RoutePlan plan = RoutingPolicy::colocatedOn(d0, "prefill_overflow");
  CHECK(plan.route == Route::kColocated);
  CHECK(plan.decodeWorker == "d0");
  CHECK(plan.prefillWorker.empty());
  CHECK(plan.reason == "prefill_overflow");
  CHECK(plan.cachedTokens == 48);
  d0.decodeSmallChunkMs = 40;  // 104 ms: no overflow there, its streams would miss
  CHECK_FALSE(policy.fitsBesideStreams(d0));
  d0.running = 0;  // no stream to protect
  CHECK(policy.fitsBesideStreams(d0));
}

// The prefill-side pull (docs/kv_cache.md, "Peer pulls"): a disaggregated prompt whose history a
// decode worker holds is pulled into the prefill worker when the pull is predicted cheaper than
// computing it at the prefill worker's rate; the decode worker holding it becomes the source and
// the request's decode worker.
namespace {
PullCandidate source(std::string id, int64_t regionCached, double bytesPerS, double setupMs) {
  PullCandidate c;
  c.id = std::move(id);
  c.healthy = true;
  c.servesPulls = true;
  c.host = "127.0.0.1";
  c.cachedTokens = regionCached;
  c.lanes = {{"tcp", bytesPerS, setupMs}};
  return c;
}
RoutePlan disaggregated(const std::vector<WorkerView>& workers, int64_t promptTokens) {
  RoutingPolicy policy({/*shortPromptTokens=*/64, /*cacheLoadSlack=*/4});
  auto p = policy.select(promptTokens, workers);
  REQUIRE(p);
  REQUIRE(p->route == Route::kDisaggregated);
  return *p;
}
}  // namespace

TEST_CASE("prefill pull: a history on a decode worker is pulled by the prefill worker when that is cheaper") {
  // d1 holds 512 tokens of the prompt, the prefill worker none; d0 has the most free blocks.
  std::vector<WorkerView> w = {decode("d0", 0, 900), decode("d1", 0, 500), prefill("p0", 0)};
  w[2].prefillTokensPerS = 2000;  // 512 tokens: 256 ms to compute
  w[2].host = "127.0.0.1";
  for (auto& v : w) v.kvBytesPerToken = 16 * 1024;  // 512 tokens: 8 MiB
  RoutePlan p = disaggregated(w, 700);
  CHECK(p.decodeWorker == "d0");
  // 8 MiB over 1 GB/s + 2 ms: ~10 ms < 256 ms.
  const std::vector<PullCandidate> c = {source("d0", 0, 1e9, 2), source("d1", 512, 1e9, 2)};
  std::string why;
  REQUIRE(planPrefillPull(p, w, c, /*fallbackRate=*/0, &why));
  CHECK(p.route == Route::kDisaggregated);
  CHECK(p.reason == "prefill_pull");
  CHECK(p.prefillWorker == "p0");
  CHECK(p.pullSource == "d1");
  CHECK(p.decodeWorker == "d1");  // the pull rides the source's link to the prefill worker
  CHECK(p.pullTokens == 512);
  CHECK(p.cachedTokens == 512);
  CHECK(why.find("pull") != std::string::npos);
}

TEST_CASE("prefill pull: none when recomputing at the prefill worker's rate is cheaper, or nothing is held") {
  std::vector<WorkerView> w = {decode("d0", 0, 900), decode("d1", 0, 500), prefill("p0", 0)};
  w[2].host = "127.0.0.1";
  for (auto& v : w) v.kvBytesPerToken = 16 * 1024;
  const RoutePlan before = disaggregated(w, 700);
  SECTION("a fast prefill worker: computing 512 tokens (5 ms) beats an 8 MiB pull over a slow lane (84 ms)") {
    w[2].prefillTokensPerS = 100000;
    RoutePlan p = before;
    std::string why;
    CHECK_FALSE(planPrefillPull(p, w, {source("d1", 512, 1e8, 2)}, 0, &why));
    CHECK(p.reason == before.reason);
    CHECK(p.pullSource.empty());
    CHECK(p.decodeWorker == before.decodeWorker);
    CHECK(why.find(">= recompute") != std::string::npos);
  }
  SECTION("the prefill worker already holds as much as the decode worker") {
    w[2].prefillTokensPerS = 2000;
    w[2].cachedTokens = 512;
    RoutePlan p = before;
    CHECK_FALSE(planPrefillPull(p, w, {source("d1", 512, 1e9, 2)}, 0));
    CHECK(p.pullSource.empty());
  }
  SECTION("no rate measured anywhere: no prediction, no pull; the fleet's rate stands in for its own") {
    RoutePlan p = before;
    CHECK_FALSE(planPrefillPull(p, w, {source("d1", 512, 1e9, 2)}, /*fallbackRate=*/0));
    CHECK(planPrefillPull(p, w, {source("d1", 512, 1e9, 2)}, /*fallbackRate=*/2000));
    CHECK(p.pullSource == "d1");
  }
  SECTION("a colocated plan is left alone") {
    RoutingPolicy policy({64, 4});
    auto p = policy.select(40, w);
    REQUIRE(p);
    CHECK_FALSE(planPrefillPull(*p, w, {source("d1", 32, 1e9, 2)}, 2000));
    CHECK(p->pullSource.empty());
  }
}
