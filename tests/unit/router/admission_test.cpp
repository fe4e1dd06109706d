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

TEST_CASE("admission: shed at a decode worker whose steps already pass the ITL target") {
  WorkerView w;
  w.id = "decode-0";
  w.running = 8;
  w.decodeStepMs = 50;
  CHECK(admitDecode(w, 0.050).admit);  // at the target
  w.decodeStepMs = 60;
  auto refused = admitDecode(w, 0.050);
  CHECK_FALSE(refused.admit);
  CHECK(refused.predictedWaitS == Approx(0.060));
  CHECK(refused.retryAfterS == 1);
  // One stream with a long step (a colocated prefill chunk) is no overload; two are, also when
  // the second is routed but not yet reported.
  WorkerView one;
  one.running = 1;
  one.decodeStepMs = 500;
  CHECK(admitDecode(one, 0.050).admit);
  one.unreportedStreams = 1;
  CHECK_FALSE(admitDecode(one, 0.050).admit);
  WorkerView fresh;  // nothing measured yet
  fresh.running = 50;
  CHECK(admitDecode(fresh, 0.050).admit);
}

}  // namespace
}  // namespace pd::router
