// The HTTP request path: bytes from a client go through Beast's request parser with the
// limits http_server.cpp sets (HttpServerOptions' body and header limits), request after
// request as on a keep-alive connection, into an HttpRequest as the server builds it; a
// request for one of the router's JSON endpoints then goes to the RequestParser call the
// router's handler makes. A framing error ends the connection, as the server does.
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <boost/beast/core/buffers_prefix.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include "common/net/http_server.h"
#include "tests/fuzz/fuzz_parser.h"

namespace {

namespace http = boost::beast::http;
using namespace pd;

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

void route(const net::HttpRequest& req) {
  const std::string path = req.path();
  (void)req.header("content-type");
  if (req.method != "POST") return;
  const router::RequestParser& parser = fuzz::tinyRequestParser();
  if (path == "/v1/completions") (void)parser.parseGenerate(req.body, router::Endpoint::kCompletions);
  if (path == "/v1/chat/completions") (void)parser.parseGenerate(req.body, router::Endpoint::kChat);
  if (path == "/tokenize") (void)parser.tokenize(req.body);
  if (path == "/detokenize") (void)parser.detokenize(req.body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const net::HttpServerOptions limits;  // the server's defaults (the router passes its own body limit)
  // A small body limit as well, so the 413 path is reached by small inputs.
  // Byte 0 picks the body limit; the rest is what the client sends.
  if (size < 1) return 0;
  const size_t bodyLimit = (data[0] & 1) ? 64 : limits.maxBodyBytes;
  ++data;
  --size;
  // Beast reads what the socket returned in pieces into a buffer and parses from there (as
  // http::async_read does); here the pieces have a fuzzed size. [pos, pos + avail) is read
  // but not yet parsed.
  const size_t piece = size > 1 ? 1 + data[size - 1] % 97 : 1;
  size_t pos = 0, avail = 0;
  auto readMore = [&] {
    size_t n = std::min(piece, size - pos - avail);
    avail += n;
    return n > 0;
  };
  while (pos < size) {
    std::optional<http::request_parser<http::string_body>> p;
    p.emplace();
    p->body_limit(bodyLimit);
    p->header_limit(static_cast<uint32_t>(limits.maxHeaderBytes));
    boost::beast::error_code ec;
    while (!p->is_done()) {
      if (avail == 0 && !readMore()) {
        p->put_eof(ec);  // the client closed
        break;
      }
      ec = {};
      size_t used = p->put(boost::asio::buffer(data + pos, avail), ec);
      pos += used;
      avail -= used;
      if (ec == http::error::need_more) {
        ec = {};
        if (!readMore() && used == 0) {
          p->put_eof(ec);
          break;
        }
        continue;
      }
      if (ec) return 0;  // 400/413/431, and the server closes the connection
    }
    if (ec || !p->is_done()) return 0;
    auto& msg = p->get();
    net::HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& field : msg) req.headers[lower(std::string(field.name_string()))] = std::string(field.value());
    req.body = std::move(msg.body());
    route(req);
    if (!msg.keep_alive()) return 0;
  }
  return 0;
}
