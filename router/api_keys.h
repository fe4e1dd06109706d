// API keys as the router holds them (docs/security.md): SHA-256 hashes only, compared in constant
// time. A config entry is a key or "sha256:<64 hex>" (`printf %s KEY | sha256sum`); plain
// keys are hashed when the set is built, so a heap dump or a core file shows no key that
// this set holds (the caller wipes its own copy of the config).
//
// Threads: immutable after construction; match() from any thread.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"

namespace pd::router {

using Sha256 = std::array<unsigned char, 32>;

Sha256 sha256Of(std::string_view bytes);

class KeySet {
 public:
  KeySet() = default;
  // Errors name the entry by index, never by value.
  static Result<KeySet> fromEntries(const std::vector<std::string>& entries, const std::string& what);

  bool empty() const { return hashes_.empty(); }
  size_t size() const { return hashes_.size(); }
  // The index of the entry `presented` matches, or -1. The time taken does not depend on
  // which entry matched or how many bytes agreed: every entry is compared (CRYPTO_memcmp of
  // the hashes), none is skipped.
  int match(std::string_view presented) const;

  // The token of "Authorization: Bearer <token>", or "" (scheme case-insensitive, RFC 7235).
  static std::string_view bearerToken(std::string_view authorizationHeader);

 private:
  std::vector<Sha256> hashes_;
};

// Overwrites and clears strings that held secrets (OPENSSL_cleanse, which the optimiser
// cannot drop). Best effort: copies made before are not reached.
void wipeSecrets(std::vector<std::string>* secrets);
void wipeSecret(std::string* secret);

}  // namespace pd::router
