// tools::planPool: what `pdserve up`'s local actuator does for a pool at one poll.
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
