// The router's HTTP server against a raw socket client on 127.0.0.1.
#include <catch2/catch.hpp>

#include <atomic>
#include <future>
#include <thread>

#include <boost/asio.hpp>

#include "common/net/http_server.h"

using namespace pd::net;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

struct ServerFixture {
  explicit ServerFixture(HttpHandler handler, size_t maxBody = 1024) {
    HttpServerOptions opts;
    opts.port = 0;
    opts.maxBodyBytes = maxBody;
    server = std::make_unique<HttpServer>(io, opts, std::move(handler));
    REQUIRE(server->start().isOk());
    thread = std::thread([this] { io.run(); });
  }
  ~ServerFixture() {
    server->stop();
    work.reset();
    io.stop();
    thread.join();
  }
  net::io_context io;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work{io.get_executor()};
  std::unique_ptr<HttpServer> server;
  std::thread thread;
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

TEST_CASE("a body over the limit is a 413 with an OpenAI error; garbage is a 400") {
  ServerFixture f([](HttpRequest, std::shared_ptr<HttpResponder> r) { r->sendFull(200, {}, "ok"); },
                  /*maxBody=*/16);
  std::string big = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 17\r\n\r\n" +
                    std::string(17, 'x');
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
  std::string reply = exchange(f.server->port(),
                               "POST /s HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
  CHECK(reply.find("HTTP/1.1 200 OK") == 0);
  CHECK(reply.find("Content-Type: text/event-stream") != std::string::npos);
  CHECK(reply.find("Transfer-Encoding: chunked") != std::string::npos);
  CHECK(reply.find("x-pdserve-route: colocated") != std::string::npos);
  auto p0 = reply.find("data: {\"i\":0}"), p1 = reply.find("data: {\"i\":1}"),
       p2 = reply.find("data: {\"i\":2}"), done = reply.find("data: [DONE]");
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
    std::string reply = exchange(f.server->port(), "POST /s HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                                 "data: first", &s);
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
