// The framed control plane's cluster authentication and its memory bounds (docs/security.md).
#include <atomic>
#include <mutex>
#include <thread>

#include <catch2/catch.hpp>

#include "common/net/framed.h"
#include "net_test_util.h"

using namespace pd;
using namespace pd::net;
using namespace pd::net::testing;
using namespace std::chrono_literals;

namespace {

auth::ClusterSecret secretOf(const std::string& s) { return std::make_shared<const std::string>(s); }
const std::string kSecret = "0123456789abcdef0123456789abcdef-cluster-a";
const std::string kOtherSecret = "0123456789abcdef0123456789abcdef-cluster-b";

// Counts onAuthFailure per side.
struct AuthCounter {
  std::mutex mu;
  std::vector<std::string> reasons;
  size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return reasons.size();
  }
  bool waitCount(size_t n) {
    for (int i = 0; i < 500 && count() < n; ++i) std::this_thread::sleep_for(10ms);
    return count() >= n;
  }
};

ConnectionOptions opts(proto::Role role, const std::string& id, const std::string& secret, AuthCounter* counter,
                       const std::string& plane) {
  ConnectionOptions o;
  o.hello.set_role(role);
  o.hello.set_worker_id(id);
  o.hello.set_model_fingerprint("fp-" + id);
  if (!secret.empty()) o.clusterSecret = secretOf(secret);
  o.plane = plane;
  o.onAuthFailure = [counter](const std::string& p, const Status& why) {
    std::lock_guard<std::mutex> lock(counter->mu);
    counter->reasons.push_back(p + ": " + why.message());
  };
  o.handshakeTimeout = 2s;
  return o;
}

struct Pair {
  Events serverEvents;
  AuthCounter serverAuth, clientAuth;
  IoPool io{2};
  std::unique_ptr<FramedServer> server;

  void listen(const std::string& secret) {
    auto s = FramedServer::listen(io, "127.0.0.1", 0,
                                  opts(proto::ROLE_ROUTER, "router", secret, &serverAuth, "router_control"),
                                  serverEvents.callbacks(true));
    REQUIRE(s.ok());
    server = std::move(s).value();
  }
  Result<ConnectionPtr> dial(const std::string& secret) {
    return FramedClient::connect(io, "127.0.0.1", server->port(),
                                 opts(proto::ROLE_DECODE, "decode-0", secret, &clientAuth, "router_link"), {}, 3s);
  }
};

}  // namespace

TEST_CASE("framed auth: the same secret on both sides opens, and messages flow") {
  Pair p;
  p.listen(kSecret);
  auto c = p.dial(kSecret);
  REQUIRE(c.ok());
  CHECK(c.value()->peerHello().worker_id() == "router");
  CHECK(c.value()->peerHello().auth_nonce().size() == auth::kNonceBytes);
  CHECK(c.value()->peerHello().model_fingerprint() == "fp-router");  // the full hello, after the proof
  proto::Envelope env;
  env.set_request_id(5);
  env.mutable_cancel()->set_request_id(5);
  REQUIRE(c.value()->send(env).isOk());
  REQUIRE(p.serverEvents.waitMessages(1));
  CHECK(p.serverEvents.opens == 1);
  CHECK(p.serverAuth.count() == 0);
  CHECK(p.clientAuth.count() == 0);
  c.value()->close(cancelled("done"));
}

TEST_CASE("framed auth: a wrong secret is refused, counted on both sides, and never opens") {
  Pair p;
  p.listen(kSecret);
  auto c = p.dial(kOtherSecret);
  REQUIRE_FALSE(c.ok());
  CHECK_THAT(c.status().message(), Catch::Contains("authentication failed"));
  CHECK(c.status().code() == StatusCode::kFailedPrecondition);
  REQUIRE(p.serverAuth.waitCount(1));
  CHECK_THAT(p.serverAuth.reasons[0], Catch::Contains("router_control") && Catch::Contains("wrong proof"));
  CHECK(p.clientAuth.waitCount(1));
  CHECK(p.serverEvents.opens == 0);
  // The server closed it (onClose runs once per accepted connection).
  CHECK_THAT(p.serverEvents.waitClose(1).message(), Catch::Contains("authentication failed"));
}

TEST_CASE("framed auth: a side without a secret and a side with one fail closed, both directions") {
  SECTION("client without a secret, server with one") {
    Pair p;
    p.listen(kSecret);
    auto c = p.dial("");
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.status().message(), Catch::Contains("authentication failed"));
    REQUIRE(p.serverAuth.waitCount(1));
    CHECK_THAT(p.serverAuth.reasons[0], Catch::Contains("no cluster credential"));
    CHECK(p.serverEvents.opens == 0);
  }
  SECTION("client with a secret, server without one") {
    Pair p;
    p.listen("");
    auto c = p.dial(kSecret);
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.status().message(), Catch::Contains("authentication failed"));
    REQUIRE(p.serverAuth.waitCount(1));
    CHECK_THAT(p.serverAuth.reasons[0], Catch::Contains("requires cluster authentication"));
    CHECK(p.clientAuth.waitCount(1));
    CHECK(p.serverEvents.opens == 0);
  }
  SECTION("neither has one: open (no cluster secret)") {
    Pair p;
    p.listen("");
    auto c = p.dial("");
    REQUIRE(c.ok());
    CHECK(c.value()->peerHello().auth_nonce().empty());
    c.value()->close(cancelled("done"));
  }
}

namespace {

// A hand-played client: hello with a chosen nonce, then whatever proof the test gives.
proto::Envelope rawHello(const std::string& nonce) {
  proto::Envelope env;
  env.set_version(kProtocolVersion);
  auto* h = env.mutable_hello();
  h->set_protocol_version(kProtocolVersion);
  h->set_role(proto::ROLE_DECODE);
  h->set_worker_id("decode-0");
  h->set_auth_nonce(nonce);
  return env;
}

proto::Envelope authFrame(const std::string& proof) {
  proto::Envelope env;
  env.set_version(kProtocolVersion);
  env.mutable_auth()->set_proof(proof);
  return env;
}

}  // namespace

TEST_CASE("framed auth: a proof replayed from another connection is refused and counted") {
  Pair p;
  p.listen(kSecret);
  const std::string nonce(auth::kNonceBytes, 'n');
  std::string firstProof;
  {
    RawClient first(p.server->port());
    REQUIRE(first.connected());
    proto::Envelope serverHello;
    REQUIRE(first.readFrame(&serverHello));
    // Before the client proved anything the server says no more than the transcript needs.
    CHECK(serverHello.hello().worker_id() == "router");
    CHECK(serverHello.hello().model_fingerprint().empty());
    proto::Envelope hello = rawHello(nonce);
    REQUIRE(first.write(frameOf(hello)));
    firstProof = handshakeProof(kSecret, true, hello.hello(), serverHello.hello());
    REQUIRE(first.write(frameOf(authFrame(firstProof))));
    proto::Envelope reply;
    REQUIRE(first.readFrame(&reply));
    REQUIRE(reply.has_auth());  // proved: the server proves itself back, with its full hello
    CHECK(reply.auth().hello().model_fingerprint() == "fp-router");
    CHECK(handshakeProof(kSecret, false, hello.hello(), serverHello.hello()) == reply.auth().proof());
  }
  CHECK(p.serverAuth.count() == 0);
  // The same hello and proof on a second connection: the server's nonce is new, so it fails.
  RawClient second(p.server->port());
  proto::Envelope serverHello2;
  REQUIRE(second.readFrame(&serverHello2));
  REQUIRE(second.write(frameOf(rawHello(nonce))));
  REQUIRE(second.write(frameOf(authFrame(firstProof))));
  proto::Envelope reply;
  REQUIRE(second.readFrame(&reply));
  REQUIRE(reply.has_error());
  CHECK(reply.error().message() == "authentication failed");  // the peer learns nothing more
  CHECK(second.waitClosed());
  REQUIRE(p.serverAuth.waitCount(1));
  CHECK_THAT(p.serverAuth.reasons[0], Catch::Contains("wrong proof"));
  // Only the first opened (its onOpen may still be running on the other I/O thread).
  {
    std::unique_lock<std::mutex> lock(p.serverEvents.mutex);
    p.serverEvents.cv.wait_for(lock, 5s, [&] { return p.serverEvents.opens >= 1; });
    CHECK(p.serverEvents.opens == 1);
  }
}

TEST_CASE("framed auth: a server replaying another connection's proof is refused by the client") {
  // A hand-played server: accepts, says hello, reads the client's hello and proof, and answers
  // with the proof the real server gave on an earlier connection.
  AuthCounter clientAuth;
  IoPool io(2);
  Pair real;
  real.listen(kSecret);
  // Record a genuine server proof from a connection with fixed client nonce.
  const std::string nonce(auth::kNonceBytes, 'c');
  std::string recordedServerProof;
  proto::Hello recordedServerHello;
  {
    RawClient rc(real.server->port());
    proto::Envelope sh;
    REQUIRE(rc.readFrame(&sh));
    proto::Envelope hello = rawHello(nonce);
    REQUIRE(rc.write(frameOf(hello)));
    REQUIRE(rc.write(frameOf(authFrame(handshakeProof(kSecret, true, hello.hello(), sh.hello())))));
    proto::Envelope reply;
    REQUIRE(rc.readFrame(&reply));
    REQUIRE(reply.has_auth());
    recordedServerProof = reply.auth().proof();
    recordedServerHello = sh.hello();
  }
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  std::thread fake([&] {
    int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    timeval tv{3, 0};
    ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    proto::Envelope sh;
    sh.set_version(kProtocolVersion);
    *sh.mutable_hello() = recordedServerHello;  // the same nonce as the recorded connection
    std::string f = frameOf(sh);
    (void)::send(c, f.data(), f.size(), MSG_NOSIGNAL);
    char buf[4096];
    (void)::recv(c, buf, sizeof buf, 0);  // the client's hello (and maybe its proof)
    std::this_thread::sleep_for(100ms);
    (void)::recv(c, buf, sizeof buf, MSG_DONTWAIT);
    std::string a = frameOf(authFrame(recordedServerProof));
    (void)::send(c, a.data(), a.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(300ms);
    ::close(c);
  });
  auto conn = FramedClient::connect(io, "127.0.0.1", port,
                                    opts(proto::ROLE_DECODE, "decode-0", kSecret, &clientAuth, "router_link"), {}, 3s);
  fake.join();
  ::close(fd);
  REQUIRE_FALSE(conn.ok());
  CHECK_THAT(conn.status().message(), Catch::Contains("authentication failed"));
  REQUIRE(clientAuth.waitCount(1));
  CHECK_THAT(clientAuth.reasons[0], Catch::Contains("router_link") && Catch::Contains("wrong proof"));
}

TEST_CASE("framed auth: a client that sends a request before its proof is refused") {
  Pair p;
  p.listen(kSecret);
  RawClient c(p.server->port());
  proto::Envelope sh;
  REQUIRE(c.readFrame(&sh));
  REQUIRE(c.write(frameOf(rawHello(std::string(auth::kNonceBytes, 'x')))));
  proto::Envelope gen;
  gen.set_version(kProtocolVersion);
  gen.mutable_token_chunk()->set_request_id(1);
  REQUIRE(c.write(frameOf(gen)));
  proto::Envelope reply;
  REQUIRE(c.readFrame(&reply));
  CHECK(reply.has_error());
  REQUIRE(p.serverAuth.waitCount(1));
  CHECK_THAT(p.serverAuth.reasons[0], Catch::Contains("before proving"));
  CHECK(p.serverEvents.opens == 0);
  CHECK(p.serverEvents.messages.empty());
}

TEST_CASE("framed memory: 10 connections announcing 64 MiB frames hold kilobytes, not 640 MiB") {
  Events ev;
  IoPool io(2);
  ConnectionOptions o;
  o.hello.set_role(proto::ROLE_ROUTER);
  o.maxFrameBytes = size_t{64} << 20;  // the old router limit: the announced frames are legal
  auto s = FramedServer::listen(io, "127.0.0.1", 0, o, ev.callbacks(false));
  REQUIRE(s.ok());
  const size_t before = bufferedReadBytes();
  std::vector<std::unique_ptr<RawClient>> clients;
  for (int i = 0; i < 10; ++i) {
    clients.push_back(std::make_unique<RawClient>(s.value()->port()));
    REQUIRE(clients.back()->connected());
    REQUIRE(clients.back()->write(helloFrame()));
    // A header announcing 64 MiB - 1, then 70 KiB of it: more than the first read chunk, so
    // the buffer has to grow (an unbounded reader would grow to the announced 64 MiB at once).
    REQUIRE(clients.back()->write(lengthPrefix((64u << 20) - 1) + std::string(70 << 10, 'x')));
  }
  CHECK(ev.waitOpens(10));
  std::this_thread::sleep_for(200ms);  // let every read land
  const size_t held = bufferedReadBytes() - before;
  INFO("read buffers hold " << held << " bytes");
  CHECK(held < size_t{4} << 20);  // 10 x a few 64 KiB chunks; was 10 x 64 MiB
  clients.clear();
}

TEST_CASE("framed memory: before the handshake a frame over 64 KiB closes the connection") {
  Events ev;
  IoPool io(2);
  ConnectionOptions o;
  o.hello.set_role(proto::ROLE_ROUTER);
  auto s = FramedServer::listen(io, "127.0.0.1", 0, o, ev.callbacks(false));
  REQUIRE(s.ok());
  RawClient c(s.value()->port());
  REQUIRE(c.write(lengthPrefix(1u << 20)));
  CHECK(c.waitClosed());
  CHECK_THAT(ev.waitClose(1).message(), Catch::Contains("handshake frame"));
}

TEST_CASE("framed limits: connections stuck in their handshake are bounded and time out") {
  Events ev;
  IoPool io(2);
  ConnectionOptions o;
  o.hello.set_role(proto::ROLE_ROUTER);
  o.maxPendingHandshakes = 3;
  o.handshakeTimeout = 400ms;
  auto s = FramedServer::listen(io, "127.0.0.1", 0, o, ev.callbacks(false));
  REQUIRE(s.ok());
  std::vector<std::unique_ptr<RawClient>> silent;
  for (int i = 0; i < 3; ++i) silent.push_back(std::make_unique<RawClient>(s.value()->port()));
  std::this_thread::sleep_for(100ms);
  RawClient fourth(s.value()->port());
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(fourth.waitClosed());  // closed on accept, well before the handshake timeout
  CHECK(std::chrono::steady_clock::now() - t0 < 350ms);
  // The silent ones are closed at handshakeTimeout.
  for (auto& c : silent) CHECK(c->waitClosed());
  // Their places are free again.
  RawClient later(s.value()->port());
  REQUIRE(later.write(helloFrame()));
  proto::Envelope sh;
  CHECK(later.readFrame(&sh));
  CHECK(ev.waitOpens(1));
  std::lock_guard<std::mutex> lock(ev.mutex);
  CHECK(ev.opens == 1);  // the refused and timed-out ones never opened
}
