#include "common/net/http_server.h"

#include <deque>
#include <mutex>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "common/base/log.h"

namespace pd::net {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

std::string HttpRequest::path() const {
  auto q = target.find('?');
  return q == std::string::npos ? target : target.substr(0, q);
}

std::string HttpRequest::header(const std::string& name) const {
  auto it = headers.find(name);
  return it == headers.end() ? std::string() : it->second;
}

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string errorBody(const std::string& message, const std::string& type) {
  // The OpenAI error shape, all four keys; written by hand to keep JSON out of this file.
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    escaped += c;
  }
  return "{\"error\":{\"message\":\"" + escaped + "\",\"type\":\"" + type +
         "\",\"param\":null,\"code\":null}}";
}

class Session;

class Responder final : public HttpResponder {
 public:
  explicit Responder(std::shared_ptr<Session> session) : session_(std::move(session)) {}
  void sendFull(int status, HttpHeaders headers, std::string body) override;
  void startStream(int status, HttpHeaders headers) override;
  void sendEvent(std::string bytes) override;
  void endStream() override;
  void onDisconnect(std::function<void()> callback) override;

  // Called by the session on its strand.
  void notifyDisconnect() {
    std::function<void()> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return;
      ended_ = true;
      cb = std::move(onDisconnect_);
    }
    if (cb) cb();
  }

 private:
  // Marks the response ended; false when it already was (later calls are ignored).
  bool markEnded() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return false;
    ended_ = true;
    onDisconnect_ = nullptr;
    return true;
  }
  bool isEnded() {
    std::lock_guard<std::mutex> lock(mu_);
    return ended_;
  }

  std::shared_ptr<Session> session_;
  std::mutex mu_;
  bool ended_ = false;
  std::function<void()> onDisconnect_;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServerOptions options, HttpHandler handler)
      : stream_(std::move(socket)), options_(std::move(options)), handler_(std::move(handler)) {}

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->readRequest(); });
  }

  net::any_io_executor executor() { return stream_.get_executor(); }

  // --- Called on the strand by Responder ---------------------------------------------------
  void writeFull(int status, HttpHeaders headers, std::string body) {
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(status), version_);
    res->set(http::field::server, "pdserve");
    res->set(http::field::content_type, "application/json");
    for (auto& [k, v] : headers) res->set(k, v);
    res->keep_alive(keepAlive_);
    res->body() = std::move(body);
    res->prepare_payload();
    enqueue([self = shared_from_this(), res](auto done) {
      http::async_write(self->stream_, *res, [res, done](beast::error_code ec, size_t) { done(ec); });
    });
    endResponse();
  }

  void writeStreamHeader(int status, HttpHeaders headers) {
    auto res = std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(status),
                                                                  version_);
    res->set(http::field::server, "pdserve");
    res->set(http::field::content_type, "text/event-stream");
    res->set(http::field::cache_control, "no-cache");
    for (auto& [k, v] : headers) res->set(k, v);
    res->keep_alive(keepAlive_);
    res->chunked(true);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    enqueue([self = shared_from_this(), res, sr](auto done) {
      http::async_write_header(self->stream_, *sr,
                               [res, sr, done](beast::error_code ec, size_t) { done(ec); });
    });
  }

  void writeChunk(std::string bytes) {
    if (bytes.empty()) return;  // an empty chunk would end the chunked body
    auto data = std::make_shared<std::string>(std::move(bytes));
    enqueue([self = shared_from_this(), data](auto done) {
      net::async_write(self->stream_, http::make_chunk(net::buffer(*data)),
                       [data, done](beast::error_code ec, size_t) { done(ec); });
    });
  }

  void writeLastChunk() {
    enqueue([self = shared_from_this()](auto done) {
      net::async_write(self->stream_, http::make_chunk_last(),
                       [done](beast::error_code ec, size_t) { done(ec); });
    });
    endResponse();
  }

 private:
  using Done = std::function<void(beast::error_code)>;
  using WriteOp = std::function<void(Done)>;

  void readRequest() {
    parser_.emplace();
    parser_->body_limit(options_.maxBodyBytes);
    parser_->header_limit(static_cast<uint32_t>(options_.maxHeaderBytes));
    stream_.expires_after(std::chrono::seconds(options_.idleTimeoutSeconds));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->onRead(ec); });
  }

  void onRead(beast::error_code ec) {
    stream_.expires_never();
    if (ec == http::error::end_of_stream || ec == net::error::eof ||
        ec == beast::error::timeout || ec == net::error::operation_aborted ||
        ec == net::error::connection_reset) {
      return close();
    }
    if (ec) {
      // The request cannot be framed: answer once and close, since the rest of the byte
      // stream cannot be trusted.
      keepAlive_ = false;
      version_ = 11;
      int status = ec == http::error::body_limit ? 413 : ec == http::error::header_limit ? 431 : 400;
      std::string message =
          status == 413 ? "request body exceeds the limit of " +
                              std::to_string(options_.maxBodyBytes) + " bytes"
          : status == 431 ? "request headers exceed the limit of " +
                                std::to_string(options_.maxHeaderBytes) + " bytes"
                          : "malformed HTTP request: " + ec.message();
      PD_LOG(kInfo, "http") << "rejecting request: " << message;
      writeFull(status, {}, errorBody(message, "invalid_request_error"));
      return;
    }
    auto& msg = parser_->get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& field : msg) req.headers[lower(std::string(field.name_string()))] = std::string(field.value());
    req.body = std::move(msg.body());
    beast::error_code addrEc;
    auto ep = stream_.socket().remote_endpoint(addrEc);
    if (!addrEc) req.remoteAddress = ep.address().to_string() + ":" + std::to_string(ep.port());
    keepAlive_ = msg.keep_alive();
    version_ = msg.version();
    responseEnded_ = false;

    responder_ = std::make_shared<Responder>(shared_from_this());
    watchForDisconnect();
    handler_(std::move(req), responder_);
  }

  // While a response is pending the client should send nothing; a read that completes
  // with an error means it went away. Bytes it does send (a pipelined request) are kept.
  void watchForDisconnect() {
    watching_ = true;
    auto scratch = buffer_.prepare(4096);
    stream_.socket().async_read_some(
        scratch, [self = shared_from_this()](beast::error_code ec, size_t n) {
          self->watching_ = false;
          if (!ec) {
            self->buffer_.commit(n);
            if (!self->responseEnded_) return self->watchForDisconnect();
          } else if (ec != net::error::operation_aborted) {
            self->clientGone();
            return;
          }
          self->afterResponse();
        });
  }

  void clientGone() {
    if (responder_) responder_->notifyDisconnect();
    responder_.reset();
    close();
  }

  void enqueue(WriteOp op) {
    if (closed_) return;
    queue_.push_back(std::move(op));
    if (!writing_) writeNext();
  }

  void writeNext() {
    if (queue_.empty()) {
      writing_ = false;
      if (responseEnded_ && watching_) {
        // Stop the disconnect watch; its handler continues with afterResponse().
        beast::error_code ignored;
        stream_.socket().cancel(ignored);
      } else if (responseEnded_) {
        afterResponse();
      }
      return;
    }
    writing_ = true;
    WriteOp op = std::move(queue_.front());
    queue_.pop_front();
    op([self = shared_from_this()](beast::error_code ec) {
      if (ec) return self->clientGone();
      self->writeNext();
    });
  }

  void endResponse() {
    responseEnded_ = true;
    responder_.reset();
  }

  void afterResponse() {
    if (closed_ || writing_ || !responseEnded_) return;
    if (!keepAlive_) return close();
    readRequest();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    queue_.clear();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  const HttpServerOptions options_;
  HttpHandler handler_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<Responder> responder_;
  std::deque<WriteOp> queue_;
  bool writing_ = false;
  bool watching_ = false;
  bool responseEnded_ = true;
  bool keepAlive_ = true;
  bool closed_ = false;
  unsigned version_ = 11;
};

void Responder::sendFull(int status, HttpHeaders headers, std::string body) {
  if (!markEnded()) return;
  net::post(session_->executor(), [s = session_, status, h = std::move(headers),
                                   b = std::move(body)]() mutable {
    s->writeFull(status, std::move(h), std::move(b));
  });
}

void Responder::startStream(int status, HttpHeaders headers) {
  if (isEnded()) return;
  net::post(session_->executor(), [s = session_, status, h = std::move(headers)]() mutable {
    s->writeStreamHeader(status, std::move(h));
  });
}

void Responder::sendEvent(std::string bytes) {
  if (isEnded()) return;
  net::post(session_->executor(),
            [s = session_, b = std::move(bytes)]() mutable { s->writeChunk(std::move(b)); });
}

void Responder::endStream() {
  if (!markEnded()) return;
  net::post(session_->executor(), [s = session_] { s->writeLastChunk(); });
}

void Responder::onDisconnect(std::function<void()> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ended_) onDisconnect_ = std::move(callback);
}

}  // namespace

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  Impl(net::io_context& io, HttpServerOptions options, HttpHandler handler)
      : io(io), options(std::move(options)), handler(std::move(handler)), acceptor(io) {}

  void accept() {
    acceptor.async_accept(net::make_strand(io), [self = shared_from_this()](beast::error_code ec,
                                                                            tcp::socket socket) {
      if (ec == net::error::operation_aborted || !self->acceptor.is_open()) return;
      if (!ec) {
        socket.set_option(tcp::no_delay(true), ec);
        std::make_shared<Session>(std::move(socket), self->options, self->handler)->start();
      }
      self->accept();
    });
  }

  net::io_context& io;
  HttpServerOptions options;
  HttpHandler handler;
  tcp::acceptor acceptor;
};

HttpServer::HttpServer(net::io_context& io, HttpServerOptions options, HttpHandler handler)
    : impl_(std::make_shared<Impl>(io, std::move(options), std::move(handler))) {}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::start() {
  const std::string where = impl_->options.host + ":" + std::to_string(impl_->options.port);
  beast::error_code ec;
  auto address = net::ip::make_address(impl_->options.host, ec);
  if (ec) return invalidArgument("http: '" + impl_->options.host + "' is not an IP address");
  tcp::endpoint ep(address, impl_->options.port);
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  if (!ec) a.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return unavailable("http: " + where + ": " + ec.message());
  impl_->accept();
  return Status::ok();
}

void HttpServer::stop() {
  net::post(impl_->acceptor.get_executor(), [impl = impl_] {
    beast::error_code ignored;
    impl->acceptor.close(ignored);
  });
}

uint16_t HttpServer::port() const {
  beast::error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

}  // namespace pd::net
