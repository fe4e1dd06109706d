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
