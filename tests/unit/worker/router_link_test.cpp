// RouterLink against a fake router that refuses the first registration (closes it right after
// the hello, as a router does for an id it still holds): the link must not wait on the dead
// connection; it registers again, after a backoff, and ends up up.
#include "worker/router_link.h"

#include <atomic>
#include <chrono>

#include <catch2/catch.hpp>

#include "common/net/io_pool.h"

using namespace pd;
using namespace std::chrono_literals;

TEST_CASE("a refused registration is retried with a backoff until the router accepts it") {
  net::IoPool io{2, "test-io"};
  std::atomic<int> opened{0};
  net::ConnectionOptions ro;
  ro.hello.set_role(proto::ROLE_ROUTER);
  ro.hello.set_worker_id("router-fake");
  net::ConnectionCallbacks cb;
  cb.onOpen = [&](const net::ConnectionPtr& c) {
    if (opened++ == 0) c->close(failedPrecondition("worker id 'decode-t' is already registered"));
  };
  auto server = net::FramedServer::listen(io, "127.0.0.1", 0, ro, cb);
  REQUIRE(server.ok());

  worker::LoopInbox inbox;
  std::vector<bool> states;
  net::ConnectionOptions lo;
  lo.hello.set_role(proto::ROLE_DECODE);
  lo.hello.set_worker_id("decode-t");
  worker::RouterLink link(
      io, inbox, "127.0.0.1", server.value()->port(), lo,
      worker::RouterLink::Handlers{[](proto::Envelope&&) {}, [&](bool up, const Status&) { states.push_back(up); }});
  const auto t0 = std::chrono::steady_clock::now();
  link.start();
  while (!(link.isUp() && opened.load() >= 2) && std::chrono::steady_clock::now() - t0 < 10s) {
    inbox.runPending(std::chrono::milliseconds(20));
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(opened.load() == 2);
  CHECK(link.isUp());
  CHECK(took >= 150ms);  // it backed off before registering again
  for (int i = 0; i < 10; ++i) inbox.runPending(std::chrono::milliseconds(10));
  REQUIRE_FALSE(states.empty());
  CHECK(states.back());
  link.stop();
  server.value()->stop();
}

TEST_CASE("a router's refusal is read from its Error frame: kept for /health, and retried with a backoff") {
  net::IoPool io{2, "test-io"};
  std::atomic<int> opened{0};
  net::ConnectionOptions ro;
  ro.hello.set_role(proto::ROLE_ROUTER);
  ro.hello.set_worker_id("router-fake");
  net::ConnectionCallbacks cb;
  // As the router refuses: an Error saying why, and no close of its own (the worker closes).
  cb.onOpen = [&](const net::ConnectionPtr& c) {
    ++opened;
    proto::Envelope env;
    *env.mutable_error() = net::toProtoError(failedPrecondition("worker 'decode-t' serves weights aa but bb"));
    (void)c->send(env);
  };
  auto server = net::FramedServer::listen(io, "127.0.0.1", 0, ro, cb);
  REQUIRE(server.ok());

  worker::LoopInbox inbox;
  net::ConnectionOptions lo;
  lo.hello.set_role(proto::ROLE_DECODE);
  lo.hello.set_worker_id("decode-t");
  worker::RouterLink link(io, inbox, "127.0.0.1", server.value()->port(), lo,
                          worker::RouterLink::Handlers{[](proto::Envelope&&) {}, [](bool, const Status&) {}});
  const auto t0 = std::chrono::steady_clock::now();
  link.start();
  while (link.refusal().empty() && std::chrono::steady_clock::now() - t0 < 10s)
    inbox.runPending(std::chrono::milliseconds(20));
  CHECK(link.refusal() == "worker 'decode-t' serves weights aa but bb");
  // Backoff 200, 400, 800 ms...: within 2.5 s at most 4 tries, never a spin.
  while (std::chrono::steady_clock::now() - t0 < 2500ms) inbox.runPending(std::chrono::milliseconds(20));
  CHECK(opened.load() >= 2);
  CHECK(opened.load() <= 4);
  CHECK_FALSE(link.refusal().empty());
  link.stop();
  server.value()->stop();
}
