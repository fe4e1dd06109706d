// tools::planPool and planCluster: what `pdserve up`'s local actuator does for a pool, and for
// both with role moves, at one poll.
#include "tools/local_actuator.h"

#include <catch2/catch.hpp>

using namespace pd::tools;

namespace {
PoolActuation pool(int desired, int live, int registered, int draining = 0) {
  PoolActuation p;
  p.minReplicas = 1;
  p.maxReplicas = 3;
  p.desired = desired;
  p.live = live;
  p.registered = registered;
  p.draining = draining;
  return p;
}
}  // namespace

TEST_CASE("the actuator starts what is missing and drains one at a time, within the bounds") {
  // Up: every missing worker at once (the autoscaler already bounded the step).
  auto s = planPool(pool(3, 1, 1));
  CHECK(s.start == 2);
  CHECK_FALSE(s.drainOne);
  // Down: one, the caller drains the newest.
  s = planPool(pool(1, 3, 3));
  CHECK(s.start == 0);
  CHECK(s.drainOne);
  // At the size: nothing.
  s = planPool(pool(2, 2, 2));
  CHECK(s.start == 0);
  CHECK_FALSE(s.drainOne);
  CHECK(s.why == "at the recommended size");
  // The recommendation is clamped to [min, max]: a router configured otherwise cannot push
  // the pool past them.
  CHECK(planPool(pool(9, 3, 3)).start == 0);
  CHECK(planPool(pool(9, 1, 1)).start == 2);
  CHECK_FALSE(planPool(pool(0, 1, 1)).drainOne);
  CHECK(planPool(pool(0, 2, 2)).drainOne);
}

TEST_CASE("the actuator waits for its last action to land before the next one") {
  // A drained worker still finishing its streams: no second drain, no start either (the
  // router's count of the pool is about to change).
  auto s = planPool(pool(1, 2, 3, /*draining*/ 1));
  CHECK_FALSE(s.drainOne);
  CHECK(s.start == 0);
  CHECK(s.why == "waiting for the drained worker to exit");
  // Started workers not registered with the router yet: nothing more is started.
  s = planPool(pool(3, 2, 1));
  CHECK(s.start == 0);
  CHECK(s.why == "waiting for the started workers to register");
  // No recommendation read (the router's first tick has not run): nothing.
  s = planPool(pool(-1, 1, 1));
  CHECK(s.start == 0);
  CHECK_FALSE(s.drainOne);
  // The router's worker count unknown (-1): act on the recommendation alone.
  CHECK(planPool(pool(2, 1, -1)).start == 1);
}

namespace {
// A pool in the shared budget of prefill 0..1 + decode 1..1 (the budget's bounds, as the
// actuator passes them: prefill [0, 1], decode [1, 2]).
PoolActuation budgeted(int lo, int hi, int desired, int live, int registered, int draining = 0) {
  PoolActuation p = pool(desired, live, registered, draining);
  p.minReplicas = lo;
  p.maxReplicas = hi;
  return p;
}
}  // namespace

TEST_CASE("role moves: a worker one pool gives up while the other wants one is moved, not stopped") {
  // The router: prefill idle -> 0, decode -> 2.
  auto c = planCluster(budgeted(0, 1, 0, 1, 1), budgeted(1, 2, 2, 1, 1), /*roleMoves*/ true);
  CHECK(c.move);
  CHECK(c.moveFrom == Pool::kPrefill);
  CHECK_FALSE(c.prefill.drainOne);
  CHECK(c.decode.start == 0);
  CHECK_THAT(c.prefill.why, Catch::StartsWith("moving a worker to the decode pool"));
  // And the other way.
  c = planCluster(budgeted(0, 1, 1, 0, 0), budgeted(1, 2, 1, 2, 2), true);
  CHECK(c.move);
  CHECK(c.moveFrom == Pool::kDecode);
  CHECK(c.prefill.start == 0);
  CHECK_FALSE(c.decode.drainOne);
  // Without role moves the same round drains one and starts one.
  c = planCluster(budgeted(0, 1, 0, 1, 1), budgeted(1, 2, 2, 1, 1), false);
  CHECK_FALSE(c.move);
  CHECK(c.prefill.drainOne);
  CHECK(c.decode.start == 1);
}

TEST_CASE("role moves: a drain waits while the other pool wants a worker but is busy with its last action") {
  // Decode wants 2 but its last started worker has not registered yet: the prefill worker
  // is kept for the next round's move.
  auto c = planCluster(budgeted(0, 1, 0, 1, 1), budgeted(1, 2, 2, 1, 0), true);
  CHECK_FALSE(c.move);
  CHECK_FALSE(c.prefill.drainOne);
  CHECK_THAT(c.prefill.why, Catch::StartsWith("keeping the worker to move it"));
  // Nobody wants it: it is drained as without role moves.
  c = planCluster(budgeted(0, 1, 0, 1, 1), budgeted(1, 2, 1, 1, 1), true);
  CHECK_FALSE(c.move);
  CHECK(c.prefill.drainOne);
  // A growing pool with room in the budget and nothing to take from starts a worker.
  c = planCluster(budgeted(0, 1, 0, 0, 0), budgeted(1, 2, 2, 1, 1), true);
  CHECK_FALSE(c.move);
  CHECK(c.decode.start == 1);
}
