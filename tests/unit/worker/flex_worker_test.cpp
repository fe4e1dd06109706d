// pdserve-worker's role switch (flex_worker/flex_worker.h) against a fake router (a real
// framed server): the worker registers as decode, switches on request, and registers again
// under the same id as prefill, its engine built on the same weights object; a second
// request while a switch runs is refused; shutdown() during a switch ends cleanly.
#include "flex_worker/flex_worker.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd;
using namespace std::chrono_literals;

namespace {

// The Hellos of every worker connection the fake router accepted, in order.
struct FakeRouter {
  FakeRouter() {
    net::ConnectionOptions ro;
    ro.hello.set_role(proto::ROLE_ROUTER);
    ro.hello.set_worker_id("router-fake");
    net::ConnectionCallbacks cb;
    cb.onOpen = [this](const net::ConnectionPtr& c) {
      std::lock_guard<std::mutex> lock(mu);
      hellos.push_back(c->peerHello());
      cv.notify_all();
    };
    auto s = net::FramedServer::listen(io, "127.0.0.1", 0, ro, cb);
    REQUIRE(s.ok());
    server = std::move(s).value();
  }
  ~FakeRouter() { server->stop(); }
  bool waitHellos(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return hellos.size() >= n; });
  }
  proto::Hello hello(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    return hellos.at(i);
  }

  net::IoPool io{1, "fake-router"};
  std::unique_ptr<net::FramedServer> server;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<proto::Hello> hellos;
};

config::ClusterConfig flexConfig() {
  const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
  auto config = config::parseClusterConfig("model: {path: " + model +
                                               "}\nengine: {backend: cpu, num_blocks: 64, drain_timeout_ms: 5000}\n"
                                               "kv_transfer: {transports: [tcp]}\nlogging: {level: warn}\n",
                                           "test.yaml");
  REQUIRE(config.ok());
  return std::move(config).value();
}

bool waitSwitched(const flex::FlexWorker& w) {
  for (int i = 0; i < 200 && w.switching(); ++i) std::this_thread::sleep_for(50ms);
  return !w.switching();
}

}  // namespace

TEST_CASE("flex worker: --role parses prefill and decode, anything else is refused by name") {
  CHECK(flex::parseRole("prefill").value() == flex::Role::kPrefill);
  CHECK(flex::parseRole("decode").value() == flex::Role::kDecode);
  auto bad = flex::parseRole("both");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("--role") != std::string::npos);
}

TEST_CASE("flex worker: decode -> prefill -> decode under the same id, on the same weights") {
  FakeRouter router;
  worker::WorkerFlags flags;
  flags.workerId = "flex-t";
  flags.routers = {worker::RouterTarget{"127.0.0.1", router.server->port()}};
  flex::FlexWorker w(flexConfig(), flags, flex::Role::kDecode);
  REQUIRE(w.start().isOk());
  REQUIRE(router.waitHellos(1, 10s));
  CHECK(router.hello(0).role() == proto::ROLE_DECODE);
  CHECK(router.hello(0).worker_id() == "flex-t");
  const auto weights = w.weights();
  REQUIRE(weights != nullptr);

  REQUIRE(w.requestSwitch());
  CHECK_FALSE(w.requestSwitch());  // one switch at a time: this one is refused, not queued
  REQUIRE(waitSwitched(w));
  CHECK_FALSE(w.failure().has_value());
  CHECK(w.role() == flex::Role::kPrefill);
  CHECK(w.weights().get() == weights.get());  // the f32 host weights were not read again
  REQUIRE(router.waitHellos(2, 10s));
  CHECK(router.hello(1).role() == proto::ROLE_PREFILL);
  CHECK(router.hello(1).worker_id() == "flex-t");
  CHECK_FALSE(router.hello(1).address().empty());  // where decode workers dial it
  CHECK(router.hello(1).model_fingerprint() == router.hello(0).model_fingerprint());

  REQUIRE(w.requestSwitch());
  REQUIRE(waitSwitched(w));
  CHECK(w.role() == flex::Role::kDecode);
  REQUIRE(router.waitHellos(3, 10s));
  CHECK(router.hello(2).role() == proto::ROLE_DECODE);
  w.shutdown();
  CHECK(w.weights() == nullptr);
  CHECK_FALSE(w.requestSwitch());  // after shutdown
}

TEST_CASE("flex worker: shutdown during a switch ends cleanly, nothing left running") {
  FakeRouter router;
  worker::WorkerFlags flags;
  flags.workerId = "flex-s";
  flags.routers = {worker::RouterTarget{"127.0.0.1", router.server->port()}};
  flex::FlexWorker w(flexConfig(), flags, flex::Role::kPrefill);
  REQUIRE(w.start().isOk());
  REQUIRE(router.waitHellos(1, 10s));
  REQUIRE(w.requestSwitch());
  w.shutdown();  // as SIGTERM in the middle of the switch
  CHECK_FALSE(w.switching());
  CHECK(w.weights() == nullptr);
  CHECK_FALSE(w.failure().has_value());
}
