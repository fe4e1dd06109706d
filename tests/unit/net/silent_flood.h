// A handshake flood for tests (docs/security.md "Peer hardening"): `count` TCP connections
// from one source address that never send a byte, each reopened as soon as the server closes
// it, until stop(). It plays the outsider without the cluster secret who tried to keep
// legitimate peers from registering.
//
// Threads: one thread of its own; start()/stop() from the test thread. Every socket is
// non-blocking and every poll has a timeout, so stop() returns within ~100 ms.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <string>
#include <thread>
#include <vector>

namespace pd::testing {

class SilentFlood {
 public:
  // sourceAddress: the local address to bind (any 127.x.y.z works on Linux loopback).
  SilentFlood(std::string sourceAddress, int port, int count)
      : source_(std::move(sourceAddress)), port_(port), count_(count) {}
  ~SilentFlood() { stop(); }

  void start() {
    fds_.assign(count_, -1);
    thread_ = std::thread([this] { run(); });
  }
  void stop() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
    for (int& fd : fds_)
      if (fd >= 0) ::close(fd), fd = -1;
  }
  // Connections the server closed (each was reopened).
  uint64_t closedByServer() const { return closed_.load(); }
  uint64_t opened() const { return opened_.load(); }

 private:
  int open() {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, source_.c_str(), &src.sin_addr);
    ::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src);
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(static_cast<uint16_t>(port_));
    dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst);  // EINPROGRESS
    ++opened_;
    return fd;
  }

  void run() {
    std::vector<pollfd> pfds(count_);
    char buf[4096];
    while (!stopping_) {
      for (int i = 0; i < count_; ++i) {
        if (fds_[i] < 0) fds_[i] = open();
        pfds[i] = pollfd{fds_[i], POLLIN, 0};
      }
      if (::poll(pfds.data(), pfds.size(), 100) <= 0) continue;
      for (int i = 0; i < count_; ++i) {
        if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        // Drain the server's hello; a close (0) or an error means the server let it go.
        ssize_t r = ::recv(fds_[i], buf, sizeof buf, 0);
        if (r > 0) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        // EOF or a reset: the server closed it. Anything else (a refused or failed connect)
        // never reached the server.
        if (r == 0 || errno == ECONNRESET) ++closed_;
        ::close(fds_[i]);
        fds_[i] = -1;
      }
    }
  }

  const std::string source_;
  const int port_;
  const int count_;
  std::vector<int> fds_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> closed_{0}, opened_{0};
};

}  // namespace pd::testing
