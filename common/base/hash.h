// mix64: splitmix64's finaliser, a full-avalanche bijection on 64 bits. Used to chain block
// hashes (KV prefix cache, the router's prefix index) and to derive sampling draws from
// (seed, step); all of them need the same value on every platform and in every process.
#pragma once

#include <cstdint>

namespace pd {

constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace pd
