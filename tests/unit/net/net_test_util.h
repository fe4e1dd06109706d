// Helpers for the net tests: a raw POSIX client (to send what FramedClient never would) and a
// recorder of server events with bounded waits.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "common/net/framed.h"

namespace pd::net::testing {

inline std::string frameOf(const proto::Envelope& env) {
  std::string body = env.SerializeAsString();
  uint32_t n = static_cast<uint32_t>(body.size());
  std::string f = {static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                   static_cast<char>(n)};
  return f + body;
}

inline std::string helloFrame(uint32_t version = kProtocolVersion) {
  proto::Envelope env;
  env.set_version(version);
  env.mutable_hello()->set_protocol_version(version);
  env.mutable_hello()->set_role(proto::ROLE_CLIENT);
  env.mutable_hello()->set_worker_id("raw");
  return frameOf(env);
}

inline std::string lengthPrefix(uint32_t n) {
  return {static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8), static_cast<char>(n)};
}

// A blocking loopback socket with a 5 s receive timeout, so no test can hang on it.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  bool write(const std::string& bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  void shutdownWrite() { ::shutdown(fd_, SHUT_WR); }
  // Reads one frame; false on EOF, error or timeout.
  bool readFrame(proto::Envelope* env) {
    std::string header(4, '\0');
    if (!readExactly(&header)) return false;
    uint32_t n = (uint32_t(uint8_t(header[0])) << 24) | (uint32_t(uint8_t(header[1])) << 16) |
                 (uint32_t(uint8_t(header[2])) << 8) | uint32_t(uint8_t(header[3]));
    std::string body(n, '\0');
    if (n > 0 && !readExactly(&body)) return false;
    return env->ParseFromString(body);
  }
  // True when the peer closed (EOF or reset) within the receive timeout.
  bool waitClosed() {
    char buf[256];
    for (;;) {
      ssize_t r = ::recv(fd_, buf, sizeof buf, 0);
      if (r == 0) return true;
      if (r < 0) return errno == ECONNRESET;
    }
  }

 private:
  bool readExactly(std::string* out) {
    size_t got = 0;
    while (got < out->size()) {
      ssize_t r = ::recv(fd_, out->data() + got, out->size() - got, 0);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  }
  int fd_ = -1;
  bool connected_ = false;
};

// A loopback listener that never accepts: the kernel completes TCP connects into its
// backlog, and nobody ever says hello.
class MuteListener {
 public:
  MuteListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(fd_, 8);
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~MuteListener() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Records a server's (or client's) events; waits are bounded.
struct Events {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<Status> closes;
  std::vector<proto::Envelope> messages;
  int opens = 0;

  ConnectionCallbacks callbacks(bool echo) {
    ConnectionCallbacks cb;
    cb.onOpen = [this](const ConnectionPtr&) {
      std::lock_guard<std::mutex> lock(mutex);
      ++opens;
      cv.notify_all();
    };
    cb.onMessage = [this, echo](const ConnectionPtr& c, proto::Envelope&& env) {
      if (echo) (void)c->send(env);
      std::lock_guard<std::mutex> lock(mutex);
      messages.push_back(std::move(env));
      cv.notify_all();
    };
    cb.onClose = [this](const ConnectionPtr&, const Status& s) {
      std::lock_guard<std::mutex> lock(mutex);
      closes.push_back(s);
      cv.notify_all();
    };
    return cb;
  }

  // The n-th close reason (1-based), or a non-ok placeholder after 5 s.
  Status waitClose(size_t n) {
    std::unique_lock<std::mutex> lock(mutex);
    if (!cv.wait_for(lock, std::chrono::seconds(5), [&] { return closes.size() >= n; })) {
      return internalError("timed out waiting for close #" + std::to_string(n));
    }
    return closes[n - 1];
  }
  // True once n connections opened, false after 5 s.
  bool waitOpens(int n) {
    std::unique_lock<std::mutex> lock(mutex);
    return cv.wait_for(lock, std::chrono::seconds(5), [&] { return opens >= n; });
  }
  bool waitMessages(size_t n) {
    std::unique_lock<std::mutex> lock(mutex);
    return cv.wait_for(lock, std::chrono::seconds(5), [&] { return messages.size() >= n; });
  }
};

// stderr into a file while alive, so a test can count the lines a flood wrote.
class StderrCapture {
 public:
  StderrCapture() : path_("/tmp/pd_flood_log_" + std::to_string(::getpid()) + ".txt") {
    std::fflush(stderr);
    saved_ = ::dup(2);
    int fd = ::open(path_.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrCapture() {
    restore();
    std::remove(path_.c_str());
  }
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  // Lines that contain `what` (and `also`, when given).
  size_t linesContaining(const std::string& what, const std::string& also = "") const {
    std::ifstream in(path_);
    size_t n = 0;
    for (std::string line; std::getline(in, line);) {
      n += line.find(what) != std::string::npos && (also.empty() || line.find(also) != std::string::npos);
    }
    return n;
  }
  StderrCapture(const StderrCapture&) = delete;

 private:
  std::string path_;
  int saved_ = -1;
};

}  // namespace pd::net::testing
