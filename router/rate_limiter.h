// Per-client rate limits (docs/security.md): a token bucket on requests/s and one on tokens/s for
// each API key (for each client address when the router has no keys).
//
// What a request costs in tokens: its prompt tokens plus its max_tokens, charged when it is
// admitted and never refunded. That is known before any work is done, so a client cannot
// overrun its limit by asking for long outputs, and it is how OpenAI counts its own TPM
// limits (max_tokens counts at admission). The price: a client that sets max_tokens far
// above what it uses is throttled early; it should send a realistic max_tokens.
//
// A bucket holds at most `burst` and refills at `rate` per second. A request that costs
// more than the whole burst passes when the bucket is full and leaves it in debt, so no
// request is refused forever; the next ones wait for the debt to refill.
//
// Threads: RateLimiter is thread-safe (one mutex around a small map); TokenBucket is not.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/base/clock.h"
#include "common/config/cluster_config.h"

namespace pd::router {

class TokenBucket {
 public:
  TokenBucket(double ratePerS, double burst, SteadyTime now)
      : rate_(ratePerS), burst_(burst), level_(burst), last_(now) {}

  struct Outcome {
    bool ok = true;
    int retryAfterS = 0;  // when refused: whole seconds until the same cost would pass (>= 1)
  };
  Outcome take(double cost, SteadyTime now);
  bool full(SteadyTime now);

 private:
  void refill(SteadyTime now);
  double rate_;
  double burst_;
  double level_;
  SteadyTime last_;
};

class RateLimiter {
 public:
  RateLimiter(config::RateLimitConfig config, const Clock& clock = SystemClock::instance());

  bool enabled() const { return config_.enabled(); }

  struct Decision {
    bool ok = true;
    std::string limit;  // "requests_per_s" | "tokens_per_s" when refused
    int retryAfterS = 0;
    std::string message;
  };
  // One request of `client` (an API key's index, or the client's address).
  Decision admitRequest(const std::string& client);
  // `tokens` for an admitted request (prompt + max_tokens).
  Decision admitTokens(const std::string& client, int64_t tokens);

  // The burst sizes in effect (config's, or one second of the rate, at least 1).
  double requestBurst() const;
  double tokenBurst() const;

 private:
  struct Buckets {
    TokenBucket requests;
    TokenBucket tokens;
  };
  Buckets& bucketsOf(const std::string& client, SteadyTime now);

  const config::RateLimitConfig config_;
  const Clock& clock_;
  std::mutex mu_;
  std::unordered_map<std::string, Buckets> clients_;
};

}  // namespace pd::router
