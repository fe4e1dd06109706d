// A small HTTP/1.1 server on Boost.Beast for the router and the workers' /health, /metrics: full responses and SSE streams,
// a request-body limit (413), keep-alive, and client-disconnect detection while streaming.
//
// Threads: the server runs on the io_context it is given (the caller runs that context on
// one or more threads). The handler is called on an I/O thread and must not block: it
// answers at once or keeps the HttpResponder and answers later from any thread. Every
// HttpResponder method is thread-safe (it posts onto its connection's strand).
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
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query, as sent
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
  // Called once, on an I/O thread, if the client goes away before the response ended.
  // Set it before starting to respond; later it may never fire.
  virtual void onDisconnect(std::function<void()> callback) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<HttpResponder>)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0 picks a free port
  size_t maxBodyBytes = 4 << 20;
  size_t maxHeaderBytes = 64 << 10;
  int idleTimeoutSeconds = 120;  // a connection that sends nothing for this long is closed
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

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace pd::net
