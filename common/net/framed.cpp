// The one translation unit with Asio sockets: FramedConnection, FramedServer, FramedClient.
#include "common/net/framed.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>

#include "common/base/log.h"
#include "common/base/peer_log_limiter.h"
#include "common/net/frame_codec.h"
#include "common/net/handshake_slots.h"

namespace pd::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

const char* bodyName(const proto::Envelope& env) {
  switch (env.body_case()) {
    case proto::Envelope::kHello:
      return "hello";
    case proto::Envelope::kLoadReport:
      return "load_report";
    case proto::Envelope::kGenerate:
      return "generate";
    case proto::Envelope::kTokenChunk:
      return "token_chunk";
    case proto::Envelope::kCancel:
      return "cancel";
    case proto::Envelope::kPrefillRequest:
      return "prefill_request";
    case proto::Envelope::kPrefillDone:
      return "prefill_done";
    case proto::Envelope::kError:
      return "error";
    case proto::Envelope::kKvConnect:
      return "kv_connect";
    case proto::Envelope::kAuth:
      return "auth";
    case proto::Envelope::kHeartbeat:
      return "heartbeat";
    case proto::Envelope::kKvEvents:
      return "kv_events";
    case proto::Envelope::kKvResync:
      return "kv_resync";
    case proto::Envelope::kPrefillProgress:
      return "prefill_progress";
    case proto::Envelope::kPullRequest:
      return "pull_request";
    case proto::Envelope::kPullDone:
      return "pull_done";
    case proto::Envelope::BODY_NOT_SET:
      return "none";
  }
  return "unknown";
}

proto::Error toProtoError(const Status& status) {
  proto::Error e;
  int code = static_cast<int>(status.code());
  // pd.proto.ErrorCode mirrors StatusCode numerically from kInvalidArgument on.
  e.set_code(code >= 2 && code <= 13 ? static_cast<proto::ErrorCode>(code) : proto::ERROR_INTERNAL);
  e.set_message(status.message());
  return e;
}

Status fromProtoError(const proto::Error& error) {
  int code = static_cast<int>(error.code());
  StatusCode sc = code >= 2 && code <= 13 ? static_cast<StatusCode>(code) : StatusCode::kInternal;
  return Status(sc, error.message());
}

namespace {

std::atomic<uint64_t> gNextConnectionId{1};
std::atomic<size_t> gReadBufferBytes{0};

constexpr const char* kAuthTag = "pdserve/framed-auth/v1";

// The read buffer is kept between frames up to this size (no allocation per frame); a larger
// frame's buffer is released after use so one big message does not pin memory.
constexpr size_t kKeepReadBufferBytes = size_t{4} << 20;
constexpr size_t kReadChunkBytes = size_t{64} << 10;

std::string endpointText(const tcp::endpoint& ep) { return ep.address().to_string() + ":" + std::to_string(ep.port()); }

double toMs(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// One frame ready to write: length prefix + payload, built on the sender's thread.
using Frame = std::shared_ptr<const std::string>;

// An envelope without a version gets kProtocolVersion as field 1 written in front of its
// serialized bytes: the same bytes protobuf would write with the field set, without copying
// the caller's message to set it.
static_assert(kProtocolVersion > 0 && kProtocolVersion < 128, "one-byte varint");

Result<Frame> buildFrame(const proto::Envelope& env, size_t maxFrameBytes) {
  const bool addVersion = env.version() == 0;
  const size_t prefix = addVersion ? 2 : 0;
  size_t size = env.ByteSizeLong() + prefix;
  if (size > maxFrameBytes) {
    return resourceExhausted("frame of " + std::to_string(size) + " bytes (" + bodyName(env) + ") exceeds the " +
                             std::to_string(maxFrameBytes) + "-byte limit");
  }
  auto frame = std::make_shared<std::string>(4 + size, '\0');
  auto* p = reinterpret_cast<uint8_t*>(frame->data());
  p[0] = static_cast<uint8_t>(size >> 24);
  p[1] = static_cast<uint8_t>(size >> 16);
  p[2] = static_cast<uint8_t>(size >> 8);
  p[3] = static_cast<uint8_t>(size);
  if (addVersion) {
    p[4] = 0x08;  // field 1, varint
    p[5] = static_cast<uint8_t>(kProtocolVersion);
  }
  if (!env.SerializeToArray(p + 4 + prefix, static_cast<int>(size - prefix))) {
    return invalidArgument(std::string("cannot serialize a ") + bodyName(env) + " envelope");
  }
  return Frame(std::move(frame));
}

class Connection final : public FramedConnection, public std::enable_shared_from_this<Connection> {
 public:
  using ConnectDone = std::function<void(Result<ConnectionPtr>)>;

  // socket's executor is this connection's strand: every completion handler of the socket and
  // the timer runs there, so the state below needs no lock (except the atomics read by
  // other threads).
  Connection(tcp::socket socket, ConnectionOptions options, ConnectionCallbacks callbacks)
      : socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        keepaliveTimer_(socket_.get_executor()),
        firstByteTimer_(socket_.get_executor()),
        options_(std::move(options)),
        callbacks_(std::move(callbacks)),
        id_(gNextConnectionId.fetch_add(1)) {}

  ~Connection() override {
    gReadBufferBytes.fetch_sub(accountedReadBytes_);
    leavePending();
  }

  // Server side, before startAccepted: `host` is the peer's address; `slots` (null: the
  // connection got no handshake slot and is being closed) holds this one's slot until it is
  // established or closed; `limiter` rate-limits the warnings about it until then.
  void setServerSide(std::shared_ptr<HandshakeSlots> slots, std::shared_ptr<PeerLogLimiter> limiter, std::string host) {
    serverSide_ = true;
    slots_ = std::move(slots);
    limiter_ = std::move(limiter);
    host_ = std::move(host);
  }

  // Server side: closes a connection that lost (or never got) its handshake slot.
  void closeOverloaded(Status reason) {
    asio::post(socket_.get_executor(), [self = shared_from_this(), reason = std::move(reason)] {
      // Established meanwhile (its slot was freed either way): a peer that made it is kept.
      if (self->closed_ || self->established_) return;
      self->noteFailure("overload");
      self->warn("closing connection " + std::to_string(self->id_) + " (" + self->remote_ + "): " + reason.toString());
      self->closeNow(reason);
    });
  }

  // Server side: the socket is connected; say hello and wait for the peer's.
  void startAccepted() {
    asio::post(socket_.get_executor(), [self = shared_from_this()] {
      if (self->closed_) return;  // closed before it started (server stopping)
      boost::system::error_code ec;
      auto ep = self->socket_.remote_endpoint(ec);
      self->remote_ = ec ? std::string("?") : endpointText(ep);
      self->beginHandshake(self->options_.handshakeTimeout);
      if (self->options_.firstByteTimeout > Duration::zero() && !self->closed_) self->armFirstByteTimer();
    });
  }

  // Client side: resolve, connect, handshake, all within timeout; done runs once.
  void startConnect(const std::string& host, int port, Duration timeout, ConnectDone done) {
    asio::post(
        socket_.get_executor(), [self = shared_from_this(), host, port, timeout, done = std::move(done)]() mutable {
          if (self->closed_) return;
          self->clientSide_ = true;
          self->connectDone_ = std::move(done);
          self->remote_ = host + ":" + std::to_string(port);
          self->armTimer(timeout, "connect to " + self->remote_);
          boost::system::error_code ec;
          auto addr = asio::ip::make_address(host, ec);
          if (!ec) {
            self->connectTo({tcp::endpoint(addr, static_cast<uint16_t>(port))}, timeout);
            return;
          }
          auto resolver = std::make_shared<tcp::resolver>(self->socket_.get_executor());
          resolver->async_resolve(host, std::to_string(port),
                                  [self, resolver, host, timeout](const boost::system::error_code& rec,
                                                                  tcp::resolver::results_type results) {
                                    if (self->closed_) return;
                                    if (rec) {
                                      self->closeNow(invalidArgument("cannot resolve " + host + ": " + rec.message()));
                                      return;
                                    }
                                    std::vector<tcp::endpoint> eps;
                                    for (const auto& r : results) eps.push_back(r.endpoint());
                                    self->connectTo(std::move(eps), timeout);
                                  });
        });
  }

  Status send(const proto::Envelope& env) override {
    if (!open_.load(std::memory_order_acquire)) {
      return unavailable("connection " + remote_ + " is closed");
    }
    auto frame = buildFrame(env, options_.maxFrameBytes);
    if (!frame.ok()) return frame.status();
    return enqueue(std::move(frame).value());
  }

  void close(Status reason) override {
    asio::post(socket_.get_executor(),
               [self = shared_from_this(), reason = std::move(reason)] { self->closeNow(reason); });
  }

  bool isOpen() const override { return open_.load(std::memory_order_acquire); }
  const proto::Hello& peerHello() const override { return peerHello_; }
  std::string remoteAddress() const override { return remote_; }
  uint64_t id() const override { return id_; }

 private:
  void connectTo(std::vector<tcp::endpoint> eps, Duration timeout) {
    asio::async_connect(
        socket_, eps, [self = shared_from_this(), timeout](const boost::system::error_code& ec, const tcp::endpoint&) {
          if (self->closed_) return;
          if (ec) {
            self->closeNow(unavailable("connect to " + self->remote_ + ": " + ec.message()));
            return;
          }
          // The connect timer keeps running: it bounds the handshake too.
          self->beginHandshake(Duration::zero());
        });
  }

  // Sends our hello and reads the peer's. timeout zero: a timer is already armed.
  void beginHandshake(Duration timeout) {
    tcpConnected_ = true;
    boost::system::error_code ec;
    socket_.set_option(tcp::no_delay(true), ec);  // token streaming: latency over batching
    if (timeout != Duration::zero()) armTimer(timeout, "handshake with " + remote_);
    proto::Envelope hello;
    hello.set_version(kProtocolVersion);
    *hello.mutable_hello() = options_.hello;
    hello.mutable_hello()->set_protocol_version(kProtocolVersion);
    hello.mutable_hello()->set_keepalive_interval_ms(
        uint32_t(std::chrono::duration_cast<std::chrono::milliseconds>(options_.keepaliveInterval).count()));
    if (authenticated()) {
      auto nonce = auth::randomNonce();
      if (!nonce.ok()) {
        fail(nonce.status());
        return;
      }
      hello.mutable_hello()->set_auth_nonce(*nonce);
    }
    ownHello_ = hello.hello();
    if (authenticated()) {
      // Only what the transcript covers goes out before the peer proved itself; the rest of
      // our hello follows in our Auth frame.
      proto::Hello minimal;
      minimal.set_protocol_version(kProtocolVersion);
      minimal.set_role(ownHello_.role());
      minimal.set_worker_id(ownHello_.worker_id());
      minimal.set_auth_nonce(ownHello_.auth_nonce());
      *hello.mutable_hello() = std::move(minimal);
    }
    auto frame = buildFrame(hello, options_.maxFrameBytes);
    if (!frame.ok()) {
      closeNow(frame.status());
      return;
    }
    queuedBytes_.fetch_add(frame.value()->size());
    pushFrame(std::move(frame).value());
    readMore();
  }

  void armTimer(Duration timeout, std::string what) {
    timer_.expires_after(timeout);
    timer_.async_wait(
        [self = shared_from_this(), what = std::move(what), timeout](const boost::system::error_code& ec) {
          if (ec || self->closed_ || self->established_) return;
          std::string ms = std::to_string(static_cast<int64_t>(toMs(timeout)));
          self->fail(deadlineExceeded(what + (self->tcpConnected_ ? ": no hello within " + ms + " ms"
                                                                  : ": not connected within " + ms + " ms")),
                     "timeout");
        });
  }

  // Server side: a peer that says nothing at all is let go long before handshakeTimeout.
  void armFirstByteTimer() {
    firstByteTimer_.expires_after(options_.firstByteTimeout);
    firstByteTimer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->closed_ || self->closing_ || self->heardAny_) return;
      self->fail(deadlineExceeded("no byte from " + self->remote_ + " within " +
                                  std::to_string(int64_t(toMs(self->options_.firstByteTimeout))) + " ms"),
                 "silent");
    });
  }

  Status enqueue(Frame frame) {
    size_t queued = queuedBytes_.fetch_add(frame->size()) + frame->size();
    if (queued > options_.maxQueuedBytes) {
      queuedBytes_.fetch_sub(frame->size());
      return resourceExhausted("send queue to " + remote_ + " holds over " + std::to_string(options_.maxQueuedBytes) +
                               " bytes");
    }
    // Frames gather under a short lock and one posted flush moves them all to the strand:
    // a burst of sends costs one handler, not one each.
    bool schedule = false;
    {
      std::lock_guard<std::mutex> lock(sendMutex_);
      sendPending_.push_back(std::move(frame));
      if (!flushScheduled_) flushScheduled_ = schedule = true;
    }
    if (schedule) {
      asio::post(socket_.get_executor(), [self = shared_from_this()] { self->flushPending(); });
    }
    return Status::ok();
  }

  // On the strand.
  void flushPending() {
    std::vector<Frame> frames;
    {
      std::lock_guard<std::mutex> lock(sendMutex_);
      frames.swap(sendPending_);
      flushScheduled_ = false;
    }
    if (closed_ || closing_) return;
    for (auto& f : frames) queue_.push_back(std::move(f));
    if (!writing_ && !queue_.empty()) writeQueued();
  }

  // On the strand. The frame's bytes are already counted in queuedBytes_.
  void pushFrame(Frame frame) {
    queue_.push_back(std::move(frame));
    if (!writing_) writeQueued();
  }

  // Writes everything queued so far in one gather write; frames queued meanwhile wait for the
  // next one. One write in flight at a time keeps frames whole and in order.
  void writeQueued() {
    writing_ = true;
    writeBatch_.assign(queue_.begin(), queue_.end());
    queue_.clear();
    std::vector<asio::const_buffer> buffers;
    buffers.reserve(writeBatch_.size());
    for (const auto& f : writeBatch_) buffers.emplace_back(f->data(), f->size());
    asio::async_write(socket_, buffers, [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
      self->onWritten(ec, n);
    });
  }

  void onWritten(const boost::system::error_code& ec, size_t) {
    size_t bytes = 0;
    for (const auto& f : writeBatch_) bytes += f->size();
    writeBatch_.clear();
    writing_ = false;
    if (closed_) return;
    queuedBytes_.fetch_sub(bytes);
    if (ec) {
      closeNow(unavailable("write to " + remote_ + " failed: " + ec.message()));
      return;
    }
    if (!queue_.empty()) {
      writeQueued();
    } else if (closing_) {
      closeNow(closingReason_);
    }
  }

  // Reads whatever the socket has into readBuf_ and handles every whole frame in it: a burst
  // of small frames costs one read, not two per frame.
  void readMore() {
    if (readEnd_ == readBuf_.size()) {
      // Room for more of the frame in progress, growing with what arrived (at most doubling
      // what is held), never with what the header announces: a peer that announces 64 MiB and
      // sends 4 bytes costs a chunk, not 64 MiB (docs/security.md).
      size_t want = kReadChunkBytes;
      size_t have = readEnd_ - readBegin_;
      if (have >= 4) want = std::min<size_t>(4 + frameLength(readBegin_) - have, std::max(want, have));
      readBuf_.resize(readEnd_ + want);
      accountReadBuffer();
    }
    socket_.async_read_some(
        asio::buffer(readBuf_.data() + readEnd_, readBuf_.size() - readEnd_),
        [self = shared_from_this()](const boost::system::error_code& ec, size_t n) { self->onRead(ec, n); });
  }

  uint32_t frameLength(size_t at) const {
    return (uint32_t{readBuf_[at]} << 24) | (uint32_t{readBuf_[at + 1]} << 16) | (uint32_t{readBuf_[at + 2]} << 8) |
           uint32_t{readBuf_[at + 3]};
  }

  void onRead(const boost::system::error_code& ec, size_t n) {
    if (closed_ || closing_) return;
    if (ec) {
      readFailed(ec);
      return;
    }
    readEnd_ += n;
    lastHeard_ = std::chrono::steady_clock::now();
    if (!heardAny_ && n > 0) {
      heardAny_ = true;
      firstByteTimer_.cancel();
      if (slots_) slots_->heard(id_, host_);
    }
    while (!closed_ && !closing_) {
      size_t have = readEnd_ - readBegin_;
      if (have < 4) break;
      uint32_t len = frameLength(readBegin_);
      // Until the peer is known (hello, proof), only handshake-sized frames.
      const size_t limit =
          established_ ? options_.maxFrameBytes : std::min(options_.maxFrameBytes, kMaxHandshakeFrameBytes);
      if (Status st = checkFrameLength(len, limit, remote_); !st.isOk()) {
        fail(established_ ? std::move(st) : resourceExhausted(st.message() + " of a handshake frame"), "protocol");
        return;
      }
      if (have < 4 + size_t{len}) break;
      const uint8_t* body = readBuf_.data() + readBegin_ + 4;
      readBegin_ += 4 + size_t{len};
      if (!handleFrame(body, len)) return;
    }
    if (closed_ || closing_) return;
    // Move the partial frame (if any) to the front; drop a big buffer once it is idle.
    size_t have = readEnd_ - readBegin_;
    if (have == 0 && readBuf_.size() > kKeepReadBufferBytes) {
      std::vector<uint8_t>(kReadChunkBytes).swap(readBuf_);
      accountReadBuffer();
    } else if (readBegin_ > 0) {
      std::memmove(readBuf_.data(), readBuf_.data() + readBegin_, have);
    }
    readBegin_ = 0;
    readEnd_ = have;
    readMore();
  }

  // Returns false when the connection is done reading (closed, closing).
  bool handleFrame(const uint8_t* data, uint32_t len) {
    // The decode rules live in frame_codec.h (pure, fuzzed); this is the socket side.
    proto::Envelope env;
    if (Status st = decodeEnvelope(data, len, established_, remote_, &env); !st.isOk()) {
      fail(std::move(st));
      return false;
    }
    if (!established_) return handshake(env);
    if (env.has_heartbeat()) return true;  // heard (onRead noted when); nothing for the owner
    if (callbacks_.onMessage) callbacks_.onMessage(shared_from_this(), std::move(env));
    return true;
  }

  bool authenticated() const { return options_.clusterSecret && !options_.clusterSecret->empty(); }
  bool isClient() const { return clientSide_; }

  bool handshake(const proto::Envelope& env) {
    if (gotHello_) return verifyPeerProof(env);
    if (env.has_error() && isClient()) {
      // The server refused us before its hello was even answered (version, overload).
      Status why = fromProtoError(env.error());
      PD_LOG(kWarn, "net") << "connection " << id_ << " (" << remote_ << ") refused by the peer: " << why.toString();
      closeNow(why);
      return false;
    }
    if (Status st = checkHello(env, remote_); !st.isOk()) {
      reject(std::move(st));
      return false;
    }
    peerHello_ = env.hello();
    gotHello_ = true;
    const std::string& peerNonce = peerHello_.auth_nonce();
    if (!authenticated()) {
      if (!peerNonce.empty()) {
        return authFailed("peer " + remote_ + " (" + peerHello_.worker_id() +
                          ") requires cluster authentication and this side has no cluster.secret_file");
      }
      return establish();
    }
    if (peerNonce.empty()) {
      return authFailed("peer " + remote_ + " (" + peerHello_.worker_id() +
                        ") sent no cluster credential (no cluster.secret_file on its side?)");
    }
    if (peerNonce.size() != auth::kNonceBytes) {
      return authFailed("peer " + remote_ + " sent a " + std::to_string(peerNonce.size()) + "-byte nonce");
    }
    if (isClient()) sendProof();  // the server proves itself only to a client that proved first
    return true;
  }

  // Transcript order is always (client, server), whichever side computes it.
  std::string proofFor(bool fromClient) const {
    const proto::Hello& client = isClient() ? ownHello_ : peerHello_;
    const proto::Hello& server = isClient() ? peerHello_ : ownHello_;
    return handshakeProof(*options_.clusterSecret, fromClient, client, server);
  }

  void sendProof() {
    proto::Envelope env;
    env.set_version(kProtocolVersion);
    env.mutable_auth()->set_proof(proofFor(isClient()));
    *env.mutable_auth()->mutable_hello() = ownHello_;
    auto frame = buildFrame(env, options_.maxFrameBytes);
    if (!frame.ok()) return fail(frame.status());
    queuedBytes_.fetch_add(frame.value()->size());
    pushFrame(std::move(frame).value());
  }

  bool verifyPeerProof(const proto::Envelope& env) {
    if (env.has_error()) {
      // Our proof was refused (or the peer has no secret): the peer's Error says why.
      Status why = fromProtoError(env.error());
      PD_LOG(kWarn, "net") << "connection " << id_ << " (" << remote_ << ", " << options_.plane
                           << ") refused by the peer during authentication: " << why.toString();
      if (options_.onAuthFailure) options_.onAuthFailure(options_.plane, why);
      noteFailure("auth");
      closeNow(why);
      return false;
    }
    if (!env.has_auth()) {
      return authFailed("peer " + remote_ + " (" + peerHello_.worker_id() + ") sent " + bodyName(env) +
                        " before proving it holds the cluster secret");
    }
    const std::string want = proofFor(!isClient());
    if (want.empty() || !auth::constantTimeEqual(want, env.auth().proof())) {
      return authFailed("peer " + remote_ + " (" + peerHello_.worker_id() +
                        ") sent a wrong proof (another cluster secret, or a proof replayed from "
                        "another connection)");
    }
    if (env.auth().has_hello()) {
      // The peer's full hello; what the proof covered must not change.
      const proto::Hello& full = env.auth().hello();
      if (full.role() != peerHello_.role() || full.worker_id() != peerHello_.worker_id() ||
          full.auth_nonce() != peerHello_.auth_nonce()) {
        return authFailed("peer " + remote_ + " (" + peerHello_.worker_id() +
                          ") changed its role, id or nonce after its proof");
      }
      peerHello_ = full;
    }
    if (!isClient()) sendProof();
    return establish();
  }

  // Refuses the peer: it reads only "authentication failed"; the log has why.
  bool authFailed(const std::string& why) {
    Status reason = failedPrecondition("authentication failed: " + why);
    warn("authentication failed on " + options_.plane + " connection " + std::to_string(id_) + " from " + remote_ +
         ": " + why);
    if (options_.onAuthFailure) options_.onAuthFailure(options_.plane, reason);
    noteFailure("auth");
    rejectWith(failedPrecondition("authentication failed"), reason);
    return false;
  }

  bool establish() {
    established_ = true;
    leavePending();
    open_.store(true, std::memory_order_release);
    timer_.cancel();
    startKeepalive();
    if (connectDone_) {
      auto done = std::move(connectDone_);
      connectDone_ = nullptr;
      done(ConnectionPtr(shared_from_this()));
    }
    if (callbacks_.onOpen) callbacks_.onOpen(shared_from_this());
    return true;
  }

  // Keepalive (framed.h): heartbeats go out every keepaliveInterval and the lease is checked
  // on the same ticks (or every quarter lease when this side sends none).
  void startKeepalive() {
    const Duration peerInterval = std::chrono::milliseconds(peerHello_.keepalive_interval_ms());
    if (peerInterval == Duration::zero()) return;  // the peer neither sends nor understands them
    sendHeartbeats_ = options_.keepaliveInterval > Duration::zero();
    if (options_.leaseTimeout > Duration::zero()) lease_ = std::max(options_.leaseTimeout, 3 * peerInterval);
    if (!sendHeartbeats_ && lease_ == Duration::zero()) return;
    lastHeard_ = std::chrono::steady_clock::now();
    keepaliveTick_ = sendHeartbeats_ ? options_.keepaliveInterval : lease_ / 4;
    if (lease_ > Duration::zero()) keepaliveTick_ = std::min(keepaliveTick_, lease_ / 2);
    armKeepalive();
  }

  void armKeepalive() {
    keepaliveTimer_.expires_after(keepaliveTick_);
    keepaliveTimer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->closed_ || self->closing_) return;
      self->onKeepaliveTick();
    });
  }

  void onKeepaliveTick() {
    const Duration silent = std::chrono::steady_clock::now() - lastHeard_;
    if (lease_ > Duration::zero() && silent > lease_) {
      Status why = deadlineExceeded("peer " + remote_ + " (" + peerHello_.worker_id() + ") silent for " +
                                    std::to_string(int64_t(toMs(silent))) + " ms (lease " +
                                    std::to_string(int64_t(toMs(lease_))) + " ms)");
      if (options_.onLeaseExpired) options_.onLeaseExpired(options_.plane, why);
      fail(std::move(why));
      return;
    }
    if (sendHeartbeats_) {
      static const Frame heartbeat = [] {
        proto::Envelope env;
        env.set_version(kProtocolVersion);
        env.mutable_heartbeat();
        return buildFrame(env, kMaxHandshakeFrameBytes).value();
      }();
      queuedBytes_.fetch_add(heartbeat->size());
      pushFrame(heartbeat);
    }
    armKeepalive();
  }

  void leavePending() {
    if (slots_ && !leftPending_) {
      leftPending_ = true;
      slots_->release(id_, host_);
    }
  }

  // Server side, before the handshake finished: the owner counts why (once per connection).
  void noteFailure(const char* reason) {
    if (!serverSide_ || established_ || failureNoted_) return;
    failureNoted_ = true;
    if (options_.onHandshakeFailure) options_.onHandshakeFailure(options_.plane, reason);
  }

  // A warning about this connection: rate-limited per address while the peer is unauthenticated
  // (a flood must not flood the log), plain once it is established or on the client side.
  void warn(const std::string& line) {
    if (!limiter_ || established_) {
      PD_LOG(kWarn, "net") << line;
      return;
    }
    limiter_->warn(remote_, "net", line);
  }

  void accountReadBuffer() {
    const size_t now = readBuf_.capacity();
    if (now >= accountedReadBytes_) {
      gReadBufferBytes.fetch_add(now - accountedReadBytes_);
    } else {
      gReadBufferBytes.fetch_sub(accountedReadBytes_ - now);
    }
    accountedReadBytes_ = now;
  }

  void readFailed(const boost::system::error_code& ec) {
    if (ec == asio::error::operation_aborted) return;  // we closed the socket
    if (ec == asio::error::eof || ec == asio::error::connection_reset) {
      size_t have = readEnd_ - readBegin_;
      if (have == 0) {
        noteFailure("closed");
        closeNow(unavailable("peer " + remote_ + " closed the connection"));
      } else if (have < 4) {
        fail(dataLoss("peer " + remote_ + " closed the connection mid-frame header: got " + std::to_string(have) +
                      " of 4 bytes"));
      } else {
        fail(dataLoss("peer " + remote_ + " closed the connection mid-frame: got " + std::to_string(have - 4) + " of " +
                      std::to_string(frameLength(readBegin_)) + " bytes"));
      }
      return;
    }
    closeNow(unavailable("read from " + remote_ + " failed: " + ec.message()));
  }

  // A protocol violation by the peer: logged once here, where it is understood. `why` labels
  // it if the handshake had not finished (noteFailure).
  void fail(Status reason, const char* why = "protocol") {
    noteFailure(why);
    warn("closing connection " + std::to_string(id_) + " (" + remote_ + "): " + reason.toString());
    closeNow(std::move(reason));
  }

  // Tells the peer why (an Error frame), then closes once it is written or after 1 s.
  void reject(Status reason) {
    noteFailure("protocol");
    warn("rejecting connection " + std::to_string(id_) + " (" + remote_ + "): " + reason.toString());
    rejectWith(reason, reason);
  }

  // The peer reads `toPeer`; onClose gets `reason`.
  void rejectWith(const Status& toPeer, Status reason) {
    proto::Envelope env;
    env.set_version(kProtocolVersion);
    *env.mutable_error() = toProtoError(toPeer);
    auto frame = buildFrame(env, options_.maxFrameBytes);
    if (frame.ok()) {
      queuedBytes_.fetch_add(frame.value()->size());
      pushFrame(std::move(frame).value());
    }
    closing_ = true;
    open_.store(false, std::memory_order_release);
    closingReason_ = reason;
    if (!writing_ && queue_.empty()) {
      closeNow(reason);
      return;
    }
    timer_.expires_after(std::chrono::seconds(1));
    timer_.async_wait([self = shared_from_this(), reason](const boost::system::error_code& ec) {
      if (!ec) self->closeNow(reason);
    });
  }

  void closeNow(Status reason) {
    if (closed_) return;
    closed_ = true;
    leavePending();  // its place among the server's handshakes is free now, not at destruction
    open_.store(false, std::memory_order_release);
    PD_LOG(kDebug, "net") << "connection " << id_ << " (" << remote_ << ") closed: " << reason.toString();
    boost::system::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    timer_.cancel();
    keepaliveTimer_.cancel();
    firstByteTimer_.cancel();
    queue_.clear();
    // Move the callbacks out: they may hold the last reference to this connection (through a
    // captured ConnectionPtr) and must not be destroyed while running.
    ConnectionCallbacks callbacks = std::move(callbacks_);
    callbacks_ = {};
    if (connectDone_) {
      // A client that never connected reports through connect()'s result, not onClose.
      auto done = std::move(connectDone_);
      connectDone_ = nullptr;
      done(reason);
      return;
    }
    if (callbacks.onClose) callbacks.onClose(shared_from_this(), reason);
  }

  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::steady_timer keepaliveTimer_;
  asio::steady_timer firstByteTimer_;  // server side, until the first byte arrives
  ConnectionOptions options_;
  ConnectionCallbacks callbacks_;
  const uint64_t id_;
  std::string remote_ = "?";
  proto::Hello peerHello_;
  proto::Hello ownHello_;  // as sent (with our nonce): half of the auth transcript
  ConnectDone connectDone_;
  bool clientSide_ = false;  // set by startConnect: connectDone_ is gone once established
  // Server side (setServerSide).
  bool serverSide_ = false;
  std::shared_ptr<HandshakeSlots> slots_;
  std::shared_ptr<PeerLogLimiter> limiter_;
  std::string host_;
  bool leftPending_ = false;
  bool heardAny_ = false;          // a byte arrived
  bool failureNoted_ = false;      // onHandshakeFailure ran
  size_t accountedReadBytes_ = 0;  // readBuf_'s capacity as counted in gReadBufferBytes

  // Strand state.
  bool tcpConnected_ = false;
  bool gotHello_ = false;     // the peer's hello was accepted (authenticated: its proof is next)
  bool established_ = false;  // open: authenticated when a secret is configured
  bool closing_ = false;      // an Error is being flushed; nothing else is read or sent
  bool closed_ = false;
  Status closingReason_;
  std::vector<uint8_t> readBuf_;
  size_t readBegin_ = 0;  // first unconsumed byte
  size_t readEnd_ = 0;    // one past the last byte read
  std::deque<Frame> queue_;
  std::vector<Frame> writeBatch_;
  bool writing_ = false;
  // Keepalive (startKeepalive): lease_ zero means the peer is never timed out.
  bool sendHeartbeats_ = false;
  Duration lease_ = Duration::zero();
  Duration keepaliveTick_ = Duration::zero();
  std::chrono::steady_clock::time_point lastHeard_;

  // Sends from any thread, waiting for the strand.
  std::mutex sendMutex_;
  std::vector<Frame> sendPending_;
  bool flushScheduled_ = false;

  std::atomic<bool> open_{false};
  std::atomic<size_t> queuedBytes_{0};
};

// Server state lives behind a shared_ptr so the accept handler can outlive the FramedServer
// object by the moment it takes the io_context to cancel it.
struct ServerState : std::enable_shared_from_this<ServerState> {
  ServerState(asio::io_context& ctx, ConnectionOptions o, ConnectionCallbacks c)
      : ctx(ctx), acceptor(asio::make_strand(ctx)), options(std::move(o)), callbacks(std::move(c)) {}

  void acceptNext() {
    acceptor.async_accept(asio::make_strand(ctx),
                          [self = shared_from_this()](const boost::system::error_code& ec, tcp::socket socket) {
                            if (ec) {
                              if (ec == asio::error::operation_aborted || !self->acceptor.is_open()) return;
                              // Out of descriptors and the like: log, back off a little, keep serving.
                              PD_LOG(kWarn, "net") << "accept failed: " << ec.message();
                              auto timer = std::make_shared<asio::steady_timer>(self->acceptor.get_executor());
                              timer->expires_after(std::chrono::milliseconds(50));
                              timer->async_wait([self, timer](const boost::system::error_code&) {
                                if (self->acceptor.is_open()) self->acceptNext();
                              });
                              return;
                            }
                            self->startConnection(std::move(socket));
                            self->acceptNext();
                          });
  }

  void startConnection(tcp::socket socket) {
    ConnectionCallbacks cb;
    std::weak_ptr<ServerState> weak = weak_from_this();
    cb.onOpen = callbacks.onOpen;
    cb.onMessage = callbacks.onMessage;
    auto userClose = callbacks.onClose;
    cb.onClose = [weak, userClose](const ConnectionPtr& c, const Status& reason) {
      if (auto self = weak.lock()) {
        std::lock_guard<std::mutex> lock(self->mutex);
        self->live.erase(c->id());
      }
      if (userClose) userClose(c, reason);
    };
    boost::system::error_code ec;
    auto ep = socket.remote_endpoint(ec);
    std::string host = ec ? std::string("?") : ep.address().to_string();
    auto conn = std::make_shared<Connection>(std::move(socket), options, std::move(cb));
    // Unauthenticated peers hold a bounded number of connections (and memory: each is limited
    // to handshake-sized frames), shared fairly between addresses (handshake_slots.h).
    auto slot = slots->admit(conn->id(), host);
    conn->setServerSide(slot.admitted ? slots : nullptr, limiter, host);
    std::shared_ptr<Connection> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (stopped) {
        conn->close(cancelled("server stopped"));
      }
      live[conn->id()] = conn;
      if (slot.evict != 0) {
        auto it = live.find(slot.evict);
        if (it != live.end()) evicted = it->second.lock();
      }
    }
    conn->startAccepted();
    if (!slot.admitted) {
      conn->closeOverloaded(resourceExhausted(
          options.plane + ": no handshake slot left for " + host + " (" + std::to_string(slots->heldBy(host)) + " of " +
          std::to_string(options.maxPendingHandshakesPerAddress) + " from it, " + std::to_string(slots->held()) +
          " of " + std::to_string(options.maxPendingHandshakes) + " in all)"));
    }
    if (evicted) {
      evicted->closeOverloaded(
          resourceExhausted(options.plane + ": handshake slot given to a newer connection (from " + host + ")"));
    }
  }

  void stop() {
    std::vector<std::shared_ptr<Connection>> toClose;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (stopped) return;
      stopped = true;
      for (auto& [id, weak] : live) {
        if (auto c = weak.lock()) toClose.push_back(std::move(c));
      }
    }
    asio::post(acceptor.get_executor(), [self = shared_from_this()] {
      boost::system::error_code ec;
      self->acceptor.close(ec);
    });
    for (auto& c : toClose) c->close(cancelled("server stopped"));
  }

  asio::io_context& ctx;
  tcp::acceptor acceptor;
  ConnectionOptions options;
  ConnectionCallbacks callbacks;
  std::mutex mutex;
  bool stopped = false;
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> live;
  std::shared_ptr<HandshakeSlots> slots =
      std::make_shared<HandshakeSlots>(options.maxPendingHandshakes, options.maxPendingHandshakesPerAddress);
  std::shared_ptr<PeerLogLimiter> limiter = std::make_shared<PeerLogLimiter>(options.plane);
  int port = 0;
};

class Server final : public FramedServer {
 public:
  explicit Server(std::shared_ptr<ServerState> state) : state_(std::move(state)) {}
  ~Server() override { stop(); }
  int port() const override { return state_->port; }
  void stop() override { state_->stop(); }
  size_t connectionCount() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->live.size();
  }

 private:
  std::shared_ptr<ServerState> state_;
};

}  // namespace

std::string handshakeProof(const std::string& secret, bool fromClient, const proto::Hello& clientHello,
                           const proto::Hello& serverHello) {
  auth::Transcript t(kAuthTag);
  t.add(fromClient ? "client->server" : "server->client");
  t.add(clientHello.auth_nonce()).add(serverHello.auth_nonce());
  t.add(uint64_t(clientHello.role())).add(clientHello.worker_id());
  t.add(uint64_t(serverHello.role())).add(serverHello.worker_id());
  return auth::proof(secret, t);
}

size_t bufferedReadBytes() { return gReadBufferBytes.load(); }

Result<std::unique_ptr<FramedServer>> FramedServer::listen(IoPool& pool, const std::string& host, int port,
                                                           ConnectionOptions options, ConnectionCallbacks callbacks) {
  std::string where = "listen on " + host + ":" + std::to_string(port);
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  if (ec) return invalidArgument(where + ": not an IP address (" + ec.message() + ")");
  if (port < 0 || port > 65535) return invalidArgument(where + ": port out of range");
  if (options.maxPendingHandshakes == 0 || options.maxPendingHandshakesPerAddress == 0) {
    return invalidArgument(where + ": maxPendingHandshakes and maxPendingHandshakesPerAddress must be at least 1");
  }
  auto state = std::make_shared<ServerState>(pool.context(), std::move(options), std::move(callbacks));
  tcp::endpoint ep(addr, static_cast<uint16_t>(port));
  state->acceptor.open(ep.protocol(), ec);
  if (!ec) state->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) state->acceptor.bind(ep, ec);
  if (!ec) state->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return unavailable(where + ": " + ec.message());
  state->port = state->acceptor.local_endpoint(ec).port();
  // The acceptor is only touched on its strand from here on.
  asio::post(state->acceptor.get_executor(), [state] { state->acceptNext(); });
  return std::unique_ptr<FramedServer>(new Server(std::move(state)));
}

void FramedClient::connectAsync(IoPool& pool, const std::string& host, int port, ConnectionOptions options,
                                ConnectionCallbacks callbacks, Duration timeout,
                                std::function<void(Result<ConnectionPtr>)> done) {
  auto conn = std::make_shared<Connection>(tcp::socket(asio::make_strand(pool.context())), std::move(options),
                                           std::move(callbacks));
  conn->startConnect(host, port, timeout, std::move(done));
}

Result<ConnectionPtr> FramedClient::connect(IoPool& pool, const std::string& host, int port, ConnectionOptions options,
                                            ConnectionCallbacks callbacks, Duration timeout) {
  if (pool.inPoolThread()) {
    return failedPrecondition("FramedClient::connect called on an I/O thread; use connectAsync");
  }
  auto promise = std::make_shared<std::promise<Result<ConnectionPtr>>>();
  auto future = promise->get_future();
  connectAsync(pool, host, port, std::move(options), std::move(callbacks), timeout,
               [promise](Result<ConnectionPtr> r) { promise->set_value(std::move(r)); });
  // The connection's own timer bounds the attempt; the margin only covers a stopped pool.
  if (future.wait_for(timeout + std::chrono::seconds(2)) != std::future_status::ready) {
    return deadlineExceeded("connect to " + host + ":" + std::to_string(port) + ": the I/O pool did not answer");
  }
  return future.get();
}

Result<ConnectionPtr> FramedClient::connectWithRetry(IoPool& pool, const std::string& host, int port,
                                                     const ConnectionOptions& options,
                                                     const ConnectionCallbacks& callbacks, const RetryPolicy& policy) {
  auto deadline = std::chrono::steady_clock::now() + policy.totalTimeout;
  Duration delay = policy.initialDelay;
  int attempts = 0;
  for (;;) {
    auto now = std::chrono::steady_clock::now();
    Duration left = deadline - now;
    Duration attempt = std::min(policy.attemptTimeout, left);
    if (attempt <= Duration::zero()) attempt = std::chrono::milliseconds(1);
    ++attempts;
    auto r = connect(pool, host, port, options, callbacks, attempt);
    if (r.ok()) return r;
    StatusCode code = r.status().code();
    if (code == StatusCode::kFailedPrecondition || code == StatusCode::kInvalidArgument) return r;
    now = std::chrono::steady_clock::now();
    if (now + delay >= deadline) {
      return Status(code, r.status().message() + " (gave up after " + std::to_string(attempts) + " attempts in " +
                              std::to_string(static_cast<int64_t>(toMs(policy.totalTimeout))) + " ms)");
    }
    PD_LOG(kDebug, "net") << "connect attempt " << attempts << " failed: " << r.status().toString() << "; retrying in "
                          << toMs(delay) << " ms";
    std::this_thread::sleep_for(delay);
    delay = std::min(policy.maxDelay, std::chrono::duration_cast<Duration>(delay * policy.multiplier));
  }
}

}  // namespace pd::net
