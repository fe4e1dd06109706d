#include "router/rate_limiter.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace pd::router {

namespace {
// Beyond this many clients, buckets that are full again (idle clients) are dropped: a full
// bucket is what a new client gets anyway, so forgetting it changes nothing.
constexpr size_t kMaxClients = 65536;

std::string number(double v) {
  std::ostringstream o;
  o << v;  // 0.5, 10, 2.5e+06: no trailing zeros
  return o.str();
}
}  // namespace

void TokenBucket::refill(SteadyTime now) {
  if (now > last_) {
    level_ = std::min(burst_, level_ + rate_ * secondsBetween(last_, now));
    last_ = now;
  }
}

TokenBucket::Outcome TokenBucket::take(double cost, SteadyTime now) {
  refill(now);
  if (level_ >= cost || level_ >= burst_) {
    level_ -= cost;
    return {};
  }
  // Seconds until the level reaches the cost (or, for a cost above the burst, the burst).
  const double need = std::min(cost, burst_) - level_;
  return {false, std::max(1, int(std::ceil(need / rate_ - 1e-9)))};
}

bool TokenBucket::full(SteadyTime now) {
  refill(now);
  return level_ >= burst_;
}

RateLimiter::RateLimiter(config::RateLimitConfig config, const Clock& clock) : config_(config), clock_(clock) {}

double RateLimiter::requestBurst() const {
  return config_.requestBurst > 0 ? double(config_.requestBurst) : std::max(1.0, std::ceil(config_.requestsPerS));
}

double RateLimiter::tokenBurst() const {
  return config_.tokenBurst > 0 ? double(config_.tokenBurst) : std::max(1.0, std::ceil(config_.tokensPerS));
}

RateLimiter::Buckets& RateLimiter::bucketsOf(const std::string& client, SteadyTime now) {
  auto it = clients_.find(client);
  if (it != clients_.end()) return it->second;
  if (clients_.size() >= kMaxClients) {
    for (auto i = clients_.begin(); i != clients_.end();) {
      i = i->second.requests.full(now) && i->second.tokens.full(now) ? clients_.erase(i) : std::next(i);
    }
  }
  return clients_
      .emplace(client, Buckets{TokenBucket(config_.requestsPerS, requestBurst(), now),
                               TokenBucket(config_.tokensPerS, tokenBurst(), now)})
      .first->second;
}

RateLimiter::Decision RateLimiter::admitRequest(const std::string& client) {
  if (config_.requestsPerS <= 0) return {};
  const SteadyTime now = clock_.now();
  std::lock_guard<std::mutex> lock(mu_);
  auto got = bucketsOf(client, now).requests.take(1, now);
  if (got.ok) return {};
  Decision d;
  d.ok = false;
  d.limit = "requests_per_s";
  d.retryAfterS = got.retryAfterS;
  d.message = "Rate limit reached: router.rate_limits.requests_per_s is " + number(config_.requestsPerS) + " (burst " +
              std::to_string(int64_t(requestBurst())) + ") for this API key; retry in " +
              std::to_string(got.retryAfterS) + " s.";
  return d;
}

RateLimiter::Decision RateLimiter::admitTokens(const std::string& client, int64_t tokens) {
  if (config_.tokensPerS <= 0) return {};
  const SteadyTime now = clock_.now();
  std::lock_guard<std::mutex> lock(mu_);
  auto got = bucketsOf(client, now).tokens.take(double(tokens), now);
  if (got.ok) return {};
  Decision d;
  d.ok = false;
  d.limit = "tokens_per_s";
  d.retryAfterS = got.retryAfterS;
  d.message = "Rate limit reached: router.rate_limits.tokens_per_s is " + number(config_.tokensPerS) + " (burst " +
              std::to_string(int64_t(tokenBurst())) + ") for this API key; this request needs " +
              std::to_string(tokens) + " tokens (prompt + max_tokens); retry in " + std::to_string(got.retryAfterS) +
              " s.";
  return d;
}

}  // namespace pd::router
