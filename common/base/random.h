// Random 64-bit identifiers (transport instance ids, exposure tokens, request ids): never 0,
// which the wire protocols reserve for "none". Not for cryptography.
// Thread-safe: each thread has its own generator, seeded from std::random_device.
#pragma once

#include <cstdint>
#include <random>

namespace pd {

inline uint64_t randomNonZeroU64() {
  static thread_local std::mt19937_64 rng{(uint64_t(std::random_device{}()) << 32) ^ std::random_device{}()};
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
}

}  // namespace pd
