// router::PrefixIndex: chained block names, longest cached run, per-worker LRU bounds.
#include "router/prefix_index.h"

#include <numeric>

#include <catch2/catch.hpp>

using namespace pd::router;

namespace {
std::vector<int32_t> tokens(int n, int32_t first = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}
}  // namespace

TEST_CASE("block names are chained: equal prefixes share names, a change renames every later block") {
  PrefixIndex idx(16);
  auto a = tokens(50);
  CHECK(idx.blockHashes(a).size() == 3);  // the partial 4th block has no name
  CHECK(idx.blockHashes(tokens(15)).empty());
  auto b = a;
  b[20] = 9999;  // inside block 1
  auto ha = idx.blockHashes(a), hb = idx.blockHashes(b);
  CHECK(ha[0] == hb[0]);
  CHECK(ha[1] != hb[1]);
  CHECK(ha[2] != hb[2]);  // same tokens in block 2, different history
}

TEST_CASE("cachedTokens is the longest leading run a worker holds") {
  PrefixIndex idx(16);
  const auto system = tokens(64);  // 4 blocks every prompt starts with
  auto p1 = system, p2 = system;
  for (int32_t t : tokens(40, 1000)) p1.push_back(t);
  for (int32_t t : tokens(40, 2000)) p2.push_back(t);
  idx.record("d0", idx.blockHashes(p1), 0);
  CHECK(idx.cachedTokens("d0", idx.blockHashes(p1)) == 96);  // 6 full blocks
  CHECK(idx.cachedTokens("d0", idx.blockHashes(p2)) == 64);  // the shared system prompt
  CHECK(idx.cachedTokens("d1", idx.blockHashes(p1)) == 0);
  // A hole stops the run: blocks after it are not a usable prefix.
  auto h = idx.blockHashes(p2);
  idx.record("d1", std::span<const uint64_t>(h).subspan(1), 0);
  CHECK(idx.cachedTokens("d1", h) == 0);
  idx.forget("d0");
  CHECK(idx.cachedTokens("d0", idx.blockHashes(p1)) == 0);
}

TEST_CASE("a worker's index is bounded by its pool and drops the least recently used first") {
  PrefixIndex idx(16);
  auto a = tokens(64, 0), b = tokens(64, 500), c = tokens(64, 900);  // 4 blocks each
  idx.record("d0", idx.blockHashes(a), 8);
  idx.record("d0", idx.blockHashes(b), 8);
  CHECK(idx.blocksKnown("d0") == 8);
  idx.record("d0", idx.blockHashes(a), 8);  // a is used again: b is now the oldest
  idx.record("d0", idx.blockHashes(c), 8);
  CHECK(idx.blocksKnown("d0") == 8);
  CHECK(idx.cachedTokens("d0", idx.blockHashes(a)) == 64);
  CHECK(idx.cachedTokens("d0", idx.blockHashes(c)) == 64);
  CHECK(idx.cachedTokens("d0", idx.blockHashes(b)) == 0);
  // Evicting part of a prompt drops its tail before its head, so a shorter prefix survives.
  idx.record("d0", std::span<const uint64_t>(idx.blockHashes(b)).first(2), 8);
  CHECK(idx.cachedTokens("d0", idx.blockHashes(a)) == 32);  // a, now the oldest, lost 2 blocks
  CHECK(idx.cachedTokens("d0", idx.blockHashes(c)) == 64);
  CHECK(idx.cachedTokens("d0", idx.blockHashes(b)) == 32);
}
