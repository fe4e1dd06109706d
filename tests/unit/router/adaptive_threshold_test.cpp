// router::AdaptiveThreshold: the routing threshold follows the pools' SLO headroom, bounded.
#include "router/adaptive_threshold.h"

#include <catch2/catch.hpp>

using namespace pd::router;

namespace {
const PoolPressure kOver{1.5, true}, kSpare{0.5, true}, kNearTarget{0.9, true}, kFew{3.0, false};
}

TEST_CASE("prefill over its SLO with decode spare raises the threshold, by 25% a tick, up to 4x") {
  AdaptiveThreshold t(256);
  std::string why;
  CHECK(t.update(kOver, kSpare, &why) == 320);
  CHECK(why == "raise: prefill over its SLO, decode has room");
  CHECK(t.update(kOver, kSpare, &why) == 400);
  for (int i = 0; i < 20; ++i) t.update(kOver, kSpare, &why);
  CHECK(t.value() == 1024);
  CHECK(why == "hold: prefill over its SLO, threshold at its maximum");
}

TEST_CASE("decode over its SLO with prefill spare lowers it, down to a quarter") {
  AdaptiveThreshold t(256);
  std::string why;
  CHECK(t.update(kSpare, kOver, &why) == 204);
  CHECK(why == "lower: decode over its SLO, prefill has room");
  for (int i = 0; i < 20; ++i) t.update(kSpare, kOver, &why);
  CHECK(t.value() == 64);
  // A small base still moves by at least one token, and never below 1.
  AdaptiveThreshold small(2);
  CHECK(small.update(kOver, kSpare, &why) == 3);
  CHECK(small.update(kSpare, kOver, &why) == 2);
  CHECK(small.update(kSpare, kOver, &why) == 1);
  CHECK(small.update(kSpare, kOver, &why) == 1);
}

TEST_CASE("both pools pressed, neither pressed, or too few samples: the threshold holds") {
  AdaptiveThreshold t(256);
  std::string why;
  CHECK(t.update(kOver, kOver, &why) == 256);        // moving work would only move the miss
  CHECK(t.update(kOver, kNearTarget, &why) == 256);  // decode has no real room
  CHECK(t.update(kSpare, kSpare, &why) == 256);
  CHECK(why == "hold: no pool over its SLO with the other one spare");
  CHECK(t.update(kFew, kSpare, &why) == 256);
  CHECK(why == "hold: too few samples in a pool's window");
}
