// router::PrefixIndex: which prompt prefixes each worker probably holds in its KV prefix
// cache, predicted from what the router sent it (workers do not publish their caches). The
// routing policy uses it to send a prompt where its prefix already is, and to route on the
// UNCACHED length (docs/design.md §6): a long prompt whose prefix a decode worker holds is short
// work for that worker.
//
// A prompt is cut into full blocks of the workers' block size; block i is named by a hash
// chained over blocks 0..i (the same prefix -> the same names, as in the workers' caches).
// Per worker the index keeps the names it recorded, least recently used dropped first once
// the worker's KV pool (its total blocks) is full -- roughly what the worker's own LRU does.
// It can be wrong both ways (a worker evicted early, or blocks a worker shared); a wrong
// guess costs only the recompute the router would have caused without it.
//
// Not thread-safe: the router calls it on its loop strand (router/router_loop.h);
// blockHashes() is const and reads only the block size, so any thread may call it.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace pd::router {

// Tokens of the longest run of leading `hashes` that `held` (anything with count(hash))
// contains: the prefix a cache holding those blocks would serve. Shared by the predicted and
// the exact index (router/kv_event_index.h).
template <typename Held>
int64_t leadingCachedTokens(const Held& held, std::span<const uint64_t> hashes, int blockSize) {
  size_t n = 0;
  while (n < hashes.size() && held.count(hashes[n])) ++n;
  return int64_t(n) * blockSize;
}

class PrefixIndex {
 public:
  explicit PrefixIndex(int blockSize) : blockSize_(blockSize > 0 ? blockSize : 16) {}

  int blockSize() const { return blockSize_; }
  // The chained names of the prompt's full blocks (a partial last block has none).
  std::vector<uint64_t> blockHashes(std::span<const int32_t> tokens) const;
  // Tokens of the longest run of leading blocks the worker is believed to hold.
  int64_t cachedTokens(const std::string& worker, std::span<const uint64_t> hashes) const;
  // The worker now holds these blocks (it computed or received them): most recently used.
  // capacityBlocks bounds what is remembered for it (<= 0: unbounded).
  void record(const std::string& worker, std::span<const uint64_t> hashes, int64_t capacityBlocks);
  // The worker left (or restarted): nothing is cached there.
  void forget(const std::string& worker) { workers_.erase(worker); }
  size_t blocksKnown(const std::string& worker) const;

 private:
  struct WorkerBlocks {
    std::list<uint64_t> lru;  // front: most recently used
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
  };
  int blockSize_;
  std::unordered_map<std::string, WorkerBlocks> workers_;
};

}  // namespace pd::router
