// ucx_bench: put bandwidth of the UCX transport between two processes on this machine, next
// to its ceiling measured in the same run: ucx_perftest -t ucp_put_bw for the same sizes.
//
//   ucx_bench [--sizes 4k,64k,1m,64m] [--bytes 256m] [--errmode peer|none|both]
//             [--memory user|ucx|both] [--pattern same|stream|both] [--reps 3]
//             [--target-idle-us N] [--no-perftest]
//
// --memory user: both regions are ordinary mmap'd memory handed to registerMemory();
// --memory ucx: both come from ucxAllocateRegistered() (UCP_MEM_MAP_ALLOCATE, what
// ucx_perftest uses), which lets shared-memory transports put with one memcpy.
//
// For each segment size S the initiator posts transfers of 64 MiB made of S-byte segments
// (back to back, `--bytes` in all) and times first post -> last completion (completion = the
// flush confirmed the data at the target). ucx_perftest does the same puts from its own loop
// (`-e` gives its endpoints the same peer error handling). Both report MiB/s.
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/base/cli.h"
#include "common/base/clock.h"
#include "common/base/log.h"
#include "kvtransfer/transports/ucx_transport.h"

using namespace pd;
using namespace pd::kvt;

namespace {

constexpr size_t kRegion = size_t{64} << 20;

bool sendMsg(int fd, const std::string& m) {
  uint32_t len = static_cast<uint32_t>(m.size());
  std::string all(reinterpret_cast<const char*>(&len), 4);
  all += m;
  const char* p = all.data();
  size_t n = all.size();
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool recvMsg(int fd, std::string* m) {
  uint32_t len = 0;
  auto readAll = [&](char* p, size_t n) {
    while (n > 0) {
      ssize_t r = ::recv(fd, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  };
  if (!readAll(reinterpret_cast<char*>(&len), 4)) return false;
  m->resize(len);
  return readAll(m->data(), len);
}

size_t parseSize(const std::string& s) {
  size_t mult = 1;
  char last = s.empty() ? 0 : s.back();
  if (last == 'k' || last == 'K') mult = 1 << 10;
  if (last == 'm' || last == 'M') mult = 1 << 20;
  if (last == 'g' || last == 'G') mult = size_t{1} << 30;
  return std::stoull(mult == 1 ? s : s.substr(0, s.size() - 1)) * mult;
}

// Target process: registers the region and progresses until the parent closes the socket.
// A 64 MiB registered region, from mmap or from UCX.
Result<UcxAllocation> makeRegion(Transport& t, bool ucxMem) {
  if (ucxMem) return ucxAllocateRegistered(t, kRegion);
  void* mem = mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (mem == MAP_FAILED) return resourceExhausted("mmap failed");
  MemDesc d{reinterpret_cast<uintptr_t>(mem), kRegion};
  PD_ASSIGN_OR_RETURN(MemHandle h, t.registerMemory(d));
  return UcxAllocation{d, h};
}

[[noreturn]] void targetMain(int fd, bool peerErr, bool ucxMem, int idleUs) {
  UcxOptions o;
  o.peerErrorHandling = peerErr;
  auto t = makeUcxTransport(o);
  if (!t.ok()) {
    sendMsg(fd, "ERR " + t.status().toString());
    _exit(1);
  }
  auto region = makeRegion(**t, ucxMem);
  if (!region.ok()) {
    sendMsg(fd, "ERR " + region.status().toString());
    _exit(1);
  }
  std::memset(region->desc.ptr(), 0, kRegion);
  auto key = (*t)->packRemoteKey(region->handle);
  sendMsg(fd, *(*t)->localConnInfo());
  sendMsg(fd, *key);
  for (;;) {
    for (int i = 0; i < 256; ++i) (*t)->progress();
    if (idleUs > 0) std::this_thread::sleep_for(std::chrono::microseconds(idleUs));
    char c;
    ssize_t r = ::recv(fd, &c, 1, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) _exit(0);
  }
}

// How long the target sleeps between batches of progress() calls. Over tcp (peer error
// handling) it must keep progressing for puts to land; over shared memory it has nothing to do
// but answer wire-up, so by default it idles like ucx_perftest's server does during put_bw
// instead of competing with the initiator for a core.
int gTargetIdleUs = -1;
int targetIdleUs(bool peerErr) { return gTargetIdleUs >= 0 ? gTargetIdleUs : (peerErr ? 0 : 1000); }

struct Figures {
  double mibPerSec = 0;
  std::string tls;
};

// Our transport's bandwidth for `size`-byte segments.
Figures measureOurs(size_t size, size_t totalBytes, bool peerErr, bool ucxMem, bool stream) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return {};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(sv[0]);
    targetMain(sv[1], peerErr, ucxMem, targetIdleUs(peerErr));
  }
  ::close(sv[1]);
  Figures f;
  std::string conn, key;
  if (!recvMsg(sv[0], &conn) || conn.rfind("ERR", 0) == 0 || !recvMsg(sv[0], &key)) {
    std::fprintf(stderr, "ucx_bench: target failed: %s\n", conn.c_str());
  } else {
    UcxOptions o;
    o.peerErrorHandling = peerErr;
    o.transferTimeout = std::chrono::seconds(120);
    auto t = std::move(makeUcxTransport(o)).value();
    auto region = makeRegion(*t, ucxMem);
    char* src = region.ok() ? static_cast<char*>(region->desc.ptr()) : nullptr;
    if (src) std::memset(src, 0x5a, kRegion);
    auto peer = t->loadPeer(PeerInfo{"bench-target", conn, {key}});
    const uint64_t base = ucxwire::decodeKey(key)->base;
    if (!region.ok() || !peer.ok()) {
      std::fprintf(stderr, "ucx_bench: setup failed\n");
    } else {
      const size_t perTransfer = std::max(size, std::min(kRegion, totalBytes));
      auto runOnce = [&](size_t bytes) -> double {
        std::vector<TransferId> ids;
        // The descriptor lists are built before the clock starts (ucx_perftest has none);
        // post() and its validation are timed.
        DescList l, r;
        for (size_t off = 0; off + size <= perTransfer; off += size) {
          // stream: walk the 64 MiB regions (a KV push); same: every put reuses offset 0,
          // which is what ucx_perftest's put_bw does (its buffers stay in cache).
          const size_t at = stream ? off : 0;
          l.push_back(MemDesc{reinterpret_cast<uintptr_t>(src) + at, size});
          r.push_back(MemDesc{base + at, size});
        }
        const SteadyTime start = steadyNow();
        for (size_t done = 0; done < bytes; done += perTransfer) {
          ids.push_back(*t->post(l, r, *peer, {}));
        }
        for (TransferId id : ids) {
          Status s;
          do {
            t->progress();
            s = t->poll(id);
          } while (s.inProgress());
          if (!s.isOk()) {
            std::fprintf(stderr, "ucx_bench: transfer failed: %s\n", s.toString().c_str());
            return 0;
          }
        }
        return secondsBetween(start, steadyNow());
      };
      runOnce(perTransfer);  // warm-up: wires the endpoint, faults in the pages
      const size_t transfers = std::max<size_t>(1, totalBytes / perTransfer);
      double secs = runOnce(transfers * perTransfer);
      if (secs > 0) f.mibPerSec = static_cast<double>(transfers * perTransfer) / secs / (1 << 20);
      std::string caps = t->caps().details;
      auto p = caps.find("peer bench-target: ");
      f.tls = p == std::string::npos ? "?" : caps.substr(p + 19);
    }
    if (region.ok() && !ucxMem) {
      (void)t->deregisterMemory(region->handle);
      munmap(region->desc.ptr(), kRegion);
    }
  }
  ::close(sv[0]);
  ::waitpid(pid, nullptr, 0);
  return f;
}

// ucx_perftest's overall put bandwidth (MB/s, 2^20 bytes) for the same size, or -1.
double measurePerftest(size_t size, size_t totalBytes, bool peerErr, int port) {
  const size_t iters = std::max<size_t>(4, totalBytes / size);
  std::string common = " -t ucp_put_bw -s " + std::to_string(size) + " -n " + std::to_string(iters) + " -p " +
                       std::to_string(port) + (peerErr ? " -e" : "");
  std::string server = "ucx_perftest" + common + " >/dev/null 2>&1";
  std::string client = "timeout 120 ucx_perftest 127.0.0.1" + common + " 2>/dev/null";
  pid_t spid = ::fork();
  if (spid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + server).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  double bw = -1;
  if (FILE* p = popen(client.c_str(), "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, p)) {
      if (std::strncmp(line, "Final:", 6) != 0) continue;
      std::istringstream in(line + 6);
      double v[8] = {};
      for (double& x : v) in >> x;
      bw = v[5];  // overall bandwidth
    }
    pclose(p);
  }
  ::kill(spid, SIGTERM);
  ::waitpid(spid, nullptr, 0);
  return bw;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  size_t totalBytes = size_t{256} << 20;
  std::string errmode = "both";
  std::string memory = "both";
  std::string pattern = "both";
  int reps = 3;
  bool perftest = true;
  CLI::App app{"ucx_bench: UCX put bandwidth and latency (against ucx_perftest)", "ucx_bench"};
  pd::cli::configure(app);
  app.add_option_function<std::string>(
      "--sizes",
      [&sizes](const std::string& list) {
        sizes.clear();
        std::istringstream in(list);
        std::string s;
        while (std::getline(in, s, ',')) sizes.push_back(parseSize(s));
      },
      "message sizes, comma-separated (4k,1m,...)");
  app.add_option_function<std::string>(
      "--bytes", [&totalBytes](const std::string& v) { totalBytes = parseSize(v); },
      "bytes per measurement (default 256m)");
  app.add_option("--errmode", errmode, "peer|none|both")->capture_default_str();
  app.add_option("--memory", memory, "user|ucx|both")->capture_default_str();
  app.add_option("--pattern", pattern, "same|stream|both")->capture_default_str();
  app.add_option_function<int>(
      "--reps", [&reps](int v) { reps = std::max(1, v); }, "repetitions (default 3)");
  app.add_option("--target-idle-us", gTargetIdleUs, "the target's idle poll in microseconds");
  app.add_flag_callback(
      "--no-perftest", [&perftest] { perftest = false; }, "skip the ucx_perftest comparison");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  if (errmode != "peer" && errmode != "none" && errmode != "both") {
    std::fprintf(stderr, "ucx_bench: --errmode must be peer, none or both (got '%s')\n", errmode.c_str());
    return 2;
  }
  if (pattern != "same" && pattern != "stream" && pattern != "both") {
    std::fprintf(stderr, "ucx_bench: --pattern must be same, stream or both (got '%s')\n", pattern.c_str());
    return 2;
  }
  if (memory != "user" && memory != "ucx" && memory != "both") {
    std::fprintf(stderr, "ucx_bench: --memory must be user, ucx or both (got '%s')\n", memory.c_str());
    return 2;
  }
  for (size_t s : sizes)
    if (s == 0 || s > kRegion) {
      std::fprintf(stderr, "ucx_bench: segment sizes must be in [1, 64m]\n");
      return 2;
    }
  setLogLevel(LogLevel::kWarn);
  std::printf("ucx_bench: %zu MiB per size, puts into one 64 MiB region, two processes, best of %d\n", totalBytes >> 20,
              reps);
  {
    // Ceiling for the stream pattern on this host: one thread copying 64 MiB region to region.
    std::vector<char> a(kRegion, 1), b(kRegion, 2);
    std::memcpy(b.data(), a.data(), kRegion);
    const SteadyTime t0 = steadyNow();
    for (int i = 0; i < 4; ++i) std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), kRegion);
    std::printf("ceiling: single-thread memcpy of 64 MiB regions: %.0f MiB/s\n",
                4.0 * kRegion / secondsBetween(t0, steadyNow()) / (1 << 20));
  }
  std::printf("%-7s %-7s %-8s %12s %14s %14s %7s  %s\n", "errmode", "pattern", "segment", "user MiB/s", "ucx-mem MiB/s",
              "perftest MiB/s", "best/pt", "ucx transports (user | ucx-mem)");
  int port = 13000 + static_cast<int>(getpid() % 2000);
  for (bool peerErr : {true, false}) {
    if ((peerErr && errmode == "none") || (!peerErr && errmode == "peer")) continue;
    for (size_t size : sizes) {
      // Best of `reps` for every figure: this host is shared, and a figure is a capability.
      double ref = -1;
      for (int r = 0; perftest && r < reps; ++r)
        ref = std::max(ref, measurePerftest(size, totalBytes, peerErr, port++));
      for (bool stream : {false, true}) {
        if ((stream && pattern == "same") || (!stream && pattern == "stream")) continue;
        Figures user, ucxMem;
        for (int r = 0; r < reps; ++r) {
          if (memory != "ucx") {
            Figures f = measureOurs(size, totalBytes, peerErr, false, stream);
            if (f.mibPerSec > user.mibPerSec) user = f;
          }
          if (memory != "user") {
            Figures f = measureOurs(size, totalBytes, peerErr, true, stream);
            if (f.mibPerSec > ucxMem.mibPerSec) ucxMem = f;
          }
        }
        char sz[32];
        if (size >= (1 << 20))
          std::snprintf(sz, sizeof sz, "%zuM", size >> 20);
        else
          std::snprintf(sz, sizeof sz, "%zuK", size >> 10);
        const double best = std::max(user.mibPerSec, ucxMem.mibPerSec);
        char ratio[16] = "-";
        if (ref > 0) std::snprintf(ratio, sizeof ratio, "%.0f%%", 100.0 * best / ref);
        std::printf("%-7s %-7s %-8s %12.0f %14.0f %14.0f %7s  %s | %s\n", peerErr ? "peer" : "none",
                    stream ? "stream" : "same", sz, user.mibPerSec, ucxMem.mibPerSec, ref, ratio, user.tls.c_str(),
                    ucxMem.tls.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
