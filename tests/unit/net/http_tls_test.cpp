// TLS on the HTTP server (docs/security.md): certificates made per run with the openssl CLI in a
// temporary directory (no key is ever committed), a verifying Asio/OpenSSL client.
#include <openssl/ssl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>  // before Boost 1.74's Asio, which uses std::exchange without it

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <catch2/catch.hpp>

#include "common/net/http_server.h"
#include "tests/test_skip.h"

using namespace pd::net;
namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

// A CA, a server certificate it signed for 127.0.0.1, and an unrelated second CA.
struct Certs {
  std::string dir;
  Certs() {
    dir = (std::filesystem::temp_directory_path() / ("pd_tls_test." + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/ext.cnf") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string q = " >/dev/null 2>&1";
    auto run = [&](const std::string& cmd) { return std::system(("cd " + dir + " && " + cmd + q).c_str()) == 0; };
    if (std::system("command -v openssl >/dev/null 2>&1") != 0)
      pd::test::skipTest("no openssl CLI (scripts/setup installs it)");
    REQUIRE(run("openssl req -x509" + ec + " -keyout ca.key -out ca.pem -days 1 -subj /CN=pd-test-ca"));
    REQUIRE(run("openssl req" + ec + " -keyout server.key -out server.csr -subj /CN=localhost"));
    REQUIRE(
        run("openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
            "-days 1 -extfile ext.cnf"));
    REQUIRE(run("openssl req -x509" + ec + " -keyout other.key -out other.pem -days 1 -subj /CN=other-ca"));
  }
  ~Certs() { std::filesystem::remove_all(dir); }
};

struct TlsServer {
  explicit TlsServer(const Certs& c) {
    HttpServerOptions o;
    o.port = 0;
    o.headerTimeoutMs = 2000;
    o.tlsCertFile = c.dir + "/server.pem";
    o.tlsKeyFile = c.dir + "/server.key";
    server = std::make_unique<HttpServer>(io, o, [](HttpRequest req, std::shared_ptr<HttpResponder> r) {
      if (req.path() == "/stream") {
        r->startStream(200, {});
        r->sendEvent("data: 1\n\n");
        r->sendEvent("data: [DONE]\n\n");
        return r->endStream();
      }
      r->sendFull(200, {}, "hello over tls " + req.path());
    });
    auto s = server->start();
    INFO(s.toString());
    REQUIRE(s.isOk());
    thread = std::thread([this] { io.run(); });
  }
  ~TlsServer() {
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

// One GET over TLS verifying the server against `caFile`; the error of the first step that
// failed, or "" and the body.
std::string tlsGet(uint16_t port, const std::string& caFile, std::string* body, int maxVersion = 0) {
  net::io_context io;
  ssl::context ctx(ssl::context::tls_client);
  ctx.set_verify_mode(ssl::verify_peer);
  beast::error_code ec;
  ctx.load_verify_file(caFile, ec);
  if (ec) return "load_verify_file: " + ec.message();
  if (maxVersion) SSL_CTX_set_max_proto_version(ctx.native_handle(), maxVersion);
  beast::ssl_stream<beast::tcp_stream> s(io, ctx);
  s.set_verify_callback(ssl::host_name_verification("127.0.0.1"));
  beast::get_lowest_layer(s).expires_after(std::chrono::seconds(5));
  beast::get_lowest_layer(s).connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port), ec);
  if (ec) return "connect: " + ec.message();
  s.handshake(ssl::stream_base::client, ec);
  if (ec) return "handshake: " + ec.message();
  for (int i = 0; i < 2; ++i) {  // two requests on one kept-alive connection
    http::request<http::empty_body> req(http::verb::get, "/v" + std::to_string(i), 11);
    req.set(http::field::host, "127.0.0.1");
    http::write(s, req, ec);
    if (ec) return "write: " + ec.message();
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(s, buf, res, ec);
    if (ec) return "read: " + ec.message();
    if (res.result_int() != 200) return "status " + std::to_string(res.result_int());
    *body += res.body() + ";";
  }
  return "";
}

// An HTTP/1.0 stream over TLS: its body ends with the connection, so the server must end
// it with a close_notify, or the client cannot tell the end from a truncation.
std::string tlsStream10(uint16_t port, const std::string& caFile, std::string* body) {
  net::io_context io;
  ssl::context ctx(ssl::context::tls_client);
  ctx.set_verify_mode(ssl::verify_peer);
  ctx.load_verify_file(caFile);
  beast::ssl_stream<beast::tcp_stream> s(io, ctx);
  beast::error_code ec;
  beast::get_lowest_layer(s).expires_after(std::chrono::seconds(5));
  beast::get_lowest_layer(s).connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port), ec);
  if (!ec) s.handshake(ssl::stream_base::client, ec);
  if (ec) return "connect/handshake: " + ec.message();
  http::request<http::empty_body> req(http::verb::post, "/stream", 10);
  http::write(s, req, ec);
  if (ec) return "write: " + ec.message();
  beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(s, buf, res, ec);
  if (ec) return "read: " + ec.message();
  if (res.chunked()) return "chunked";
  *body = res.body();
  return "";
}

}  // namespace

TEST_CASE("TLS: an HTTP/1.0 stream ends with close_notify, never looking truncated") {
  Certs certs;
  TlsServer srv(certs);
  std::string body;
  CHECK(tlsStream10(srv.server->port(), certs.dir + "/ca.pem", &body) == "");
  CHECK(body == "data: 1\n\ndata: [DONE]\n\n");
}

TEST_CASE("TLS: a verifying client gets answers, while plain HTTP, a wrong CA and TLS 1.1 fail cleanly") {
  Certs certs;
  TlsServer srv(certs);
  const uint16_t port = srv.server->port();

  std::string body;
  CHECK(tlsGet(port, certs.dir + "/ca.pem", &body) == "");
  CHECK(body == "hello over tls /v0;hello over tls /v1;");

  // Plain HTTP to the TLS port: no HTTP answer, the connection is closed (not left open).
  {
    net::io_context io;
    tcp::socket s(io);
    s.connect({net::ip::make_address("127.0.0.1"), port});
    net::write(s, net::buffer(std::string("GET / HTTP/1.1\r\nHost: a\r\n\r\n")));
    std::string got;
    char buf[1024];
    auto t0 = std::chrono::steady_clock::now();
    beast::error_code ec;
    while (!ec && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
      size_t n = s.read_some(net::buffer(buf), ec);
      got.append(buf, n);
    }
    CHECK(ec);  // closed by the server, well before the 5 s
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(4));
    CHECK(got.find("HTTP/") == std::string::npos);
  }

  std::string none;
  std::string wrongCa = tlsGet(port, certs.dir + "/other.pem", &none);
  CHECK(wrongCa.rfind("handshake: ", 0) == 0);
  CHECK(wrongCa.find("certificate verify failed") != std::string::npos);

  std::string old = tlsGet(port, certs.dir + "/ca.pem", &none, TLS1_1_VERSION);
  CHECK(old.rfind("handshake: ", 0) == 0);

  // The server still serves after all of that.
  body.clear();
  CHECK(tlsGet(port, certs.dir + "/ca.pem", &body) == "");
}

TEST_CASE("TLS: a missing, unreadable or mismatched key is refused at start, naming the file") {
  Certs certs;
  net::io_context io;
  auto startWith = [&](const std::string& cert, const std::string& key) {
    HttpServerOptions o;
    o.port = 0;
    o.tlsCertFile = cert;
    o.tlsKeyFile = key;
    HttpServer s(io, o, [](HttpRequest, std::shared_ptr<HttpResponder>) {});
    return s.start();
  };
  auto onlyCert = startWith(certs.dir + "/server.pem", "");
  CHECK(!onlyCert.isOk());
  auto missing = startWith(certs.dir + "/nope.pem", certs.dir + "/server.key");
  CHECK(missing.message() == "TLS certificate file '" + certs.dir + "/nope.pem' cannot be read");
  auto mismatch = startWith(certs.dir + "/server.pem", certs.dir + "/other.key");
  CHECK(!mismatch.isOk());
  CHECK(mismatch.message().find("other.key") != std::string::npos);
}
