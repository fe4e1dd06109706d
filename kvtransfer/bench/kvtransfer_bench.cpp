// kvtransfer-bench: throughput and latency of every transport built in, between two
// processes on this machine, each next to a LIKE-FOR-LIKE ceiling measured in the same run on
// the same lanes, the same segments and the same error-handling mode (docs/kvtransfer.md):
//   - cma: raw process_vm_writev of the same segment list into the same receiver process, with
//     the transport's thread count and batching (<= slice bytes, <= 1,024 iovecs per call);
//     single-thread memcpy is printed too, as the memory ceiling;
//   - tcp: raw loopback TCP moving the transport's own frames: its stream count, batches,
//     readv/writev sizes, socket options and one I/O thread per side, into the transport's
//     receiver process and buffer, without validation or acks (tcp_like.h);
//     plain 1-stream sockets (best of 64 KiB / 256 KiB / 4 MiB) are printed for reference;
//   - ucx: ucx_perftest ucp_put_bw at each segment size with the same UCX_TLS (inherited) and
//     -e (peer error handling, as the transport's endpoints), when ucx_perftest is installed
//     (Debian ucx-utils); the figure without -e is printed as what shared memory would give.
//     When the transport beats perftest -e at any size, perftest bounds nothing on that lane
//     and no ucx ratio is printed (n/a*; docs/kvtransfer.md "ucx: no like-for-like ceiling").
// A ceiling the transport beats by more than 10% gets no ratio (n/a*) in any table.
// The table prints transport GB/s, ceiling GB/s and their ratio for 4 KiB .. 64 MiB segments
// and the realistic case: the KV of a 4,096-token prompt of a Llama-3-8B-shaped layout (32
// layers, 8 KV heads, head dim 128, bf16, 16-token blocks: 512 MiB in 8,192 segments of 64
// KiB, scattered blocks), sent whole and layer by layer; then the KV of a 2,048-token prompt of
// that shape in each KV dtype the engine stores (f32, bf16, int8 and fp8 with their scales):
// bytes and transfer time per token, each next to the same lane's ceiling.
// Last, tcp staged GPU memory (device to device through pinned bounce buffers; skipped
// without a CUDA device) and a wire-time projection.
//
//   kvtransfer-bench [--transports tcp,ucx] [--streams N] [--quick]
//
// The receiving process is this binary re-executed with --role recv (or --role rawrecv for the
// plain-socket reference).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/base/cli.h"
#include "kvtransfer/bench/bench_util.h"
#include "kvtransfer/bench/tcp_like.h"
#include "kvtransfer/block_segments.h"
#include "kvtransfer/transport_factory.h"
#if PD_HAVE_CMA
#include "kvtransfer/transports/cma_transport.h"
#endif

namespace pd::kvt::bench {
void runStagedGpu(bool quick);  // staged_gpu_bench.cpp
namespace {

std::string hexOf(const std::string& b) {
  static const char* d = "0123456789abcdef";
  std::string o;
  for (unsigned char c : b) {
    o += d[c >> 4];
    o += d[c & 15];
  }
  return o.empty() ? "-" : o;
}
std::string unhex(const std::string& h) {
  std::string o;
  if (h == "-") return o;
  for (size_t i = 0; i + 1 < h.size(); i += 2) o += char(std::stoi(h.substr(i, 2), nullptr, 16));
  return o;
}

std::string sizeName(size_t n) {
  if (n >= kMiB && n % kMiB == 0) return std::to_string(n / kMiB) + " MiB";
  if (n >= kKiB && n % kKiB == 0) return std::to_string(n / kKiB) + " KiB";
  return std::to_string(n) + " B";
}

// Receiver for the transports: registers and exposes `bytes`, prints its PeerInfo, serves
// until QUIT (the transport's I/O thread writes the data; this loop only harvests).
int runReceiver(const std::string& name, size_t bytes, int streams) {
  TransportOptions o;
  o.localName = "bench-recv";
  auto t = makeTransport(name, o);
  if (!t.ok()) {
    std::printf("ERROR %s\n", t.status().toString().c_str());
    return 1;
  }
  auto buf = touched(bytes, 0);
  MemDesc d;
  d.addr = reinterpret_cast<uintptr_t>(buf.get());
  d.len = bytes;
  auto h = (*t)->registerMemory(d);
  auto key = h.ok() ? (*t)->packRemoteKey(*h) : Result<std::string>(h.status());
  auto conn = (*t)->localConnInfo();
  if (!key.ok() || !conn.ok()) {
    std::printf("ERROR registration failed\n");
    return 1;
  }
  // tcp's like-for-like ceiling lands in this same buffer, from this same process.
  std::unique_ptr<TcpLikeReceiver> like;
  if (name == "tcp") like = std::make_unique<TcpLikeReceiver>(streams, buf.get(), bytes);
  std::printf("INFO %s %s %zu %d\n", hexOf(*conn).c_str(), hexOf(*key).c_str(), size_t(d.addr),
              like ? like->port() : 0);
  std::fflush(stdout);
  std::string pending;
  while (true) {
    (*t)->progress();
    pollfd p{0, POLLIN, 0};
    if (::poll(&p, 1, 1) > 0) {
      char tmp[256];
      ssize_t n = ::read(0, tmp, sizeof tmp);
      if (n <= 0) break;
      pending.append(tmp, size_t(n));
      if (pending.find("QUIT") != std::string::npos) break;
      if (pending.find("CPU") != std::string::npos) {
        pending.clear();
        std::printf("CPU %.6f\n", cpuSeconds());
        std::fflush(stdout);
      }
    }
  }
  t->reset();  // stop its I/O thread before the buffer it writes into goes away
  return 0;
}

// Raw TCP ceiling receiver: per connection, reads everything into a large buffer (cycling),
// like a transport reading payloads into place, and prints DONE <bytes> at EOF.
int runRawReceiver(size_t bufBytes) {
  int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(ls, 1) != 0) return 1;
  socklen_t len = sizeof a;
  ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  auto buf = touched(bufBytes, 0);
  std::printf("PORT %d\n", ntohs(a.sin_port));
  std::fflush(stdout);
  while (true) {
    pollfd p[2] = {{ls, POLLIN, 0}, {0, POLLIN, 0}};
    if (::poll(p, 2, -1) <= 0) continue;
    if (p[1].revents) {  // CPU, or QUIT / EOF from the driver
      char cmd[64];
      ssize_t n = ::read(0, cmd, sizeof cmd);
      if (n <= 0 || std::string(cmd, size_t(n)).find("CPU") == std::string::npos) break;
      std::printf("CPU %.6f\n", cpuSeconds());
      std::fflush(stdout);
      continue;
    }
    int s = ::accept(ls, nullptr, nullptr);
    if (s < 0) continue;
    // A thread per connection, so a multi-stream ceiling reads its streams in parallel like the
    // transport's receiver does (the bytes are garbage; only the rate matters).
    std::thread([s, bufBytes, b = buf.get()] {
      // The sender names the read size first (8 bytes), so the ceiling can try several.
      uint64_t chunk = 0;
      if (::recv(s, &chunk, sizeof chunk, MSG_WAITALL) != sizeof chunk || chunk == 0) chunk = 4 * kMiB;
      size_t total = 0, off = 0;
      while (true) {
        size_t want = std::min<size_t>(chunk, bufBytes - off);
        ssize_t n = ::recv(s, b + off, want, 0);
        if (n <= 0) break;
        total += size_t(n);
        off = (off + size_t(n)) % bufBytes;
      }
      ::close(s);
      static std::mutex mu;
      std::lock_guard lock(mu);
      std::printf("DONE %zu\n", total);
      std::fflush(stdout);
    }).detach();
  }
  ::close(ls);
  return 0;
}

// ---- ceilings -------------------------------------------------------------------------------
double memcpyGBps() {
  const size_t n = 512 * kMiB;
  auto a = touched(n, 1), b = touched(n, 2);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto t = Clock::now();
    std::memcpy(b.get(), a.get(), n);
    best = std::max(best, gbps(n, secondsSince(t)));
  }
  return best;
}

// Plain sockets, one stream, send()s from a large source buffer: the ceiling tcp is
// held to. One receiver process serves every measurement, so rounds can interleave with the
// transport's (this machine is shared; interleaving keeps the ratio honest).
class RawTcp {
 public:
  RawTcp() : src_(touched(kBuf, 3)) {
    child_ = Child::spawn({selfExe(), "--role", "rawrecv", "--bytes", std::to_string(kBuf)});
    auto l = child_.line(10000);
    if (l && l->rfind("PORT ", 0) == 0) port_ = std::stoi(l->substr(5));
  }
  ~RawTcp() { child_.finish(); }
  // Best over a few read/write sizes: the ceiling is what plain sockets can do at their best.
  // Also keeps the lowest CPU cost seen (both processes, CPU seconds per GB moved), which,
  // unlike wall time, a busy shared machine barely disturbs.
  double measure(size_t totalBytes) {
    double best = 0;
    for (size_t chunk : {64 * kKiB, 256 * kKiB, 4 * kMiB}) best = std::max(best, measureChunk(totalBytes / 2, chunk));
    return best;
  }
  double cpuPerGB() const { return cpuPerGB_; }
  double childCpu() {
    child_.send("CPU");
    auto l = child_.line(10000);
    return l && l->rfind("CPU ", 0) == 0 ? std::stod(l->substr(4)) : 0;
  }
  double measureChunk(size_t totalBytes, size_t chunk) {
    if (port_ == 0) return 0;
    const double cpu0 = cpuSeconds() + childCpu();
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(s);
      return 0;
    }
    int one = 1;
    ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint64_t c64 = chunk;
    if (::send(s, &c64, sizeof c64, MSG_NOSIGNAL) != sizeof c64) {
      ::close(s);
      return 0;
    }
    auto t = Clock::now();
    size_t sent = 0, off = 0;
    while (sent < totalBytes) {
      size_t want = std::min<size_t>(chunk, std::min(totalBytes - sent, kBuf - off));
      ssize_t n = ::send(s, src_.get() + off, want, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += size_t(n);
      off = (off + size_t(n)) % kBuf;
    }
    ::shutdown(s, SHUT_WR);
    auto done = child_.line(60000);  // the receiver has read everything
    double secs = secondsSince(t);
    ::close(s);
    if (!done || done->rfind("DONE ", 0) != 0) return 0;
    size_t bytes = std::stoull(done->substr(5));
    double cpu = cpuSeconds() + childCpu() - cpu0;
    if (bytes > 0) cpuPerGB_ = std::min(cpuPerGB_, cpu / (double(bytes) / 1e9));
    return gbps(bytes, secs);
  }

 private:
  static constexpr size_t kBuf = 256 * kMiB;
  Buffer src_;
  Child child_;
  int port_ = 0;
  double cpuPerGB_ = 1e9;
};

// ucx_perftest ucp_put_bw on 127.0.0.1, server + client; GB/s from the "Final:" line.
// errorHandling adds -e: endpoints with peer error handling, as the ucx transport creates them
// (UCX then leaves out lanes that cannot report a dead peer, e.g. shared memory).
std::optional<double> ucxPerftestGBps(size_t size, int iters, bool errorHandling = false) {
  if (::system("command -v ucx_perftest >/dev/null 2>&1") != 0) return std::nullopt;
  int port = 20000 + int(::getpid() % 20000);
  Child server = Child::spawn({"/bin/sh", "-c", "exec ucx_perftest -p " + std::to_string(port) + " >/dev/null 2>&1"});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::string cmd = "timeout 60 ucx_perftest 127.0.0.1 -p " + std::to_string(port) + " -t ucp_put_bw" +
                    (errorHandling ? " -e" : "") + " -s " + std::to_string(size) + " -n " + std::to_string(iters) +
                    " -w " + std::to_string(std::max(1, iters / 10)) + " 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  std::optional<double> out;
  if (f) {
    char line[1024];
    while (std::fgets(line, sizeof line, f)) {
      std::string l(line);
      if (l.rfind("Final:", 0) != 0) continue;
      std::istringstream in(l.substr(6));
      double iters2, p50, avg, overall, bwAvg, bwOverall;
      if (in >> iters2 >> p50 >> avg >> overall >> bwAvg >> bwOverall) out = bwOverall * 1024 * 1024 / 1e9;
    }
    ::pclose(f);
  }
  ::kill(server.pid, SIGKILL);
  ::waitpid(server.pid, nullptr, 0);
  ::close(server.in);
  ::close(server.out);
  return out;
}

// The cma transport's thread count and batch size, read the way the factory reads them.
struct CmaLike {
  int threads = 2;
  size_t slice = 4 << 20;
};
CmaLike cmaLike() {
#if PD_HAVE_CMA
  CmaOptions o = cmaOptionsFrom(TransportOptions{});
  return {o.copyThreads, o.sliceBytes};
#else
  return {};
#endif
}

// Raw process_vm_writev of the same segments into the same receiver process, batched as the
// cma transport batches (<= slice bytes and <= 1,024 iovecs per call) on as many threads.
double rawCmaGBps(pid_t pid, const DescList& local, const DescList& remote, int threads, size_t slice) {
  struct Batch {
    std::vector<iovec> l, r;
  };
  std::vector<Batch> batches;
  Batch cur;
  size_t curBytes = 0, total = 0;
  for (size_t i = 0; i < local.size(); ++i) {
    for (size_t off = 0; off < local[i].len;) {
      size_t n = std::min(local[i].len - off, slice - curBytes);
      cur.l.push_back({reinterpret_cast<void*>(local[i].addr + off), n});
      cur.r.push_back({reinterpret_cast<void*>(remote[i].addr + off), n});
      curBytes += n;
      off += n;
      total += n;
      if (curBytes >= slice || cur.l.size() >= 1024) {
        batches.push_back(std::move(cur));
        cur = Batch{};
        curBytes = 0;
      }
    }
  }
  if (!cur.l.empty()) batches.push_back(std::move(cur));
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto t = Clock::now();
  std::vector<std::thread> ts;
  for (int k = 0; k < threads; ++k) {
    ts.emplace_back([&] {
      for (size_t b; (b = next.fetch_add(1)) < batches.size();) {
        if (::process_vm_writev(pid, batches[b].l.data(), batches[b].l.size(), batches[b].r.data(), batches[b].r.size(),
                                0) < 0)
          failed = true;
      }
    });
  }
  for (auto& th : ts) th.join();
  return failed ? 0 : gbps(total, secondsSince(t));
}

// ---- the transport runs -------------------------------------------------------------------------
struct Link {
  Buffer src;  // outlives the transport's I/O thread
  std::unique_ptr<Transport> t;
  Child recv;
  PeerId peer = 0;
  uintptr_t remote = 0;
  size_t bytes = 0;
  int likePort = 0;  // tcp: the receiver's TcpLikeReceiver

  double cpuNow() {
    recv.send("CPU");
    auto l = recv.line(10000);
    return cpuSeconds() + (l && l->rfind("CPU ", 0) == 0 ? std::stod(l->substr(4)) : 0);
  }

  // Throughput runs sleep between polls (a spinning owner would steal a core from the I/O
  // thread and the receiver on a small machine); latency runs spin.
  Status wait(TransferId id, bool spin = false) {
    auto end = Clock::now() + std::chrono::seconds(120);
    while (Clock::now() < end) {
      t->progress();
      Status st = t->poll(id);
      if (!st.inProgress()) return st;
      if (spin) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    return deadlineExceeded("bench: transfer did not finish within 120 s");
  }
};

Result<std::unique_ptr<Link>> connectLink(const std::string& name, size_t bytes, int streams) {
  auto link = std::make_unique<Link>();
  TransportOptions o;
  o.localName = "bench-send";
  o.tcpStreams = streams;
  o.peerTimeout = std::chrono::milliseconds(30000);
  PD_ASSIGN_OR_RETURN(link->t, makeTransport(name, o));
  link->recv = Child::spawn({selfExe(), "--role", "recv", "--transport", name, "--bytes", std::to_string(bytes),
                             "--streams", std::to_string(streams)});
  auto l = link->recv.line(30000);
  if (!l || l->rfind("INFO ", 0) != 0)
    return unavailable("bench: receiver for " + name + " did not start: " + l.value_or("(nothing)"));
  std::istringstream in(l->substr(5));
  std::string conn, key;
  size_t addr = 0;
  in >> conn >> key >> addr >> link->likePort;
  link->remote = addr;
  link->bytes = bytes;
  link->src = touched(bytes, 0x5a);
  MemDesc d;
  d.addr = reinterpret_cast<uintptr_t>(link->src.get());
  d.len = bytes;
  PD_ASSIGN_OR_RETURN(MemHandle h, link->t->registerMemory(d));
  (void)h;
  PeerInfo pi;
  pi.name = "bench-recv";
  pi.connInfo = unhex(conn);
  pi.remoteKeys = {unhex(key)};
  PD_ASSIGN_OR_RETURN(link->peer, link->t->loadPeer(pi));
  return link;
}

struct Row {
  size_t segSize = 0;
  size_t segments = 0;
  double gbps = 0;
  double ceilGBps = 0;  // the like-for-like ceiling, best of the same rounds
  double latencyUs = 0;
  double cpuPerGB = 1e9;   // both processes, CPU seconds per GB moved
  bool ceilBounds = true;  // false: the ceiling was shown not to bound this transport
};

// The like-for-like ceiling of one transfer's segment lists (GB/s), measured right after the
// transport moved them; 0 = not measured.
using Ceiling = std::function<double(const DescList& local, const DescList& remote)>;

void segmentSweep(Link& link, const std::vector<size_t>& sizes, size_t total, int reps, const Ceiling& ceiling,
                  std::vector<Row>& rows) {
  for (size_t seg : sizes) {
    Row r;
    r.segSize = seg;
    r.segments = std::max<size_t>(1, total / seg);
    DescList local, remote;
    for (size_t i = 0; i < r.segments; ++i) {
      local.push_back(MemDesc{reinterpret_cast<uintptr_t>(link.src.get()) + i * seg, seg});
      remote.push_back(MemDesc{link.remote + i * seg, seg});
    }
    for (int k = 0; k < reps; ++k) {
      const double cpu0 = link.cpuNow();
      auto t = Clock::now();
      auto id = link.t->post(local, remote, link.peer, {});
      if (!id.ok() || !link.wait(*id).isOk()) break;
      r.gbps = std::max(r.gbps, gbps(r.segments * seg, secondsSince(t)));
      r.cpuPerGB = std::min(r.cpuPerGB, (link.cpuNow() - cpu0) / (double(r.segments * seg) / 1e9));
      if (ceiling) r.ceilGBps = std::max(r.ceilGBps, ceiling(local, remote));
    }
    // Latency: one segment, post -> confirmed at the target; the median of several.
    std::vector<double> lat;
    int n = seg <= kMiB ? 50 : seg <= 16 * kMiB ? 10 : 4;
    for (int k = 0; k < n; ++k) {
      auto t = Clock::now();
      auto id = link.t->post({local[0]}, {remote[0]}, link.peer, {});
      if (!id.ok() || !link.wait(*id, /*spin=*/true).isOk()) break;
      lat.push_back(secondsSince(t) * 1e6);
    }
    if (!lat.empty()) {
      std::sort(lat.begin(), lat.end());
      r.latencyUs = lat[lat.size() / 2];
    }
    rows.push_back(r);
  }
}

struct LlamaResult {
  double wholeMs = 0, layerMs = 0, firstLayerMs = 0;
  double wholeCeilMs = 0, layerCeilMs = 0;  // the like-for-like ceiling on the same segments
  size_t bytes = 0, segments = 0;
};

// Llama-3-8B-shaped KV of a 4,096-token prompt: 256 blocks per layer, scattered on both sides.
// The like-for-like ceiling of the layer-by-layer case, when it differs from the whole's
// (tcp: the same transfers posted back to back); null = the whole's figure.
using LayersCeiling = std::function<double(const std::vector<Segments>& layers)>;

// Llama-3-8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks: 2 (K|V) x 16 x 8 x 128 x 2 B.
constexpr size_t kLlamaBf16BlockBytes = 2 * 16 * 8 * 128 * 2;

LlamaResult llamaCase(Link& link, int reps, const Ceiling& ceiling, const LayersCeiling& layersCeiling,
                      size_t blockBytes = kLlamaBf16BlockBytes, int blocksPerLayer = 256) {
  const size_t kBlockBytes = blockBytes;
  const int nb = blocksPerLayer;
  BlockPool srcPool{reinterpret_cast<uintptr_t>(link.src.get()), kBlockBytes, nb, 32};
  BlockPool dstPool{link.remote, kBlockBytes, nb, 32};
  std::vector<int> srcBlocks(nb), dstBlocks(nb);
  std::iota(srcBlocks.begin(), srcBlocks.end(), 0);
  std::iota(dstBlocks.begin(), dstBlocks.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(srcBlocks.begin(), srcBlocks.end(), rng);
  std::shuffle(dstBlocks.begin(), dstBlocks.end(), rng);
  LlamaResult res;
  res.bytes = srcPool.totalBytes();
  auto whole = blockSegments(srcPool, srcBlocks, dstPool, dstBlocks, 0, srcPool.numLayers);
  if (!whole.ok()) return res;
  res.segments = whole->local.size();
  res.wholeMs = res.layerMs = res.firstLayerMs = res.wholeCeilMs = res.layerCeilMs = 1e9;
  std::vector<Segments> layers;
  for (int l = 0; l < srcPool.numLayers; ++l)
    layers.push_back(*blockSegments(srcPool, srcBlocks, dstPool, dstBlocks, l, l + 1));
  for (int k = 0; k < reps; ++k) {
    auto t = Clock::now();
    auto id = link.t->post(whole->local, whole->remote, link.peer, {});
    if (!id.ok() || !link.wait(*id).isOk()) return res;
    res.wholeMs = std::min(res.wholeMs, secondsSince(t) * 1e3);
    if (ceiling) {
      double g = ceiling(whole->local, whole->remote);
      if (g > 0) res.wholeCeilMs = std::min(res.wholeCeilMs, double(res.bytes) / g / 1e6);
    }
  }
  for (int k = 0; k < reps; ++k) {
    auto t = Clock::now();
    std::vector<TransferId> ids;
    for (int l = 0; l < srcPool.numLayers; ++l) {
      auto id = link.t->post(layers[size_t(l)].local, layers[size_t(l)].remote, link.peer, {});
      if (!id.ok()) return res;
      ids.push_back(*id);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!link.wait(ids[i]).isOk()) return res;
      if (i == 0) res.firstLayerMs = std::min(res.firstLayerMs, secondsSince(t) * 1e3);
    }
    res.layerMs = std::min(res.layerMs, secondsSince(t) * 1e3);
    if (layersCeiling) {
      double g = layersCeiling(layers);
      if (g > 0) res.layerCeilMs = std::min(res.layerCeilMs, double(res.bytes) / g / 1e6);
    } else {
      // The layers together are the whole list: what cutting it into 32 transfers costs is
      // the transport's to pay, so the ceiling is the same raw figure as for the whole.
      res.layerCeilMs = res.wholeCeilMs;
    }
  }
  return res;
}

// The KV of one remote prefill of a 2,048-token prompt of the Llama-3-8B shape, per KV dtype
// the engine stores (engine.kv_cache_dtype; engine/kv_layout.h: 16-token blocks of
// [k|v][token][kv head][head dim] elements, the 8-bit ones followed by an f32 scale per token,
// kv head and k|v), scattered blocks, sent whole: bytes and time per token, next to the lane's
// like-for-like ceiling on the same segments (null: none on this lane).
bool isBound(double g, double c);

void kvDtypeTable(Link& link, int reps, const Ceiling& ceiling) {
  struct Dtype {
    const char* name;
    size_t elemBytes, scaleBytes;
  };
  constexpr int kTokens = 2048, kBlocks = kTokens / 16;
  std::printf("  per KV dtype, Llama-3-8B shape, %d-token prompt, sent whole (engine.kv_cache_dtype):\n", kTokens);
  std::printf("  %-6s %9s %11s %10s %12s %8s %9s %8s\n", "dtype", "KV MiB", "bytes/token", "ms", "us/token", "GB/s",
              "ceiling", "ratio");
  double f32Ms = 0;
  for (const Dtype d : {Dtype{"f32", 4, 0}, Dtype{"bf16", 2, 0}, Dtype{"int8", 1, 4}, Dtype{"fp8", 1, 4}}) {
    const size_t blockBytes = 2 * 16 * 8 * 128 * d.elemBytes + 2 * 16 * 8 * d.scaleBytes;
    if (blockBytes * kBlocks * 32 > link.bytes) continue;
    LlamaResult r = llamaCase(link, reps, ceiling, nullptr, blockBytes, kBlocks);
    if (r.wholeMs >= 1e8) {
      std::printf("  %-6s transfer failed\n", d.name);
      continue;
    }
    const double g = gbps(r.bytes, r.wholeMs / 1e3), c = r.wholeCeilMs < 1e8 ? gbps(r.bytes, r.wholeCeilMs / 1e3) : 0;
    if (f32Ms == 0) f32Ms = r.wholeMs;
    std::printf("  %-6s %9.1f %11zu %10.1f %12.2f %8.2f ", d.name, double(r.bytes) / kMiB, r.bytes / kTokens, r.wholeMs,
                r.wholeMs * 1e3 / kTokens, g);
    if (c > 0 && isBound(g, c))
      std::printf("%9.2f %7.0f%%", c, 100 * g / c);
    else if (c > 0)
      std::printf("%9.2f %8s", c, "n/a*");  // beaten by more than noise: no bound
    else
      std::printf("%9s %8s", "n/a", "n/a");
    std::printf("   (%.2fx the f32 time)\n", r.wholeMs / f32Ms);
  }
}

// A ratio is printed only against a ceiling that bounds the transport: one the transport beats
// by more than noise (10%) is no ceiling of it, and its "ratio" would say nothing (docs/kvtransfer.md).
bool isBound(double g, double c) { return c > 0 && g <= 1.1 * c; }
std::string ratioText(double g, double c) {
  if (c <= 0) return "n/a";
  if (!isBound(g, c)) return "n/a*";
  char b[32];
  std::snprintf(b, sizeof b, "%.0f%%", 100 * g / c);
  return b;
}
constexpr const char* kNotABound =
    "  * ceiling more than 10% below the transport: it bounds nothing, so no ratio is printed\n";

void printRatioRow(const char* label, double g, double c) {
  std::printf("  %-22s %9.2f %9.2f %8s\n", label, g, c, ratioText(g, c).c_str());
}

int runDriver(std::vector<std::string> transports, int streams, bool quick) {
  std::string load = "?";
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    char b[128] = {0};
    if (std::fgets(b, sizeof b, f)) load = std::string(b).substr(0, 14);
    std::fclose(f);
  }
  std::printf("kvtransfer-bench: two processes on this machine (%u hardware threads, load average %s)\n",
              std::thread::hardware_concurrency(), load.c_str());
  std::printf(
      "throughput = best of %d rounds; latency = post -> completion confirmed at the target,\n"
      "median within a round, best round; every ceiling is like for like (see the header)\n",
      quick ? 2 : 4);
  std::printf("\n== reference figures (same run)\n");
  double mc = memcpyGBps();
  std::printf("  memcpy, 1 thread, 512 MiB:              %7.2f GB/s\n", mc);
  RawTcp rawTcp;
  double raw = 0;
  const int rounds = quick ? 2 : 4;
  const size_t rawBytes = 512 * kMiB;
  for (int i = 0; i < rounds; ++i) raw = std::max(raw, rawTcp.measure(rawBytes));
  std::printf("  raw loopback TCP, 1 stream (best of 64K/256K/4M I/O sizes): %5.2f GB/s, %.3f CPU s/GB\n", raw,
              rawTcp.cpuPerGB());
  const bool haveUcx = std::find(transports.begin(), transports.end(), "ucx") != transports.end();
  std::optional<double> ucxShm, ucxErr;
  if (haveUcx) {
    ucxShm = ucxPerftestGBps(4 * kMiB, quick ? 100 : 400, false);
    ucxErr = ucxPerftestGBps(4 * kMiB, quick ? 100 : 400, true);
    if (ucxShm && ucxErr) {
      std::printf(
          "  ucx_perftest ucp_put_bw 4 MiB: %.2f GB/s without -e (shared memory allowed), %.2f GB/s "
          "with -e (peer error handling, as the transport)\n",
          *ucxShm, *ucxErr);
    } else {
      std::printf(
          "  ucx_perftest: not installed or failed (apt-get install ucx-utils): the ucx rows have no "
          "ceiling\n");
    }
  }

  const std::vector<size_t> sizes = {4 * kKiB, 64 * kKiB, 1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB};
  // ucx is held to ucx_perftest with -e on the same sizes (and 64 KiB for the Llama case).
  std::map<size_t, double> ucxBySize;
  if (haveUcx && ucxErr) {
    for (size_t sz : sizes) {
      int iters = int(std::clamp<size_t>((quick ? 128 : 256) * kMiB / sz, 8, 20000));
      if (auto g = ucxPerftestGBps(sz, iters, true)) ucxBySize[sz] = *g;
    }
  }
  const size_t total = quick ? 128 * kMiB : 256 * kMiB;
  const int reps = quick ? 2 : 4;
  struct Summary {
    std::string name;
    double llamaGBps = 0, llamaCeil = 0;
    double minRatioAt1MiB = 1e9;
    bool unbounded = false;  // some row's ceiling was below the transport (no ratio)
  };
  std::vector<Summary> summaries;
  for (const auto& name : transports) {
    auto link = connectLink(name, 512 * kMiB, streams);
    if (!link.ok()) {
      std::printf("\n== %s: skipped: %s\n", name.c_str(), link.status().message().c_str());
      continue;
    }
    Link& lk = **link;
    std::printf("\n== %s (%s)\n", name.c_str(), lk.t->caps().details.c_str());
    Ceiling ceiling;
    std::string ceilName;
    std::unique_ptr<TcpLike> tcpLike;  // tcp's ceiling, into the transport's receiver
    if (name == "cma") {
      const CmaLike c = cmaLike();
      ceiling = [&lk, c](const DescList& l, const DescList& r) {
        return rawCmaGBps(lk.recv.pid, l, r, c.threads, c.slice);
      };
      ceilName = "raw process_vm_writev, " + std::to_string(c.threads) + " threads, " + sizeName(c.slice) + " batches";
    } else if (name == "tcp") {
      tcpLike = std::make_unique<TcpLike>(streams, lk.likePort);
      if (tcpLike->ok()) {
        ceiling = [&tcpLike, &lk](const DescList& l, const DescList& r) { return tcpLike->measure(l, r, lk.remote); };
      }
      ceilName = "raw loopback TCP moving the same frames: " + std::to_string(streams) +
                 " stream(s), the transport's batches and readv/writev sizes, one I/O thread per side, no "
                 "validation or acks (tcp_like.h)" +
                 (tcpLike->ok() ? "" : ": DID NOT START");
    } else if (name == "ucx" && !ucxBySize.empty()) {
      ceiling = [&ucxBySize](const DescList& l, const DescList&) {
        auto it = ucxBySize.find(l.empty() ? 0 : l[0].len);
        return it == ucxBySize.end() ? 0.0 : it->second;
      };
      ceilName = "ucx_perftest ucp_put_bw -e, same UCX_TLS, same segment size";
    } else {
      ceilName = "none measured (memcpy " + std::to_string(mc) + " GB/s for reference)";
    }
    // Rounds interleave the ceiling with the sweep, best of each counts.
    std::vector<Row> rows;
    for (int round = 0; round < reps; ++round) {
      std::vector<Row> these;
      segmentSweep(lk, sizes, total, 1, ceiling, these);
      if (rows.empty()) {
        rows = these;
      } else {
        for (size_t i = 0; i < rows.size() && i < these.size(); ++i) {
          rows[i].gbps = std::max(rows[i].gbps, these[i].gbps);
          rows[i].ceilGBps = std::max(rows[i].ceilGBps, these[i].ceilGBps);
          rows[i].latencyUs = std::min(rows[i].latencyUs, these[i].latencyUs);
          rows[i].cpuPerGB = std::min(rows[i].cpuPerGB, these[i].cpuPerGB);
        }
      }
    }
    std::printf("  ceiling: %s\n", ceilName.c_str());
    std::printf("  %-9s %9s %9s %9s %8s %14s %10s\n", "segment", "segments", "GB/s", "ceiling", "ratio", "latency p50",
                "CPU s/GB");
    Summary sum;
    sum.name = name;
    // ucx_perftest is another program run before the sweep: if the transport beats it at any
    // size it has been shown not to bound the transport on this lane, and no ucx row gets a
    // ratio (cma's and tcp's ceilings are measured right after each transfer: judged per row).
    if (name == "ucx") {
      const bool bounds = std::all_of(rows.begin(), rows.end(),
                                      [](const Row& r) { return r.ceilGBps <= 0 || isBound(r.gbps, r.ceilGBps); });
      if (!bounds) {
        for (auto& r : rows) r.ceilBounds = false;
      }
    }
    bool footnote = false;
    for (const auto& r : rows) {
      const bool bound = r.ceilBounds && isBound(r.gbps, r.ceilGBps);
      std::printf("  %-9s %9zu %9.2f %9.2f %8s %11.1f us %10.3f\n", sizeName(r.segSize).c_str(), r.segments, r.gbps,
                  r.ceilGBps, r.ceilGBps > 0 && !bound ? "n/a*" : ratioText(r.gbps, r.ceilGBps).c_str(), r.latencyUs,
                  r.cpuPerGB);
      footnote |= r.ceilGBps > 0 && !bound;
      if (r.segSize < kMiB || r.ceilGBps <= 0) continue;
      if (bound) {
        sum.minRatioAt1MiB = std::min(sum.minRatioAt1MiB, r.gbps / r.ceilGBps);
      } else {
        sum.unbounded = true;
      }
    }
    const bool ucxUnbounded = name == "ucx" && footnote;
    if (footnote && !ucxUnbounded) std::printf("%s", kNotABound);
    if (ucxUnbounded) {
      // Why (docs/kvtransfer.md "ucx: no like-for-like ceiling here"): with peer error handling
      // UCX 1.13 keeps only tcp between two local processes, where ucp_put is emulated with
      // active messages; ucx_perftest -e drives the same emulation its own way, slower.
      std::printf(
          "  * ucx_perftest -e runs more than 10%% below the transport at some size, so it bounds nothing and no\n"
          "  ucx ratio is printed at any size\n"
          "  (docs/kvtransfer.md \"ucx: no like-for-like ceiling here\"; the endpoint's lane is in the line above)\n");
      const auto at4 = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.segSize == 4 * kMiB; });
      if (lk.t->caps().details.find("tcp/") != std::string::npos && at4 != rows.end() && raw > 0) {
        std::printf(
            "  for scale only: its lane is tcp, raw 1-stream loopback TCP (reference above) %.2f GB/s, ucx at "
            "4 MiB %.2f GB/s (%.0f%%)\n",
            raw, at4->gbps, 100 * at4->gbps / raw);
      }
    }
    Ceiling llamaCeil = ceiling;
    if (name == "ucx" && sum.unbounded) {
      llamaCeil = nullptr;  // perftest bounds nothing here (above): no Llama ratio either
    } else if (name == "ucx" && !ucxBySize.empty()) {
      // 64 KiB segments: perftest at 64 KiB.
      llamaCeil = [&ucxBySize](const DescList&, const DescList&) {
        auto it = ucxBySize.find(64 * kKiB);
        return it == ucxBySize.end() ? 0.0 : it->second;
      };
    }
    LayersCeiling layersCeil;
    if (name == "tcp" && tcpLike && tcpLike->ok()) {
      layersCeil = [&tcpLike, &lk](const std::vector<Segments>& layers) {
        std::vector<TcpLike::Transfer> ts;
        for (const Segments& l : layers) ts.push_back({l.local, l.remote});
        return tcpLike->measureMany(ts, lk.remote);
      };
    }
    LlamaResult lr = llamaCase(lk, quick ? 2 : 3, llamaCeil, layersCeil);
    std::printf("  Llama-3-8B KV, 4,096-token prompt (%zu MiB, %zu segments of 64 KiB):\n", lr.bytes / kMiB,
                lr.segments);
    std::printf("  %-22s %9s %9s %8s\n", "", "GB/s", "ceiling", "ratio");
    auto g = [&](double ms) { return ms < 1e8 ? gbps(lr.bytes, ms / 1e3) : 0.0; };
    printRatioRow("whole", g(lr.wholeMs), g(lr.wholeCeilMs));
    printRatioRow("layer by layer", g(lr.layerMs), g(lr.layerCeilMs));
    if (lr.wholeCeilMs < 1e8 && !isBound(g(lr.wholeMs), g(lr.wholeCeilMs))) std::printf("%s", kNotABound);
    std::printf("    whole %.1f ms; layer by layer %.1f ms, first layer confirmed after %.1f ms\n", lr.wholeMs,
                lr.layerMs, lr.firstLayerMs);
    kvDtypeTable(lk, quick ? 2 : 3, name == "ucx" ? Ceiling{} : ceiling);
    sum.llamaGBps = g(lr.wholeMs);
    sum.llamaCeil = g(lr.wholeCeilMs);
    summaries.push_back(sum);
    lk.recv.finish();
  }

  std::printf("\n== targets (docs/kvtransfer.md)\n");
  for (const auto& s : summaries) {
    // A "ceiling" the transport beats by more than noise is no bound: say so instead of "met".
    const char* verdict = s.unbounded               ? "n/a: the ceiling is below the transport, not a bound"
                          : s.minRatioAt1MiB >= 1e8 ? "no ceiling measured"
                          : s.minRatioAt1MiB >= 0.9 ? "met"
                                                    : "NOT met";
    std::printf("  %-5s >= 90%% of its ceiling at >= 1 MiB segments: %s", s.name.c_str(), verdict);
    if (s.minRatioAt1MiB < 1e8) std::printf(" (lowest ratio %.0f%%)", 100 * s.minRatioAt1MiB);
    std::printf("\n");
    if (s.name == "cma") {
      std::printf("  cma   Llama 512 MiB >= 10 GB/s and >= 80%% of its ceiling: %.2f GB/s, %.0f%%: %s\n", s.llamaGBps,
                  s.llamaCeil > 0 ? 100 * s.llamaGBps / s.llamaCeil : 0.0,
                  s.llamaGBps >= 10 && s.llamaCeil > 0 && s.llamaGBps >= 0.8 * s.llamaCeil ? "met" : "NOT met");
    }
  }

  runStagedGpu(quick);

  // Wire-time projection for Llama-3-8B (128 KiB of KV per token), transport overhead aside.
  std::printf("\n== projection: Llama-3-8B KV wire time per prompt (bytes / link rate)\n");
  std::printf("  %-8s %10s %10s %10s %10s\n", "tokens", "KV MiB", "100 Gb/s", "200 Gb/s", "400 Gb/s");
  for (size_t tokens : {1024u, 4096u, 16384u, 32768u, 131072u}) {
    double bytes = double(tokens) * 128 * 1024;
    std::printf("  %-8zu %10.0f %8.1f ms %7.1f ms %7.1f ms\n", tokens, bytes / kMiB, bytes * 8 / 100e9 * 1e3,
                bytes * 8 / 200e9 * 1e3, bytes * 8 / 400e9 * 1e3);
  }
  return 0;
}

}  // namespace
}  // namespace pd::kvt::bench

int main(int argc, char** argv) {
  using namespace pd::kvt::bench;
  std::string role = "driver", transport;
  size_t bytes = 0;
  std::vector<std::string> transports;
  int streams = 1;
  bool quick = false;
  CLI::App app{"kvtransfer-bench: KV transfer throughput and latency per transport", "kvtransfer-bench"};
  pd::cli::configure(app);
  app.add_option_function<std::string>(
      "--transports",
      [&transports](const std::string& list) {
        std::stringstream in(list);
        std::string t;
        while (std::getline(in, t, ',')) transports.push_back(t);
      },
      "comma-separated transports to measure (default: every built one but loopback)");
  app.add_option("--streams", streams, "concurrent streams")->capture_default_str();
  app.add_flag("--quick", quick, "fewer sizes and rounds");
  // The driver starts its receivers as child processes with these (not for people).
  app.add_option("--role", role)->group("");
  app.add_option("--transport", transport)->group("");
  app.add_option("--bytes", bytes)->group("");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  ::signal(SIGPIPE, SIG_IGN);
  if (role == "recv") return runReceiver(transport, bytes, streams);
  if (role == "rawrecv") return runRawReceiver(bytes);
  if (transports.empty()) {
    for (const auto& n : pd::kvt::builtTransports()) {
      if (n != "loopback") transports.push_back(n);  // loopback cannot cross processes
    }
  }
  return runDriver(transports, streams, quick);
}
