// Multi-turn replay for `pdserve bench --multi-turn` (docs/bench.md, "Multi-turn replay").
//
// The Mooncake conversation trace gives each request's prefix blocks (`hash_ids`, 512 tokens
// each), not its conversation. A next turn shows as a request whose leading blocks are every
// full block of an earlier request: its prompt was that request's prompt, the answer, and a
// new message. The replay keeps that structure with real ids: a next turn's prompt is the
// previous turn's prompt ids, the ids the server generated for it (return_token_ids), and
// fresh ids for the new message (its length scaled like the prompts); it is sent once the
// previous turn finished. A request with no previous turn is built from its hash ids as in a
// plain trace replay, so conversations still share the system prompt and common prefixes.
//
// Contract: plain functions over values; safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/bench/stats.h"
#include "tools/bench/trace.h"
#include "tools/bench/workload.h"

namespace pd::bench {

// Links requests[i] (made from rows[i]) to its previous turn: the latest earlier request
// with at least 2 full blocks, all of them the leading blocks of requests[i] (one shared
// block is the trace's common system prompt, not a conversation). newTokens is
// max(minNewTokens, scale * (input - previous input - previous output)). Returns the number
// of requests linked.
int64_t linkTurns(std::vector<PlannedRequest>& requests, const std::vector<TraceRow>& rows, int blockTokens,
                  double scale, int64_t minNewTokens);

// A next turn's prompt: `history` (the previous turn's prompt and generated ids), then
// r.newTokens ids of its own drawn from `range` (deterministic in seed and r.index).
std::vector<int32_t> turnPromptIds(const PlannedRequest& r, const std::vector<int32_t>& history,
                                   const TokenIdRange& range, uint64_t seed);

struct TurnSummary {
  int64_t requests = 0;         // measured requests that completed with usage
  int64_t promptTokens = 0;     // their prompt tokens
  int64_t cachedTokens = 0;     // usage.prompt_tokens_details.cached_tokens summed
  int64_t withCachedUsage = 0;  // requests whose usage carried cached_tokens
  // An unbounded single cache of blockSize-token blocks over the same requests in the order
  // they were sent: every full block of every earlier request's prompt and answer (all but
  // the last generated token, whose KV is never computed), at most (prompt - 1) / blockSize
  // blocks of a prompt (its last token is always computed).
  int64_t idealCachedTokens = 0;
  // Next turns only: their prompt tokens, cached tokens, and the full blocks of the previous
  // turn's history they could hit (the ideal for a next turn).
  int64_t turns = 0;
  int64_t turnPromptTokens = 0;
  int64_t turnCachedTokens = 0;
  int64_t turnHistoryTokens = 0;
  double hitRate() const { return promptTokens > 0 ? double(cachedTokens) / double(promptTokens) : kNaN; }
  double idealHitRate() const { return promptTokens > 0 ? double(idealCachedTokens) / double(promptTokens) : kNaN; }
};
// Over the measured records of a multi-turn run (their promptIds / generatedIds).
TurnSummary summarizeTurns(const std::vector<PlannedRequest>& plan, const std::vector<RequestRecord>& records,
                           int blockSize);
// The report's lines for it.
std::string formatTurns(const TurnSummary& s, int blockSize);

}  // namespace pd::bench
