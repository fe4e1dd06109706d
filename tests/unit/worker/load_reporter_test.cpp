// load reports keep flowing while the loop thread is inside a long engine step. The
// reporter sends from the I/O pool: here the "loop" (this thread) publishes once, starts a
// step and blocks for 600 ms; a fake router must still get a report every interval, the later
// ones saying how long the step has been running.
#include "worker/load_reporter.h"

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "common/net/io_pool.h"

using namespace pd;
using namespace std::chrono_literals;

TEST_CASE("load reports reach the router while the loop is blocked in a step") {
  net::IoPool io{2, "test-io"};
  std::mutex mu;
  std::vector<proto::LoadReport> got;
  net::ConnectionOptions ro;
  ro.hello.set_role(proto::ROLE_ROUTER);
  ro.hello.set_worker_id("router-fake");
  net::ConnectionCallbacks cb;
  cb.onMessage = [&](const net::ConnectionPtr&, proto::Envelope&& env) {
    if (env.body_case() != proto::Envelope::kLoadReport) return;
    std::lock_guard<std::mutex> lock(mu);
    got.push_back(env.load_report());
  };
  auto server = net::FramedServer::listen(io, "127.0.0.1", 0, ro, cb);
  REQUIRE(server.ok());

  worker::LoopInbox inbox;
  net::ConnectionOptions lo;
  lo.hello.set_role(proto::ROLE_PREFILL);
  lo.hello.set_worker_id("prefill-t");
  worker::RouterLinks routers(io, inbox, {worker::RouterTarget{"127.0.0.1", server.value()->port()}}, lo,
                              worker::RouterLinks::Handlers{[](worker::RouterId, proto::Envelope&&) {},
                                                            [](worker::RouterId, bool, const Status&) {}});
  routers.start();
  for (int i = 0; i < 200 && !routers.anyUp(); ++i) std::this_thread::sleep_for(10ms);
  REQUIRE(routers.anyUp());
  metrics::Registry registry;
  metrics::WorkerMetrics metrics(registry);
  worker::LoadReporter reporter(io, routers, metrics, proto::ROLE_PREFILL, "prefill-t", 50ms);
  worker::LoadSnapshot snapshot;
  snapshot.engine.queuedPrefillTokens = 2000;
  snapshot.engine.running = 1;
  reporter.publish(snapshot);
  reporter.start();
  std::this_thread::sleep_for(60ms);
  const size_t before = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return got.size();
  }();
  reporter.stepStarted();
  std::this_thread::sleep_for(600ms);  // the loop thread computing a long prefill chunk
  reporter.stepEnded();
  reporter.stop();
  routers.stop();
  std::lock_guard<std::mutex> lock(mu);
  INFO(got.size() << " reports, " << before << " before the step");
  CHECK(got.size() - before >= 8);  // ~12 intervals of 50 ms inside the step
  REQUIRE_FALSE(got.empty());
  CHECK(got.back().worker_id() == "prefill-t");
  CHECK(got.back().queued_prefill_tokens() == 2000);
  double longest = 0;
  for (const auto& r : got) longest = std::max(longest, r.step_running_ms());
  CHECK(longest >= 400);
}
