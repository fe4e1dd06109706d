#include "common/base/peer_log_limiter.h"

#include "common/base/log.h"

namespace pd {

std::string PeerLogLimiter::hostOf(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  // One colon: host:port. More: a bare IPv6 address.
  if (colon != std::string::npos && address.find(':') == colon) return address.substr(0, colon);
  return address;
}

PeerLogLimiter::Decision PeerLogLimiter::admit(const std::string& address, Clock::time_point now) {
  const std::string host = hostOf(address);
  std::lock_guard<std::mutex> lock(mutex_);
  Decision d;
  if (windowStart_ == Clock::time_point{} || now - windowStart_ >= window_) {
    if (suppressedInWindow_ > 0) {
      d.summary = what_ + ": suppressed " + std::to_string(suppressedInWindow_) + " warnings from " +
                  std::to_string(suppressedAddresses_.size()) + " addresses in the last " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - windowStart_).count()) + " s";
    }
    windowStart_ = now;
    suppressedInWindow_ = 0;
    suppressedAddresses_.clear();
    // Forget addresses that have been quiet for two windows: the map stays as small as the set
    // of recently noisy peers.
    std::erase_if(entries_, [&](const auto& kv) { return now - kv.second.lastLogged >= 2 * window_; });
  }
  auto [it, fresh] = entries_.try_emplace(host);
  Entry& e = it->second;
  if (fresh || now - e.lastLogged >= window_) {
    d.log = true;
    if (e.held > 0) d.note = " (" + std::to_string(e.held) + " earlier lines from this address suppressed)";
    e.lastLogged = now;
    e.held = 0;
    return d;
  }
  ++e.held;
  ++suppressedInWindow_;
  ++suppressedTotal_;
  suppressedAddresses_[host] = true;
  return d;
}

void PeerLogLimiter::warn(const std::string& address, const char* component, const std::string& line) {
  Decision d = admit(address);
  if (d.summary) {
    PD_LOG(kWarn, component) << *d.summary;
  }
  if (d.log) {
    PD_LOG(kWarn, component) << line << d.note;
  }
}

uint64_t PeerLogLimiter::suppressedTotal() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return suppressedTotal_;
}

}  // namespace pd
