#include "kvtransfer/transports/cma_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "common/base/log.h"
#include "common/base/random.h"
#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/segment_matcher.h"
#include "kvtransfer/transports/blob_codec.h"

namespace pd::kvt {

namespace {

constexpr uint32_t kConnMagic = 0x43414d43;  // "CMAC"
constexpr uint32_t kKeyMagic = 0x4b414d43;   // "CMAK"
constexpr uint32_t kBlobVersion = 1;
constexpr size_t kMaxIov = 1024;  // IOV_MAX: per side of one process_vm_writev
constexpr int kPollTickMs = 50;

using Clock = std::chrono::steady_clock;

std::string errnoText(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

Result<std::string> bootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id) || id.empty()) return unavailable("cma: cannot read /proc/sys/kernel/random/boot_id (no /proc?)");
  return id;
}

Result<uint64_t> pidNamespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0)
    return unavailable("cma: cannot stat /proc/self/ns/pid: " + errnoText(errno));
  return uint64_t(st.st_ino);
}

// The one-character state of a process from /proc/<pid>/stat ("R", "S", "T" = stopped, ...).
std::string processState(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = all.rfind(')');
  if (close == std::string::npos || close + 2 >= all.size()) return "?";
  return all.substr(close + 2, 1);
}

int pidfdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return int(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

// Control-channel messages (SOCK_SEQPACKET keeps their boundaries). Host byte order: both
// ends run on one kernel by construction.
enum MsgType : uint32_t { kHello = 1, kEnd = 2, kAck = 3 };
struct MsgHead {
  uint32_t type = 0;
  uint32_t code = 0;     // ACK: StatusCode
  uint64_t seq = 0;      // END / ACK: the sender's transfer id; HELLO: the target's instance
  uint32_t tokens = 0;   // END: number of u64 exposure tokens that follow
  uint32_t unused = 0;   // 0 (keeps the layout: it flagged a notification, now removed)
  uint32_t nameLen = 0;  // ACK: error message length
  uint32_t pad = 0;
};

struct Batch {
  std::vector<iovec> local, remote;
};

enum class JobState { kCopying, kEnding, kDone };

struct Job {
  TransferId id = 0;
  PeerId peer = 0;
  std::vector<Batch> batches;
  std::vector<uint64_t> tokens;
  JobState state = JobState::kCopying;
  size_t nextBatch = 0;  // next batch a copy thread takes
  size_t doneBatches = 0;
  int activeCopiers = 0;
  bool stop = false;              // cancelled or failed: copy threads take no more batches
  std::optional<Status> error;    // first copy error
  std::optional<Status> outcome;  // set once: what poll() reports
  Clock::time_point ackDeadline{};
};

struct PeerConn {
  std::string name;
  pid_t pid = 0;
  int fd = -1;  // control socket (sender side)
  int pidfd = -1;
  std::vector<KeyRange> keys;
  std::vector<uint64_t> tokens;  // per key
  std::optional<Status> dead;    // set once known dead; later posts fail with it
  bool unloaded = false;
  std::deque<std::string> pendingMsgs;  // ENDs the socket did not take yet, one per message
};

struct Incoming {
  int fd = -1;
  bool greeted = false;
  std::deque<std::string> pendingMsgs;  // ACKs the socket did not take yet
};

class CmaTransport final : public Transport {
 public:
  CmaTransport(const CmaOptions& o, std::string bootId, uint64_t pidNs)
      : opts_(o), bootId_(std::move(bootId)), pidNs_(pidNs), instance_(randomNonZeroU64()) {
    probe_ = instance_;
  }

  Status start() {
    wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wakeFd_ < 0) return unavailable("cma: eventfd: " + errnoText(errno));
    listenFd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listenFd_ < 0) return unavailable("cma: socket(AF_UNIX, SOCK_SEQPACKET): " + errnoText(errno));
    // Abstract name: no file to clean up, and it lives in this network namespace only, so
    // peers in another one (multi-host tests) cannot connect and fall back to tcp.
    socketName_ = "pdserve-kvt-cma-" + std::to_string(::getpid()) + "-" + std::to_string(instance_);
    sockaddr_un addr = abstractAddr(socketName_);
    socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + socketName_.size());
    if (::bind(listenFd_, reinterpret_cast<sockaddr*>(&addr), len) != 0)
      return unavailable("cma: bind of the control socket: " + errnoText(errno));
    if (::listen(listenFd_, 128) != 0) return unavailable("cma: listen: " + errnoText(errno));
    // Does this kernel have CMA at all? A zero-length write to ourselves answers it.
    if (::process_vm_writev(::getpid(), nullptr, 0, nullptr, 0, 0) < 0 && errno == ENOSYS)
      return unavailable("cma: this kernel has no process_vm_writev (CONFIG_CROSS_MEMORY_ATTACH off)");
    io_ = std::thread([this] { ioLoop(); });
    for (int i = 0; i < std::max(1, opts_.copyThreads); ++i) copiers_.emplace_back([this] { copyLoop(); });
    return Status::ok();
  }

  ~CmaTransport() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      for (auto& [id, j] : jobs_) j->stop = true;
    }
    workCv_.notify_all();
    for (auto& t : copiers_) t.join();
    wake();
    if (io_.joinable()) io_.join();
    for (auto& [id, p] : peers_) closePeer(*p);
    for (auto& in : incoming_) ::close(in.fd);
    if (listenFd_ >= 0) ::close(listenFd_);
    if (wakeFd_ >= 0) ::close(wakeFd_);
  }

  TransportCaps caps() const override {
    TransportCaps c;
    c.name = "cma";
    c.oneSided = true;
    c.details =
        "same-node cross-memory attach (process_vm_writev), " + std::to_string(opts_.copyThreads) + " copy threads";
    return c;
  }

  Result<MemHandle> registerMemory(const MemDesc& desc) override {
    if (desc.kind == MemKind::kCuda)
      return unimplemented("cma: cannot register CUDA memory " + toString(desc) +
                           " (cross-memory attach moves host memory only)");
    if (desc.addr == 0 || desc.len == 0)
      return invalidArgument("cma: cannot register an empty region " + toString(desc));
    MemHandle h = nextHandle_++;
    regions_[h] = desc;
    matcher_.addRegion(h, desc);
    return h;
  }

  Status deregisterMemory(MemHandle handle) override {
    auto it = regions_.find(handle);
    if (it == regions_.end()) return notFound("cma: no registration " + std::to_string(handle));
    {
      std::lock_guard lock(mu_);
      for (auto e = exposures_.begin(); e != exposures_.end();) {
        e = (e->second.addr == it->second.addr && e->second.len == it->second.len) ? exposures_.erase(e) : ++e;
      }
    }
    regions_.erase(it);
    matcher_.removeRegion(handle);
    return Status::ok();
  }

  Result<std::string> packRemoteKey(MemHandle handle) override {
    auto it = regions_.find(handle);
    if (it == regions_.end()) return notFound("cma: no registration " + std::to_string(handle));
    proto::CmaRemoteKey key;
    key.set_magic(kKeyMagic);
    key.set_version(kBlobVersion);
    key.set_addr(it->second.addr);
    key.set_len(it->second.len);
    key.set_token(randomNonZeroU64());
    key.set_instance(instance_);
    std::lock_guard lock(mu_);
    exposures_[key.token()] = it->second;
    return key.SerializeAsString();
  }

  Result<std::string> localConnInfo() override {
    proto::CmaConnInfo info;
    info.set_magic(kConnMagic);
    info.set_version(kBlobVersion);
    info.set_boot_id(bootId_);
    info.set_pid_ns(pidNs_);
    info.set_pid(uint32_t(::getpid()));
    info.set_instance(instance_);
    info.set_probe_addr(reinterpret_cast<uintptr_t>(&probe_));
    info.set_socket(socketName_);
    return info.SerializeAsString();
  }

  Result<PeerId> loadPeer(const PeerInfo& peer) override {
    const std::string who = "cma: peer '" + peer.name + "'";
    PD_ASSIGN_OR_RETURN(proto::CmaConnInfo info,
                        parseMagicBlob<proto::CmaConnInfo>(peer.connInfo, kConnMagic, kBlobVersion,
                                                           who + ": connection info", "a cma connection blob"));
    if (!info.has_boot_id() || !info.has_pid_ns() || !info.has_pid() || !info.has_instance() ||
        !info.has_probe_addr() || !info.has_socket())
      return dataLoss(who + ": connection info lacks a field (truncated)");
    if (info.boot_id() != bootId_)
      return unavailable(who + " is on another node (boot id " + info.boot_id() + ", here " + bootId_ +
                         "); cma reaches processes on this node only");
    if (info.pid_ns() != pidNs_)
      return unavailable(who + " runs in another pid namespace (" + std::to_string(info.pid_ns()) + ", here " +
                         std::to_string(pidNs_) +
                         "): its pid means nothing here (share the pid namespace, "
                         "e.g. one pod with shareProcessNamespace, to use cma)");
    auto p = std::make_shared<PeerConn>();
    p->name = peer.name;
    p->pid = pid_t(info.pid());
    p->pidfd = pidfdOpen(p->pid);
    if (p->pidfd < 0 && errno == ESRCH)
      return unavailable(who + ": process " + std::to_string(p->pid) + " does not exist");
    // The probe: the right process (not a reused pid) and the kernel lets us into its memory.
    uint64_t word = 0;
    iovec l{&word, sizeof word};
    iovec r{reinterpret_cast<void*>(uintptr_t(info.probe_addr())), sizeof word};
    ssize_t n = ::process_vm_readv(p->pid, &l, 1, &r, 1, 0);
    if (n != ssize_t(sizeof word)) {
      int e = errno;
      closePeer(*p);
      if (e == EPERM)
        return unavailable(who + ": not permitted to access process " + std::to_string(p->pid) +
                           "'s memory (ptrace access check: another user, a non-dumpable process or Yama "
                           "ptrace_scope)");
      return unavailable(who + ": cross-memory probe of process " + std::to_string(p->pid) +
                         " failed: " + errnoText(e));
    }
    if (word != info.instance()) {
      closePeer(*p);
      return unavailable(who + ": process " + std::to_string(p->pid) + " is not that peer any more (pid reused)");
    }
    p->fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr = abstractAddr(info.socket());
    socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + info.socket().size());
    // A Unix connect completes in the kernel (backlog) without the peer running: never waits on it.
    if (p->fd < 0 || ::connect(p->fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      int e = errno;
      closePeer(*p);
      return unavailable(who + ": cannot reach its control socket (" + errnoText(e) + "; another network namespace?)");
    }
    ::fcntl(p->fd, F_SETFL, ::fcntl(p->fd, F_GETFL) | O_NONBLOCK);
    for (size_t i = 0; i < peer.remoteKeys.size(); ++i) {
      auto key = parseMagicBlob<proto::CmaRemoteKey>(peer.remoteKeys[i], kKeyMagic, kBlobVersion,
                                                     who + ": remote key " + std::to_string(i), "a cma key");
      if (!key.ok()) {
        closePeer(*p);
        return key.status();
      }
      if (key->instance() != info.instance()) {
        closePeer(*p);
        return invalidArgument(who + ": remote key " + std::to_string(i) + " belongs to another transport instance");
      }
      p->keys.push_back(KeyRange{key->addr(), key->len()});
      p->tokens.push_back(key->token());
    }
    MsgHead hello;
    hello.type = kHello;
    hello.seq = info.instance();
    std::string msg(reinterpret_cast<const char*>(&hello), sizeof hello);
    if (::send(p->fd, msg.data(), msg.size(), MSG_NOSIGNAL) != ssize_t(msg.size())) {
      int e = errno;
      closePeer(*p);
      return unavailable(who + ": hello on the control socket failed: " + errnoText(e));
    }
    PeerId id;
    {
      std::lock_guard lock(mu_);
      id = nextPeer_++;
      peers_[id] = std::move(p);
    }
    wake();
    return id;
  }

  // False once the peer is known dead: its pidfd reported the process gone, a write into it
  // failed with ESRCH, or its control socket closed. KV fencing (docs/kvtransfer.md) relies on
  // this: a dead cma peer writes no more into our memory (its writes are its own syscalls).
  bool peerAlive(PeerId peer) const override {
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    return it != peers_.end() && !it->second->dead;
  }

  Status unloadPeer(PeerId peer) override {
    std::vector<std::shared_ptr<Job>> waiting;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return notFound("cma: no peer " + std::to_string(peer));
      it->second->unloaded = true;
      for (auto& [id, j] : jobs_) {
        if (j->peer == peer && !j->outcome)
          finishLocked(*j, cancelled("cma: peer '" + it->second->name + "' unloaded"));
      }
    }
    waitCopiersIdle(peer);
    wake();  // the I/O thread closes its sockets
    return Status::ok();
  }

  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& /*grant*/) override {
    std::shared_ptr<PeerConn> p;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end() || it->second->unloaded) return notFound("cma: no peer " + std::to_string(peer));
      p = it->second;
      if (p->dead) return *p->dead;
    }
    // keys / tokens are written only by loadPeer on this thread: no lock needed to read them.
    PD_ASSIGN_OR_RETURN(auto matches, matcher_.match(local, remote, p->keys, p->name));
    auto job = std::make_shared<Job>();
    job->peer = peer;
    std::set<size_t> keysUsed;
    Batch cur;
    size_t curBytes = 0;
    auto flush = [&] {
      if (!cur.local.empty()) job->batches.push_back(std::move(cur));
      cur = Batch{};
      curBytes = 0;
    };
    for (const auto& m : matches) {
      keysUsed.insert(m.key);
      const MemDesc& a = local[m.index];
      const MemDesc& b = remote[m.index];
      for (size_t off = 0; off < a.len;) {
        size_t n = std::min(a.len - off, opts_.sliceBytes - curBytes);
        cur.local.push_back({reinterpret_cast<void*>(a.addr + off), n});
        cur.remote.push_back({reinterpret_cast<void*>(b.addr + off), n});
        curBytes += n;
        off += n;
        if (curBytes >= opts_.sliceBytes || cur.local.size() >= kMaxIov) flush();
      }
    }
    flush();
    for (size_t k : keysUsed) job->tokens.push_back(p->tokens[k]);
    {
      std::lock_guard lock(mu_);
      job->id = nextTransfer_++;
      jobs_[job->id] = job;
      if (job->batches.empty()) {
        job->state = JobState::kEnding;
        endQueue_.push_back(job);
      } else {
        copyQueue_.push_back(job);
      }
    }
    if (job->batches.empty()) {
      wake();
    } else {
      workCv_.notify_all();
    }
    return job->id;
  }

  Status poll(TransferId id) override {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return notFound("cma: transfer " + std::to_string(id) + " is unknown or already reported");
    Job& j = *it->second;
    // An outcome is reported only once no copy thread is inside the transfer (cancel and
    // failure promise the local memory is no longer read).
    if (!j.outcome || j.activeCopiers > 0) return Status(StatusCode::kInProgress, "");
    Status st = *j.outcome;
    jobs_.erase(it);
    return st;
  }

  Status cancel(TransferId id) override {
    std::shared_ptr<Job> j;
    {
      std::lock_guard lock(mu_);
      auto it = jobs_.find(id);
      if (it == jobs_.end()) return notFound("cma: transfer " + std::to_string(id) + " is unknown");
      j = it->second;
      if (j->outcome) return failedPrecondition("cma: transfer " + std::to_string(id) + " already finished");
      if (j->state != JobState::kCopying)
        return failedPrecondition("cma: transfer " + std::to_string(id) +
                                  " has written all its data and its END is on its way");
      finishLocked(*j, cancelled("cma: transfer " + std::to_string(id) + " was cancelled"));
    }
    // Bounded by one batch per copy thread: they never wait on the peer.
    std::unique_lock lock(mu_);
    idleCv_.wait(lock, [&] { return j->activeCopiers == 0; });
    return Status::ok();
  }

  bool progress() override {
    std::lock_guard lock(mu_);
    bool any = changed_;
    changed_ = false;
    return any;
  }

 private:
  static sockaddr_un abstractAddr(const std::string& name) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    a.sun_path[0] = '\0';
    std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof a.sun_path - 2));
    return a;
  }
  void wake() {
    uint64_t one = 1;
    if (wakeFd_ >= 0) (void)!::write(wakeFd_, &one, sizeof one);
  }
  static void closePeer(PeerConn& p) {
    if (p.fd >= 0) ::close(p.fd);
    if (p.pidfd >= 0) ::close(p.pidfd);
    p.fd = p.pidfd = -1;
  }

  // mu_ held. Sets the outcome once and stops the copy threads taking its batches.
  void finishLocked(Job& j, Status st) {
    if (j.outcome) return;
    j.outcome = std::move(st);
    j.stop = true;
    j.state = JobState::kDone;
    changed_ = true;
  }

  void waitCopiersIdle(PeerId peer) {
    std::unique_lock lock(mu_);
    idleCv_.wait(lock, [&] {
      for (auto& [id, j] : jobs_) {
        if (j->peer == peer && j->activeCopiers > 0) return false;
      }
      return true;
    });
  }

  // mu_ held: a peer is dead; every transfer to it fails and later posts fail at once.
  void markDeadLocked(PeerId id, PeerConn& p, const std::string& why) {
    if (!p.dead) {
      p.dead = unavailable("cma: peer '" + p.name + "' (pid " + std::to_string(p.pid) + ") " + why);
      PD_LOG(kWarn, "kvt") << p.dead->message();
    }
    for (auto& [tid, j] : jobs_) {
      if (j->peer == id && !j->outcome) finishLocked(*j, *p.dead);
    }
  }

  void copyLoop() {
    std::unique_lock lock(mu_);
    while (true) {
      workCv_.wait(lock, [&] { return stopping_ || !copyQueue_.empty(); });
      if (stopping_) return;
      std::shared_ptr<Job> j = copyQueue_.front();
      if (j->stop || j->nextBatch >= j->batches.size()) {
        copyQueue_.pop_front();
        continue;
      }
      size_t b = j->nextBatch++;
      if (j->nextBatch >= j->batches.size()) copyQueue_.pop_front();
      std::shared_ptr<PeerConn> peer;
      if (auto pit = peers_.find(j->peer); pit != peers_.end()) peer = pit->second;
      const pid_t pid = peer ? peer->pid : 0;
      ++j->activeCopiers;
      lock.unlock();
      const Batch& batch = j->batches[b];
      size_t want = 0;
      for (const auto& v : batch.local) want += v.iov_len;
      ssize_t n = pid ? ::process_vm_writev(pid, batch.local.data(), batch.local.size(), batch.remote.data(),
                                            batch.remote.size(), 0)
                      : -1;
      int e = errno;
      lock.lock();
      --j->activeCopiers;
      if (n == ssize_t(want)) {
        ++j->doneBatches;
      } else if (!j->outcome) {
        std::string peerName = peer ? peer->name : "?";
        if (n < 0 && e == ESRCH && peer) {
          markDeadLocked(j->peer, *peer, "exited (a write into it failed with ESRCH)");
          wake();  // the I/O thread closes its sockets
        } else {
          finishLocked(*j, n < 0 ? unavailable("cma: writing transfer " + std::to_string(j->id) + " into peer '" +
                                               peerName + "' failed: " + errnoText(e))
                                 : dataLoss("cma: transfer " + std::to_string(j->id) + " into peer '" + peerName +
                                            "': short write (" + std::to_string(n) + " of " + std::to_string(want) +
                                            " bytes; its region is not mapped?)"));
        }
      }
      if (!j->outcome && j->doneBatches == j->batches.size()) {
        j->state = JobState::kEnding;
        endQueue_.push_back(j);
        wake();
      }
      if (j->activeCopiers == 0) idleCv_.notify_all();
    }
  }

  // ---- I/O thread ---------------------------------------------------------------------------

  void sendQueued(int fd, std::deque<std::string>& q, std::string* err) {
    while (!q.empty()) {
      ssize_t n = ::send(fd, q.front().data(), q.front().size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0) {
        *err = errnoText(errno);
        return;
      }
      q.pop_front();
    }
  }

  // mu_ held: turns ENDs whose data is in place into messages for their peers' sockets.
  void queueEndsLocked() {
    for (auto& j : endQueue_) {
      if (j->outcome) continue;
      auto pit = peers_.find(j->peer);
      if (pit == peers_.end()) continue;
      MsgHead h;
      h.type = kEnd;
      h.seq = j->id;
      h.tokens = uint32_t(j->tokens.size());
      std::string m(reinterpret_cast<const char*>(&h), sizeof h);
      m.append(reinterpret_cast<const char*>(j->tokens.data()), j->tokens.size() * sizeof(uint64_t));
      pit->second->pendingMsgs.push_back(std::move(m));
      j->ackDeadline = Clock::now() + opts_.peerTimeout;
    }
    endQueue_.clear();
  }

  void handleIncoming(Incoming& in) {
    char buf[sizeof(MsgHead) + 72 * 1024];  // END: up to 9,216 exposure tokens
    while (true) {
      ssize_t n = ::recv(in.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        ::close(in.fd);
        in.fd = -1;
        return;
      }
      if (size_t(n) < sizeof(MsgHead)) continue;
      MsgHead h;
      std::memcpy(&h, buf, sizeof h);
      const char* body = buf + sizeof h;
      size_t bodyLen = size_t(n) - sizeof h;
      if (h.type == kHello) {
        // Only a sender that read our connection info (the control plane) knows the instance.
        if (h.seq != instance_) {
          PD_LOG(kWarn, "kvt") << "cma: refused a control connection that does not name this transport";
          ::close(in.fd);
          in.fd = -1;
          return;
        }
        in.greeted = true;
      } else if (h.type == kEnd && in.greeted) {
        size_t tokBytes = size_t(h.tokens) * sizeof(uint64_t);
        if (tokBytes > bodyLen) continue;
        MsgHead ack;
        ack.type = kAck;
        ack.seq = h.seq;
        std::string why;
        {
          std::lock_guard lock(mu_);
          for (uint32_t i = 0; i < h.tokens && why.empty(); ++i) {
            uint64_t t;
            std::memcpy(&t, body + i * sizeof t, sizeof t);
            if (!exposures_.count(t))
              why = "cma: peer '" + opts_.localName + "' reports transfer " + std::to_string(h.seq) +
                    " wrote into an exposure it has withdrawn (deregistered); the bytes landed";
          }
        }
        if (!why.empty()) {
          PD_LOG(kWarn, "kvt") << why;
          ack.code = uint32_t(StatusCode::kInvalidArgument);
          ack.nameLen = uint32_t(why.size());
        }
        std::string m(reinterpret_cast<const char*>(&ack), sizeof ack);
        m += why;
        in.pendingMsgs.push_back(std::move(m));
      }
    }
  }

  // mu_ held.
  void handleAcksLocked(PeerId id, PeerConn& p) {
    char buf[sizeof(MsgHead) + 4096];
    while (p.fd >= 0) {
      ssize_t n = ::recv(p.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        markDeadLocked(id, p,
                       n == 0 ? "closed its control socket (exited?)" : "control socket error: " + errnoText(errno));
        return;
      }
      if (size_t(n) < sizeof(MsgHead)) continue;
      MsgHead h;
      std::memcpy(&h, buf, sizeof h);
      if (h.type != kAck) continue;
      auto it = jobs_.find(h.seq);
      if (it == jobs_.end() || it->second->outcome || it->second->peer != id) continue;  // late ACK
      if (h.code == 0) {
        finishLocked(*it->second, Status::ok());
      } else {
        size_t len = std::min<size_t>(h.nameLen, size_t(n) - sizeof h);
        finishLocked(*it->second, Status(StatusCode(h.code), std::string(buf + sizeof h, len)));
      }
    }
  }

  void ioLoop() {
    std::vector<pollfd> fds;
    enum Kind { kWake, kListen, kIn, kPeerSock, kPeerPid };
    std::vector<std::pair<Kind, uint64_t>> what;
    while (true) {
      fds.clear();
      what.clear();
      fds.push_back({wakeFd_, POLLIN, 0});
      what.push_back({kWake, 0});
      fds.push_back({listenFd_, POLLIN, 0});
      what.push_back({kListen, 0});
      {
        std::lock_guard lock(mu_);
        if (stopping_) return;
        queueEndsLocked();
        // Unloaded peers: close their sockets here, where they are polled.
        for (auto it = peers_.begin(); it != peers_.end();) {
          if (it->second->unloaded) {
            closePeer(*it->second);
            it = peers_.erase(it);
          } else {
            ++it;
          }
        }
        for (auto& [id, p] : peers_) {
          // A dead peer's sockets are closed here, where they are polled (never under poll()).
          if (p->dead) {
            closePeer(*p);
            continue;
          }
          if (p->fd >= 0 && !p->pendingMsgs.empty()) {
            std::string err;
            sendQueued(p->fd, p->pendingMsgs, &err);
            if (!err.empty()) markDeadLocked(id, *p, "control socket send failed: " + err);
          }
          if (p->fd >= 0) {
            fds.push_back({p->fd, short(POLLIN | (p->pendingMsgs.empty() ? 0 : POLLOUT)), 0});
            what.push_back({kPeerSock, id});
          }
          if (p->pidfd >= 0) {
            fds.push_back({p->pidfd, POLLIN, 0});
            what.push_back({kPeerPid, id});
          }
        }
        // A stalled peer: END sent, no ACK within peerTimeout.
        auto now = Clock::now();
        for (auto& [tid, j] : jobs_) {
          if (j->outcome || j->state != JobState::kEnding || j->ackDeadline == Clock::time_point{} ||
              now < j->ackDeadline)
            continue;
          auto pit = peers_.find(j->peer);
          std::string name = pit != peers_.end() ? pit->second->name : "?";
          pid_t pid = pit != peers_.end() ? pit->second->pid : 0;
          std::string state = pid ? processState(pid) : "?";
          finishLocked(*j, unavailable("cma: peer '" + name + "' (pid " + std::to_string(pid) + ", process state " +
                                       state + (state == "T" ? ", stopped" : "") + ") did not acknowledge transfer " +
                                       std::to_string(tid) + " within " + std::to_string(opts_.peerTimeout.count()) +
                                       " ms: the data was written but the peer is not running its transport"));
        }
      }
      for (size_t i = 0; i < incoming_.size(); ++i) {
        std::string err;
        sendQueued(incoming_[i].fd, incoming_[i].pendingMsgs, &err);
        fds.push_back({incoming_[i].fd, short(POLLIN | (incoming_[i].pendingMsgs.empty() ? 0 : POLLOUT)), 0});
        what.push_back({kIn, i});
      }
      int r = ::poll(fds.data(), fds.size(), kPollTickMs);
      if (r < 0 && errno != EINTR) {
        PD_LOG(kError, "kvt") << "cma: poll failed: " << errnoText(errno);
        std::this_thread::sleep_for(std::chrono::milliseconds(kPollTickMs));
      }
      if (r <= 0) continue;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        auto [kind, ref] = what[i];
        if (kind == kWake) {
          uint64_t v;
          (void)!::read(wakeFd_, &v, sizeof v);
        } else if (kind == kListen) {
          while (true) {
            int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) break;
            incoming_.push_back(Incoming{fd, false, {}});
          }
        } else if (kind == kIn) {
          handleIncoming(incoming_[ref]);
        } else {
          std::lock_guard lock(mu_);
          auto pit = peers_.find(ref);
          if (pit == peers_.end()) continue;
          if (kind == kPeerPid) {
            markDeadLocked(ref, *pit->second, "exited (its pidfd reported the process gone)");
          } else {
            handleAcksLocked(ref, *pit->second);
          }
        }
      }
      incoming_.erase(std::remove_if(incoming_.begin(), incoming_.end(), [](const Incoming& in) { return in.fd < 0; }),
                      incoming_.end());
    }
  }

  CmaOptions opts_;
  std::string bootId_;
  uint64_t pidNs_;
  uint64_t instance_;
  volatile uint64_t probe_ = 0;  // peers read it by process_vm_readv
  std::string socketName_;
  int wakeFd_ = -1, listenFd_ = -1;

  // Owner thread only.
  std::unordered_map<MemHandle, MemDesc> regions_;
  SegmentMatcher matcher_{"cma"};
  MemHandle nextHandle_ = 1;

  // mu_ guards everything below (owner, copy threads and I/O thread meet here).
  mutable std::mutex mu_;
  std::condition_variable workCv_, idleCv_;
  bool stopping_ = false;
  bool changed_ = false;
  std::unordered_map<uint64_t, MemDesc> exposures_;
  std::unordered_map<PeerId, std::shared_ptr<PeerConn>> peers_;
  std::unordered_map<TransferId, std::shared_ptr<Job>> jobs_;
  std::deque<std::shared_ptr<Job>> copyQueue_;
  std::vector<std::shared_ptr<Job>> endQueue_;
  PeerId nextPeer_ = 1;
  TransferId nextTransfer_ = 1;

  std::vector<Incoming> incoming_;  // I/O thread only
  std::thread io_;
  std::vector<std::thread> copiers_;
};

}  // namespace

CmaOptions cmaOptionsFrom(const TransportOptions& options) {
  CmaOptions o;
  o.localName = options.localName;
  o.peerTimeout = options.peerTimeout;
  auto num = [&](const char* key, auto* out) {
    auto it = options.extra.find(key);
    if (it == options.extra.end()) return;
    long long v = 0;
    const std::string& s = it->second;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || v <= 0) {
      PD_LOG(kWarn, "kvt") << "cma: ignoring " << key << "='" << s << "' (not a positive integer)";
      return;
    }
    *out = decltype(+*out)(v);
  };
  num("cma.threads", &o.copyThreads);
  num("cma.slice_bytes", &o.sliceBytes);
  return o;
}

Result<std::unique_ptr<Transport>> makeCmaTransport(const CmaOptions& options) {
  PD_ASSIGN_OR_RETURN(std::string boot, bootId());
  PD_ASSIGN_OR_RETURN(uint64_t ns, pidNamespace());
  auto t = std::make_unique<CmaTransport>(options, std::move(boot), ns);
  PD_RETURN_IF_ERROR(t->start());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pd::kvt
