#include "router/prefix_index.h"

#include "common/base/hash.h"

namespace pd::router {

std::vector<uint64_t> PrefixIndex::blockHashes(std::span<const int32_t> tokens) const {
  return blockHashChain(tokens, blockSize_);  // the workers' own names (common/base/hash.h)
}

int64_t PrefixIndex::cachedTokens(const std::string& worker, std::span<const uint64_t> hashes) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : leadingCachedTokens(it->second.where, hashes, blockSize_);
}

void PrefixIndex::record(const std::string& worker, std::span<const uint64_t> hashes, int64_t capacityBlocks) {
  if (hashes.empty()) return;
  WorkerBlocks& w = workers_[worker];
  // Later blocks are touched first, so a prefix's head ends up most recent: evicting from
  // the tail drops suffixes before the prefixes they extend, as the workers' caches do.
  for (auto h = hashes.rbegin(); h != hashes.rend(); ++h) {
    auto found = w.where.find(*h);
    if (found != w.where.end()) {
      w.lru.splice(w.lru.begin(), w.lru, found->second);
    } else {
      w.lru.push_front(*h);
      w.where.emplace(*h, w.lru.begin());
    }
  }
  while (capacityBlocks > 0 && int64_t(w.lru.size()) > capacityBlocks) {
    w.where.erase(w.lru.back());
    w.lru.pop_back();
  }
}

size_t PrefixIndex::blocksKnown(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.lru.size();
}

}  // namespace pd::router
