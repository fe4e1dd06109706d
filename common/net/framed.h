// Framed protobuf RPC over TCP (docs/design.md §5): the control plane between router and workers.
//
// Wire: each frame is a 4-byte big-endian length followed by that many bytes of a serialized
// pd.proto.Envelope. The first frame in each direction is a Hello whose protocol version must
// equal kProtocolVersion. A connection is closed, with the reason logged and passed to
// onClose, when the peer
//   - announces a frame larger than maxFrameBytes      (kResourceExhausted)
//   - sends bytes that do not parse as an Envelope     (kDataLoss)
//   - sends an Envelope with no (known) body           (kInvalidArgument)
//   - starts with anything but Hello, or another version (kFailedPrecondition; the peer gets
//     an Error frame saying why before the close)
//   - says nothing within handshakeTimeout             (kDeadlineExceeded)
//   - fails cluster authentication (below)             (kFailedPrecondition "authentication
//     failed: ..."; the peer gets an Error frame that says only "authentication failed")
//   - closes mid-frame                                  (kDataLoss)
//   - closes between frames                             (kUnavailable)
// Nothing a peer sends can crash the process; the server keeps serving other connections.
//
// Memory (docs/security.md): the read buffer grows with the bytes received, never with the length a
// header announces (at most doubling what is already held), so a peer announcing a 64 MiB
// frame costs what it actually sends. Before the handshake is done a frame may be at most
// kMaxHandshakeFrameBytes, and a server holds at most maxPendingHandshakes connections that
// have not finished it, shared fairly between source addresses (net/handshake_slots.h), and
// closes one that sent nothing within firstByteTimeout: unauthenticated peers cost a bounded
// amount and cannot starve others. Warnings about connections that never finished their
// handshake are rate-limited per source address (base/peer_log_limiter.h) and counted
// (onHandshakeFailure).
// bufferedReadBytes() is the process-wide total held in read buffers.
//
// Cluster authentication (options.clusterSecret set; docs/security.md): each hello
// carries a fresh 32-byte nonce (RAND_bytes); the client then sends Auth{HMAC-SHA256(secret,
// transcript)}, the server verifies it and only then answers with its own proof, which the
// client verifies. The transcript (handshakeProof) holds a protocol tag, the direction, both
// nonces and both hellos' role and worker id, so a proof is good for one connection and one
// direction only. onOpen (and connect()'s result) comes only after the peer's proof verified.
// Without a secret the connection is unauthenticated (no cluster secret). A mixed pair (one
// side with a secret, the other without) fails closed on both sides. Every refusal is logged
// with the reason and the peer's address and reported to options.onAuthFailure.
//
// Keepalive (options.keepaliveInterval set, docs/reliability.md "Leases"): the hello
// announces the interval and, once open, this side sends a Heartbeat frame at least that often
// from the connection's strand (an I/O thread, so a busy owner loop does not stop it; a stopped
// or dead process does). With options.leaseTimeout set, a connection whose peer announced
// keepalive and from which no byte arrived for the lease is closed with kDeadlineExceeded
// ("... silent for N ms") and options.onLeaseExpired runs: a stopped, hung or cut-off peer is
// found within the lease plus one check interval, with no traffic of the owner's own. The lease
// is never shorter than three of the peer's announced intervals. A peer that announced no
// keepalive (an older build) is never timed out and is sent no heartbeats. Heartbeats count
// as heard and never reach onMessage.
//
// Usage (a worker dialing the router; the router runs a FramedServer):
//   pd::net::IoPool io(2);
//   pd::net::ConnectionOptions opts;
//   opts.hello.set_role(pd::proto::ROLE_DECODE);
//   opts.hello.set_worker_id("decode-0");
//   pd::net::ConnectionCallbacks cb;
//   cb.onMessage = [&](const pd::net::ConnectionPtr& c, pd::proto::Envelope&& env) {...};
//   cb.onClose = [&](const pd::net::ConnectionPtr& c, const pd::Status& why) {...};
//   PD_ASSIGN_OR_RETURN(auto conn, pd::net::FramedClient::connect(io, "127.0.0.1", 9000,
//                                                  opts, cb, std::chrono::seconds(5)));
//   pd::proto::Envelope env;  env.set_request_id(7);  env.mutable_cancel()->set_request_id(7);
//   PD_RETURN_IF_ERROR(conn->send(env));
//
// Threads:
//   - onOpen, onMessage and onClose of one connection run on that connection's strand: one at
//     a time, in order, on some IoPool thread. Different connections run in parallel. They
//     must not block (post heavy work to the owner's loop thread) and must not throw.
//   - onClose runs exactly once per connection that a server accepted (also when the handshake
//     failed; then onOpen never ran) and per client connection that connect() returned. A
//     client connection that failed to connect reports through connect()'s result only.
//     Nothing runs on a connection after its onClose.
//   - send(), close(), isOpen(), peerHello() (after open) may be called from any thread,
//     including from inside the callbacks.
//   - What the callbacks capture must stay valid until onClose ran or the IoPool is destroyed
//     (destroying the pool drops pending callbacks without running them). Servers and
//     connections must go before their IoPool.
//   - Policy on the peer's Hello (model fingerprint, role) is the owner's: check peerHello() in
//     onOpen and close() with a reason if it does not fit.
//   - FramedClient::connect() blocks the caller until the handshake is done or the timeout
//     passes; do not call it from an IoPool thread (use connectAsync there).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/base/cluster_auth.h"
#include "common/base/status.h"
#include "common/net/io_pool.h"
#include "common/proto/pdserve.pb.h"

namespace pd::net {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr size_t kDefaultMaxFrameBytes = size_t{64} << 20;
// Hello and Auth frames are small (ids, a fingerprint, a nonce and a MAC).
inline constexpr size_t kMaxHandshakeFrameBytes = size_t{64} << 10;

using Duration = std::chrono::steady_clock::duration;

class FramedConnection;
using ConnectionPtr = std::shared_ptr<FramedConnection>;

struct ConnectionOptions {
  // What this side says in its first frame (protocol_version and the envelope version are
  // filled in). Role and worker id are what the peer's logs and tables will call us.
  proto::Hello hello;
  size_t maxFrameBytes = kDefaultMaxFrameBytes;  // both directions
  // send() fails with kResourceExhausted while this many bytes wait to be written.
  size_t maxQueuedBytes = size_t{256} << 20;
  Duration handshakeTimeout = std::chrono::seconds(5);
  // Servers: at most this many connections in their handshake at a time, and at most
  // maxPendingHandshakesPerAddress of them from one source address (net/handshake_slots.h
  // says which one gives way when they are taken: never a peer at a quieter address).
  size_t maxPendingHandshakes = 64;
  size_t maxPendingHandshakesPerAddress = 8;
  // Servers: an accepted connection that has sent no byte within this is closed (a legitimate
  // peer sends its hello as soon as TCP connects); well under handshakeTimeout, so a silent
  // flood holds each slot briefly. Zero: only handshakeTimeout applies.
  Duration firstByteTimeout = std::chrono::seconds(1);
  // The cluster secret (cluster.secret_file). Null or empty: this side is unauthenticated.
  auth::ClusterSecret clusterSecret;
  // The plane's name in logs and in onAuthFailure ("router_control", "prefill_control").
  std::string plane = "control";
  // Runs on the connection's strand once per handshake refused for authentication (a wrong,
  // missing or replayed proof, a mixed pair), with the reason. The owner counts it
  // (pdserve_auth_failures_total{plane}). Must not block.
  std::function<void(const std::string& plane, const Status& why)> onAuthFailure;
  // Servers: runs on the connection's strand once per accepted connection that closed before
  // its handshake finished, with why: "auth" (also reported to onAuthFailure), "protocol" (a bad
  // hello or frame), "silent" (no byte within firstByteTimeout), "timeout" (no hello within
  // handshakeTimeout), "closed" (the peer closed first), "overload" (no handshake slot left, or
  // its slot given to another peer). The owner counts it
  // (pdserve_handshake_failures_total{plane,reason}). Not run for a server's stop(). Must not
  // block.
  std::function<void(const std::string& plane, const char* reason)> onHandshakeFailure;
  // Keepalive (above). Zero: off. Both are per side; a plane's owners set both.
  Duration keepaliveInterval = Duration::zero();
  Duration leaseTimeout = Duration::zero();
  // Runs on the connection's strand when it is closed for silence, before onClose. Must not
  // block.
  std::function<void(const std::string& plane, const Status& why)> onLeaseExpired;
};

struct ConnectionCallbacks {
  std::function<void(const ConnectionPtr&)> onOpen;  // handshake done; peerHello() is valid
  std::function<void(const ConnectionPtr&, proto::Envelope&&)> onMessage;
  std::function<void(const ConnectionPtr&, const Status& reason)> onClose;
};

class FramedConnection {
 public:
  virtual ~FramedConnection() = default;

  // Queues one frame; frames go out in the order send() was called, never interleaved.
  // Serialization happens on the caller's thread; env is not copied. An env.version of 0 is
  // sent as kProtocolVersion. Never blocks.
  // Errors: kUnavailable (closed or closing), kResourceExhausted (frame over maxFrameBytes,
  // or the send queue is full), kInvalidArgument (the message cannot be serialized).
  virtual Status send(const proto::Envelope& env) = 0;
  // Closes now (queued frames are dropped); onClose gets `reason`. Idempotent. Dropping the
  // last ConnectionPtr does not close a connection (its pending read keeps it alive): close().
  virtual void close(Status reason) = 0;
  virtual bool isOpen() const = 0;
  // The peer's Hello; valid once onOpen ran (or connect() returned).
  virtual const proto::Hello& peerHello() const = 0;
  virtual std::string remoteAddress() const = 0;  // "127.0.0.1:54321"
  virtual uint64_t id() const = 0;                // unique within the process
};

class FramedServer {
 public:
  // Binds host:port (port 0: an OS-chosen port, see port()) and accepts until stop().
  // callbacks apply to every accepted connection.
  static Result<std::unique_ptr<FramedServer>> listen(IoPool& pool, const std::string& host, int port,
                                                      ConnectionOptions options, ConnectionCallbacks callbacks);
  virtual ~FramedServer() = default;  // stops
  virtual int port() const = 0;
  // Stops accepting and closes every live connection (their onClose runs with kCancelled).
  // Any thread; idempotent.
  virtual void stop() = 0;
  virtual size_t connectionCount() const = 0;
};

// Backoff between connection attempts: initialDelay, then * multiplier up to maxDelay, until
// the overall deadline passes.
struct RetryPolicy {
  Duration initialDelay = std::chrono::milliseconds(50);
  Duration maxDelay = std::chrono::seconds(2);
  double multiplier = 2.0;
  Duration attemptTimeout = std::chrono::seconds(2);
  Duration totalTimeout = std::chrono::seconds(30);
};

class FramedClient {
 public:
  // Connects and exchanges hellos within timeout. Errors: kUnavailable (refused, unreachable,
  // closed during the handshake), kDeadlineExceeded, kFailedPrecondition (the server rejected
  // our version or role), kInvalidArgument (host does not resolve).
  static Result<ConnectionPtr> connect(IoPool& pool, const std::string& host, int port, ConnectionOptions options,
                                       ConnectionCallbacks callbacks, Duration timeout);
  // The same, without blocking: done runs once, on a pool thread.
  static void connectAsync(IoPool& pool, const std::string& host, int port, ConnectionOptions options,
                           ConnectionCallbacks callbacks, Duration timeout,
                           std::function<void(Result<ConnectionPtr>)> done);
  // connect() until it succeeds, a non-retryable error (kFailedPrecondition,
  // kInvalidArgument) occurs, or policy.totalTimeout passes. Blocking, like connect().
  static Result<ConnectionPtr> connectWithRetry(IoPool& pool, const std::string& host, int port,
                                                const ConnectionOptions& options, const ConnectionCallbacks& callbacks,
                                                const RetryPolicy& policy);
};

// The proof a side of an authenticated handshake sends: HMAC-SHA256(secret, transcript of
// the direction, both hellos' nonce, role and worker id). Exposed for tests that play a peer.
std::string handshakeProof(const std::string& secret, bool fromClient, const proto::Hello& clientHello,
                           const proto::Hello& serverHello);

// Bytes held in the read buffers of every framed connection of this process.
size_t bufferedReadBytes();

// "hello", "generate", ... for logs and messages; "none" when unset.
const char* bodyName(const proto::Envelope& env);

// Status <-> wire Error.
proto::Error toProtoError(const Status& status);
Status fromProtoError(const proto::Error& error);

}  // namespace pd::net
