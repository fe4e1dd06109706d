#include <catch2/catch.hpp>

#include "router/routing_policy.h"

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
  std::vector<WorkerView> ws{decode("d0", 5, 900), decode("d1", 2, 100), prefill("p0", 4096),
                             prefill("p1", 100), prefill("p2", 0, /*healthy=*/false)};
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
