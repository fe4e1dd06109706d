// Internal to TcpTransport (tcp_transport.h has the contract): the state its owner-thread
// API, sender, receiver, GPU staging and watchdog share, and TcpTransport::Impl, whose member
// functions are defined across tcp_transport.cpp and the files of this folder:
//   tcp_transport.cpp  owner thread: registration, peers, post / poll / cancel
//   tcp_sender.cpp     I/O thread: connecting streams, framing and writing jobs, reading acks
//   tcp_receiver.cpp   I/O thread: accepting, validating and landing frames, writing acks
//   tcp_staging.cpp    I/O thread: kCuda memory through pinned bounce buffers, both sides
//   tcp_watchdog.cpp   I/O thread: peer death (no progress within peerTimeout, socket errors)
// Only these files include it (it pulls in Asio and opens namespace tcpimpl into pd::kvt);
// the threading rules are the ones of the members below: "owner thread", "I/O thread" or
// guarded by the named mutex.
#pragma once

#include <netinet/tcp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include <boost/asio.hpp>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/base/peer_log_limiter.h"
#include "common/base/random.h"
#include "kvtransfer/segment_matcher.h"
#include "kvtransfer/staging_ring.h"
#include "kvtransfer/transports/tcp/tcp_batching.h"
#include "kvtransfer/transports/tcp_transport.h"

namespace pd::kvt {
namespace tcpimpl {

namespace asio = boost::asio;
using asio::ip::tcp;

inline constexpr uint32_t kMagic = 0x544b4450;  // "PDKT" little-endian; also catches endianness
// 2: the receiver speaks first (a kChallenge frame), and the hello may carry a proof (docs/security.md).
inline constexpr uint16_t kWireVersion = 2;
// kMaxBatchBytes, kMaxBatchBuffers, kSmallPayload, kStripeMinBytes, kStripeChunk: tcp_batching.h.
inline constexpr size_t kMaxGroupBytes = 8 << 20;  // receiver-side bound on one group frame
inline constexpr size_t kMaxNameLen = 256;
inline constexpr size_t kMaxAckMessage = 64 << 10;
// Staging of kCuda memory (docs/kvtransfer.md): pieces per bounce buffer, so a chunk's frames fit one
// gathered write with room for the End frame; the smallest chunk holds any group piece.
inline constexpr size_t kMaxStagePieces = (kMaxBatchBuffers - 4) / 2;
inline constexpr size_t kMinStageChunk = 64 << 10;
inline constexpr auto kStagePoll = std::chrono::microseconds(20);

enum class FrameType : uint8_t {
  kHello = 1,      // token = receiver instance, addr = stream index, len = name bytes that follow
  kData = 2,       // token, addr, len: payload of len bytes follows
  kEnd = 3,        // end of this stream's share of a transfer (no payload: len = 0)
  kAbort = 4,      // the sender cancelled the transfer (the receiver forgets its state)
  kAck = 5,        // receiver -> sender: flags = 0 ok / 1 refused; len = message bytes that follow
  kGroup = 6,      // len bytes follow: back-to-back (data header, payload) pairs of small payloads,
                   // which the receiver reads in one go and copies into place
  kChallenge = 7,  // receiver -> sender, the first frame of every connection: len = nonce
                   // bytes that follow (kNonceBytes with a cluster secret, 0 without one)
};
// Hello flag: the name is followed by an auth::kProofBytes proof (kvHelloProof).
inline constexpr uint8_t kFlagHasProof = 2;
inline constexpr const char* kKvAuthTag = "pdserve/kv-tcp-auth/v1";

// What a writer proves in its hello: it holds the cluster secret, on this connection (the
// receiver's fresh nonce), to this receiver instance, for this stream and name.
inline std::string kvHelloProof(const std::string& secret, const std::string& nonce, uint64_t instance, uint64_t stream,
                                const std::string& name) {
  auth::Transcript t(kKvAuthTag);
  t.add("writer->receiver").add(nonce).add(instance).add(stream).add(name);
  return auth::proof(secret, t);
}
inline constexpr uint8_t kFlagRefused = 1;

struct WireHeader {
  uint32_t magic = kMagic;
  uint8_t type = 0;
  uint8_t flags = 0;
  uint16_t version = kWireVersion;
  uint64_t transferId = 0;
  uint64_t token = 0;
  uint64_t addr = 0;
  uint64_t len = 0;
};
static_assert(sizeof(WireHeader) == kWireHeaderBytes, "the wire header is 40 bytes");

// Asio's transfer_all moves at most 64 KiB per syscall; the bulk paths let the kernel take
// (or give) as much as it can in one writev/readv instead.
struct TransferAllInOne {
  size_t total;
  size_t operator()(const boost::system::error_code& ec, size_t done) const {
    return ec || done >= total ? 0 : total - done;
  }
};

inline std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

// One (local -> remote) piece as it goes on the wire.
struct Seg {
  uintptr_t local = 0;
  uint64_t token = 0;
  uint64_t remote = 0;
  size_t len = 0;
  int device = -1;  // CUDA ordinal when `local` is kCuda memory (the job is staged)
};

struct OutPeer;

// I/O-thread state of one transfer (shared with the owner only through atomics).
struct IoTransfer {
  TransferId id = 0;
  std::atomic<bool> cancelled{false};
  // I/O thread only below.
  Status status;
  int pendingEnds = 0;     // End frames written or queued whose ack is outstanding
  bool finalSent = false;  // a one-stream transfer's End frame is written: too late to cancel
  int writesInFlight = 0;  // gathered writes that still read local memory
  bool done = false;
  std::vector<std::promise<bool>> quiesceWaiters;
};

struct Job {
  std::shared_ptr<IoTransfer> t;
  std::vector<Seg> segs;
  size_t next = 0;
  bool final = false;  // its End frame is the transfer's last (one stream carries it all)
  bool started = false;
  bool staged = false;  // some local segment is kCuda: it goes through the stage ring
  size_t nextOff = 0;   // staged: bytes of segs[next] already in a bounce buffer
};

struct OutStream {
  explicit OutStream(asio::io_context& io) : sock(io), stageTimer(io) {}
  tcp::socket sock;
  int index = 0;
  std::deque<Job> jobs;
  bool writing = false;
  std::shared_ptr<IoTransfer> writingFor;
  std::array<WireHeader, kMaxBatchBuffers> hdrs;
  std::vector<asio::const_buffer> bufs;
  std::deque<std::shared_ptr<IoTransfer>> awaitingAck;  // End frames in write order
  WireHeader ackHdr;
  std::string ackMsg;
  WireHeader challengeHdr;  // the receiver's first frame
  std::string challenge;    // its nonce
  // Staging (only for jobs with kCuda segments; created on first use). Slots
  // [stageHead, stageHead + stageCount) hold chunks of the front job, copied or copying out of
  // device memory, in wire order; stageFrames[slot] are their data frames.
  std::unique_ptr<StagingRing> stage;
  std::vector<std::vector<Seg>> stageFrames;
  std::vector<CopyPiece> stagePieces;
  size_t stageHead = 0;
  size_t stageCount = 0;
  uint64_t stageGen = 0;          // bumped when the ring is dropped; a late write completion is ignored
  asio::steady_timer stageTimer;  // polls the head chunk's copy
  bool stageTimerArmed = false;
};

struct RemoteKey {
  uint64_t token = 0;
  uint64_t addr = 0;
  uint64_t len = 0;
};

struct OutPeer {
  PeerId id = 0;
  std::string name;
  std::string endpoint;
  std::vector<RemoteKey> keys;                       // owner thread only
  std::vector<KeyRange> keyRanges;                   // keys' addresses, for SegmentMatcher (owner thread only)
  std::vector<std::shared_ptr<OutStream>> streams;   // made by loadPeer; the vector never changes after
  std::unique_ptr<asio::steady_timer> connectTimer;  // fails the peer if it is not connected in time
  std::atomic<bool> dead{false};
  std::mutex reasonMu;
  std::string deathReason;
  // I/O thread only.
  bool connected = false;  // every stream connected and greeted: jobs may be written
  std::unordered_map<TransferId, std::shared_ptr<IoTransfer>> active;
  SteadyTime lastProgress = steadyNow();
};

struct InConn {
  explicit InConn(asio::io_context& io) : sock(io), helloTimer(io) {}
  tcp::socket sock;
  asio::steady_timer helloTimer;  // closes a connection that does not say (and prove) hello in time
  std::string nonce;              // our challenge (empty without a cluster secret)
  std::string remote;
  std::string peerName;
  bool helloDone = false;
  WireHeader hdr;
  std::string text;                                   // the hello's name (and proof) being read
  std::unordered_map<uint64_t, std::string> refused;  // transferId -> reason
  std::vector<char> discard;
  uint64_t discardLeft = 0;
  std::vector<char> group;  // the group frame being read
  // The write grant of the data frame whose payload is being read into place (0: none, or a
  // region token): revokeWrite() closes the connection when it is its grant, so that no byte
  // of the frame lands after the revoke.
  uint64_t landingGrant = 0;
  // Staging into kCuda exposures: payload bytes land in slot stageSlot at stageOff, then an
  // async copy moves them to the device; acks wait for every copy of the connection.
  std::unique_ptr<StagingRing> stage;
  size_t stageSlot = 0;
  size_t stageOff = 0;
  std::deque<std::string> outq;  // serialized acks
  bool writing = false;
  bool closed = false;
};

struct Completion {
  TransferId id;
  Status status;
};

struct OwnerEntry {
  std::shared_ptr<IoTransfer> t;
  PeerId peer = 0;
  bool cancelled = false;
  std::optional<Status> outcome;
};

struct Region {
  MemDesc desc;
  std::vector<uint64_t> tokens;
};

// A live write grant (grantWrite): the only ranges a write under its token may touch, sorted
// by address, each inside one registered region (kind and device are that region's).
struct Grant {
  std::vector<MemDesc> ranges;
  // The range covering [addr, addr + len), or null.
  const MemDesc* find(uint64_t addr, uint64_t len) const {
    auto it =
        std::upper_bound(ranges.begin(), ranges.end(), addr, [](uint64_t a, const MemDesc& d) { return a < d.addr; });
    if (it == ranges.begin()) return nullptr;
    --it;
    return KeyRange{it->addr, it->len}.covers(addr, len) ? &*it : nullptr;
  }
};

}  // namespace tcpimpl

using namespace tcpimpl;  // the Impl's members name these types unqualified

class TcpTransport::Impl {
 public:
  explicit Impl(const TransportOptions& options)
      : options_(options), acceptor_(io_), instance_(randomNonZeroU64()), watchdog_(io_) {}

  ~Impl() { shutdown(); }

  // ---- owner thread (tcp_transport.cpp) ---------------------------------------------------
  Status start();
  void shutdown();
  TransportCaps caps() const;
  Result<MemHandle> registerMemory(const MemDesc& desc);
  Status deregisterMemory(MemHandle handle);
  Result<std::string> packRemoteKey(MemHandle handle);
  Result<std::string> localConnInfo();
  Result<PeerId> loadPeer(const PeerInfo& peer);
  bool peerAlive(PeerId id) const;
  Status unloadPeer(PeerId id);
  void dropConnections(PeerId id);
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peerId, const std::string& grant);
  Result<std::string> grantWrite(const DescList& ranges);
  Status revokeWrite(const std::string& grant);
  void harvest();
  Status poll(TransferId id);
  Status cancel(TransferId id);
  bool progress();

 private:
  // ---- sender side, I/O thread (tcp_sender.cpp) -------------------------------------------
  void connectStreams(std::shared_ptr<OutPeer> p, tcp::endpoint ep, uint64_t remoteInstance);
  void startTransfer(std::shared_ptr<OutPeer> p, std::shared_ptr<IoTransfer> t, std::vector<std::vector<Seg>> perStream,
                     bool staged);
  void pump(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s);
  void startWrite(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                  std::shared_ptr<IoTransfer> t);
  // Every write's completion: the stream is free again, the transfer has one write fewer in
  // flight, and the stream pumps on (or the peer fails).
  void onWritten(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                 const std::shared_ptr<IoTransfer>& t, boost::system::error_code ec);
  // A DATA frame for `seg` into s.bufs: its header in slot nh, then the payload gathered
  // straight from seg.local (host memory, or a pinned staging slot): no copy.
  static void appendData(OutStream& s, uint64_t transferId, const Seg& seg, size_t& nh);
  // Ends the stream's front job: its END frame goes into s.bufs after header slot nh, the
  // transfer waits for the receiver's ack, and the job leaves the queue.
  static void appendEnd(OutStream& s, const std::shared_ptr<IoTransfer>& t, size_t& nh);
  void readAck(std::shared_ptr<OutPeer> p, std::shared_ptr<OutStream> s);
  void onAck(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s);
  void complete(OutPeer& p, const std::shared_ptr<IoTransfer>& t, Status st);
  void cancelOnIo(const std::shared_ptr<IoTransfer>& t, const std::shared_ptr<std::promise<bool>>& prom);
  static void resolveQuiesce(IoTransfer& t);

  // ---- staging of kCuda memory, both sides, I/O thread (tcp_staging.cpp) -------------------
  // The front job's chunks are copied device -> pinned slot ahead of the socket: while chunk k
  // is written, chunks k+1.. are copying. A chunk is written as soon as its copy is done; a
  // copy still running is polled (kStagePoll) with the peer deadline as its bound.
  void pumpStaged(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s);
  // startWrite's twin for a staged chunk: the head slot is free again once the write is done.
  void startStagedWrite(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                        std::shared_ptr<IoTransfer> t);
  void armStageTimer(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s);
  // Fails the transfer; pump() then drops the front job (an Abort tells the receiver) and the ring.
  void failStaged(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                  const std::shared_ptr<IoTransfer>& t, Status st);
  // Drops the stream's ring: waits (bounded, in the ring's destructor) for copies still reading
  // device memory, then frees the bounce buffers. Never called while a write reads a slot,
  // except from failPeer, whose closed socket no longer reads anything.
  void resetStage(OutStream& s);
  // cancel(): copies of `t` still reading its device memory must be done before cancel returns.
  void quiesceStagedCopies(const std::shared_ptr<IoTransfer>& t);
  // Payload bytes are read into the connection's bounce buffers; each piece is copied to the
  // device asynchronously while the next one is read. A buffer is reused only after its copies
  // finished (a short, bounded wait: the device copy is faster than the socket), and every
  // End frame waits for all of the connection's copies before its ack.
  void stagedRead(const std::shared_ptr<InConn>& c, uint64_t tid, int device, uint64_t addr, uint64_t left);
  // Room for `need` bytes in the current bounce buffer, moving to the next one (and waiting for
  // its earlier copies) when full. nullopt when the connection was dropped.
  std::optional<char*> reserveStage(const std::shared_ptr<InConn>& c, size_t need);
  void launchStaged(const std::shared_ptr<InConn>& c, uint64_t tid, int device, uint64_t addr, char* src, size_t n);
  // Waits for every copy of the connection; false when the connection was dropped.
  bool drainStage(const std::shared_ptr<InConn>& c);
  // Failed copies refuse their transfers (the sender sees the reason); a copy that does not
  // finish within the deadline drops the connection (the sender's transfers fail).
  bool noteStageErrors(const std::shared_ptr<InConn>& c, const Status& st, const std::vector<uint64_t>& failed);

  // ---- peer death, I/O thread (tcp_watchdog.cpp) ------------------------------------------
  void closePeerSockets(OutPeer& p);
  void failPeer(const std::shared_ptr<OutPeer>& p, const std::string& reason,
                StatusCode code = StatusCode::kUnavailable);
  void armWatchdog();

  // ---- receiver side, I/O thread (tcp_receiver.cpp) ---------------------------------------
  void doAccept();
  bool authenticated() const { return options_.clusterSecret && !options_.clusterSecret->empty(); }
  // Sender: the receiver's challenge read, say hello (with a proof when we hold the secret).
  void sendHello(std::shared_ptr<OutPeer> p, std::shared_ptr<OutStream> s, uint64_t remoteInstance,
                 std::shared_ptr<int> remaining, bool thenFail);
  void closeIn(InConn& c);
  // Closes an incoming connection. warn: log why at warn level (rate-limited per address while
  // the peer has not said hello). Before the hello, the failure is also reported to
  // onHandshakeFailure under handshakeReason (default: "protocol" when warn, else "closed").
  void dropIn(const std::shared_ptr<InConn>& c, const std::string& why, bool warn,
              const char* handshakeReason = nullptr);
  void readHeader(std::shared_ptr<InConn> c);
  // The hello's text (name, then the proof when flagged) is in c->text: check it.
  void onHelloText(const std::shared_ptr<InConn>& c, bool hasProof, uint64_t stream);
  void onHeader(const std::shared_ptr<InConn>& c);
  // Copies each (header, payload) of a group frame into place after the same checks as a
  // data frame; false (connection dropped) when the group is malformed.
  bool scatterGroup(const std::shared_ptr<InConn>& c);
  // Empty when [addr, addr+len) lies inside a region this transport registered and exposed
  // under `token`; otherwise the reason, for the sender and the log.
  // *device is the CUDA ordinal when the region is kCuda (the write is staged), -1 otherwise.
  // Tokens are looked up as write grants first (the write must lie inside one of the grant's
  // ranges), then as region tokens (refused while options.requireWriteGrant). *reason is the
  // refusal's label for onWriteRejected.
  std::string validateWrite(uint64_t token, uint64_t addr, uint64_t len, int* device, const char** reason);
  // A refused transfer: logged, remembered for its End frame's ack, counted.
  void refuse(const std::shared_ptr<InConn>& c, uint64_t tid, const std::string& why, const char* reason);
  template <typename Fn>
  void readText(const std::shared_ptr<InConn>& c, uint64_t len, Fn&& then);
  void discardPayload(std::shared_ptr<InConn> c);
  void sendAck(const std::shared_ptr<InConn>& c, uint64_t tid, bool refused, const std::string& msg);
  void flushAcks(const std::shared_ptr<InConn>& c);

  TransportOptions options_;
  // Warnings about peers that have not said hello (docs/security.md "Peer hardening").
  PeerLogLimiter helloWarnings_{"kv_tcp"};
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_ = asio::make_work_guard(io_);
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  uint64_t instance_;
  asio::steady_timer watchdog_;
  std::thread thread_;

  // Owner thread.
  std::unordered_map<MemHandle, Region> regions_;
  SegmentMatcher matcher_{"tcp transport"};  // mirrors regions_
  std::unordered_map<PeerId, std::shared_ptr<OutPeer>> peers_;
  std::unordered_map<TransferId, OwnerEntry> entries_;
  MemHandle nextHandle_ = 1;
  PeerId nextPeer_ = 1;
  TransferId nextTransfer_ = 1;
  bool harvested_ = false;

  // I/O thread.
  std::vector<std::shared_ptr<OutPeer>> ioPeers_;
  std::vector<std::shared_ptr<InConn>> inConns_;
  bool stopping_ = false;

  // Set in start(), read-only afterwards: stages kCuda memory (null: no device, see why).
  std::shared_ptr<DeviceCopier> copier_;
  std::string noCopierWhy_;

  // Shared.
  std::shared_mutex exposuresMu_;
  std::unordered_map<uint64_t, MemDesc> exposures_;  // token -> exposed region
  std::unordered_map<uint64_t, Grant> grants_;       // token -> live write grant
  std::mutex completedMu_;
  std::vector<Completion> completed_;
};

}  // namespace pd::kvt
