// pd_net_bench: the control plane's cost on loopback, next to raw TCP in the same run.
//
//   build/common/net/pd_net_bench [--rtt-iters N] [--frames N] [--big-frames N]
//
// 1. Round trip: one small Envelope (a Cancel) to an echo server and back, one at a time;
//    ceiling: a 32-byte ping-pong over a plain blocking TCP socket pair.
// 2. Small-frame rate: N TokenChunks (one token each) pipelined to a server that counts them;
//    frames/s.
// 3. Large-frame throughput: N 1 MiB frames (a PrefillRequest's worth of bytes) pipelined;
//    MB/s; ceiling: raw TCP streaming of the same bytes.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/base/cli.h"
#include "common/net/framed.h"

using namespace pd;
using namespace pd::net;
using Clock = std::chrono::steady_clock;

namespace {

double usSince(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * v.size()));
  return v[i];
}

// A loopback listener; returns the fd and sets *port.
int rawListen(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::listen(fd, 1);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

int rawConnect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1;
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

bool rawExact(int fd, char* p, size_t n, bool write) {
  while (n > 0) {
    ssize_t r = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Ceiling 1: blocking ping-pong of 32 bytes; returns per-iteration round trips in us.
std::vector<double> rawPingPong(int iters) {
  int port = 0;
  int lfd = rawListen(&port);
  std::thread echo([lfd] {
    int c = ::accept(lfd, nullptr, nullptr);
    int one = 1;
    ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char buf[32];
    while (rawExact(c, buf, sizeof buf, false) && rawExact(c, buf, sizeof buf, true)) {
    }
    ::close(c);
  });
  int fd = rawConnect(port);
  std::vector<double> rtts;
  char buf[32] = {};
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    rawExact(fd, buf, sizeof buf, true);
    rawExact(fd, buf, sizeof buf, false);
    rtts.push_back(usSince(t0));
  }
  ::close(fd);
  echo.join();
  ::close(lfd);
  return rtts;
}

// Ceiling 2: stream `total` bytes in 1 MiB writes; returns MB/s.
double rawStream(size_t total) {
  int port = 0;
  int lfd = rawListen(&port);
  std::thread sink([lfd, total] {
    int c = ::accept(lfd, nullptr, nullptr);
    std::vector<char> buf(1 << 20);
    size_t got = 0;
    while (got < total) {
      ssize_t r = ::recv(c, buf.data(), buf.size(), 0);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    ::close(c);
  });
  int fd = rawConnect(port);
  std::vector<char> chunk(1 << 20, 'k');
  auto t0 = Clock::now();
  for (size_t sent = 0; sent < total; sent += chunk.size()) {
    rawExact(fd, chunk.data(), chunk.size(), true);
  }
  ::shutdown(fd, SHUT_WR);
  sink.join();
  double s = usSince(t0) / 1e6;
  ::close(fd);
  ::close(lfd);
  return static_cast<double>(total) / 1e6 / s;
}

// Counts frames; wakes the waiter only when its target is reached, so the count costs the
// I/O thread a short lock and no wake-up per frame.
struct Counter {
  std::mutex m;
  std::condition_variable cv;
  uint64_t n = 0;
  uint64_t target = ~uint64_t{0};
  void add() {
    std::lock_guard<std::mutex> l(m);
    if (++n >= target) cv.notify_all();
  }
  uint64_t get() {
    std::lock_guard<std::mutex> l(m);
    return n;
  }
  bool waitFor(uint64_t target, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> l(m);
    this->target = target;
    return cv.wait_for(l, limit, [&] { return n >= target; });
  }
};

}  // namespace

int main(int argc, char** argv) {
  int rttIters = 5000, frames = 200000, bigFrames = 512;
  CLI::App app{"pd_net_bench: framed connection round trips and throughput", "pd_net_bench"};
  pd::cli::configure(app);
  app.add_option("--rtt-iters", rttIters, "round trips to time")->capture_default_str();
  app.add_option("--frames", frames, "small frames to stream")->capture_default_str();
  app.add_option("--big-frames", bigFrames, "large frames to stream")->capture_default_str();
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;

  Counter received;  // frames seen by the client (echoes) or counted by the server
  std::atomic<bool> echo{true};
  IoPool io(2);
  ConnectionCallbacks scb;
  scb.onMessage = [&](const ConnectionPtr& c, proto::Envelope&& env) {
    if (echo.load()) {
      (void)c->send(std::move(env));
    } else {
      received.add();
    }
  };
  ConnectionOptions sopt;
  sopt.hello.set_role(proto::ROLE_ROUTER);
  auto server = FramedServer::listen(io, "127.0.0.1", 0, sopt, scb);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().toString().c_str());
    return 1;
  }
  ConnectionCallbacks ccb;
  ccb.onMessage = [&](const ConnectionPtr&, proto::Envelope&&) { received.add(); };
  ConnectionOptions copt;
  copt.hello.set_role(proto::ROLE_DECODE);
  auto conn = FramedClient::connect(io, "127.0.0.1", server.value()->port(), copt, ccb, std::chrono::seconds(5));
  if (!conn.ok()) {
    std::fprintf(stderr, "%s\n", conn.status().toString().c_str());
    return 1;
  }

  // 1. Round trip.
  std::vector<double> rtts;
  for (int i = 0; i < rttIters; ++i) {
    proto::Envelope env;
    env.set_request_id(static_cast<uint64_t>(i + 1));
    env.mutable_cancel()->set_request_id(static_cast<uint64_t>(i + 1));
    uint64_t before = received.get();
    auto t0 = Clock::now();
    (void)conn.value()->send(std::move(env));
    if (!received.waitFor(before + 1, std::chrono::seconds(5))) {
      std::fprintf(stderr, "echo lost\n");
      return 1;
    }
    rtts.push_back(usSince(t0));
  }
  std::vector<double> raw = rawPingPong(rttIters);
  std::printf(
      "round trip (small envelope, %d iters): p50 %.1f us  p99 %.1f us   | raw TCP "
      "ping-pong p50 %.1f us  p99 %.1f us\n",
      rttIters, percentile(rtts, 50), percentile(rtts, 99), percentile(raw, 50), percentile(raw, 99));

  // 2. Small frames, pipelined, counted by the server.
  echo = false;
  {
    std::lock_guard<std::mutex> l(received.m);
    received.n = 0;
  }
  auto t0 = Clock::now();
  for (int i = 0; i < frames; ++i) {
    proto::Envelope env;
    env.set_request_id(static_cast<uint64_t>(i % 1000 + 1));
    env.mutable_token_chunk()->add_token_ids(static_cast<uint32_t>(i));
    while (conn.value()->send(env).code() == StatusCode::kResourceExhausted) {
      std::this_thread::yield();
    }
  }
  if (!received.waitFor(static_cast<uint64_t>(frames), std::chrono::seconds(60))) {
    std::fprintf(stderr, "small frames lost\n");
    return 1;
  }
  double s = usSince(t0) / 1e6;
  std::printf("small frames (token_chunk, %d): %.0f frames/s (%.2f us/frame)\n", frames, frames / s, s * 1e6 / frames);

  // 3. Large frames.
  {
    std::lock_guard<std::mutex> l(received.m);
    received.n = 0;
  }
  proto::Envelope big;
  big.set_request_id(1);
  big.mutable_prefill_request()->mutable_kv_target()->set_write_grant(std::string(1 << 20, 'k'));
  size_t bigBytes = big.ByteSizeLong();
  t0 = Clock::now();
  for (int i = 0; i < bigFrames; ++i) {
    while (conn.value()->send(big).code() == StatusCode::kResourceExhausted) {
      std::this_thread::yield();
    }
  }
  if (!received.waitFor(static_cast<uint64_t>(bigFrames), std::chrono::seconds(60))) {
    std::fprintf(stderr, "large frames lost\n");
    return 1;
  }
  s = usSince(t0) / 1e6;
  double rawMBs = rawStream(static_cast<size_t>(bigFrames) << 20);
  std::printf("large frames (%zu bytes, %d): %.0f MB/s   | raw TCP stream %.0f MB/s\n", bigBytes, bigFrames,
              bigBytes * static_cast<double>(bigFrames) / 1e6 / s, rawMBs);

  conn.value()->close(cancelled("bench done"));
  server.value()->stop();
  io.stop();
  return 0;
}
