// A small HTTP/1.1 server on Boost.Beast for the router and the workers' /health, /metrics:
// full responses and SSE streams, a request-body limit (413), keep-alive, client-disconnect
// detection while streaming, and optional TLS (OpenSSL, TLS 1.2+).
//
// Hardening (docs/security.md): every wait of a connection has a deadline (TLS handshake and headers,
// body, keep-alive idle, the handler's first response byte); the number of open connections
// is capped (at the cap the oldest idle connection makes room, or the new one is closed); a
// handler that throws gets its request answered with a 500 instead of a connection left
// open forever; HTTP/1.0 clients get close-delimited streams, never chunked encoding.
//
// Threads: the server runs on the io_context it is given (the caller runs that context on
// one or more threads). The handler is called on an I/O thread and must not block: it
// answers at once or keeps the HttpResponder and answers later from any thread. Every
// HttpResponder method is thread-safe (it posts onto its connection's strand). A handler
// should not throw; if it does, the server logs it and answers 500.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "common/base/status.h"

namespace pd::net {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string target;                          // path and query, as sent
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  std::string remoteAddress;

  // The path without the query string.
  std::string path() const;
  // A header's value, or "" when absent. `name` is lower-case.
  std::string header(const std::string& name) const;
};

using HttpHeaders = std::map<std::string, std::string>;

class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  // One complete response. Ends the request; later calls are ignored.
  virtual void sendFull(int status, HttpHeaders headers, std::string body) = 0;
  // Starts a chunked text/event-stream response; then sendEvent() any number of times,
  // then endStream().
  virtual void startStream(int status, HttpHeaders headers) = 0;
  virtual void sendEvent(std::string bytes) = 0;
  virtual void endStream() = 0;
  // Called once, on an I/O thread, if the client goes away before the response ended; if it
  // already went away (or the server answered 504 for the handler), it is called at once
  // (posted). Set it before starting to respond: it does not fire once the response ended.
  virtual void onDisconnect(std::function<void()> callback) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<HttpResponder>)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0 picks a free port
  size_t maxBodyBytes = 4 << 20;
  size_t maxHeaderBytes = 64 << 10;
  // From accept (or from the first byte of a later request on a kept-alive connection) to
  // the end of the headers, the TLS handshake included. Past it the connection is closed:
  // a client that trickles its headers (slowloris) or connects and says nothing holds a
  // connection slot this long at most.
  int64_t headerTimeoutMs = 10000;
  int64_t bodyTimeoutMs = 60000;       // end of the headers -> end of the body
  int64_t keepAliveTimeoutMs = 60000;  // idle between two requests of one connection
  // The handler must begin its response (sendFull or startStream) this long after the request
  // was read, or the server answers 504 itself, fires onDisconnect and closes. 0: no limit.
  // Once a stream has started, its pace is the handler's business.
  int64_t responseTimeoutMs = 0;
  // At this many open connections, a new one makes the server close the oldest connection
  // that is not inside a request (idle, or still sending its headers or body); when all are
  // inside one, the new connection is closed as soon as it is accepted.
  size_t maxConnections = 4096;
  // Both set: the port speaks TLS only (PEM files: the certificate chain, the private key).
  std::string tlsCertFile;
  std::string tlsKeyFile;
};

struct HttpServerStats {
  size_t openConnections = 0;
  uint64_t refusedConnections = 0;  // closed at accept: maxConnections open, all in a request
  uint64_t evictedConnections = 0;  // idle ones closed to make room for a new one
};

class HttpServer {
 public:
  HttpServer(boost::asio::io_context& io, HttpServerOptions options, HttpHandler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts accepting. Errors name the address ("127.0.0.1:8000: address in use").
  Status start();
  // Stops accepting; open connections finish their current response.
  void stop();
  uint16_t port() const;
  HttpServerStats stats() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace pd::net
