// TcpTransport implementation. The only compile unit of kvtransfer that includes Asio.
//
// Two roles per transport instance:
//  - sender: per loaded peer, options.tcpStreams outgoing sockets ("streams"); each stream
//    has a FIFO of jobs (one job = this stream's share of one transfer) and at most one
//    gathered write in flight; it reads acks back on the same socket.
//  - receiver: accepted sockets; each reads header -> validates -> reads payload in place,
//    and writes acks.
// Everything on the I/O side runs on the single I/O thread, so it needs no locks; the owner
// thread and the I/O thread meet in three mutex-guarded places: the exposure table, the
// completion queue and the notification queue.
#include "kvtransfer/transports/tcp_transport.h"

#include <netinet/tcp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/staging_ring.h"

namespace pd::kvt {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

constexpr uint32_t kMagic = 0x544b4450;  // "PDKT" little-endian; also catches endianness
constexpr uint16_t kWireVersion = 1;
constexpr size_t kMaxBatchBytes = 4 << 20;   // bounds cancel latency and interleaving
constexpr size_t kMaxBatchBuffers = 256;     // per gathered write (Asio issues 64 per writev)
constexpr size_t kSmallPayload = 16 << 10;   // smaller payloads travel in group frames
constexpr size_t kMaxGroupBytes = 8 << 20;   // receiver-side bound on one group frame
constexpr size_t kStripeMinBytes = 4 << 20;  // smaller transfers stay on one stream
constexpr size_t kStripeChunk = 1 << 20;
constexpr size_t kMaxNotification = 1 << 20;
constexpr size_t kMaxNameLen = 256;
constexpr size_t kMaxAckMessage = 64 << 10;
// Staging of kCuda memory (issue 7): pieces per bounce buffer, so a chunk's frames fit one
// gathered write with room for the End frame; the smallest chunk holds any group piece.
constexpr size_t kMaxStagePieces = (kMaxBatchBuffers - 4) / 2;
constexpr size_t kMinStageChunk = 64 << 10;
constexpr auto kStagePoll = std::chrono::microseconds(20);

enum class FrameType : uint8_t {
  kHello = 1,  // token = receiver instance, addr = stream index, len = name bytes that follow
  kData = 2,   // token, addr, len: payload of len bytes follows
  kEnd = 3,    // end of this stream's share of a transfer; len = notification bytes that follow
  kAbort = 4,  // the sender cancelled the transfer (the receiver forgets its state)
  kAck = 5,    // receiver -> sender: flags = 0 ok / 1 refused; len = message bytes that follow
  kGroup = 6,  // len bytes follow: back-to-back (data header, payload) pairs of small payloads,
               // which the receiver reads in one go and copies into place
};
constexpr uint8_t kFlagHasNotification = 1;
constexpr uint8_t kFlagRefused = 1;

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
static_assert(sizeof(WireHeader) == 40, "the wire header is 40 bytes");

// Asio's transfer_all moves at most 64 KiB per syscall; the bulk paths let the kernel take
// (or give) as much as it can in one writev/readv instead.
struct TransferAllInOne {
  size_t total;
  size_t operator()(const boost::system::error_code& ec, size_t done) const {
    return ec || done >= total ? 0 : total - done;
  }
};

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

uint64_t randomU64() {
  static thread_local std::mt19937_64 rng{std::random_device{}() ^
                                          uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())};
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
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
  std::optional<std::string> notification;
  std::atomic<bool> cancelled{false};
  // I/O thread only below.
  Status status;
  int pendingEnds = 0;     // End frames written or queued whose ack is outstanding
  int streamsUsed = 0;
  bool notifyPhase = false;
  bool finalSent = false;  // the frame that makes the transfer visible has been written
  int writesInFlight = 0;  // gathered writes that still read local memory
  bool done = false;
  std::vector<std::promise<bool>> quiesceWaiters;
};

struct Job {
  std::shared_ptr<IoTransfer> t;
  std::vector<Seg> segs;
  size_t next = 0;
  bool final = false;       // its End frame is the transfer's last
  bool withNotify = false;  // its End frame carries the notification
  bool started = false;
  bool staged = false;      // some local segment is kCuda: it goes through the stage ring
  size_t nextOff = 0;       // staged: bytes of segs[next] already in a bounce buffer
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
  // Staging (only for jobs with kCuda segments; created on first use). Slots
  // [stageHead, stageHead + stageCount) hold chunks of the front job, copied or copying out of
  // device memory, in wire order; stageFrames[slot] are their data frames.
  std::unique_ptr<StagingRing> stage;
  std::vector<std::vector<Seg>> stageFrames;
  std::vector<CopyPiece> stagePieces;
  size_t stageHead = 0;
  size_t stageCount = 0;
  uint64_t stageGen = 0;  // bumped when the ring is dropped; a late write completion is ignored
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
  std::vector<RemoteKey> keys;  // owner thread only
  std::vector<std::shared_ptr<OutStream>> streams;
  std::atomic<bool> dead{false};
  std::mutex reasonMu;
  std::string deathReason;
  // I/O thread only.
  std::unordered_map<TransferId, std::shared_ptr<IoTransfer>> active;
  SteadyTime lastProgress = steadyNow();
};

struct InConn {
  explicit InConn(asio::io_context& io) : sock(io) {}
  tcp::socket sock;
  std::string remote;
  std::string peerName;
  bool helloDone = false;
  WireHeader hdr;
  std::string text;  // name / notification being read
  std::unordered_map<uint64_t, std::string> refused;  // transferId -> reason
  std::vector<char> discard;
  uint64_t discardLeft = 0;
  std::vector<char> group;  // the group frame being read
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

}  // namespace

class TcpTransport::Impl {
 public:
  explicit Impl(const TransportOptions& options)
      : options_(options), acceptor_(io_), instance_(randomU64()), watchdog_(io_) {}

  ~Impl() { shutdown(); }

  Status start() {
    boost::system::error_code ec;
    auto addr = asio::ip::make_address(options_.listenHost, ec);
    if (ec) return invalidArgument("tcp transport: listen host '" + options_.listenHost + "': " + ec.message());
    tcp::endpoint ep(addr, options_.listenPort);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return unavailable("tcp transport: cannot listen on " + options_.listenHost + ":" +
                         std::to_string(options_.listenPort) + ": " + ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    if (options_.tcpStreams < 1 || options_.tcpStreams > 16) {
      return invalidArgument("tcp transport: tcpStreams must be in [1, 16], got " +
                             std::to_string(options_.tcpStreams));
    }
    if (options_.stageChunkBytes < kMinStageChunk || options_.stageBuffers < 2 || options_.stageBuffers > 64) {
      return invalidArgument("tcp transport: stageChunkBytes must be >= " + std::to_string(kMinStageChunk) +
                             " and stageBuffers in [2, 64], got " + std::to_string(options_.stageChunkBytes) +
                             " and " + std::to_string(options_.stageBuffers));
    }
    if (options_.deviceCopier) {
      copier_ = options_.deviceCopier;
    } else {
      auto c = makeCudaCopier();
      if (c.ok()) {
        copier_ = std::move(c).value();
      } else {
        noCopierWhy_ = c.status().message();
      }
    }
    doAccept();
    armWatchdog();
    thread_ = std::thread([this] { io_.run(); });
    return Status::ok();
  }

  void shutdown() {
    if (!thread_.joinable()) return;
    asio::post(io_, [this] {
      // Completions already queued (a watchdog tick, an accept) must not re-arm anything.
      stopping_ = true;
      boost::system::error_code ec;
      acceptor_.close(ec);
      watchdog_.cancel();
      for (auto& p : ioPeers_) closePeerSockets(*p);
      for (auto& c : inConns_) closeIn(*c);
      work_.reset();
    });
    // The posted lambda drops the work guard; pending handlers drain with operation_aborted.
    thread_.join();
    ioPeers_.clear();
    inConns_.clear();
  }

  TransportCaps caps() const {
    TransportCaps c;
    c.name = "tcp";
    c.hostMemory = true;
    c.cudaMemory = copier_ != nullptr;
    c.cudaStaged = c.cudaMemory;
    c.oneSided = false;
    c.details = "asio, " + std::to_string(options_.tcpStreams) + " stream(s) per peer, listening on " +
                options_.listenHost + ":" + std::to_string(port_);
    if (copier_) {
      c.cudaPath = "staged through pinned host memory";
      c.details += "; GPU memory staged through pinned host memory (" + copier_->describe() + ", " +
                   std::to_string(options_.stageBuffers) + " x " + std::to_string(options_.stageChunkBytes >> 10) +
                   " KiB bounce buffers)";
    }
    return c;
  }

  // ---- registration (owner thread) -------------------------------------------------------
  Result<MemHandle> registerMemory(const MemDesc& desc) {
    if (desc.addr == 0 || desc.len == 0) {
      return invalidArgument("tcp transport: cannot register an empty region " + toString(desc));
    }
    if (desc.kind == MemKind::kCuda) {
      if (!copier_) {
        return failedPrecondition("tcp transport: cannot register CUDA memory " + toString(desc) +
                                  ": staging it needs a CUDA device at run time (" + noCopierWhy_ + ")");
      }
      Status st = copier_->checkDeviceMemory(desc);
      if (!st.isOk()) return st.withContext("tcp transport: registering " + toString(desc));
    }
    MemHandle h = nextHandle_++;
    regions_[h] = Region{desc, {}};
    return h;
  }

  Status deregisterMemory(MemHandle handle) {
    auto it = regions_.find(handle);
    if (it == regions_.end()) return notFound("tcp transport: no registration " + std::to_string(handle));
    {
      std::unique_lock lock(exposuresMu_);
      for (uint64_t tok : it->second.tokens) exposures_.erase(tok);
    }
    regions_.erase(it);
    return Status::ok();
  }

  Result<std::string> packRemoteKey(MemHandle handle) {
    auto it = regions_.find(handle);
    if (it == regions_.end()) return notFound("tcp transport: no registration " + std::to_string(handle));
    proto::TcpRemoteKey key;
    key.set_token(randomU64());
    key.set_addr(it->second.desc.addr);
    key.set_len(it->second.desc.len);
    key.set_instance(instance_);
    {
      std::unique_lock lock(exposuresMu_);
      exposures_[key.token()] = it->second.desc;
    }
    it->second.tokens.push_back(key.token());
    return key.SerializeAsString();
  }

  Result<std::string> localConnInfo() {
    proto::TcpConnInfo info;
    info.set_version(kWireVersion);
    info.set_host(options_.listenHost);
    info.set_port(port_);
    info.set_instance(instance_);
    return info.SerializeAsString();
  }

  // ---- peers (owner thread) ----------------------------------------------------------------
  Result<PeerId> loadPeer(const PeerInfo& peer) {
    proto::TcpConnInfo info;
    if (!info.ParseFromString(peer.connInfo) || info.port() == 0 || info.port() > 65535) {
      return invalidArgument("tcp transport: peer '" + peer.name + "': connInfo is not a tcp connection blob");
    }
    if (info.version() != kWireVersion) {
      return failedPrecondition("tcp transport: peer '" + peer.name + "' speaks wire version " +
                                std::to_string(info.version()) + ", this build speaks " +
                                std::to_string(kWireVersion));
    }
    auto p = std::make_shared<OutPeer>();
    for (size_t i = 0; i < peer.remoteKeys.size(); ++i) {
      proto::TcpRemoteKey key;
      if (!key.ParseFromString(peer.remoteKeys[i]) || key.token() == 0) {
        return invalidArgument("tcp transport: peer '" + peer.name + "': remote key " + std::to_string(i) +
                               " is not a tcp key");
      }
      p->keys.push_back({key.token(), key.addr(), key.len()});
    }
    boost::system::error_code ec;
    auto addr = asio::ip::make_address(info.host(), ec);
    if (ec) return invalidArgument("tcp transport: peer '" + peer.name + "': bad host '" + info.host() + "'");
    tcp::endpoint ep(addr, uint16_t(info.port()));
    p->id = nextPeer_++;
    p->name = peer.name;
    p->endpoint = info.host() + ":" + std::to_string(info.port());

    // Connect every stream on the I/O thread; the owner waits, bounded by connectTimeout.
    auto done = std::make_shared<std::promise<Status>>();
    auto fut = done->get_future();
    uint64_t remoteInstance = info.instance();
    asio::post(io_, [this, p, ep, remoteInstance, done] {
      connectStreams(p, ep, remoteInstance, done);
    });
    if (fut.wait_for(options_.connectTimeout) != std::future_status::ready) {
      asio::post(io_, [this, p] { failPeer(p, "connect timed out"); });
      return unavailable("tcp transport: connecting to peer '" + peer.name + "' at " + p->endpoint +
                         " timed out after " + std::to_string(options_.connectTimeout.count()) + " ms");
    }
    Status st = fut.get();
    if (!st.isOk()) return st;
    peers_[p->id] = p;
    PD_LOG(kDebug, "kvt.tcp") << "peer '" << peer.name << "' at " << p->endpoint << " connected with "
                              << p->streams.size() << " stream(s)";
    return p->id;
  }

  Status unloadPeer(PeerId id) {
    auto it = peers_.find(id);
    if (it == peers_.end()) return notFound("tcp transport: no peer " + std::to_string(id));
    auto p = it->second;
    peers_.erase(it);
    asio::post(io_, [this, p] {
      failPeer(p, "peer unloaded", StatusCode::kCancelled);
      ioPeers_.erase(std::remove(ioPeers_.begin(), ioPeers_.end(), p), ioPeers_.end());
    });
    return Status::ok();
  }

  void dropConnections(PeerId id) {
    auto it = peers_.find(id);
    if (it == peers_.end()) return;
    auto p = it->second;
    asio::post(io_, [this, p] { failPeer(p, "connection dropped (test hook)"); });
  }

  // ---- transfers (owner thread) ------------------------------------------------------------
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peerId,
                          std::optional<std::string> notification) {
    auto pit = peers_.find(peerId);
    if (pit == peers_.end()) return notFound("tcp transport: no peer " + std::to_string(peerId));
    auto& peer = pit->second;
    if (peer->dead.load()) {
      std::lock_guard lock(peer->reasonMu);
      return unavailable("tcp transport: peer '" + peer->name + "' at " + peer->endpoint +
                         " is dead: " + peer->deathReason);
    }
    if (local.size() != remote.size()) {
      return invalidArgument("tcp transport: " + std::to_string(local.size()) + " local segments but " +
                             std::to_string(remote.size()) + " remote segments");
    }
    if (notification && notification->size() > kMaxNotification) {
      return invalidArgument("tcp transport: notification of " + std::to_string(notification->size()) +
                             " bytes exceeds the limit of " + std::to_string(kMaxNotification));
    }
    std::vector<Seg> segs;
    segs.reserve(local.size());
    size_t total = 0;
    bool staged = false;
    const Region* lastRegion = nullptr;
    const RemoteKey* lastKey = nullptr;
    for (size_t i = 0; i < local.size(); ++i) {
      const MemDesc& l = local[i];
      const MemDesc& r = remote[i];
      if (l.len != r.len) {
        return invalidArgument("tcp transport: segment " + std::to_string(i) + ": local length " +
                               std::to_string(l.len) + " != remote length " + std::to_string(r.len));
      }
      if (l.len == 0) continue;
      if (!lastRegion || !lastRegion->desc.contains(l)) {
        lastRegion = nullptr;
        for (const auto& [h, reg] : regions_) {
          if (reg.desc.contains(l)) {
            lastRegion = &reg;
            break;
          }
        }
        if (!lastRegion) {
          return invalidArgument("tcp transport: segment " + std::to_string(i) + ": local " + toString(l) +
                                 " is not inside memory registered with this transport");
        }
      }
      auto inKey = [&](const RemoteKey* k) {
        return k && r.addr >= k->addr && r.addr + r.len >= r.addr && r.addr + r.len <= k->addr + k->len;
      };
      if (!inKey(lastKey)) {
        lastKey = nullptr;
        for (const auto& k : peer->keys) {
          if (inKey(&k)) {
            lastKey = &k;
            break;
          }
        }
        if (!lastKey) {
          return invalidArgument("tcp transport: segment " + std::to_string(i) + ": remote " + toString(r) +
                                 " is not inside any region peer '" + peer->name + "' exposed");
        }
      }
      const int device = lastRegion->desc.kind == MemKind::kCuda ? lastRegion->desc.device : -1;
      staged |= device >= 0;
      segs.push_back({l.addr, lastKey->token, r.addr, l.len, device});
      total += l.len;
    }

    auto t = std::make_shared<IoTransfer>();
    t->id = nextTransfer_++;
    t->notification = std::move(notification);

    // Striping: large transfers are spread over the peer's streams in chunks.
    const size_t nStreams = peer->streams.size();
    std::vector<std::vector<Seg>> perStream(nStreams);
    if (nStreams == 1 || total < kStripeMinBytes) {
      perStream[t->id % nStreams] = std::move(segs);
    } else {
      size_t s = 0;
      for (const Seg& seg : segs) {
        for (size_t off = 0; off < seg.len; off += kStripeChunk) {
          size_t n = std::min(kStripeChunk, seg.len - off);
          perStream[s].push_back({seg.local + off, seg.token, seg.remote + off, n, seg.device});
          s = (s + 1) % nStreams;
        }
      }
    }
    entries_[t->id] = OwnerEntry{t, peerId, false, std::nullopt};
    asio::post(io_, [this, p = peer, t, perStream = std::move(perStream), staged]() mutable {
      startTransfer(p, t, std::move(perStream), staged);
    });
    return t->id;
  }

  void harvest() {
    std::vector<Completion> done;
    {
      std::lock_guard lock(completedMu_);
      done.swap(completed_);
    }
    for (auto& c : done) {
      auto it = entries_.find(c.id);
      if (it == entries_.end()) continue;
      if (!it->second.cancelled) it->second.outcome = std::move(c.status);
    }
    harvested_ = !done.empty();
  }

  Status poll(TransferId id) {
    harvest();
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      return notFound("tcp transport: transfer " + std::to_string(id) + " is unknown or its outcome was already reported");
    }
    if (it->second.cancelled) {
      entries_.erase(it);
      return cancelled("tcp transport: transfer " + std::to_string(id) + " was cancelled");
    }
    if (!it->second.outcome) return Status(StatusCode::kInProgress, "");
    Status st = std::move(*it->second.outcome);
    entries_.erase(it);
    return st;
  }

  Status cancel(TransferId id) {
    harvest();
    auto it = entries_.find(id);
    if (it == entries_.end()) return notFound("tcp transport: transfer " + std::to_string(id) + " is unknown");
    if (it->second.cancelled) return Status::ok();
    if (it->second.outcome) {
      return failedPrecondition("tcp transport: transfer " + std::to_string(id) + " already finished");
    }
    auto t = it->second.t;
    auto prom = std::make_shared<std::promise<bool>>();
    auto fut = prom->get_future();
    asio::post(io_, [this, t, prom] { cancelOnIo(t, prom); });
    // Bounded: at most one batch (kMaxBatchBytes) is in flight per stream.
    if (fut.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      return internalError("tcp transport: cancel of transfer " + std::to_string(id) +
                           " did not quiesce within 5 s");
    }
    if (!fut.get()) {
      return failedPrecondition("tcp transport: transfer " + std::to_string(id) +
                                " is past the point of no return (all its data and its notification are sent)");
    }
    it->second.cancelled = true;
    return Status::ok();
  }

  bool progress() {
    harvest();
    bool any = harvested_;
    std::lock_guard lock(notifyMu_);
    return any || !notifications_.empty();
  }

  std::vector<Notification> takeNotifications() {
    std::vector<Notification> out;
    std::lock_guard lock(notifyMu_);
    out.swap(notifications_);
    return out;
  }

 private:
  // ---- sender side, I/O thread ---------------------------------------------------------------
  void connectStreams(std::shared_ptr<OutPeer> p, tcp::endpoint ep, uint64_t remoteInstance,
                      std::shared_ptr<std::promise<Status>> done) {
    auto remaining = std::make_shared<int>(options_.tcpStreams);
    auto failed = std::make_shared<bool>(false);
    for (int i = 0; i < options_.tcpStreams; ++i) {
      auto s = std::make_shared<OutStream>(io_);
      s->index = i;
      p->streams.push_back(s);
      s->sock.async_connect(ep, [this, p, s, remaining, failed, done, remoteInstance](boost::system::error_code ec) {
        if (*failed) return;
        if (ec) {
          *failed = true;
          failPeer(p, "connect failed: " + ec.message());
          done->set_value(unavailable("tcp transport: cannot connect to peer '" + p->name + "' at " +
                                      p->endpoint + ": " + ec.message()));
          return;
        }
        boost::system::error_code ig;
        s->sock.set_option(tcp::no_delay(true), ig);
        // Hello: who we are (for Notification::peerName) and whom we meant to reach.
        auto hello = std::make_shared<std::string>(sizeof(WireHeader), '\0');
        WireHeader h;
        h.type = uint8_t(FrameType::kHello);
        h.token = remoteInstance;
        h.addr = uint64_t(s->index);
        h.len = options_.localName.size();
        std::memcpy(hello->data(), &h, sizeof h);
        hello->append(options_.localName);
        asio::async_write(s->sock, asio::buffer(*hello),
                          [this, p, s, hello, remaining, failed, done](boost::system::error_code wec, size_t) {
                            if (*failed) return;
                            if (wec) {
                              *failed = true;
                              failPeer(p, "hello failed: " + wec.message());
                              done->set_value(unavailable("tcp transport: peer '" + p->name + "' at " +
                                                          p->endpoint + ": " + wec.message()));
                              return;
                            }
                            readAck(p, s);
                            if (--*remaining == 0) {
                              ioPeers_.push_back(p);
                              done->set_value(Status::ok());
                            }
                          });
      });
    }
  }

  void startTransfer(std::shared_ptr<OutPeer> p, std::shared_ptr<IoTransfer> t,
                     std::vector<std::vector<Seg>> perStream, bool staged) {
    if (p->dead.load()) {
      std::lock_guard lock(p->reasonMu);
      complete(*p, t, unavailable("tcp transport: peer '" + p->name + "' is dead: " + p->deathReason));
      return;
    }
    if (t->cancelled.load()) return;
    if (p->active.empty()) p->lastProgress = steadyNow();
    p->active[t->id] = t;
    int used = 0;
    for (auto& segs : perStream) used += segs.empty() ? 0 : 1;
    const bool single = used <= 1;
    t->streamsUsed = std::max(used, 1);
    bool placedEmpty = false;
    for (size_t i = 0; i < perStream.size(); ++i) {
      if (perStream[i].empty()) {
        if (used != 0 || placedEmpty) continue;
        placedEmpty = true;
      }
      Job j;
      j.t = t;
      j.segs = std::move(perStream[i]);
      j.final = single;
      j.withNotify = single && t->notification.has_value();
      j.staged = staged && !j.segs.empty();
      t->pendingEnds++;
      p->streams[i]->jobs.push_back(std::move(j));
      pump(p, p->streams[i]);
    }
  }

  void pump(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
    if (s->writing || p->dead.load()) return;
    while (!s->jobs.empty()) {
      Job& j = s->jobs.front();
      auto t = j.t;
      if (t->cancelled.load() || t->done) {
        bool started = j.started;
        if (j.staged) resetStage(*s);
        s->jobs.pop_front();
        if (started) {
          // Let the receiver drop any refusal state for it; the ack it would have sent never comes.
          s->hdrs[0] = WireHeader{};
          s->hdrs[0].type = uint8_t(FrameType::kAbort);
          s->hdrs[0].transferId = t->id;
          s->bufs.assign(1, asio::buffer(&s->hdrs[0], sizeof(WireHeader)));
          startWrite(p, s, nullptr);
          return;
        }
        continue;
      }
      if (j.staged) {
        pumpStaged(p, s);
        return;
      }
      j.started = true;
      s->bufs.clear();
      size_t nh = 0;
      size_t bytes = 0;
      auto addData = [&](const Seg& seg) {
        appendData(*s, t->id, seg, nh);
        bytes += seg.len;
      };
      // Leave room for an End frame and its notification (2 buffers).
      while (j.next < j.segs.size() && s->bufs.size() + 4 <= kMaxBatchBuffers && bytes < kMaxBatchBytes) {
        if (j.segs[j.next].len >= kSmallPayload) {
          addData(j.segs[j.next++]);
          continue;
        }
        if (s->bufs.size() + 5 > kMaxBatchBuffers) break;  // no room for a non-empty group
        // A run of small payloads becomes one group frame: the receiver reads it with one
        // syscall instead of one per segment (the send side still gathers from registered
        // memory, no copy).
        WireHeader& g = s->hdrs[nh++];
        g = WireHeader{};
        g.type = uint8_t(FrameType::kGroup);
        g.transferId = t->id;
        s->bufs.push_back(asio::buffer(&g, sizeof g));
        const size_t before = bytes;
        size_t inner = 0;
        while (j.next < j.segs.size() && j.segs[j.next].len < kSmallPayload &&
               s->bufs.size() + 4 <= kMaxBatchBuffers && bytes < kMaxBatchBytes) {
          addData(j.segs[j.next++]);
          ++inner;
        }
        g.len = (bytes - before) + inner * sizeof(WireHeader);
      }
      bool endNow = j.next == j.segs.size() && s->bufs.size() + 2 <= kMaxBatchBuffers;
      if (endNow) appendEnd(*s, t, nh);
      startWrite(p, s, t);
      return;
    }
  }

  void startWrite(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                  std::shared_ptr<IoTransfer> t) {
    s->writing = true;
    s->writingFor = t;
    if (t) t->writesInFlight++;
    asio::async_write(s->sock, s->bufs, TransferAllInOne{asio::buffer_size(s->bufs)},
                      [this, p, s, t](boost::system::error_code ec, size_t) { onWritten(p, s, t, ec); });
  }

  // Every write's completion: the stream is free again, the transfer has one write fewer in
  // flight, and the stream pumps on (or the peer fails).
  void onWritten(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                 const std::shared_ptr<IoTransfer>& t, boost::system::error_code ec) {
    s->writing = false;
    s->writingFor.reset();
    if (t) {
      t->writesInFlight--;
      if (t->writesInFlight == 0) resolveQuiesce(*t);
    }
    if (ec) {
      if (!p->dead.load() && ec != asio::error::operation_aborted) failPeer(p, "write failed: " + ec.message());
      return;
    }
    p->lastProgress = steadyNow();
    pump(p, s);
  }

  // ---- staging of kCuda memory, sender side (I/O thread) --------------------------------------
  // The front job's chunks are copied device -> pinned slot ahead of the socket: while chunk k
  // is written, chunks k+1.. are copying. A chunk is written as soon as its copy is done; a
  // copy still running is polled (kStagePoll) with the peer deadline as its bound.
  void pumpStaged(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
    Job& j = s->jobs.front();
    auto t = j.t;
    j.started = true;
    if (!s->stage) {
      s->stage = std::make_unique<StagingRing>(copier_, options_.stageChunkBytes, size_t(options_.stageBuffers),
                                               options_.peerTimeout);
      s->stageFrames.assign(s->stage->slots(), {});
      s->stageHead = 0;
      s->stageCount = 0;
    }
    StagingRing& ring = *s->stage;
    const size_t nSlots = ring.slots();
    while (s->stageCount < nSlots && j.next < j.segs.size()) {
      const size_t slot = (s->stageHead + s->stageCount) % nSlots;
      auto buf = ring.buffer(slot);
      if (!buf.ok()) {
        failStaged(p, s, t, buf.status().withContext("tcp transport: staging buffer"));
        return;
      }
      auto& frames = s->stageFrames[slot];
      frames.clear();
      s->stagePieces.clear();
      size_t off = 0;
      int device = j.segs[j.next].device;
      while (j.next < j.segs.size() && off < ring.slotBytes() && frames.size() < kMaxStagePieces) {
        const Seg& seg = j.segs[j.next];
        if (seg.device != device && !frames.empty()) break;  // one copy batch per device
        const size_t n = std::min(seg.len - j.nextOff, ring.slotBytes() - off);
        char* dst = *buf + off;
        s->stagePieces.push_back({dst, reinterpret_cast<const void*>(seg.local + j.nextOff), n});
        frames.push_back({reinterpret_cast<uintptr_t>(dst), seg.token, seg.remote + j.nextOff, n, -1});
        off += n;
        j.nextOff += n;
        if (j.nextOff == seg.len) {
          j.next++;
          j.nextOff = 0;
        }
      }
      Status st = ring.launch(slot, CopyDirection::kToHost, std::max(device, 0), s->stagePieces, t->id);
      if (!st.isOk()) {
        failStaged(p, s, t, st.withContext("tcp transport: copying GPU memory out"));
        return;
      }
      s->stageCount++;
    }
    if (s->stageCount == 0) {  // defensive: a staged job always has data
      failStaged(p, s, t, internalError("tcp transport: staged job without data"));
      return;
    }
    const size_t head = s->stageHead;
    std::vector<uint64_t> failed;
    Status q = ring.query(head, &failed);
    if (q.inProgress()) {
      if (steadyNow() - ring.launchedAt(head) > options_.peerTimeout) {
        failStaged(p, s, t, deadlineExceeded("tcp transport: a device-to-host copy of transfer " +
                                             std::to_string(t->id) + " did not finish within " +
                                             std::to_string(options_.peerTimeout.count()) + " ms"));
        return;
      }
      armStageTimer(p, s);
      return;
    }
    if (!q.isOk()) {
      failStaged(p, s, t, q.withContext("tcp transport: copying GPU memory out for transfer " + std::to_string(t->id)));
      return;
    }
    s->bufs.clear();
    size_t nh = 0;
    for (const Seg& f : s->stageFrames[head]) appendData(*s, t->id, f, nh);
    if (j.next == j.segs.size() && s->stageCount == 1) appendEnd(*s, t, nh);
    startStagedWrite(p, s, t);
  }

  // A DATA frame for `seg` into s.bufs: its header in slot nh, then the payload gathered
  // straight from seg.local (host memory, or a pinned staging slot): no copy.
  static void appendData(OutStream& s, uint64_t transferId, const Seg& seg, size_t& nh) {
    WireHeader& h = s.hdrs[nh++];
    h = WireHeader{};
    h.type = uint8_t(FrameType::kData);
    h.transferId = transferId;
    h.token = seg.token;
    h.addr = seg.remote;
    h.len = seg.len;
    s.bufs.push_back(asio::buffer(&h, sizeof h));
    s.bufs.push_back(asio::buffer(reinterpret_cast<const void*>(seg.local), seg.len));
  }

  // Ends the stream's front job: its END frame (with the notification when the job carries
  // it) goes into s.bufs after header slot nh, the transfer waits for the receiver's ack,
  // and the job leaves the queue.
  static void appendEnd(OutStream& s, const std::shared_ptr<IoTransfer>& t, size_t& nh) {
    const Job& j = s.jobs.front();
    WireHeader& h = s.hdrs[nh++];
    h = WireHeader{};
    h.type = uint8_t(FrameType::kEnd);
    h.transferId = t->id;
    if (j.withNotify) {
      h.flags = kFlagHasNotification;
      h.len = t->notification->size();
    }
    s.bufs.push_back(asio::buffer(&h, sizeof h));
    if (j.withNotify && !t->notification->empty()) s.bufs.push_back(asio::buffer(*t->notification));
    s.awaitingAck.push_back(t);
    if (j.final) t->finalSent = true;
    s.jobs.pop_front();
  }

  // startWrite's twin for a staged chunk: the head slot is free again once the write is done.
  void startStagedWrite(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                        std::shared_ptr<IoTransfer> t) {
    s->writing = true;
    s->writingFor = t;
    t->writesInFlight++;
    const uint64_t gen = s->stageGen;
    asio::async_write(s->sock, s->bufs, TransferAllInOne{asio::buffer_size(s->bufs)},
                      [this, p, s, t, gen](boost::system::error_code ec, size_t) {
      if (gen == s->stageGen && s->stageCount > 0) {  // the chunk's slot is free again
        s->stageHead = (s->stageHead + 1) % s->stage->slots();
        s->stageCount--;
      }
      onWritten(p, s, t, ec);
    });
  }

  void armStageTimer(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
    if (s->stageTimerArmed) return;
    s->stageTimerArmed = true;
    s->stageTimer.expires_after(kStagePoll);
    s->stageTimer.async_wait([this, p, s](boost::system::error_code ec) {
      s->stageTimerArmed = false;
      if (ec || stopping_) return;
      pump(p, s);
    });
  }

  // Fails the transfer; pump() then drops the front job (an Abort tells the receiver) and the ring.
  void failStaged(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                  const std::shared_ptr<IoTransfer>& t, Status st) {
    PD_LOG(kWarn, "kvt.tcp") << "peer '" << p->name << "': transfer " << t->id << " failed: " << st.message();
    complete(*p, t, std::move(st));
    pump(p, s);
  }

  // Drops the stream's ring: waits (bounded, in the ring's destructor) for copies still reading
  // device memory, then frees the bounce buffers. Never called while a write reads a slot,
  // except from failPeer, whose closed socket no longer reads anything.
  void resetStage(OutStream& s) {
    if (!s.stage) return;
    s.stage.reset();
    s.stageHead = 0;
    s.stageCount = 0;
    s.stageGen++;
  }

  // cancel(): copies of `t` still reading its device memory must be done before cancel returns.
  void quiesceStagedCopies(const std::shared_ptr<IoTransfer>& t) {
    for (auto& p : ioPeers_) {
      for (auto& s : p->streams) {
        if (!s->stage || s->jobs.empty() || s->jobs.front().t != t) continue;
        std::vector<uint64_t> ignored;
        Status st = s->stage->waitAll(steadyNow() + options_.peerTimeout, &ignored);
        if (st.code() == StatusCode::kDeadlineExceeded) {
          PD_LOG(kError, "kvt.tcp") << "cancel of transfer " << t->id << ": " << st.message();
        }
      }
    }
  }

  void readAck(std::shared_ptr<OutPeer> p, std::shared_ptr<OutStream> s) {
    asio::async_read(s->sock, asio::buffer(&s->ackHdr, sizeof(WireHeader)),
                     [this, p, s](boost::system::error_code ec, size_t) {
                       if (ec) {
                         // Aborted = we closed the socket ourselves (failPeer, unload, shutdown).
                         if (!p->dead.load() && ec != asio::error::operation_aborted) {
                           failPeer(p, ec == asio::error::eof ? std::string("connection closed by peer")
                                                              : "read failed: " + ec.message());
                         }
                         return;
                       }
                       const WireHeader& h = s->ackHdr;
                       if (h.magic != kMagic || h.type != uint8_t(FrameType::kAck) || h.len > kMaxAckMessage) {
                         failPeer(p, "protocol error: unexpected frame from the receiver");
                         return;
                       }
                       s->ackMsg.resize(h.len);
                       if (h.len == 0) {
                         onAck(p, s);
                         return;
                       }
                       asio::async_read(s->sock, asio::buffer(s->ackMsg),
                                        [this, p, s](boost::system::error_code ec2, size_t) {
                                          if (ec2) {
                                            if (!p->dead.load()) failPeer(p, "read failed: " + ec2.message());
                                            return;
                                          }
                                          onAck(p, s);
                                        });
                     });
  }

  void onAck(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
    const WireHeader h = s->ackHdr;
    if (s->awaitingAck.empty() || s->awaitingAck.front()->id != h.transferId) {
      failPeer(p, "protocol error: ack for transfer " + std::to_string(h.transferId) + " out of order");
      return;
    }
    auto t = s->awaitingAck.front();
    s->awaitingAck.pop_front();
    p->lastProgress = steadyNow();
    if (!t->done) {
      if ((h.flags & kFlagRefused) && t->status.isOk()) {
        t->status = invalidArgument("tcp transport: peer '" + p->name + "' refused transfer " +
                                    std::to_string(t->id) + ": " + s->ackMsg);
      }
      if (--t->pendingEnds == 0) {
        if (!t->status.isOk()) {
          complete(*p, t, t->status);
        } else if (t->notification && !t->notifyPhase && t->streamsUsed > 1) {
          // Every stream's data has landed: now the notification (one more End frame).
          t->notifyPhase = true;
          if (!t->cancelled.load()) {
            Job j;
            j.t = t;
            j.final = true;
            j.withNotify = true;
            t->pendingEnds = 1;
            p->streams[0]->jobs.push_back(std::move(j));
            pump(p, p->streams[0]);
          }
        } else {
          complete(*p, t, Status::ok());
        }
      }
    }
    readAck(p, s);
  }

  void complete(OutPeer& p, const std::shared_ptr<IoTransfer>& t, Status st) {
    if (t->done) return;
    t->done = true;
    p.active.erase(t->id);
    {
      std::lock_guard lock(completedMu_);
      completed_.push_back({t->id, std::move(st)});
    }
    if (t->writesInFlight == 0) resolveQuiesce(*t);
  }

  void cancelOnIo(const std::shared_ptr<IoTransfer>& t, const std::shared_ptr<std::promise<bool>>& prom) {
    // Past the point of no return: its outcome is known or its notification may be out.
    if (t->done || t->finalSent) {
      prom->set_value(false);
      return;
    }
    t->cancelled = true;
    if (copier_) quiesceStagedCopies(t);
    // Forget it for the peer's liveness accounting; acks still in flight are matched and dropped.
    for (auto& p : ioPeers_) p->active.erase(t->id);
    t->done = true;
    if (t->writesInFlight == 0) {
      prom->set_value(true);
    } else {
      t->quiesceWaiters.push_back(std::move(*prom));
    }
  }

  static void resolveQuiesce(IoTransfer& t) {
    for (auto& w : t.quiesceWaiters) w.set_value(true);
    t.quiesceWaiters.clear();
  }

  void closePeerSockets(OutPeer& p) {
    for (auto& s : p.streams) {
      boost::system::error_code ec;
      s->sock.shutdown(tcp::socket::shutdown_both, ec);
      s->sock.close(ec);
    }
  }

  void failPeer(const std::shared_ptr<OutPeer>& p, const std::string& reason,
                StatusCode code = StatusCode::kUnavailable) {
    if (p->dead.exchange(true)) return;
    {
      std::lock_guard lock(p->reasonMu);
      p->deathReason = reason;
    }
    if (code == StatusCode::kUnavailable && !p->active.empty()) {
      PD_LOG(kWarn, "kvt.tcp") << "peer '" << p->name << "' at " << p->endpoint << ": " << reason
                               << "; failing " << p->active.size() << " pending transfer(s)";
    } else {
      PD_LOG(kDebug, "kvt.tcp") << "peer '" << p->name << "' at " << p->endpoint << ": " << reason;
    }
    closePeerSockets(*p);
    auto active = std::move(p->active);
    p->active.clear();
    for (auto& [id, t] : active) {
      complete(*p, t, Status(code, "tcp transport: peer '" + p->name + "' at " + p->endpoint + ": " + reason));
    }
    for (auto& s : p->streams) {
      s->jobs.clear();
      s->awaitingAck.clear();
      resetStage(*s);
    }
  }

  void armWatchdog() {
    auto period = std::max(std::chrono::milliseconds(10),
                           std::min(std::chrono::milliseconds(200), options_.peerTimeout / 4));
    watchdog_.expires_after(period);
    watchdog_.async_wait([this](boost::system::error_code ec) {
      if (ec || stopping_) return;
      auto now = steadyNow();
      for (auto& p : ioPeers_) {
        if (p->dead.load() || p->active.empty()) continue;
        if (now - p->lastProgress > options_.peerTimeout) {
          failPeer(p, "no progress for " + std::to_string(options_.peerTimeout.count()) +
                          " ms (peer hung or network stalled)");
        }
      }
      armWatchdog();
    });
  }

  // ---- receiver side, I/O thread ------------------------------------------------------------
  void doAccept() {
    auto c = std::make_shared<InConn>(io_);
    acceptor_.async_accept(c->sock, [this, c](boost::system::error_code ec) {
      if (stopping_) {
        closeIn(*c);
        return;
      }
      if (ec) {
        if (ec != asio::error::operation_aborted) {
          PD_LOG(kWarn, "kvt.tcp") << "accept failed: " << ec.message();
          doAccept();
        }
        return;
      }
      boost::system::error_code ig;
      c->sock.set_option(tcp::no_delay(true), ig);
      auto rep = c->sock.remote_endpoint(ig);
      c->remote = rep.address().to_string() + ":" + std::to_string(rep.port());
      inConns_.push_back(c);
      readHeader(c);
      doAccept();
    });
  }

  void closeIn(InConn& c) {
    if (c.closed) return;
    c.closed = true;
    boost::system::error_code ec;
    c.sock.shutdown(tcp::socket::shutdown_both, ec);
    c.sock.close(ec);
  }

  void dropIn(const std::shared_ptr<InConn>& c, const std::string& why, bool warn) {
    if (c->closed) return;
    if (warn) {
      PD_LOG(kWarn, "kvt.tcp") << "closing connection from " << (c->peerName.empty() ? "?" : c->peerName)
                               << " (" << c->remote << "): " << why;
    } else {
      PD_LOG(kDebug, "kvt.tcp") << "connection from " << c->peerName << " (" << c->remote << ") ended: " << why;
    }
    closeIn(*c);
    inConns_.erase(std::remove(inConns_.begin(), inConns_.end(), c), inConns_.end());
  }

  void readHeader(std::shared_ptr<InConn> c) {
    asio::async_read(c->sock, asio::buffer(&c->hdr, sizeof(WireHeader)),
                     [this, c](boost::system::error_code ec, size_t) {
                       if (ec) {
                         dropIn(c, ec.message(), false);
                         return;
                       }
                       onHeader(c);
                     });
  }

  void onHeader(const std::shared_ptr<InConn>& c) {
    const WireHeader& h = c->hdr;
    if (h.magic != kMagic || h.version != kWireVersion) {
      dropIn(c, "protocol error: bad magic or wire version", true);
      return;
    }
    auto type = FrameType(h.type);
    if (!c->helloDone && type != FrameType::kHello) {
      dropIn(c, "protocol error: data before hello", true);
      return;
    }
    switch (type) {
      case FrameType::kHello: {
        if (c->helloDone || h.len > kMaxNameLen) {
          dropIn(c, "protocol error: bad hello", true);
          return;
        }
        if (h.token != instance_) {
          dropIn(c, "hello names another transport instance (stale connection info?)", true);
          return;
        }
        readText(c, h.len, [this, c] {
          c->peerName = c->text;
          c->helloDone = true;
          readHeader(c);
        });
        return;
      }
      case FrameType::kData: {
        uint64_t tid = h.transferId;
        if (c->refused.count(tid) == 0) {
          int device = -1;
          std::string why = validateWrite(h.token, h.addr, h.len, &device);
          if (why.empty() && device >= 0) {
            stagedRead(c, tid, device, h.addr, h.len);
            return;
          }
          if (why.empty()) {
            // A data frame is always followed by another frame (data, end or abort), so the
            // payload and the next header come in one read: half the syscalls for small
            // segments, and the payload still lands straight in place.
            std::array<asio::mutable_buffer, 2> bufs = {
                asio::buffer(reinterpret_cast<void*>(h.addr), h.len),
                asio::buffer(&c->hdr, sizeof(WireHeader))};
            asio::async_read(c->sock, bufs, TransferAllInOne{asio::buffer_size(bufs)},
                             [this, c](boost::system::error_code ec, size_t) {
              if (ec) {
                dropIn(c, ec.message(), false);
                return;
              }
              onHeader(c);
            });
            return;
          }
          PD_LOG(kWarn, "kvt.tcp") << "refusing transfer " << tid << " from '" << c->peerName << "' ("
                                   << c->remote << "): " << why;
          c->refused[tid] = why;
        }
        c->discardLeft = h.len;
        discardPayload(c);
        return;
      }
      case FrameType::kEnd: {
        if (h.len > kMaxNotification) {
          dropIn(c, "protocol error: notification too large", true);
          return;
        }
        bool hasNotify = h.flags & kFlagHasNotification;
        uint64_t tid = h.transferId;
        readText(c, h.len, [this, c, tid, hasNotify] {
          // Staged data must be in device memory before the ack (and the notification).
          if (c->stage && !drainStage(c)) return;
          auto it = c->refused.find(tid);
          if (it != c->refused.end()) {
            sendAck(c, tid, true, it->second);
            c->refused.erase(it);
          } else {
            if (hasNotify) {
              std::lock_guard lock(notifyMu_);
              notifications_.push_back({c->peerName, c->text});
            }
            sendAck(c, tid, false, "");
          }
          readHeader(c);
        });
        return;
      }
      case FrameType::kAbort:
        c->refused.erase(h.transferId);
        readHeader(c);
        return;
      case FrameType::kGroup: {
        if (h.len < sizeof(WireHeader) || h.len > kMaxGroupBytes) {
          dropIn(c, "protocol error: bad group frame length", true);
          return;
        }
        c->group.resize(h.len);
        // Like a data frame, a group is always followed by another frame: read both at once.
        std::array<asio::mutable_buffer, 2> bufs = {asio::buffer(c->group),
                                                    asio::buffer(&c->hdr, sizeof(WireHeader))};
        asio::async_read(c->sock, bufs, TransferAllInOne{asio::buffer_size(bufs)},
                         [this, c](boost::system::error_code ec, size_t) {
                           if (ec) {
                             dropIn(c, ec.message(), false);
                             return;
                           }
                           if (!scatterGroup(c)) return;
                           onHeader(c);
                         });
        return;
      }
      default:
        dropIn(c, "protocol error: unknown frame type " + std::to_string(h.type), true);
        return;
    }
  }

  // Copies each (header, payload) of a group frame into place after the same checks as a
  // data frame; false (connection dropped) when the group is malformed.
  bool scatterGroup(const std::shared_ptr<InConn>& c) {
    const char* p = c->group.data();
    const char* end = p + c->group.size();
    while (p < end) {
      WireHeader h;
      if (size_t(end - p) < sizeof h) {
        dropIn(c, "protocol error: truncated header in a group frame", true);
        return false;
      }
      std::memcpy(&h, p, sizeof h);
      p += sizeof h;
      if (h.magic != kMagic || h.type != uint8_t(FrameType::kData) || h.len > size_t(end - p)) {
        dropIn(c, "protocol error: bad frame inside a group frame", true);
        return false;
      }
      if (c->refused.count(h.transferId) == 0) {
        int device = -1;
        std::string why = validateWrite(h.token, h.addr, h.len, &device);
        if (why.empty() && device >= 0) {
          auto dst = reserveStage(c, h.len);
          if (!dst) return false;
          std::memcpy(*dst, p, h.len);
          launchStaged(c, h.transferId, device, h.addr, *dst, h.len);
        } else if (why.empty()) {
          std::memcpy(reinterpret_cast<void*>(h.addr), p, h.len);
        } else {
          PD_LOG(kWarn, "kvt.tcp") << "refusing transfer " << h.transferId << " from '" << c->peerName << "' ("
                                   << c->remote << "): " << why;
          c->refused[h.transferId] = why;
        }
      }
      p += h.len;
    }
    return true;
  }

  // Empty when [addr, addr+len) lies inside a region this transport registered and exposed
  // under `token`; otherwise the reason, for the sender and the log.
  // *device is the CUDA ordinal when the region is kCuda (the write is staged), -1 otherwise.
  std::string validateWrite(uint64_t token, uint64_t addr, uint64_t len, int* device) {
    std::shared_lock lock(exposuresMu_);
    auto it = exposures_.find(token);
    if (it == exposures_.end()) {
      return "write of " + std::to_string(len) + " bytes at " + hex(addr) +
             " names an unknown or withdrawn exposure token";
    }
    const MemDesc& d = it->second;
    if (addr < d.addr || addr + len < addr || addr + len > d.addr + d.len) {
      return "write of " + std::to_string(len) + " bytes at " + hex(addr) + " is outside the exposed region " +
             toString(d);
    }
    *device = d.kind == MemKind::kCuda ? d.device : -1;
    return {};
  }

  // ---- staging into kCuda exposures, receiver side (I/O thread) ------------------------------
  // Payload bytes are read into the connection's bounce buffers; each piece is copied to the
  // device asynchronously while the next one is read. A buffer is reused only after its copies
  // finished (a short, bounded wait: the device copy is faster than the socket), and every
  // End frame waits for all of the connection's copies before its ack / notification.
  void stagedRead(const std::shared_ptr<InConn>& c, uint64_t tid, int device, uint64_t addr, uint64_t left) {
    if (left == 0) {
      readHeader(c);
      return;
    }
    auto dst = reserveStage(c, 1);
    if (!dst) return;
    const size_t n = std::min<uint64_t>(left, c->stage->slotBytes() - c->stageOff);
    asio::async_read(c->sock, asio::buffer(*dst, n),
                     [this, c, tid, device, addr, left, n, dst = *dst](boost::system::error_code ec, size_t) {
                       if (ec) {
                         dropIn(c, ec.message(), false);
                         return;
                       }
                       launchStaged(c, tid, device, addr, dst, n);
                       if (c->refused.count(tid)) {
                         c->discardLeft = left - n;
                         discardPayload(c);
                         return;
                       }
                       stagedRead(c, tid, device, addr + n, left - n);
                     });
  }

  // Room for `need` bytes in the current bounce buffer, moving to the next one (and waiting for
  // its earlier copies) when full. nullopt when the connection was dropped.
  std::optional<char*> reserveStage(const std::shared_ptr<InConn>& c, size_t need) {
    if (!c->stage) {
      c->stage = std::make_unique<StagingRing>(copier_, options_.stageChunkBytes, size_t(options_.stageBuffers),
                                               options_.peerTimeout);
      c->stageSlot = 0;
      c->stageOff = 0;
    }
    StagingRing& ring = *c->stage;
    if (ring.slotBytes() - c->stageOff < need) {
      c->stageSlot = (c->stageSlot + 1) % ring.slots();
      c->stageOff = 0;
      std::vector<uint64_t> failed;
      Status st = ring.wait(c->stageSlot, steadyNow() + options_.peerTimeout, &failed);
      if (!noteStageErrors(c, st, failed)) return std::nullopt;
    }
    auto buf = ring.buffer(c->stageSlot);
    if (!buf.ok()) {
      dropIn(c, "staging buffer: " + buf.status().message(), true);
      return std::nullopt;
    }
    return *buf + c->stageOff;
  }

  void launchStaged(const std::shared_ptr<InConn>& c, uint64_t tid, int device, uint64_t addr, char* src, size_t n) {
    CopyPiece piece{reinterpret_cast<void*>(addr), src, n};
    Status st = c->stage->launch(c->stageSlot, CopyDirection::kToDevice, device, {&piece, 1}, tid);
    c->stageOff += n;
    if (!st.isOk()) {
      PD_LOG(kWarn, "kvt.tcp") << "transfer " << tid << " from '" << c->peerName << "': " << st.message();
      c->refused.emplace(tid, "copying into GPU memory failed: " + st.message());
    }
  }

  // Waits for every copy of the connection; false when the connection was dropped.
  bool drainStage(const std::shared_ptr<InConn>& c) {
    std::vector<uint64_t> failed;
    Status st = c->stage->waitAll(steadyNow() + options_.peerTimeout, &failed);
    return noteStageErrors(c, st, failed);
  }

  // Failed copies refuse their transfers (the sender sees the reason); a copy that does not
  // finish within the deadline drops the connection (the sender's transfers fail).
  bool noteStageErrors(const std::shared_ptr<InConn>& c, const Status& st, const std::vector<uint64_t>& failed) {
    if (st.code() == StatusCode::kDeadlineExceeded) {
      dropIn(c, "a host-to-device copy did not finish within " + std::to_string(options_.peerTimeout.count()) +
                    " ms", true);
      return false;
    }
    for (uint64_t tid : failed) {
      PD_LOG(kWarn, "kvt.tcp") << "transfer " << tid << " from '" << c->peerName << "': " << st.message();
      c->refused.emplace(tid, "copying into GPU memory failed: " + st.message());
    }
    return true;
  }

  template <typename Fn>
  void readText(const std::shared_ptr<InConn>& c, uint64_t len, Fn&& then) {
    c->text.resize(len);
    if (len == 0) {
      then();
      return;
    }
    asio::async_read(c->sock, asio::buffer(c->text),
                     [this, c, then = std::forward<Fn>(then)](boost::system::error_code ec, size_t) {
                       if (ec) {
                         dropIn(c, ec.message(), false);
                         return;
                       }
                       then();
                     });
  }

  void discardPayload(std::shared_ptr<InConn> c) {
    if (c->discardLeft == 0) {
      readHeader(c);
      return;
    }
    if (c->discard.empty()) c->discard.resize(1 << 20);
    size_t n = std::min<uint64_t>(c->discardLeft, c->discard.size());
    asio::async_read(c->sock, asio::buffer(c->discard.data(), n),
                     [this, c, n](boost::system::error_code ec, size_t) {
                       if (ec) {
                         dropIn(c, ec.message(), false);
                         return;
                       }
                       c->discardLeft -= n;
                       discardPayload(c);
                     });
  }

  void sendAck(const std::shared_ptr<InConn>& c, uint64_t tid, bool refused, const std::string& msg) {
    WireHeader h;
    h.type = uint8_t(FrameType::kAck);
    h.flags = refused ? kFlagRefused : 0;
    h.transferId = tid;
    std::string m = msg.substr(0, kMaxAckMessage);
    h.len = m.size();
    std::string frame(sizeof h, '\0');
    std::memcpy(frame.data(), &h, sizeof h);
    frame += m;
    c->outq.push_back(std::move(frame));
    flushAcks(c);
  }

  void flushAcks(const std::shared_ptr<InConn>& c) {
    if (c->writing || c->outq.empty() || c->closed) return;
    c->writing = true;
    asio::async_write(c->sock, asio::buffer(c->outq.front()), [this, c](boost::system::error_code ec, size_t) {
      c->writing = false;
      if (ec) {
        dropIn(c, ec.message(), false);
        return;
      }
      c->outq.pop_front();
      flushAcks(c);
    });
  }

  TransportOptions options_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_ = asio::make_work_guard(io_);
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  uint64_t instance_;
  asio::steady_timer watchdog_;
  std::thread thread_;

  // Owner thread.
  std::unordered_map<MemHandle, Region> regions_;
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
  std::mutex completedMu_;
  std::vector<Completion> completed_;
  std::mutex notifyMu_;
  std::vector<Notification> notifications_;
};

Result<std::unique_ptr<Transport>> TcpTransport::create(const TransportOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  PD_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<Transport>(new TcpTransport(std::move(impl)));
}

TcpTransport::TcpTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpTransport::~TcpTransport() = default;

TransportCaps TcpTransport::caps() const { return impl_->caps(); }
Result<MemHandle> TcpTransport::registerMemory(const MemDesc& d) { return impl_->registerMemory(d); }
Status TcpTransport::deregisterMemory(MemHandle h) { return impl_->deregisterMemory(h); }
Result<std::string> TcpTransport::packRemoteKey(MemHandle h) { return impl_->packRemoteKey(h); }
Result<std::string> TcpTransport::localConnInfo() { return impl_->localConnInfo(); }
Result<PeerId> TcpTransport::loadPeer(const PeerInfo& p) { return impl_->loadPeer(p); }
Status TcpTransport::unloadPeer(PeerId p) { return impl_->unloadPeer(p); }
Result<TransferId> TcpTransport::post(const DescList& l, const DescList& r, PeerId p,
                                      std::optional<std::string> n) {
  return impl_->post(l, r, p, std::move(n));
}
Status TcpTransport::poll(TransferId id) { return impl_->poll(id); }
Status TcpTransport::cancel(TransferId id) { return impl_->cancel(id); }
bool TcpTransport::progress() { return impl_->progress(); }
std::vector<Notification> TcpTransport::takeNotifications() { return impl_->takeNotifications(); }
void TcpTransport::dropConnections(PeerId p) { impl_->dropConnections(p); }

}  // namespace pd::kvt
