// The router's HTTP server against a raw socket client on 127.0.0.1.
#include "common/net/http_server.h"

#include <atomic>
#include <future>
#include <mutex>
#include <thread>

#include <boost/asio.hpp>
#include <catch2/catch.hpp>

using namespace pd::net;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

struct ServerFixture {
  explicit ServerFixture(HttpHandler handler, size_t maxBody = 1024) {
    HttpServerOptions opts;
    opts.maxBodyBytes = maxBody;
    init(opts, std::move(handler));
  }
  ServerFixture(HttpServerOptions opts, HttpHandler handler) { init(opts, std::move(handler)); }
  void init(HttpServerOptions opts, HttpHandler handler) {
    opts.port = 0;
    server = std::make_unique<HttpServer>(io, opts, std::move(handler));
    REQUIRE(server->start().isOk());
    for (auto& t : threads) t = std::thread([this] { io.run(); });
  }
  ~ServerFixture() {
    server->stop();
    work.reset();
    io.stop();
    for (auto& t : threads) t.join();
  }
  net::io_context io;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work{io.get_executor()};
  std::unique_ptr<HttpServer> server;
  std::thread threads[2];
};

// Sends raw bytes and reads until the server closes or `until` appears in the reply.
std::string exchange(uint16_t port, const std::string& request, const std::string& until = "",
                     tcp::socket* keep = nullptr) {
  net::io_context io;
  tcp::socket local(io);
  tcp::socket& s = keep ? *keep : local;
  s.connect({net::ip::make_address("127.0.0.1"), port});
  net::write(s, net::buffer(request));
  std::string reply;
  char buf[4096];
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    boost::system::error_code ec;
    size_t n = s.read_some(net::buffer(buf), ec);
    reply.append(buf, n);
    if (ec) break;
    if (!until.empty() && reply.find(until) != std::string::npos) break;
  }
  return reply;
}

}  // namespace

TEST_CASE("full responses, keep-alive and request fields") {
  ServerFixture f([](HttpRequest req, std::shared_ptr<HttpResponder> r) {
    r->sendFull(200, {{"x-echo-path", req.path()}},
                req.method + " " + req.target + " " + req.header("content-type") + " " + req.body);
  });
  std::string two =
      "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
      "Content-Length: 2\r\n\r\n{}"
      "GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
  std::string reply = exchange(f.server->port(), two);
  CHECK(reply.find("HTTP/1.1 200 OK") == 0);
  CHECK(reply.find("x-echo-path: /v1/completions") != std::string::npos);
  CHECK(reply.find("POST /v1/completions?x=1 application/json {}") != std::string::npos);
  // The pipelined second request is answered on the same connection.
  CHECK(reply.find("GET /health  ") != std::string::npos);
}

TEST_CASE("a body over the limit is a 413 with an OpenAI error, garbage is a 400") {
  ServerFixture f([](HttpRequest, std::shared_ptr<HttpResponder> r) { r->sendFull(200, {}, "ok"); },
                  /*maxBody=*/16);
  std::string big = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 17\r\n\r\n" + std::string(17, 'x');
  std::string reply = exchange(f.server->port(), big);
  CHECK(reply.find("HTTP/1.1 413") == 0);
  CHECK(reply.find("\"message\":\"request body exceeds the limit of 16 bytes\"") != std::string::npos);
  CHECK(reply.find("\"type\":\"invalid_request_error\"") != std::string::npos);

  std::string bad = exchange(f.server->port(), "HELLO THERE\r\n\r\n");
  CHECK(bad.find("HTTP/1.1 400") == 0);
  CHECK(bad.find("malformed HTTP request") != std::string::npos);
  // The server still serves after both.
  CHECK(exchange(f.server->port(), "GET / HTTP/1.1\r\nConnection: close\r\n\r\n").find("HTTP/1.1 200 OK") == 0);
}

TEST_CASE("SSE streams are chunked events written in order, from another thread") {
  ServerFixture f([](HttpRequest, std::shared_ptr<HttpResponder> r) {
    std::thread([r] {
      r->startStream(200, {{"x-pdserve-route", "colocated"}});
      for (int i = 0; i < 3; ++i) r->sendEvent("data: {\"i\":" + std::to_string(i) + "}\n\n");
      r->sendEvent("data: [DONE]\n\n");
      r->endStream();
    }).detach();
  });
  std::string reply =
      exchange(f.server->port(), "POST /s HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
  CHECK(reply.find("HTTP/1.1 200 OK") == 0);
  CHECK(reply.find("Content-Type: text/event-stream") != std::string::npos);
  CHECK(reply.find("Transfer-Encoding: chunked") != std::string::npos);
  CHECK(reply.find("x-pdserve-route: colocated") != std::string::npos);
  auto p0 = reply.find("data: {\"i\":0}"), p1 = reply.find("data: {\"i\":1}"), p2 = reply.find("data: {\"i\":2}"),
       done = reply.find("data: [DONE]");
  REQUIRE(p0 != std::string::npos);
  CHECK(p0 < p1);
  CHECK(p1 < p2);
  CHECK(p2 < done);
  CHECK(reply.substr(reply.size() - 5) == "0\r\n\r\n");  // the last chunk
}

TEST_CASE("a client that disconnects mid-stream fires onDisconnect") {
  std::promise<void> disconnected;
  std::promise<std::shared_ptr<HttpResponder>> gotResponder;
  ServerFixture f([&](HttpRequest, std::shared_ptr<HttpResponder> r) {
    r->onDisconnect([&] { disconnected.set_value(); });
    r->startStream(200, {});
    r->sendEvent("data: first\n\n");
    gotResponder.set_value(r);
  });
  {
    net::io_context io;
    tcp::socket s(io);
    std::string reply = exchange(f.server->port(), "POST /s HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "data: first", &s);
    CHECK(reply.find("data: first") != std::string::npos);
    s.close();
  }
  auto fut = disconnected.get_future();
  REQUIRE(fut.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  // Writing after the disconnect is harmless.
  auto r = gotResponder.get_future().get();
  r->sendEvent("data: late\n\n");
  r->endStream();
}

TEST_CASE("a server stopped while a stream's writes are queued closes the connection: no session is left behind") {
  // 64 MiB of events against a client that reads nothing: one write stays in flight and the
  // rest queue. Once the server and its io_context are gone, the session must be too, and
  // with it the socket: the client reads to the end. A queued write that owned its session
  // kept it (and the socket) alive forever, a leak LeakSanitizer found at a router's exit.
  auto f = std::make_unique<ServerFixture>([](HttpRequest, std::shared_ptr<HttpResponder> r) {
    r->startStream(200, {});
    const std::string event = "data: " + std::string(size_t(1) << 20, 'x') + "\n\n";
    for (int i = 0; i < 64; ++i) r->sendEvent(event);
    r->endStream();
  });
  net::io_context io;
  tcp::socket s(io);
  std::string reply = exchange(f->server->port(), "POST /s HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "data: x", &s);
  REQUIRE(reply.find("HTTP/1.1 200 OK") == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the socket buffers fill
  f.reset();
  s.non_blocking(true);
  size_t received = reply.size();
  bool closed = false;
  char buf[1 << 16];
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       !closed && std::chrono::steady_clock::now() < deadline;) {
    boost::system::error_code ec;
    const size_t n = s.read_some(net::buffer(buf), ec);
    received += n;
    if (ec == net::error::would_block)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    else if (ec)
      closed = true;  // eof or reset: the server's socket is gone
  }
  INFO(received << " bytes received before the end");
  CHECK(closed);
  CHECK(received < (size_t(64) << 20));  // the server stopped before the stream was written
}

// The router asks to hear of a disconnect only once the request is admitted and routed; a
// client that left before that (aborts before the first token) must still be heard
// of, or its request runs to the end for nobody.
TEST_CASE("onDisconnect set after the client left fires at once") {
  std::promise<std::shared_ptr<HttpResponder>> gotResponder;
  ServerFixture f([&](HttpRequest, std::shared_ptr<HttpResponder> r) { gotResponder.set_value(r); });
  {
    net::io_context io;
    tcp::socket s(io);
    s.connect({net::ip::address_v4::loopback(), f.server->port()});
    net::write(s, net::buffer(std::string("POST /s HTTP/1.1\r\nContent-Length: 0\r\n\r\n")));
    auto fut = gotResponder.get_future();
    REQUIRE(fut.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
    auto r = fut.get();
    s.close();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the server sees the close
    std::promise<void> disconnected;
    r->onDisconnect([&] { disconnected.set_value(); });
    CHECK(disconnected.get_future().wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  }
}

// ---- Hardening (docs/security.md) ------------------------------------------------------------------

namespace {

// A blocking loopback socket with a receive timeout, for clients that misbehave on purpose.
struct RawSocket {
  explicit RawSocket(uint16_t port, int timeoutMs = 5000) : s(io) {
    s.connect({net::ip::make_address("127.0.0.1"), port});
    timeval tv{timeoutMs / 1000, (timeoutMs % 1000) * 1000};
    ::setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  // Reads until EOF/reset (true) or the receive timeout (false); what came is in `got`.
  bool readUntilClosed(std::string* got = nullptr) {
    char buf[4096];
    for (;;) {
      ssize_t n = ::recv(s.native_handle(), buf, sizeof buf, 0);
      if (n > 0) {
        if (got) got->append(buf, size_t(n));
        continue;
      }
      if (n == 0) return true;
      return errno == ECONNRESET;
    }
  }
  // True when the server has closed it already (no waiting).
  bool closedNow() {
    char b;
    ssize_t n = ::recv(s.native_handle(), &b, 1, MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }
  net::io_context io;
  tcp::socket s;
};

}  // namespace

TEST_CASE("a handler that throws still gets its request answered: a 500 with the OpenAI error shape") {
  ServerFixture f([](HttpRequest req, std::shared_ptr<HttpResponder> r) {
    if (req.path() == "/throw") throw std::runtime_error("type must be boolean, but is string");
    r->sendFull(200, {}, "ok");
  });
  std::string reply = exchange(f.server->port(), "GET /throw HTTP/1.1\r\nHost: a\r\n\r\n");
  CHECK(reply.find("HTTP/1.1 500") == 0);
  CHECK(reply.find("\"type\":\"internal_error\"") != std::string::npos);
  CHECK(reply.find("\"param\":null,\"code\":null") != std::string::npos);
  // The connection is closed after it (exchange returned without a timeout), and the server serves on.
  CHECK(exchange(f.server->port(), "GET / HTTP/1.1\r\nConnection: close\r\n\r\n").find("HTTP/1.1 200 OK") == 0);
}

TEST_CASE("a handler that never answers: the server answers 504 at responseTimeoutMs and fires onDisconnect") {
  HttpServerOptions o;
  o.responseTimeoutMs = 300;
  std::promise<void> disconnected;
  std::shared_ptr<HttpResponder> kept;
  ServerFixture f(o, [&](HttpRequest, std::shared_ptr<HttpResponder> r) {
    r->onDisconnect([&] { disconnected.set_value(); });
    kept = r;  // holds it and never answers
  });
  auto t0 = std::chrono::steady_clock::now();
  std::string reply = exchange(f.server->port(), "GET /stuck HTTP/1.1\r\nHost: a\r\n\r\n");
  auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(reply.find("HTTP/1.1 504") == 0);
  CHECK(reply.find("did not answer within 300 ms") != std::string::npos);
  CHECK(waited >= std::chrono::milliseconds(250));
  CHECK(waited < std::chrono::seconds(5));
  CHECK(disconnected.get_future().wait_for(std::chrono::seconds(2)) == std::future_status::ready);
  kept->sendFull(200, {}, "too late");  // ignored, harmless
  kept.reset();                         // a responder holds its connection: drop it while the server's io_context lives
}

TEST_CASE("slowloris: a client that trickles its headers or sends nothing is closed at the header deadline") {
  HttpServerOptions o;
  o.headerTimeoutMs = 400;
  ServerFixture f(o, [](HttpRequest, std::shared_ptr<HttpResponder> r) { r->sendFull(200, {}, "ok"); });
  SECTION("silent") {
    RawSocket c(f.server->port());
    auto t0 = std::chrono::steady_clock::now();
    CHECK(c.readUntilClosed());
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
  }
  SECTION("trickling: a byte every 100 ms never finishes the headers") {
    RawSocket c(f.server->port());
    const std::string head = "GET / HTTP/1.1\r\nHost: a\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    auto t0 = std::chrono::steady_clock::now();
    bool closed = false;
    for (char ch : head) {
      boost::system::error_code ec;
      net::write(c.s, net::buffer(&ch, 1), ec);
      if (ec) {
        closed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!closed) closed = c.readUntilClosed();
    CHECK(closed);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(2000));
  }
  SECTION("a slow body is cut at bodyTimeoutMs") {
    HttpServerOptions ob;
    ob.bodyTimeoutMs = 300;
    ServerFixture fb(ob, [](HttpRequest, std::shared_ptr<HttpResponder> r) { r->sendFull(200, {}, "ok"); });
    RawSocket c(fb.server->port());
    net::write(c.s, net::buffer(std::string("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{")));
    auto t0 = std::chrono::steady_clock::now();
    std::string got;
    CHECK(c.readUntilClosed(&got));
    CHECK(got.empty());
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
  }
}

TEST_CASE("idle keep-alive connections are closed at keepAliveTimeoutMs") {
  HttpServerOptions o;
  o.keepAliveTimeoutMs = 300;
  ServerFixture f(o, [](HttpRequest, std::shared_ptr<HttpResponder> r) { r->sendFull(200, {}, "ok"); });
  RawSocket c(f.server->port());
  net::write(c.s, net::buffer(std::string("GET / HTTP/1.1\r\nHost: a\r\n\r\n")));
  std::string got;
  auto t0 = std::chrono::steady_clock::now();
  CHECK(c.readUntilClosed(&got));
  CHECK(got.find("HTTP/1.1 200 OK") == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
}

TEST_CASE(
    "hundreds of idle sockets against max_connections: the oldest idle ones make room, a fresh client is answered at "
    "once") {
  HttpServerOptions o;
  o.maxConnections = 32;
  o.headerTimeoutMs = 10000;  // far longer than the test: only the cap closes the idle sockets
  ServerFixture f(o, [](HttpRequest, std::shared_ptr<HttpResponder> r) { r->sendFull(200, {}, "ok"); });
  std::vector<std::unique_ptr<RawSocket>> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(std::make_unique<RawSocket>(f.server->port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The oldest 268 were closed to make room, the newest 32 are open.
  int closed = 0;
  for (int i = 0; i < 300; ++i) {
    bool c = idle[i]->closedNow();
    closed += c ? 1 : 0;
    if (i >= 300 - 32) CHECK(!c);
  }
  CHECK(closed == 300 - 32);
  CHECK(f.server->stats().evictedConnections == 300 - 32);
  CHECK(f.server->stats().refusedConnections == 0);
  CHECK(f.server->stats().openConnections <= 32);
  // A fresh client gets in at once (long before any header deadline) and is answered.
  auto t0 = std::chrono::steady_clock::now();
  CHECK(exchange(f.server->port(), "GET / HTTP/1.1\r\nConnection: close\r\n\r\n").find("HTTP/1.1 200 OK") == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
}

TEST_CASE("max_connections all inside requests: a new connection is closed at once, and admitted once they end") {
  HttpServerOptions o;
  o.maxConnections = 4;
  std::mutex mu;
  std::vector<std::shared_ptr<HttpResponder>> held;
  ServerFixture f(o, [&](HttpRequest req, std::shared_ptr<HttpResponder> r) {
    if (req.path() != "/hold") return r->sendFull(200, {}, "ok");
    std::lock_guard<std::mutex> lock(mu);
    held.push_back(r);
  });
  std::vector<std::unique_ptr<RawSocket>> busy;
  for (int i = 0; i < 4; ++i) {
    busy.push_back(std::make_unique<RawSocket>(f.server->port()));
    net::write(busy.back()->s, net::buffer(std::string("GET /hold HTTP/1.1\r\nHost: a\r\n\r\n")));
  }
  for (int i = 0; i < 100; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (held.size() == 4) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  RawSocket extra(f.server->port());
  auto t0 = std::chrono::steady_clock::now();
  CHECK(extra.readUntilClosed());
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  CHECK(f.server->stats().refusedConnections == 1);
  CHECK(f.server->stats().evictedConnections == 0);
  for (auto& s : busy) CHECK(!s->closedNow());  // requests in progress are never the ones closed
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& r : held) r->sendFull(200, {}, "released");
  }
  std::string got;
  busy[0]->s.shutdown(tcp::socket::shutdown_send);
  CHECK(busy[0]->readUntilClosed(&got));
  CHECK(got.find("released") != std::string::npos);
  // Kept-alive but idle now: they make room for a new client.
  CHECK(exchange(f.server->port(), "GET / HTTP/1.1\r\nConnection: close\r\n\r\n").find("HTTP/1.1 200 OK") == 0);
  std::lock_guard<std::mutex> lock(mu);
  held.clear();  // responders hold their connections: drop them while the io_context lives
}

TEST_CASE("HTTP/1.0 clients get a close-delimited stream, never chunked encoding") {
  ServerFixture f([](HttpRequest, std::shared_ptr<HttpResponder> r) {
    std::thread([r] {
      r->startStream(200, {});
      for (int i = 0; i < 3; ++i) r->sendEvent("data: {\"i\":" + std::to_string(i) + "}\n\n");
      r->sendEvent("data: [DONE]\n\n");
      r->endStream();
    }).detach();
  });
  std::string reply = exchange(f.server->port(), "POST /s HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
  CHECK(reply.find("HTTP/1.0 200 OK") == 0);
  CHECK(reply.find("Transfer-Encoding") == std::string::npos);
  CHECK(reply.find("chunked") == std::string::npos);
  // The events follow the headers as they were sent, and the connection closes after [DONE].
  auto body = reply.substr(reply.find("\r\n\r\n") + 4);
  CHECK(body == "data: {\"i\":0}\n\ndata: {\"i\":1}\n\ndata: {\"i\":2}\n\ndata: [DONE]\n\n");
  // HTTP/1.1 still gets chunks.
  std::string chunked =
      exchange(f.server->port(), "POST /s HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
  CHECK(chunked.find("Transfer-Encoding: chunked") != std::string::npos);
}
