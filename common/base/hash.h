// mix64: splitmix64's finaliser, a full-avalanche bijection on 64 bits. Used to chain block
// hashes (KV prefix cache, the router's prefix indexes) and to derive sampling draws from
// (seed, step); all of them need the same value on every platform and in every process.
//
// hashBlockTokens / blockHashChain: THE name of a KV block, shared by the worker's prefix
// cache (engine/kv_cache_manager.h), the KV events it publishes (docs/kv_events.md)
// and the router's predicted and exact indexes (router/prefix_index.h, router/kv_event_index.h).
// Block i of a prompt is named by a hash of its tokens chained with block i-1's name
// (kRootBlockHash before block 0), so equal names mean equal prefixes (up to 64-bit collisions,
// which the worker's cache double-checks against the tokens it keeps). Changing either
// function changes the names on both sides: they must stay in one place.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pd {

constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

inline constexpr uint64_t kRootBlockHash = 0x70647365727665ULL;  // "pdserve"

// The name of a block holding `tokens`, whose predecessor is named `parentHash`.
inline uint64_t hashBlockTokens(uint64_t parentHash, std::span<const int32_t> tokens) {
  uint64_t h = mix64(parentHash ^ (uint64_t(tokens.size()) << 32));
  for (int32_t t : tokens) h = mix64(h ^ uint32_t(t));
  return h;
}

// The chained names of the full blocks of `tokens` (a partial last block has none).
// blockSize must be positive.
inline std::vector<uint64_t> blockHashChain(std::span<const int32_t> tokens, int blockSize) {
  std::vector<uint64_t> out;
  const size_t bs = size_t(blockSize);
  out.reserve(tokens.size() / bs);
  uint64_t h = kRootBlockHash;
  for (size_t b = 0; (b + 1) * bs <= tokens.size(); ++b) {
    h = hashBlockTokens(h, tokens.subspan(b * bs, bs));
    out.push_back(h);
  }
  return out;
}

}  // namespace pd
