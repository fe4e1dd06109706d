// LaneRates: the best sample's rate (every sample's observed rate is a lower bound of the
// lane's), the quickest sample's time as the fixed part, a bounded window per transport.
#include "kvtransfer/lane_rates.h"

#include <catch2/catch.hpp>

namespace pd::kvt {
namespace {

TEST_CASE("lane rates: the best observed rate and the quickest transfer, per transport") {
  LaneRates rates;
  CHECK(rates.figures().empty());
  // 1 MB in 1 ms (seen promptly), 1 MB in 50 ms (seen after the owner's step): 1 GB/s.
  rates.record("cma", 1'000'000, 0.001);
  rates.record("cma", 1'000'000, 0.050);
  rates.record("tcp", 2'000'000, 0.020);
  rates.record("tcp", 0, 0.001);        // ignored: no bytes
  rates.record("tcp", 1'000'000, 0.0);  // ignored: no time
  auto f = rates.figures();
  REQUIRE(f.size() == 2);
  CHECK(f[0].transport == "cma");
  CHECK(f[0].bytesPerS == Approx(1e9));
  CHECK(f[0].setupMs == Approx(1.0));
  CHECK(f[0].samples == 2);
  CHECK(f[1].transport == "tcp");
  CHECK(f[1].bytesPerS == Approx(1e8));
  CHECK(f[1].setupMs == Approx(20.0));
  CHECK(f[1].samples == 1);
}

TEST_CASE("lane rates: only the last window of transfers counts") {
  LaneRates rates;
  rates.record("tcp", 10'000'000, 0.001);  // 10 GB/s, then pushed out of the window
  for (size_t i = 0; i < LaneRates::kWindow; ++i) rates.record("tcp", 1'000'000, 0.01);
  auto f = rates.figures();
  REQUIRE(f.size() == 1);
  CHECK(f[0].bytesPerS == Approx(1e8));
  CHECK(f[0].samples == LaneRates::kWindow);
}

}  // namespace
}  // namespace pd::kvt
