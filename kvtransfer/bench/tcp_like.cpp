// TcpLike: the tcp transport's like-for-like ceiling (tcp_like.h says what "like" covers).
#include "kvtransfer/bench/tcp_like.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "kvtransfer/transports/tcp/tcp_batching.h"

namespace pd::kvt::bench {
namespace {

using namespace pd::kvt::tcpimpl;

// Frame header with the transport's size; only type, len and addr mean anything here.
struct RawHeader {
  uint32_t magic = 0;
  uint8_t type = 0;
  uint8_t flags = 0;
  uint16_t version = 0;
  uint64_t transferId = 0;
  uint64_t token = 0;
  uint64_t addr = 0;  // data frames: offset into the receiver's memory
  uint64_t len = 0;
};
static_assert(sizeof(RawHeader) == kWireHeaderBytes, "the transport's header size");
enum : uint8_t { kData = 2, kEnd = 3, kGroup = 6 };

constexpr size_t kAsioMaxIov = 64;  // boost/asio/detail/buffer_sequence_adapter.hpp max_buffers

void setNonBlocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }
void setNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Drops n bytes from the front of iov[*at..]; *at moves past emptied entries.
void consume(std::vector<iovec>& iov, size_t* at, size_t n) {
  while (n > 0 && *at < iov.size()) {
    size_t take = std::min(n, iov[*at].iov_len);
    iov[*at].iov_base = static_cast<char*>(iov[*at].iov_base) + take;
    iov[*at].iov_len -= take;
    n -= take;
    if (iov[*at].iov_len == 0) ++*at;
  }
  while (*at < iov.size() && iov[*at].iov_len == 0) ++*at;
}

// One gathered write of the transport (one pump() batch) and the headers it points into.
struct Write {
  std::unique_ptr<RawHeader[]> hdrs{new RawHeader[kMaxBatchBuffers]};
  std::vector<iovec> iov;
};

struct Piece {
  uintptr_t local = 0;
  uint64_t offset = 0;  // in the receiver's memory
  size_t len = 0;
};

// The batches of tcp_sender.cpp pump() for one stream's pieces, in order.
std::vector<Write> planStream(const std::vector<Piece>& segs) {
  std::vector<Write> out;
  size_t next = 0;
  while (true) {
    Write w;
    size_t nh = 0, bytes = 0;
    auto addData = [&](const Piece& p) {
      RawHeader& h = w.hdrs[nh++];
      h.type = kData;
      h.addr = p.offset;
      h.len = p.len;
      w.iov.push_back({&h, sizeof h});
      w.iov.push_back({reinterpret_cast<void*>(p.local), p.len});
      bytes += p.len;
    };
    while (next < segs.size() && w.iov.size() + 4 <= kMaxBatchBuffers && bytes < kMaxBatchBytes) {
      if (segs[next].len >= kSmallPayload) {
        addData(segs[next++]);
        continue;
      }
      if (w.iov.size() + 5 > kMaxBatchBuffers) break;
      RawHeader& g = w.hdrs[nh++];
      g.type = kGroup;
      w.iov.push_back({&g, sizeof g});
      const size_t before = bytes;
      size_t inner = 0;
      while (next < segs.size() && segs[next].len < kSmallPayload && w.iov.size() + 4 <= kMaxBatchBuffers &&
             bytes < kMaxBatchBytes) {
        addData(segs[next++]);
        ++inner;
      }
      g.len = (bytes - before) + inner * sizeof(RawHeader);
    }
    const bool endNow = next == segs.size() && w.iov.size() + 2 <= kMaxBatchBuffers;
    if (endNow) {
      RawHeader& e = w.hdrs[nh++];
      e.type = kEnd;
      w.iov.push_back({&e, sizeof e});
    }
    out.push_back(std::move(w));
    if (endNow) return out;
  }
}

// ---- receiver -----------------------------------------------------------------------------------
struct InConn {
  int fd = -1;
  RawHeader hdr;
  RawHeader done;          // the 40 bytes that end a stream's share
  std::vector<iovec> iov;  // the read in progress
  size_t at = 0;
  std::vector<char> group;
  bool dead = false;
};

void readHeaderNext(InConn& c) {
  c.iov = {{&c.hdr, sizeof c.hdr}};
  c.at = 0;
}

void sendDone(InConn& c) {
  size_t off = 0;
  while (off < sizeof c.done) {
    ssize_t n = ::send(c.fd, reinterpret_cast<char*>(&c.done) + off, sizeof c.done - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += size_t(n);
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p{c.fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
    } else {
      c.dead = true;
      return;
    }
  }
}

// The read just completed: the header in c.hdr says what comes next.
void onRead(InConn& c, uint8_t* dest, size_t destBytes) {
  const RawHeader& h = c.hdr;
  switch (h.type) {
    case kData:
      if (h.addr > destBytes || h.len > destBytes - h.addr) {
        c.dead = true;
        return;
      }
      c.iov = {{dest + h.addr, h.len}, {&c.hdr, sizeof c.hdr}};
      break;
    case kGroup:
      c.group.resize(h.len);
      c.iov = {{c.group.data(), h.len}, {&c.hdr, sizeof c.hdr}};
      break;
    case kEnd:
      sendDone(c);
      readHeaderNext(c);
      return;
    default:
      c.dead = true;
      return;
  }
  c.at = 0;
}

// The receiver's one I/O thread: every connection's reads, readv first, poll when none can move.
// A connection is read until its readv would block, then waits for poll() to say it is
// readable again (Asio: a speculative read, then the reactor), so no syscall is wasted.
void readLoop(std::vector<InConn>& conns, uint8_t* dest, size_t destBytes, const std::atomic<bool>& stop) {
  std::vector<bool> ready(conns.size(), true);
  for (auto& c : conns) readHeaderNext(c);
  while (!stop.load()) {
    std::vector<pollfd> ps;
    std::vector<size_t> which;
    for (size_t i = 0; i < conns.size(); ++i) {
      InConn& c = conns[i];
      while (ready[i] && !c.dead) {
        ssize_t n = ::readv(c.fd, c.iov.data() + c.at, int(c.iov.size() - c.at));
        if (n > 0) {
          consume(c.iov, &c.at, size_t(n));
          if (c.at == c.iov.size()) onRead(c, dest, destBytes);
          continue;
        }
        if (n == 0 || errno != EAGAIN) c.dead = true;
        ready[i] = false;
      }
      if (!c.dead) {
        ps.push_back({c.fd, POLLIN, 0});
        which.push_back(i);
      }
    }
    if (ps.empty()) return;
    if (::poll(ps.data(), ps.size(), 100) <= 0) continue;
    for (size_t k = 0; k < ps.size(); ++k) {
      if (ps[k].revents) ready[which[k]] = true;
    }
  }
}

}  // namespace

TcpLikeReceiver::TcpLikeReceiver(int streams, uint8_t* dest, size_t destBytes) {
  listenFd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(listenFd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listenFd_, 16) != 0 ||
      ::getsockname(listenFd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    return;
  }
  port_ = ntohs(a.sin_port);
  reader_ = std::thread([this, streams, dest, destBytes] {
    std::vector<InConn> conns(size_t(std::max(streams, 1)));
    for (auto& c : conns) {
      pollfd p{listenFd_, POLLIN, 0};
      while (!stop_.load() && ::poll(&p, 1, 100) <= 0) {
      }
      if (stop_.load() || (c.fd = ::accept(listenFd_, nullptr, nullptr)) < 0) return;
      setNoDelay(c.fd);
      setNonBlocking(c.fd);
    }
    readLoop(conns, dest, destBytes, stop_);
    for (auto& c : conns) ::close(c.fd);
  });
}

TcpLikeReceiver::~TcpLikeReceiver() {
  stop_ = true;
  if (reader_.joinable()) reader_.join();
  if (listenFd_ >= 0) ::close(listenFd_);
}

TcpLike::TcpLike(int streams, int port) {
  if (port <= 0) return;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < std::max(streams, 1); ++i) {
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(s);
      for (int fd : fds_) ::close(fd);
      fds_.clear();
      return;
    }
    setNoDelay(s);
    setNonBlocking(s);
    fds_.push_back(s);
  }
}

TcpLike::~TcpLike() {
  for (int fd : fds_) ::close(fd);
}

double TcpLike::measure(const DescList& local, const DescList& remote, uintptr_t remoteBase) {
  return measureMany({Transfer{local, remote}}, remoteBase);
}

double TcpLike::measureMany(const std::vector<Transfer>& transfers, uintptr_t remoteBase) {
  if (fds_.empty()) return 0;
  struct Out {
    int fd = -1;
    std::vector<Write> writes;
    size_t w = 0, at = 0;
    size_t dones = 0;  // expected: one per transfer this stream carries
    RawHeader done;
    size_t doneGot = 0;  // bytes of all of its dones so far
    bool ready = true;   // the last call did not block
    bool active() const { return doneGot < dones * sizeof done; }
  };
  const size_t nStreams = fds_.size();
  std::vector<Out> outs(nStreams);
  size_t total = 0;
  for (const Transfer& tr : transfers) {
    if (tr.local.size() != tr.remote.size()) return 0;
    // Striping as TcpTransport::Impl::post().
    std::vector<std::vector<Piece>> perStream(nStreams);
    size_t bytes = 0, s = 0;
    for (const MemDesc& d : tr.local) bytes += d.len;
    total += bytes;
    for (size_t i = 0; i < tr.local.size(); ++i) {
      const uint64_t off = tr.remote[i].addr - remoteBase;
      if (nStreams == 1 || bytes < kStripeMinBytes) {
        perStream[0].push_back({tr.local[i].addr, off, tr.local[i].len});
        continue;
      }
      for (size_t o = 0; o < tr.local[i].len; o += kStripeChunk) {
        perStream[s].push_back({tr.local[i].addr + o, off + o, std::min(kStripeChunk, tr.local[i].len - o)});
        s = (s + 1) % nStreams;
      }
    }
    for (size_t i = 0; i < nStreams; ++i) {
      if (perStream[i].empty()) continue;
      auto ws = planStream(perStream[i]);
      for (auto& w : ws) outs[i].writes.push_back(std::move(w));
      outs[i].dones++;
    }
  }
  for (size_t i = 0; i < nStreams; ++i) outs[i].fd = fds_[i];
  std::erase_if(outs, [](const Out& o) { return o.dones == 0; });
  // Each stream writes (or reads its "done") until the call would block, then waits for poll().
  auto t = Clock::now();
  for (size_t left = outs.size(); left > 0;) {
    std::vector<pollfd> ps;
    std::vector<Out*> which;
    for (auto& o : outs) {
      while (o.ready && o.active() && o.w < o.writes.size()) {
        auto& iov = o.writes[o.w].iov;
        const int cnt = int(std::min(kAsioMaxIov, iov.size() - o.at));
        ssize_t n = ::writev(o.fd, iov.data() + o.at, cnt);
        if (n < 0 && errno == EAGAIN) {
          o.ready = false;
          break;
        }
        if (n <= 0) return 0;
        consume(iov, &o.at, size_t(n));
        if (o.at == iov.size()) {
          ++o.w;
          o.at = 0;
        }
      }
      while (o.ready && o.active() && o.w == o.writes.size()) {
        const size_t in = o.doneGot % sizeof o.done;
        ssize_t n = ::recv(o.fd, reinterpret_cast<char*>(&o.done) + in, sizeof o.done - in, 0);
        if (n < 0 && errno == EAGAIN) {
          o.ready = false;
          break;
        }
        if (n <= 0) return 0;
        o.doneGot += size_t(n);
        if (!o.active()) --left;
      }
      if (o.active()) {
        ps.push_back({o.fd, short(o.w < o.writes.size() ? POLLOUT : POLLIN), 0});
        which.push_back(&o);
      }
    }
    if (left == 0) break;
    if (::poll(ps.data(), ps.size(), 10000) <= 0) return 0;  // stuck for 10 s: no figure
    for (size_t k = 0; k < ps.size(); ++k) {
      if (ps[k].revents) which[k]->ready = true;
    }
  }
  return gbps(total, secondsSince(t));
}

}  // namespace pd::kvt::bench
