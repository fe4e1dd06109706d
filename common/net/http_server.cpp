#include "common/net/http_server.h"

#include <openssl/ssl.h>
#include <sys/resource.h>

#include <atomic>
#include <deque>
#include <fstream>
#include <list>
#include <mutex>
#include <optional>
#include <type_traits>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

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
  return "{\"error\":{\"message\":\"" + escaped + "\",\"type\":\"" + type + "\",\"param\":null,\"code\":null}}";
}

class SessionBase;

// Connection accounting shared by the acceptor and its sessions, and the connections that
// are not inside a request (connecting, waiting for or reading one), oldest first: at the
// cap, the acceptor closes the oldest of those to make room. So a flood of idle or
// slowloris sockets cannot lock clients out: a new connection sends its request at once and
// is then no longer a candidate, while the flood's sockets are.
struct Connections {
  std::atomic<size_t> open{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> evicted{0};
  std::mutex mu;
  std::list<std::weak_ptr<SessionBase>> idle;
};

class Responder final : public HttpResponder {
 public:
  explicit Responder(std::shared_ptr<SessionBase> session) : session_(std::move(session)) {}
  void sendFull(int status, HttpHeaders headers, std::string body) override;
  void startStream(int status, HttpHeaders headers) override;
  void sendEvent(std::string bytes) override;
  void endStream() override;
  void onDisconnect(std::function<void()> callback) override;

  // Called by the session on its strand. False when the response had already ended.
  bool notifyDisconnect() {
    std::function<void()> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return false;
      ended_ = true;
      disconnected_ = true;
      cb = std::move(onDisconnect_);
    }
    if (cb) cb();
    return true;
  }

  // Marks the response ended; false when it already was (later calls are ignored).
  bool markEnded() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return false;
    ended_ = true;
    onDisconnect_ = nullptr;
    return true;
  }

 private:
  bool isEnded() {
    std::lock_guard<std::mutex> lock(mu_);
    return ended_;
  }

  std::shared_ptr<SessionBase> session_;
  std::mutex mu_;
  bool ended_ = false;
  bool disconnected_ = false;  // the response ended because the client went away
  std::function<void()> onDisconnect_;
};

// What a Responder needs of its connection, whatever the stream type (plain or TLS).
class SessionBase : public std::enable_shared_from_this<SessionBase> {
 public:
  virtual ~SessionBase() = default;
  virtual net::any_io_executor executor() = 0;
  // From the acceptor, any thread: close this connection unless a request began meanwhile.
  virtual void evict() = 0;
  // Where this session is in Connections::idle; guarded by Connections::mu.
  std::optional<std::list<std::weak_ptr<SessionBase>>::iterator> idleAt;
  // On the strand:
  virtual void writeFull(int status, HttpHeaders headers, std::string body) = 0;
  virtual void writeStreamHeader(int status, HttpHeaders headers) = 0;
  virtual void writeChunk(std::string bytes) = 0;
  virtual void writeLastChunk() = 0;
};

// Throttles a log line that an attacker could otherwise make the server write per connection.
bool logAllowed() {
  static std::atomic<int64_t> last{0};
  const int64_t now =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t prev = last.load();
  return now != prev && last.compare_exchange_strong(prev, now);
}

template <class Stream>
class Session final : public SessionBase {
 public:
  static constexpr bool kTls = !std::is_same_v<Stream, beast::tcp_stream>;

  template <class... StreamArgs>
  Session(const HttpServerOptions& options, HttpHandler handler, std::shared_ptr<Connections> conns,
          StreamArgs&&... streamArgs)
      : stream_(std::forward<StreamArgs>(streamArgs)...),
        options_(options),
        handler_(std::move(handler)),
        conns_(std::move(conns)),
        responseTimer_(stream_.get_executor()) {}

  ~Session() override {
    markBusy();
    release();
  }

  void evict() override {
    net::post(stream_.get_executor(), [self = self()] {
      if (!self->inRequest_) self->close();
    });
  }

  void start() {
    markIdle();
    net::dispatch(stream_.get_executor(), [self = self()] {
      // The first request's header deadline counts from accept (and covers the handshake).
      self->headerDeadline_ = std::chrono::steady_clock::now() + ms(self->options_.headerTimeoutMs);
      if constexpr (kTls) {
        self->lowest().expires_at(self->headerDeadline_);
        self->stream_.async_handshake(net::ssl::stream_base::server, [self](beast::error_code ec) {
          if (ec) {
            if (logAllowed()) {
              PD_LOG(kInfo, "http") << "TLS handshake failed: " << ec.message();
            }
            return self->close();
          }
          self->waitForRequest(/*first=*/true);
        });
      } else {
        self->waitForRequest(/*first=*/true);
      }
    });
  }

  net::any_io_executor executor() override { return stream_.get_executor(); }

  // --- Called on the strand by Responder ---------------------------------------------------
  void writeFull(int status, HttpHeaders headers, std::string body) override {
    responseStarted_ = true;
    responseTimer_.cancel();
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), version_);
    res->set(http::field::server, "pdserve");
    res->set(http::field::content_type, "application/json");
    for (auto& [k, v] : headers) res->set(k, v);
    res->keep_alive(keepAlive_);
    res->body() = std::move(body);
    res->prepare_payload();
    enqueue([this, res](auto done) {
      http::async_write(stream_, *res, [res, done](beast::error_code ec, size_t) { done(ec); });
    });
    endResponse();
  }

  void writeStreamHeader(int status, HttpHeaders headers) override {
    responseStarted_ = true;
    responseTimer_.cancel();
    auto res = std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(status), version_);
    res->set(http::field::server, "pdserve");
    res->set(http::field::content_type, "text/event-stream");
    res->set(http::field::cache_control, "no-cache");
    for (auto& [k, v] : headers) res->set(k, v);
    // HTTP/1.0 has no chunked encoding: the body is close-delimited, so the connection ends
    // with the stream.
    chunked_ = version_ >= 11;
    if (!chunked_) keepAlive_ = false;
    res->keep_alive(keepAlive_);
    res->chunked(chunked_);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    enqueue([this, res, sr](auto done) {
      http::async_write_header(stream_, *sr, [res, sr, done](beast::error_code ec, size_t) { done(ec); });
    });
  }

  void writeChunk(std::string bytes) override {
    if (bytes.empty()) return;  // an empty chunk would end the chunked body
    auto data = std::make_shared<std::string>(std::move(bytes));
    enqueue([this, data](auto done) {
      if (chunked_) {
        net::async_write(stream_, http::make_chunk(net::buffer(*data)),
                         [data, done](beast::error_code ec, size_t) { done(ec); });
      } else {
        net::async_write(stream_, net::buffer(*data), [data, done](beast::error_code ec, size_t) { done(ec); });
      }
    });
  }

  void writeLastChunk() override {
    if (chunked_) {
      enqueue([this](auto done) {
        net::async_write(stream_, http::make_chunk_last(), [done](beast::error_code ec, size_t) { done(ec); });
      });
      endResponse();
      return;
    }
    endResponse();
    if (!writing_) writeNext();  // nothing more to write: close once the queue is empty
  }

 private:
  using Done = std::function<void(beast::error_code)>;
  using WriteOp = std::function<void(Done)>;
  using Clock = std::chrono::steady_clock;

  static std::chrono::milliseconds ms(int64_t v) { return std::chrono::milliseconds(v); }
  std::shared_ptr<Session> self() { return std::static_pointer_cast<Session>(shared_from_this()); }
  beast::tcp_stream& lowest() { return beast::get_lowest_layer(stream_); }

  // Waits for the first byte of the next request: from accept under the header deadline,
  // between requests under the keep-alive timeout. Bytes already buffered (a pipelined
  // request) go straight to the header read.
  void waitForRequest(bool first) {
    inRequest_ = false;
    markIdle();
    if (buffer_.size() > 0) return readHeader(first);
    if (first)
      lowest().expires_at(headerDeadline_);
    else
      lowest().expires_after(ms(options_.keepAliveTimeoutMs));
    stream_.async_read_some(buffer_.prepare(4096), [self = self(), first](beast::error_code ec, size_t n) {
      if (ec) return self->close();  // timeout, EOF, reset: nothing to answer
      self->buffer_.commit(n);
      self->readHeader(first);
    });
  }

  void readHeader(bool first) {
    if (!first) headerDeadline_ = Clock::now() + ms(options_.headerTimeoutMs);
    parser_.emplace();
    parser_->body_limit(options_.maxBodyBytes);
    parser_->header_limit(static_cast<uint32_t>(options_.maxHeaderBytes));
    lowest().expires_at(headerDeadline_);
    http::async_read_header(stream_, buffer_, *parser_, [self = self()](beast::error_code ec, size_t) {
      if (ec) return self->onReadError(ec);
      if (self->parser_->is_done()) return self->onRequest();
      self->lowest().expires_after(ms(self->options_.bodyTimeoutMs));
      http::async_read(self->stream_, self->buffer_, *self->parser_, [self](beast::error_code ec2, size_t) {
        if (ec2) return self->onReadError(ec2);
        self->onRequest();
      });
    });
  }

  void onReadError(beast::error_code ec) {
    lowest().expires_never();
    inRequest_ = true;
    markBusy();
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset ||
        ec == net::ssl::error::stream_truncated) {
      if (ec == beast::error::timeout && logAllowed()) {
        PD_LOG(kInfo, "http") << "closing a connection that did not send its request in time";
      }
      return close();
    }
    // The request cannot be framed: answer once and close, since the rest of the byte
    // stream cannot be trusted.
    keepAlive_ = false;
    version_ = 11;
    int status = ec == http::error::body_limit ? 413 : ec == http::error::header_limit ? 431 : 400;
    std::string message =
        status == 413   ? "request body exceeds the limit of " + std::to_string(options_.maxBodyBytes) + " bytes"
        : status == 431 ? "request headers exceed the limit of " + std::to_string(options_.maxHeaderBytes) + " bytes"
                        : "malformed HTTP request: " + ec.message();
    if (logAllowed()) {
      PD_LOG(kInfo, "http") << "rejecting request: " << message;
    }
    writeFull(status, {}, errorBody(message, "invalid_request_error"));
  }

  void onRequest() {
    lowest().expires_never();
    inRequest_ = true;
    markBusy();
    auto& msg = parser_->get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& field : msg) req.headers[lower(std::string(field.name_string()))] = std::string(field.value());
    req.body = std::move(msg.body());
    beast::error_code addrEc;
    auto ep = lowest().socket().remote_endpoint(addrEc);
    if (!addrEc) req.remoteAddress = ep.address().to_string() + ":" + std::to_string(ep.port());
    keepAlive_ = msg.keep_alive();
    version_ = msg.version();
    responseEnded_ = false;
    responseStarted_ = false;
    chunked_ = true;

    responder_ = std::make_shared<Responder>(shared_from_this());
    auto responder = responder_;
    watchForDisconnect();
    armResponseTimer();
    // The handler should not throw (docs/design.md §9); when it does, the request still gets an
    // answer and the connection is not left waiting for one (docs/security.md).
    std::string failure;
    try {
      handler_(std::move(req), responder);
    } catch (const std::exception& e) {
      failure = e.what();
    } catch (...) {
      failure = "an exception that is not a std::exception";
    }
    if (!failure.empty()) {
      PD_LOG(kError, "http") << "handler threw: " << failure.substr(0, 200);
      if (responder->markEnded()) {
        keepAlive_ = false;
        writeFull(500, {}, errorBody("internal error while handling the request", "internal_error"));
      }
    }
  }

  void armResponseTimer() {
    if (options_.responseTimeoutMs <= 0) return;
    responseTimer_.expires_after(ms(options_.responseTimeoutMs));
    responseTimer_.async_wait([self = self()](beast::error_code ec) {
      if (ec || self->responseStarted_ || self->closed_ || !self->responder_) return;
      // The handler's own callbacks learn that the request is over (onDisconnect), and the
      // client learns why.
      auto r = self->responder_;
      if (!r->notifyDisconnect()) return;  // a response is already on its way to the strand
      PD_LOG(kWarn, "http") << "no response within " << self->options_.responseTimeoutMs << " ms: answering 504";
      self->keepAlive_ = false;
      self->writeFull(
          504, {},
          errorBody("the server did not answer within " + std::to_string(self->options_.responseTimeoutMs) + " ms",
                    "timeout"));
    });
  }

  // While a response is pending the client should send nothing; a read that completes
  // with an error means it went away. Bytes it does send (a pipelined request) are kept.
  void watchForDisconnect() {
    watching_ = true;
    auto scratch = buffer_.prepare(4096);
    stream_.async_read_some(scratch, [self = self()](beast::error_code ec, size_t n) {
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

  // A queued op holds no reference to the session: it runs inside writeNext(), on a live
  // session, and the `done` it is given keeps the session alive until its write completes.
  // A `self` in the queue was a cycle (session -> queue -> op -> session) that leaked the
  // session when the process stopped with writes queued (LeakSanitizer, router mid-stream).
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
        lowest().socket().cancel(ignored);
      } else if (responseEnded_) {
        afterResponse();
      }
      return;
    }
    writing_ = true;
    WriteOp op = std::move(queue_.front());
    queue_.pop_front();
    op([self = self()](beast::error_code ec) {
      if (ec) return self->clientGone();
      self->writeNext();
    });
  }

  void endResponse() {
    responseEnded_ = true;
    responseTimer_.cancel();
    responder_.reset();
  }

  void afterResponse() {
    if (closed_ || writing_ || !responseEnded_) return;
    if (!keepAlive_) return close(/*graceful=*/true);
    waitForRequest(/*first=*/false);
  }

  // `graceful`: after a complete response, with nothing pending on the stream. Every other
  // close (errors, deadlines, eviction, a client gone) may have a read or write pending, and
  // a TLS close_notify must not overlap it, so those just close the socket.
  void close(bool graceful = false) {
    if (closed_) return;
    closed_ = true;
    queue_.clear();
    responseTimer_.cancel();
    markBusy();
    release();
    if constexpr (kTls) {
      if (!graceful || watching_ || writing_) {
        beast::error_code ignored;
        lowest().socket().close(ignored);
        return;
      }
      // close_notify, so that a close-delimited body is not mistaken for a truncated one;
      // bounded, since the peer need not answer.
      lowest().expires_after(std::chrono::seconds(2));
      stream_.async_shutdown([self = self()](beast::error_code) {
        beast::error_code ignored;
        self->lowest().socket().close(ignored);
      });
    } else {
      beast::error_code ignored;
      lowest().socket().shutdown(tcp::socket::shutdown_both, ignored);
      lowest().socket().close(ignored);
    }
  }

  // Gives the connection's slot back (once).
  void release() {
    if (counted_) {
      counted_ = false;
      conns_->open.fetch_sub(1);
    }
  }

  void markIdle() {
    std::lock_guard<std::mutex> lock(conns_->mu);
    if (!idleAt && !closed_) idleAt = conns_->idle.insert(conns_->idle.end(), weak_from_this());
  }
  void markBusy() {
    std::lock_guard<std::mutex> lock(conns_->mu);
    if (idleAt) {
      conns_->idle.erase(*idleAt);
      idleAt.reset();
    }
  }

  Stream stream_;
  const HttpServerOptions options_;
  HttpHandler handler_;
  std::shared_ptr<Connections> conns_;
  net::steady_timer responseTimer_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<Responder> responder_;
  std::deque<WriteOp> queue_;
  Clock::time_point headerDeadline_{};
  bool counted_ = true;
  bool inRequest_ = false;  // from a request's arrival to the end of its response
  bool writing_ = false;
  bool watching_ = false;
  bool responseEnded_ = true;
  bool responseStarted_ = false;
  bool chunked_ = true;
  bool keepAlive_ = true;
  bool closed_ = false;
  unsigned version_ = 11;
};

void Responder::sendFull(int status, HttpHeaders headers, std::string body) {
  if (!markEnded()) return;
  net::post(session_->executor(), [s = session_, status, h = std::move(headers), b = std::move(body)]() mutable {
    s->writeFull(status, std::move(h), std::move(b));
  });
}

void Responder::startStream(int status, HttpHeaders headers) {
  if (isEnded()) return;
  net::post(session_->executor(),
            [s = session_, status, h = std::move(headers)]() mutable { s->writeStreamHeader(status, std::move(h)); });
}

void Responder::sendEvent(std::string bytes) {
  if (isEnded()) return;
  net::post(session_->executor(), [s = session_, b = std::move(bytes)]() mutable { s->writeChunk(std::move(b)); });
}

void Responder::endStream() {
  if (!markEnded()) return;
  net::post(session_->executor(), [s = session_] { s->writeLastChunk(); });
}

void Responder::onDisconnect(std::function<void()> callback) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ended_) {
      onDisconnect_ = std::move(callback);
      return;
    }
    if (!disconnected_) return;  // the response ended: there is nothing to tell
  }
  // The client left before the handler asked to hear of it (the router registers once the
  // request is admitted and routed): tell it now, on an I/O thread as for a later disconnect.
  net::post(session_->executor(), std::move(callback));
}

}  // namespace

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  Impl(net::io_context& io, HttpServerOptions options, HttpHandler handler)
      : io(io), options(std::move(options)), handler(std::move(handler)), acceptor(io), retry(io) {}

  void accept() {
    acceptor.async_accept(net::make_strand(io), [self = shared_from_this()](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !self->acceptor.is_open()) return;
      if (ec) {
        // Out of descriptors (EMFILE) and the like: retrying at once would spin an I/O thread
        // on the same error (20,000 idle connections); back off a little.
        if (logAllowed()) {
          PD_LOG(kWarn, "http") << "accept failed: " << ec.message() << "; retrying in 100 ms";
        }
        self->retry.expires_after(std::chrono::milliseconds(100));
        self->retry.async_wait([self](beast::error_code) { self->accept(); });
        return;
      }
      auto& conns = *self->conns;
      if (conns.open.load() >= self->options.maxConnections) {
        // At the cap: make room by closing the oldest connection that is not inside a
        // request; when every one is, refuse this one.
        std::shared_ptr<SessionBase> victim;
        {
          std::lock_guard<std::mutex> lock(conns.mu);
          while (!victim && !conns.idle.empty()) {
            victim = conns.idle.front().lock();
            if (victim) victim->idleAt.reset();
            conns.idle.pop_front();
          }
        }
        if (victim) {
          conns.evicted.fetch_add(1);
          victim->evict();
          if (logAllowed()) {
            PD_LOG(kWarn, "http") << self->options.maxConnections
                                  << " connections are open (router.max_connections): closing the oldest idle one";
          }
        } else {
          conns.refused.fetch_add(1);
          if (logAllowed()) {
            PD_LOG(kWarn, "http") << "refusing a connection: " << self->options.maxConnections
                                  << " are open and busy (router.max_connections)";
          }
          beast::error_code ignored;
          socket.close(ignored);
          return self->accept();
        }
      }
      conns.open.fetch_add(1);
      socket.set_option(tcp::no_delay(true), ec);
      if (self->tls) {
        std::make_shared<Session<beast::ssl_stream<beast::tcp_stream>>>(self->options, self->handler, self->conns,
                                                                        std::move(socket), *self->tls)
            ->start();
      } else {
        std::make_shared<Session<beast::tcp_stream>>(self->options, self->handler, self->conns, std::move(socket))
            ->start();
      }
      self->accept();
    });
  }

  Status loadTls() {
    const auto& o = options;
    if (o.tlsCertFile.empty() != o.tlsKeyFile.empty()) {
      return invalidArgument("http: TLS needs both a certificate and a private key file");
    }
    if (o.tlsCertFile.empty()) return Status::ok();
    auto ctx = std::make_shared<net::ssl::context>(net::ssl::context::tls_server);
    ctx->set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                     net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 | net::ssl::context::no_tlsv1_1 |
                     net::ssl::context::single_dh_use);
    // TLS 1.2 is the floor (RFC 8996 deprecates 1.0 and 1.1).
    if (SSL_CTX_set_min_proto_version(ctx->native_handle(), TLS1_2_VERSION) != 1) {
      return internalError("http: cannot set the minimum TLS version");
    }
    // OpenSSL's own message for a missing file is a bare "asio.ssl error": say it plainly.
    for (const auto& [what, path] : {std::pair{"certificate", o.tlsCertFile}, std::pair{"private key", o.tlsKeyFile}}) {
      if (!std::ifstream(path))
        return invalidArgument(std::string("TLS ") + what + " file '" + path + "' cannot be read");
    }
    beast::error_code ec;
    ctx->use_certificate_chain_file(o.tlsCertFile, ec);
    if (ec) return invalidArgument("TLS certificate file '" + o.tlsCertFile + "': " + ec.message());
    ctx->use_private_key_file(o.tlsKeyFile, net::ssl::context::pem, ec);
    if (ec) return invalidArgument("TLS private key file '" + o.tlsKeyFile + "': " + ec.message());
    if (SSL_CTX_check_private_key(ctx->native_handle()) != 1) {
      return invalidArgument("TLS private key file '" + o.tlsKeyFile + "' does not match the certificate in '" +
                             o.tlsCertFile + "'");
    }
    tls = std::move(ctx);
    return Status::ok();
  }

  net::io_context& io;
  HttpServerOptions options;
  HttpHandler handler;
  tcp::acceptor acceptor;
  net::steady_timer retry;
  std::shared_ptr<Connections> conns = std::make_shared<Connections>();
  std::shared_ptr<net::ssl::context> tls;
};

HttpServer::HttpServer(net::io_context& io, HttpServerOptions options, HttpHandler handler)
    : impl_(std::make_shared<Impl>(io, std::move(options), std::move(handler))) {}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::start() {
  const std::string where = impl_->options.host + ":" + std::to_string(impl_->options.port);
  PD_RETURN_IF_ERROR(impl_->loadTls());
  // Each connection is a descriptor: make room for maxConnections if the hard limit allows,
  // and say so when it does not (accept then fails with EMFILE before the cap is reached).
  rlimit lim{};
  const rlim_t want = static_cast<rlim_t>(impl_->options.maxConnections) + 256;
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < want) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? want : std::min(want, lim.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &raised);
    if (raised.rlim_cur < want) {
      PD_LOG(kWarn, "http") << where << ": the descriptor limit (" << raised.rlim_cur << ") is below "
                            << impl_->options.maxConnections << " connections + 256";
    }
  }
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
    impl->retry.cancel();
  });
}

uint16_t HttpServer::port() const {
  beast::error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

HttpServerStats HttpServer::stats() const {
  return HttpServerStats{impl_->conns->open.load(), impl_->conns->refused.load(), impl_->conns->evicted.load()};
}

}  // namespace pd::net
