#include "common/base/mem_desc.h"

#include <catch2/catch.hpp>

#include "common/base/clock.h"

using namespace pd;

TEST_CASE("MemDesc containment and totals") {
  MemDesc region{0x1000, 0x1000, 0, MemKind::kHost};
  CHECK(region.contains({0x1000, 0x1000, 0, MemKind::kHost}));
  CHECK(region.contains({0x1800, 0x10, 0, MemKind::kHost}));
  CHECK_FALSE(region.contains({0x1ff0, 0x20, 0, MemKind::kHost}));  // runs past the end
  CHECK_FALSE(region.contains({0x0ff0, 0x20, 0, MemKind::kHost}));  // starts before
  CHECK_FALSE(region.contains({0x1800, 0x10, 0, MemKind::kCuda}));  // other memory kind
  CHECK(totalBytes({region, {0x5000, 24, 0, MemKind::kHost}}) == 0x1000 + 24);
  CHECK(toString(MemDesc{0x10, 8, 1, MemKind::kCuda}) == "cuda:1[0x10, +8)");
}

TEST_CASE("ManualClock drives deadlines") {
  ManualClock clock;
  Deadline d = Deadline::in(std::chrono::milliseconds(100), clock);
  CHECK_FALSE(d.expired(clock));
  clock.advance(std::chrono::milliseconds(99));
  CHECK_FALSE(d.expired(clock));
  clock.advance(std::chrono::milliseconds(1));
  CHECK(d.expired(clock));
  CHECK_FALSE(Deadline().expired(clock));
}
