// Overload shedding: refuse exactly when the predicted queue wait passes the target.
#include <catch2/catch.hpp>

#include "router/admission.h"

namespace pd::router {
namespace {

WorkerView worker(int64_t queued, int64_t unreported, double rate) {
  WorkerView w;
  w.id = "prefill-0";
  w.queuedPrefillTokens = queued;
  w.unreportedPrefillTokens = unreported;
  w.prefillTokensPerS = rate;
  return w;
}

TEST_CASE("admission: shed when queued prompt tokens over the prefill rate exceed the TTFT target") {
  // 2,000 tokens/s, 1 s target: up to 2,000 queued tokens are admitted.
  CHECK(admitPrefill(worker(0, 0, 2000), 1.0).admit);
  CHECK(admitPrefill(worker(2000, 0, 2000), 1.0).admit);
  auto refused = admitPrefill(worker(1500, 600, 2000), 1.0);  // routed but not yet reported counts
  CHECK_FALSE(refused.admit);
  CHECK(refused.predictedWaitS == Approx(1.05));
  CHECK(refused.retryAfterS == 1);
  auto deep = admitPrefill(worker(20000, 0, 2000), 1.0);  // 10 s of work queued
  CHECK_FALSE(deep.admit);
  CHECK(deep.retryAfterS == 9);
  // No measured rate yet: nothing to predict from, never shed.
  CHECK(admitPrefill(worker(1000000, 0, 0), 1.0).admit);
}

}  // namespace
}  // namespace pd::router
