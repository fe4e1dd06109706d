#include "common/net/framed.h"

#include <google/protobuf/util/message_differencer.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <catch2/catch.hpp>

#include "net_test_util.h"

using namespace pd;
using namespace pd::net;
using namespace pd::net::testing;
using namespace std::chrono_literals;

namespace {

ConnectionOptions options(proto::Role role, const std::string& id) {
  ConnectionOptions o;
  o.hello.set_role(role);
  o.hello.set_worker_id(id);
  o.hello.set_model_fingerprint("llama-small/f32/bs16");
  return o;
}

std::unique_ptr<FramedServer> startServer(IoPool& io, Events& ev, bool echo,
                                          ConnectionOptions o = options(proto::ROLE_ROUTER, "router")) {
  auto s = FramedServer::listen(io, "127.0.0.1", 0, std::move(o), ev.callbacks(echo));
  REQUIRE(s.ok());
  REQUIRE(s.value()->port() > 0);
  return std::move(s).value();
}

// One envelope of every body type, with the fields that matter set.
std::vector<proto::Envelope> oneOfEach() {
  std::vector<proto::Envelope> all;
  auto add = [&](uint64_t id) -> proto::Envelope& {
    all.emplace_back();
    all.back().set_request_id(id);
    return all.back();
  };
  {
    auto* r = add(0).mutable_load_report();
    r->set_role(proto::ROLE_PREFILL);
    r->set_worker_id("prefill-1");
    r->set_queued_prefill_tokens(12345);
    r->set_running(3);
    r->set_waiting(7);
    r->set_free_blocks(100);
    r->set_total_blocks(4096);
    r->mutable_ttft()->set_p99_ms(412.5);
    r->mutable_ttft()->set_attainment(0.97);
  }
  {
    auto* g = add(11).mutable_generate();
    g->set_request_id(11);
    for (uint32_t t : {1u, 15043u, 338u, 128000u}) g->add_prompt_token_ids(t);
    auto* s = g->mutable_sampling();
    s->set_temperature(0.7f);
    s->set_top_k(40);
    s->set_top_p(0.9f);
    s->set_min_p(0.05f);
    s->set_seed(1234567890123ULL);
    s->set_max_tokens(64);
    s->add_stop_token_ids(2);
    s->set_ignore_eos(true);
    s->set_logprobs(5);
    g->set_prefill_worker_address("127.0.0.1:9100");
    g->set_deadline_ms(30000);
    g->set_route(proto::ROUTE_DISAGGREGATED);
  }
  {
    auto* c = add(11).mutable_token_chunk();
    c->set_request_id(11);
    c->add_token_ids(450);
    c->add_token_ids(451);
    auto* lp = c->add_logprobs();
    lp->set_token_id(450);
    lp->set_logprob(-0.25f);
    auto* top = lp->add_top();
    top->set_token_id(9);
    top->set_logprob(-1.5f);
    c->set_finish_reason(proto::FINISH_LENGTH);
    c->mutable_usage()->set_prompt_tokens(4);
    c->mutable_usage()->set_completion_tokens(2);
    c->mutable_timings()->set_queue_ms(1.5);
    c->mutable_timings()->set_prefill_ms(20);
    c->mutable_timings()->set_transfer_ms(3.25);
    c->mutable_timings()->set_prefill_worker_id("prefill-1");
    c->mutable_timings()->set_decode_worker_id("decode-0");
    c->mutable_timings()->set_route(proto::ROUTE_DISAGGREGATED);
  }
  {
    auto* c = add(11).mutable_cancel();
    c->set_request_id(11);
    c->set_reason("client disconnected");
  }
  {
    auto* p = add(12).mutable_prefill_request();
    p->set_request_id(12);
    for (uint32_t t = 0; t < 300; ++t) p->add_prompt_token_ids(t * 7);
    p->mutable_sampling()->set_max_tokens(1);
    auto* k = p->mutable_kv_target();
    k->set_write_grant(std::string("\x00\x01\x02grant", 8));
    for (int layer = 0; layer < 4; ++layer) {
      auto* l = k->add_layers();
      for (uint32_t b = 0; b < 19; ++b) l->add_block_ids(b * 3 + layer);
    }
  }
  {
    auto* d = add(12).mutable_prefill_done();
    d->set_request_id(12);
    d->set_first_token_id(29871);
    d->mutable_first_logprob()->set_logprob(-0.01f);
    d->mutable_timings()->set_prefill_ms(88);
    d->set_bytes_transferred(9437184);
  }
  {
    auto* e = add(13).mutable_error();
    e->set_code(proto::ERROR_RESOURCE_EXHAUSTED);
    e->set_message("no free KV blocks");
  }
  return all;
}

}  // namespace

// Declaration order matters in these tests: what the callbacks touch (Events, tables) is
// declared before the IoPool, and servers and connections after it, so callbacks never run
// against destroyed state and nothing outlives the pool it runs on.
TEST_CASE("every message type makes the round trip") {
  Events server;
  Events client;
  IoPool io(2);
  auto srv = startServer(io, server, /*echo=*/true);
  auto conn = FramedClient::connect(io, "127.0.0.1", srv->port(), options(proto::ROLE_DECODE, "decode-0"),
                                    client.callbacks(false), 2s);
  REQUIRE(conn.ok());
  // The handshake carried both hellos.
  CHECK(conn.value()->peerHello().worker_id() == "router");
  CHECK(conn.value()->peerHello().role() == proto::ROLE_ROUTER);
  CHECK(conn.value()->peerHello().protocol_version() == kProtocolVersion);
  CHECK(conn.value()->isOpen());

  auto sent = oneOfEach();
  for (const auto& env : sent) REQUIRE(conn.value()->send(env).isOk());
  REQUIRE(client.waitMessages(sent.size()));
  std::lock_guard<std::mutex> lock(client.mutex);
  REQUIRE(client.messages.size() == sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    proto::Envelope expected = sent[i];
    expected.set_version(kProtocolVersion);
    INFO("message " << i << " (" << bodyName(expected) << ")");
    CHECK(google::protobuf::util::MessageDifferencer::Equals(client.messages[i], expected));
  }
  CHECK(client.messages[1].generate().sampling().seed() == 1234567890123ULL);
  CHECK(client.messages[4].prefill_request().kv_target().layers(3).block_ids(18) == 18 * 3 + 3);
  CHECK(server.opens == 1);
  CHECK(srv->connectionCount() == 1);
}

TEST_CASE("1000 interleaved request ids on one connection") {
  constexpr int kRequests = 1000;
  constexpr int kChunks = 3;
  std::atomic<int> ok{0};
  std::atomic<int> wrong{0};
  std::promise<void> allDone;
  std::atomic<int> finished{0};
  std::atomic<int> undelivered{0};  // Catch assertions are not thread-safe: count on I/O threads
  // The server answers only once it has every request, then sends chunk k of every request
  // in a shuffled order before chunk k+1: answers for different ids interleave on the wire.
  std::mutex m;
  std::vector<uint64_t> ids;
  ConnectionCallbacks scb;
  scb.onMessage = [&](const ConnectionPtr& c, proto::Envelope&& env) {
    std::vector<uint64_t> all;
    {
      std::lock_guard<std::mutex> lock(m);
      if (!env.has_generate()) ++wrong;
      ids.push_back(env.request_id());
      if (ids.size() < kRequests) return;
      all = ids;
    }
    std::mt19937 rng(42);
    for (int k = 0; k < kChunks; ++k) {
      std::shuffle(all.begin(), all.end(), rng);
      for (uint64_t id : all) {
        proto::Envelope out;
        out.set_request_id(id);
        auto* chunk = out.mutable_token_chunk();
        chunk->set_request_id(id);
        chunk->add_token_ids(static_cast<uint32_t>(id * 10 + k));
        if (k == kChunks - 1) chunk->set_finish_reason(proto::FINISH_STOP);
        (void)c->send(std::move(out));
      }
    }
  };
  // The client demultiplexes by request id: each id's chunks must arrive in order, whole.
  std::mutex seenMutex;
  std::map<uint64_t, std::vector<uint32_t>> seen;
  ConnectionCallbacks ccb;
  ccb.onMessage = [&](const ConnectionPtr&, proto::Envelope&& env) {
    const uint64_t id = env.request_id();
    if (!env.has_token_chunk() || env.token_chunk().request_id() != id) {
      ++wrong;
      return;
    }
    bool last = env.token_chunk().finish_reason() != proto::FINISH_NONE;
    std::vector<uint32_t> got;
    {
      std::lock_guard<std::mutex> lock(seenMutex);
      if (id == 0 || id > kRequests) {
        ++undelivered;
        return;
      }
      auto& ids = seen[id];
      for (uint32_t t : env.token_chunk().token_ids()) ids.push_back(t);
      if (!last) return;
      got = ids;
    }
    std::vector<uint32_t> want;
    for (int k = 0; k < kChunks; ++k) want.push_back(static_cast<uint32_t>(id * 10 + k));
    if (got == want)
      ++ok;
    else
      ++wrong;
    if (++finished == kRequests) allDone.set_value();
  };
  IoPool io(2);
  auto srv = FramedServer::listen(io, "127.0.0.1", 0, options(proto::ROLE_DECODE, "decode-0"), scb);
  REQUIRE(srv.ok());
  auto conn =
      FramedClient::connect(io, "127.0.0.1", srv.value()->port(), options(proto::ROLE_ROUTER, "router"), ccb, 2s);
  REQUIRE(conn.ok());
  for (uint64_t id = 1; id <= kRequests; ++id) {
    proto::Envelope env;
    env.set_request_id(id);
    env.mutable_generate()->set_request_id(id);
    env.mutable_generate()->add_prompt_token_ids(static_cast<uint32_t>(id));
    REQUIRE(conn.value()->send(std::move(env)).isOk());
  }
  REQUIRE(allDone.get_future().wait_for(10s) == std::future_status::ready);
  CHECK(ok == kRequests);
  CHECK(wrong == 0);
  CHECK(undelivered == 0);
  conn.value()->close(cancelled("test done"));
  srv.value()->stop();
  io.stop();
}

TEST_CASE("malformed input closes only the offending connection, with the reason") {
  Events server;
  Events healthy;
  IoPool io(2);
  ConnectionOptions o = options(proto::ROLE_ROUTER, "router");
  o.maxFrameBytes = 1 << 20;
  o.handshakeTimeout = 300ms;
  auto srv = startServer(io, server, /*echo=*/true, o);
  const int port = srv->port();

  // A healthy client stays connected through everything below.
  auto good =
      FramedClient::connect(io, "127.0.0.1", port, options(proto::ROLE_DECODE, "d0"), healthy.callbacks(false), 2s);
  REQUIRE(good.ok());
  size_t closes = 0;
  size_t echoes = 0;
  auto stillServing = [&] {
    proto::Envelope ping;
    ping.set_request_id(99);
    ping.mutable_cancel()->set_request_id(99);
    REQUIRE(good.value()->send(ping).isOk());
    REQUIRE(healthy.waitMessages(++echoes));
    // And a new connection is accepted too.
    Events fresh;
    auto c =
        FramedClient::connect(io, "127.0.0.1", port, options(proto::ROLE_DECODE, "d1"), fresh.callbacks(false), 2s);
    REQUIRE(c.ok());
    c.value()->close(cancelled("test done"));
    REQUIRE(fresh.waitClose(1).code() == StatusCode::kCancelled);
    REQUIRE(server.waitClose(++closes).code() == StatusCode::kUnavailable);
  };

  SECTION("oversized length prefix") {
    RawClient raw(port);
    REQUIRE(raw.connected());
    REQUIRE(raw.write(helloFrame() + lengthPrefix(0x7fffffff)));
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kResourceExhausted);
    CHECK_THAT(s.message(), Catch::Contains("announced a frame of 2147483647 bytes, over the "
                                            "1048576-byte limit"));
    CHECK(raw.waitClosed());
    stillServing();
  }
  SECTION("a frame that is not an Envelope") {
    RawClient raw(port);
    REQUIRE(raw.write(helloFrame() + lengthPrefix(8) + std::string(8, '\xff')));
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kDataLoss);
    CHECK_THAT(s.message(), Catch::EndsWith("sent a frame of 8 bytes that is not a valid Envelope"));
    CHECK(raw.waitClosed());
    stillServing();
  }
  SECTION("a truncated frame followed by close") {
    RawClient raw(port);
    REQUIRE(raw.write(helloFrame() + lengthPrefix(100) + std::string(10, 'x')));
    raw.shutdownWrite();
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kDataLoss);
    CHECK_THAT(s.message(), Catch::EndsWith("closed the connection mid-frame: got 10 of 100 bytes"));
    stillServing();
  }
  SECTION("a truncated length prefix followed by close") {
    RawClient raw(port);
    REQUIRE(raw.write(helloFrame() + std::string(2, '\0')));
    raw.shutdownWrite();
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kDataLoss);
    CHECK_THAT(s.message(), Catch::EndsWith("closed the connection mid-frame header: got 2 of 4 bytes"));
    stillServing();
  }
  SECTION("a wrong protocol version is rejected with an Error frame") {
    RawClient raw(port);
    REQUIRE(raw.write(helloFrame(99)));
    proto::Envelope first, second;
    REQUIRE(raw.readFrame(&first));
    CHECK(first.has_hello());
    CHECK(first.hello().worker_id() == "router");
    REQUIRE(raw.readFrame(&second));
    REQUIRE(second.has_error());
    CHECK(second.error().code() == proto::ERROR_FAILED_PRECONDITION);
    CHECK_THAT(second.error().message(), Catch::EndsWith("speaks 99, this side speaks 1"));
    CHECK(raw.waitClosed());
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::StartsWith("protocol version mismatch: peer 127.0.0.1:"));
    stillServing();
  }
  SECTION("a first frame that is not hello") {
    RawClient raw(port);
    proto::Envelope env;
    env.set_version(kProtocolVersion);
    env.mutable_cancel()->set_request_id(1);
    REQUIRE(raw.write(frameOf(env)));
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::EndsWith("sent cancel as its first frame; expected hello"));
    stillServing();
  }
  SECTION("an envelope without a body after the handshake") {
    RawClient raw(port);
    proto::Envelope empty;
    empty.set_version(kProtocolVersion);
    empty.set_request_id(5);
    REQUIRE(raw.write(helloFrame() + frameOf(empty)));
    Status s = server.waitClose(++closes);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::EndsWith("sent an envelope with no known body (newer protocol?)"));
    stillServing();
  }
  SECTION("silence past the handshake timeout") {
    RawClient raw(port);
    auto t0 = std::chrono::steady_clock::now();
    Status s = server.waitClose(++closes);
    auto waited = std::chrono::steady_clock::now() - t0;
    CHECK(s.code() == StatusCode::kDeadlineExceeded);
    CHECK_THAT(s.message(), Catch::EndsWith("no hello within 300 ms"));
    CHECK(waited >= 250ms);
    CHECK(waited < 3s);
    stillServing();
  }
  CHECK(good.value()->isOpen());
  CHECK(healthy.closes.empty());
}

TEST_CASE("send refuses frames over the limit and after close") {
  Events server;
  Events client;
  IoPool io(1);
  auto srv = startServer(io, server, false);
  ConnectionOptions o = options(proto::ROLE_DECODE, "d0");
  o.maxFrameBytes = 1024;
  auto conn = FramedClient::connect(io, "127.0.0.1", srv->port(), o, client.callbacks(false), 2s);
  REQUIRE(conn.ok());
  proto::Envelope big;
  big.mutable_error()->set_message(std::string(2000, 'x'));
  Status s = conn.value()->send(big);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(s.message(), Catch::Contains("(error) exceeds the 1024-byte limit"));

  conn.value()->close(cancelled("done here"));
  Status why = client.waitClose(1);
  CHECK(why.code() == StatusCode::kCancelled);
  CHECK(why.message() == "done here");
  CHECK_FALSE(conn.value()->isOpen());
  CHECK(conn.value()->send(proto::Envelope()).code() == StatusCode::kUnavailable);
  // The server saw the peer go away.
  CHECK(server.waitClose(1).code() == StatusCode::kUnavailable);
}

TEST_CASE("stopping the server closes its connections; clients see the close") {
  Events server;
  Events client;
  IoPool io(2);
  auto srv = startServer(io, server, false);
  auto conn = FramedClient::connect(io, "127.0.0.1", srv->port(), options(proto::ROLE_PREFILL, "p0"),
                                    client.callbacks(false), 2s);
  REQUIRE(conn.ok());
  srv->stop();
  CHECK(server.waitClose(1).code() == StatusCode::kCancelled);
  Status s = client.waitClose(1);
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK_THAT(s.message(), Catch::EndsWith("closed the connection"));
}

TEST_CASE("connect errors are bounded and say why") {
  Events ev;
  IoPool io(1);
  // A port that was just free: bind, read the port, close.
  int port = 0;
  {
    auto s = FramedServer::listen(io, "127.0.0.1", 0, ConnectionOptions(), ev.callbacks(false));
    REQUIRE(s.ok());
    port = s.value()->port();
  }
  auto t0 = std::chrono::steady_clock::now();
  auto r = FramedClient::connect(io, "127.0.0.1", port, ConnectionOptions(), {}, 2s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(r.status().message(), Catch::StartsWith("connect to 127.0.0.1:" + std::to_string(port)));
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);

  // A listener that never answers the handshake: the deadline ends the attempt.
  MuteListener mute;
  t0 = std::chrono::steady_clock::now();
  auto silent = FramedClient::connect(io, "127.0.0.1", mute.port(), ConnectionOptions(), {}, 300ms);
  auto waited = std::chrono::steady_clock::now() - t0;
  REQUIRE_FALSE(silent.ok());
  CHECK(silent.status().code() == StatusCode::kDeadlineExceeded);
  CHECK(silent.status().message() ==
        "connect to 127.0.0.1:" + std::to_string(mute.port()) + ": no hello within 300 ms");
  CHECK(waited >= 250ms);
  CHECK(waited < 2s);

  auto bad = FramedServer::listen(io, "not-an-ip", 0, ConnectionOptions(), {});
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("connectWithRetry waits for a server that starts late") {
  Events ev;
  Events server;
  IoPool io(2);
  int port = 0;
  {
    auto s = FramedServer::listen(io, "127.0.0.1", 0, ConnectionOptions(), ev.callbacks(false));
    REQUIRE(s.ok());
    port = s.value()->port();
  }
  std::unique_ptr<FramedServer> late;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    auto s =
        FramedServer::listen(io, "127.0.0.1", port, options(proto::ROLE_ROUTER, "router"), server.callbacks(false));
    if (s.ok()) late = std::move(s).value();  // checked on the test thread below
  });
  RetryPolicy policy;
  policy.initialDelay = 20ms;
  policy.maxDelay = 100ms;
  policy.attemptTimeout = 500ms;
  policy.totalTimeout = 5s;
  auto t0 = std::chrono::steady_clock::now();
  auto conn = FramedClient::connectWithRetry(io, "127.0.0.1", port, options(proto::ROLE_DECODE, "d0"), {}, policy);
  auto took = std::chrono::steady_clock::now() - t0;
  starter.join();
  REQUIRE(late != nullptr);
  REQUIRE(conn.ok());
  CHECK(conn.value()->peerHello().worker_id() == "router");
  CHECK(took >= 250ms);
  CHECK(took < 5s);

  // Nobody ever listens: it gives up at the total timeout.
  policy.totalTimeout = 300ms;
  late.reset();
  t0 = std::chrono::steady_clock::now();
  auto never = FramedClient::connectWithRetry(io, "127.0.0.1", port, ConnectionOptions(), {}, policy);
  took = std::chrono::steady_clock::now() - t0;
  REQUIRE_FALSE(never.ok());
  CHECK(never.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(never.status().message(), Catch::Contains("gave up after"));
  CHECK(took < 2s);
}

TEST_CASE("Status survives the wire") {
  Status s = resourceExhausted("no free KV blocks");
  Status back = fromProtoError(toProtoError(s));
  CHECK(back.code() == StatusCode::kResourceExhausted);
  CHECK(back.message() == "no free KV blocks");
  CHECK(toProtoError(deadlineExceeded("x")).code() == proto::ERROR_DEADLINE_EXCEEDED);
  CHECK(toProtoError(Status(StatusCode::kInProgress, "x")).code() == proto::ERROR_INTERNAL);
}

TEST_CASE("random bytes after the handshake never take the server down") {
  Events server;
  Events healthy;
  IoPool io(2);
  ConnectionOptions o = options(proto::ROLE_ROUTER, "router");
  o.maxFrameBytes = 4096;
  auto srv = startServer(io, server, /*echo=*/false, o);
  auto good = FramedClient::connect(io, "127.0.0.1", srv->port(), options(proto::ROLE_DECODE, "d0"),
                                    healthy.callbacks(false), 2s);
  REQUIRE(good.ok());
  std::mt19937 rng(7);
  constexpr int kStreams = 60;
  for (int i = 0; i < kStreams; ++i) {
    std::string junk;
    // Half the streams announce plausible lengths so the bytes reach the parser; the rest are
    // raw noise (mostly oversized lengths).
    int frames = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < frames; ++f) {
      uint32_t len = i % 2 == 0 ? rng() % 64 : rng();
      if (i % 2 == 0) junk += lengthPrefix(len);
      for (uint32_t b = 0; b < (i % 2 == 0 ? len : 64u); ++b) junk += static_cast<char>(rng());
    }
    RawClient raw(srv->port());
    REQUIRE(raw.write(helloFrame() + junk));
    raw.shutdownWrite();
    // Every stream ends in a close with a reason (some junk parses as messages first).
    Status s = server.waitClose(static_cast<size_t>(i) + 1);
    INFO("stream " << i << ": " << s.toString());
    CHECK(s.code() != StatusCode::kInternal);  // not the wait's timeout placeholder
    CHECK_FALSE(s.isOk());
  }
  // Still serving: the healthy connection round-trips and a new one connects.
  proto::Envelope ping;
  ping.set_request_id(1);
  ping.mutable_cancel()->set_request_id(1);
  size_t before = 0;
  {
    std::lock_guard<std::mutex> lock(server.mutex);
    before = server.messages.size();  // junk that happened to parse as messages
  }
  REQUIRE(good.value()->send(ping).isOk());
  REQUIRE(server.waitMessages(before + 1));
  {
    std::lock_guard<std::mutex> lock(server.mutex);
    CHECK(server.messages.back().cancel().request_id() == 1);
  }
  CHECK(good.value()->isOpen());
  auto again = FramedClient::connect(io, "127.0.0.1", srv->port(), options(proto::ROLE_DECODE, "d1"), {}, 2s);
  CHECK(again.ok());
  if (again.ok()) again.value()->close(cancelled("test done"));
}

// Leases (docs/reliability.md): the keepalive of framed.h.
TEST_CASE("keepalive: heartbeats keep a quiet connection open, a silent peer is closed within its lease") {
  Events server;
  Events client;
  std::atomic<int> expired{0};
  IoPool io(2);
  ConnectionOptions o = options(proto::ROLE_PREFILL, "prefill-0");
  o.keepaliveInterval = 20ms;
  o.leaseTimeout = 150ms;
  o.plane = "prefill_control";
  o.onLeaseExpired = [&](const std::string& plane, const Status&) {
    CHECK(plane == "prefill_control");
    ++expired;
  };
  auto srv = startServer(io, server, /*echo=*/false, o);

  SECTION("two sides with keepalive stay open through silence, and heartbeats never reach onMessage") {
    ConnectionOptions co = options(proto::ROLE_DECODE, "decode-0");
    co.keepaliveInterval = 20ms;
    co.leaseTimeout = 150ms;
    auto c = FramedClient::connect(io, "127.0.0.1", srv->port(), co, client.callbacks(false), 2s);
    REQUIRE(c.ok());
    std::this_thread::sleep_for(700ms);  // > 4 leases with nothing sent by either owner
    CHECK(c.value()->isOpen());
    CHECK(c.value()->peerHello().keepalive_interval_ms() == 20);
    std::lock_guard<std::mutex> lock(server.mutex);
    CHECK(server.closes.empty());
    CHECK(server.messages.empty());
    CHECK(client.messages.empty());
    CHECK(expired == 0);
  }
  SECTION("a peer that announced keepalive and then says nothing is closed after the lease") {
    RawClient raw(srv->port());
    proto::Envelope hello;
    hello.set_version(kProtocolVersion);
    hello.mutable_hello()->set_protocol_version(kProtocolVersion);
    hello.mutable_hello()->set_role(proto::ROLE_DECODE);
    hello.mutable_hello()->set_worker_id("stopped");
    hello.mutable_hello()->set_keepalive_interval_ms(20);
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(raw.write(frameOf(hello)));
    Status why = server.waitClose(1);
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(why.code() == StatusCode::kDeadlineExceeded);
    CHECK_THAT(why.message(), Catch::Contains("(stopped) silent for") && Catch::Contains("lease 150 ms"));
    CHECK(took >= 150ms);
    CHECK(took < 1s);
    CHECK(expired == 1);
    // It was sent heartbeats while it was open (after the server's hello).
    proto::Envelope env;
    REQUIRE(raw.readFrame(&env));
    CHECK(env.has_hello());
    REQUIRE(raw.readFrame(&env));
    CHECK(env.has_heartbeat());
  }
  SECTION("a peer that announced no keepalive (an older build) is never timed out and sent no heartbeat") {
    RawClient raw(srv->port());
    REQUIRE(raw.write(helloFrame()));
    proto::Envelope env;
    REQUIRE(raw.readFrame(&env));
    CHECK(env.has_hello());
    CHECK(env.hello().keepalive_interval_ms() == 20);
    std::this_thread::sleep_for(500ms);
    std::lock_guard<std::mutex> lock(server.mutex);
    CHECK(server.closes.empty());
    CHECK(expired == 0);
    // Nothing more arrives (the socket's 5 s receive timeout would be hit): check with a poll.
    pollfd p{raw.fd(), POLLIN, 0};
    CHECK(::poll(&p, 1, 100) == 0);
  }
}
