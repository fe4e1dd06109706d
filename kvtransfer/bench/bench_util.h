// Helpers shared by kvtransfer-bench's parts (kvtransfer_bench.cpp, tcp_like.cpp): timing,
// touched buffers, CPU time and the child processes it drives over pipes (one line per
// message). Single-threaded use per object; nothing here is for production code.
#pragma once

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace pd::kvt::bench {

using Clock = std::chrono::steady_clock;
inline constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

inline double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
inline double gbps(size_t bytes, double s) { return s > 0 ? double(bytes) / s / 1e9 : 0; }

// Page-touched buffer, aligned and advised like the product's KV regions
// (KvCacheManager::create: on a 2 MiB boundary, transparent huge pages): a malloc'd buffer
// this large starts 16 bytes into a page, so every 64 KiB segment would span one page more
// than in the product, and a 4 KiB-paged one halves what cma moves. First-touch costs must
// not land in the measurements.
struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t[], FreeDeleter>;
inline Buffer touched(size_t n, uint8_t v) {
  constexpr size_t kHuge = 2 * kMiB;
  const size_t rounded = (n + kHuge - 1) / kHuge * kHuge;
  Buffer b(static_cast<uint8_t*>(std::aligned_alloc(kHuge, rounded)));
  if (!b) throw std::bad_alloc();
  ::madvise(b.get(), rounded, MADV_HUGEPAGE);
  std::memset(b.get(), v, n);
  return b;
}

// CPU seconds (user + system, all threads) this process has used so far.
inline double cpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// ---- child processes ------------------------------------------------------------------------
struct Child {
  pid_t pid = -1;
  int in = -1;   // we write
  int out = -1;  // we read
  std::string buf;

  static Child spawn(std::vector<std::string> args) {
    int p2c[2], c2p[2];
    if (::pipe(p2c) != 0 || ::pipe(c2p) != 0) {
      std::perror("pipe");
      std::exit(1);
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p2c[0], 0);
    posix_spawn_file_actions_adddup2(&fa, c2p[1], 1);
    posix_spawn_file_actions_addclose(&fa, p2c[1]);
    posix_spawn_file_actions_addclose(&fa, c2p[0]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    Child c;
    if (posix_spawn(&c.pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) {
      std::perror("posix_spawn");
      std::exit(1);
    }
    posix_spawn_file_actions_destroy(&fa);
    ::close(p2c[0]);
    ::close(c2p[1]);
    c.in = p2c[1];
    c.out = c2p[0];
    return c;
  }
  void send(const std::string& line) {
    std::string s = line + "\n";
    (void)!::write(in, s.data(), s.size());
  }
  std::optional<std::string> line(int timeoutMs) {
    auto end = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (true) {
      auto nl = buf.find('\n');
      if (nl != std::string::npos) {
        std::string l = buf.substr(0, nl);
        buf.erase(0, nl + 1);
        return l;
      }
      int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
      if (left <= 0) return std::nullopt;
      pollfd p{out, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) continue;
      char tmp[4096];
      ssize_t n = ::read(out, tmp, sizeof tmp);
      if (n <= 0) return std::nullopt;
      buf.append(tmp, size_t(n));
    }
  }
  void finish() {
    send("QUIT");
    ::close(in);
    for (int i = 0; i < 300; ++i) {
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {
        ::close(out);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ::close(out);
  }
};

inline std::string selfExe() {
  char p[4096];
  ssize_t n = ::readlink("/proc/self/exe", p, sizeof p - 1);
  if (n <= 0) return "kvtransfer-bench";
  p[n] = 0;
  return p;
}

}  // namespace pd::kvt::bench
