#include "tools/bench/multiturn.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "common/base/hash.h"

namespace pd::bench {
namespace {

uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t chain(uint64_t h, int64_t id) {
  uint64_t s = h ^ static_cast<uint64_t>(id);
  return splitmix(s);
}

}  // namespace

int64_t linkTurns(std::vector<PlannedRequest>& requests, const std::vector<TraceRow>& rows, int blockTokens,
                  double scale, int64_t minNewTokens) {
  if (blockTokens <= 0) return 0;
  // The chained hash of a request's first k ids -> the latest request whose full blocks are
  // exactly those k.
  std::unordered_map<uint64_t, size_t> byFullBlocks;
  int64_t linked = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    PlannedRequest& r = requests[i];
    const TraceRow& row = rows[static_cast<size_t>(r.index) % rows.size()];
    const std::vector<int64_t>& ids = row.hashIds;
    std::vector<uint64_t> prefix(ids.size() + 1, 0);
    for (size_t k = 0; k < ids.size(); ++k) prefix[k + 1] = chain(prefix[k], ids[k]);
    for (size_t k = ids.size(); k >= 2; --k) {
      auto it = byFullBlocks.find(prefix[k]);
      if (it == byFullBlocks.end()) continue;
      const TraceRow& prev = rows[static_cast<size_t>(requests[it->second].index) % rows.size()];
      if (!std::equal(ids.begin(), ids.begin() + static_cast<long>(k), prev.hashIds.begin())) continue;
      r.parent = static_cast<int64_t>(it->second);
      const double fresh = static_cast<double>(row.promptTokens - prev.promptTokens - prev.outputTokens) * scale;
      r.newTokens = std::max<int64_t>(minNewTokens, std::llround(fresh));
      ++linked;
      break;
    }
    const size_t full = static_cast<size_t>(row.promptTokens / blockTokens);
    if (full >= 2 && full <= ids.size()) byFullBlocks[prefix[full]] = i;
  }
  return linked;
}

std::vector<int32_t> turnPromptIds(const PlannedRequest& r, const std::vector<int32_t>& history,
                                   const TokenIdRange& range, uint64_t seed) {
  std::vector<int32_t> ids = history;
  const uint64_t span = static_cast<uint64_t>(std::max<int64_t>(1, range.maxId - range.minId));
  uint64_t state = chain(chain(seed, 0x7e4e), r.index);
  for (int64_t k = 0; k < r.newTokens; ++k)
    ids.push_back(static_cast<int32_t>(range.minId + static_cast<int64_t>(splitmix(state) % span)));
  return ids;
}

TurnSummary summarizeTurns(const std::vector<PlannedRequest>& plan, const std::vector<RequestRecord>& records,
                           int blockSize) {
  TurnSummary s;
  if (blockSize <= 0) return s;
  auto good = [&](const RequestRecord& r) { return r.ok && !r.promptIds.empty(); };
  std::vector<size_t> order;
  for (size_t i = 0; i < records.size(); ++i)
    if (good(records[i])) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return records[a].startS < records[b].startS; });
  std::unordered_set<uint64_t> seen;  // the unbounded cache: names of every computed full block
  for (size_t i : order) {
    const RequestRecord& r = records[i];
    const std::vector<uint64_t> names = blockHashChain(r.promptIds, blockSize);
    const size_t usable = (r.promptIds.size() - 1) / static_cast<size_t>(blockSize);
    size_t hit = 0;
    while (hit < std::min(usable, names.size()) && seen.count(names[hit])) ++hit;
    ++s.requests;
    s.promptTokens += static_cast<int64_t>(r.promptIds.size());
    s.idealCachedTokens += static_cast<int64_t>(hit) * blockSize;
    if (r.cachedTokens >= 0) {
      ++s.withCachedUsage;
      s.cachedTokens += r.cachedTokens;
    }
    const int64_t parent = i < plan.size() ? plan[i].parent : -1;
    if (parent >= 0 && static_cast<size_t>(parent) < records.size()) {
      const RequestRecord& p = records[static_cast<size_t>(parent)];
      const size_t history = p.promptIds.size() + p.generatedIds.size();
      ++s.turns;
      s.turnPromptTokens += static_cast<int64_t>(r.promptIds.size());
      s.turnCachedTokens += std::max<int64_t>(0, r.cachedTokens);
      if (history > 0)
        s.turnHistoryTokens +=
            static_cast<int64_t>(std::min(usable, (history - 1) / static_cast<size_t>(blockSize))) * blockSize;
    }
    // What this request leaves computed: its prompt and answer but the last generated token.
    std::vector<int32_t> computed = r.promptIds;
    computed.insert(computed.end(), r.generatedIds.begin(), r.generatedIds.end());
    if (!r.generatedIds.empty()) computed.pop_back();
    for (uint64_t h : blockHashChain(computed, blockSize)) seen.insert(h);
  }
  return s;
}

std::string formatTurns(const TurnSummary& s, int blockSize) {
  auto pct = [](int64_t a, int64_t b) { return b > 0 ? 100.0 * double(a) / double(b) : 0.0; };
  char buf[1024];
  std::string out = "---------------------------Multi-turn replay----------------------------\n";
  std::snprintf(buf, sizeof buf, "%-40s %d\n", "Engine block size (tokens):", blockSize);
  out += buf;
  std::snprintf(buf, sizeof buf, "%-40s %lld (%lld with cached_tokens)\n",
                "Completed requests:", static_cast<long long>(s.requests), static_cast<long long>(s.withCachedUsage));
  out += buf;
  std::snprintf(buf, sizeof buf, "%-40s %.1f%% (%lld of %lld prompt tokens)\n",
                "Fleet prefix hit rate:", pct(s.cachedTokens, s.promptTokens), static_cast<long long>(s.cachedTokens),
                static_cast<long long>(s.promptTokens));
  out += buf;
  std::snprintf(buf, sizeof buf, "%-40s %.1f%% (%lld tokens)\n",
                "Ceiling: one unbounded cache:", pct(s.idealCachedTokens, s.promptTokens),
                static_cast<long long>(s.idealCachedTokens));
  out += buf;
  std::snprintf(buf, sizeof buf, "%-40s %lld: %.1f%% of their prompt tokens cached\n",
                "Next turns:", static_cast<long long>(s.turns), pct(s.turnCachedTokens, s.turnPromptTokens));
  out += buf;
  std::snprintf(buf, sizeof buf, "%-40s %.1f%% (%lld of %lld tokens)\n",
                "  history blocks served:", pct(std::min(s.turnCachedTokens, s.turnHistoryTokens), s.turnHistoryTokens),
                static_cast<long long>(s.turnCachedTokens), static_cast<long long>(s.turnHistoryTokens));
  out += buf;
  return out;
}

}  // namespace pd::bench
