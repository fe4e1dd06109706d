// Rate limit for warnings about unauthenticated peers (docs/security.md "Peer hardening").
//
// Why: a peer without the cluster secret can open connections as fast as it likes, and each
// refused handshake used to write a warning line (3,166 router lines in 25 s from one flooding
// host). The limiter lets through at most one line per source address per window; what it held
// back is reported in the next line that address gets, and once per window a summary line
// says how many lines from all addresses were suppressed.
//
// Threads: every method may be called from any thread at once (one mutex; callers are the
// I/O threads of one server). Memory: one entry per address seen in the current window;
// entries older than two windows are dropped as the window turns.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace pd {

class PeerLogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit PeerLogLimiter(std::string what, Clock::duration window = std::chrono::seconds(10))
      : what_(std::move(what)), window_(window) {}

  struct Decision {
    bool log = false;  // write the caller's line now
    // Appended to the caller's line when lines of this address were held back before it:
    // " (K earlier lines from this address suppressed)".
    std::string note;
    // A line to write as well (once per window when anything was suppressed):
    // "<what>: suppressed K warnings from N addresses in the last S s".
    std::optional<std::string> summary;
  };

  // One warning about a peer at `address` (host only, or host:port: the port is stripped).
  Decision admit(const std::string& address, Clock::time_point now = Clock::now());

  // admit(), then writes the summary (if any) and the line (if let through, with its note) at
  // warn level under `component`.
  void warn(const std::string& address, const char* component, const std::string& line);

  uint64_t suppressedTotal() const;

  // "127.0.0.1:5000" -> "127.0.0.1", "[::1]:5000" -> "::1".
  static std::string hostOf(const std::string& address);

 private:
  struct Entry {
    Clock::time_point lastLogged;
    uint64_t held = 0;  // lines suppressed since lastLogged
  };
  const std::string what_;
  const Clock::duration window_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, Entry> entries_;
  Clock::time_point windowStart_{};
  uint64_t suppressedInWindow_ = 0;
  std::unordered_map<std::string, bool> suppressedAddresses_;
  uint64_t suppressedTotal_ = 0;
};

}  // namespace pd
