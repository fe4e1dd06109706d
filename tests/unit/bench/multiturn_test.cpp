// The multi-turn replay (tools/bench/multiturn.h): which trace rows are next turns, what a next
// turn's prompt holds, the stream's generated ids and cached tokens, and the report's figures.
#include "tools/bench/multiturn.h"

#include <catch2/catch.hpp>

#include "common/base/hash.h"
#include "tools/bench/sse.h"

using namespace pd::bench;

namespace {

TraceRow row(int64_t input, int64_t output, std::vector<int64_t> ids) {
  TraceRow r;
  r.promptTokens = input;
  r.outputTokens = output;
  r.hashIds = std::move(ids);
  return r;
}

std::vector<PlannedRequest> plan(size_t n) {
  std::vector<PlannedRequest> p(n);
  for (size_t i = 0; i < n; ++i) p[i].index = int64_t(i);
  return p;
}

}  // namespace

TEST_CASE("multi-turn: a next turn extends every full block of the latest earlier turn", "[bench][multiturn]") {
  // Blocks of 512; block 0 is the shared system prompt.
  std::vector<TraceRow> rows = {
      row(1300, 100, {0, 1, 2}),       // 0: two full blocks (0, 1), a partial one
      row(1700, 50, {0, 1, 3, 4}),     // 1: extends row 0's full blocks: its next turn
      row(900, 10, {0, 5}),            // 2: shares only the system block: no previous turn
      row(2100, 40, {0, 1, 3, 6, 7}),  // 3: extends row 1's three full blocks (longest)
      row(600, 10, {0, 9}),            // 4: one full block: never anyone's previous turn
      row(700, 10, {0, 9}),            // 5: ... so not linked to row 4
      row(1500, 10, {0, 1, 3}),        // 6: row 1's full blocks are (0, 1, 3): its next turn
      row(1100, 10, {0, 1, 8}),        // 7: full blocks (0, 1): row 6's too, the latest
  };
  auto p = plan(rows.size());
  CHECK(linkTurns(p, rows, 512, 0.1, 16) == 4);
  CHECK(p[0].parent == -1);
  CHECK(p[1].parent == 0);
  CHECK(p[1].newTokens == 30);  // (1700 - 1300 - 100) x 0.1
  CHECK(p[2].parent == -1);
  CHECK(p[3].parent == 1);
  CHECK(p[3].newTokens == 35);  // (2100 - 1700 - 50) x 0.1
  CHECK(p[4].parent == -1);
  CHECK(p[5].parent == -1);
  CHECK(p[6].parent == 1);
  CHECK(p[6].newTokens == 16);  // shorter than the previous turn and its answer: the floor
  CHECK(p[7].parent == 6);
}

TEST_CASE("multi-turn: a next turn's prompt is the history, then its own new message", "[bench][multiturn]") {
  PlannedRequest r;
  r.index = 4;
  r.newTokens = 20;
  const std::vector<int32_t> history = {5, 6, 7, 8, 9};
  const auto ids = turnPromptIds(r, history, {10, 50}, 1);
  REQUIRE(ids.size() == 25);
  CHECK(std::equal(history.begin(), history.end(), ids.begin()));
  for (size_t i = 5; i < ids.size(); ++i) CHECK((ids[i] >= 10 && ids[i] < 50));
  CHECK(turnPromptIds(r, history, {10, 50}, 1) == ids);  // deterministic
  r.index = 5;
  CHECK(turnPromptIds(r, history, {10, 50}, 1) != ids);  // another request's message
}

TEST_CASE("multi-turn: the stream's generated ids and cached tokens are kept", "[bench][multiturn]") {
  StreamAccounting a(/*chat=*/false);
  a.onEvent({"", R"({"choices":[{"index":0,"text":"ab","token_ids":[97,98]}]})"}, 10);
  a.onEvent({"", R"({"choices":[{"index":0,"text":"c","token_ids":[99]}]})"}, 20);
  a.onEvent({"", R"({"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,)"
                 R"("prompt_tokens_details":{"cached_tokens":32}}})"},
            21);
  CHECK(a.tokenIds() == std::vector<int32_t>{97, 98, 99});
  CHECK(a.chunkTokens() == 3);
  CHECK(a.usageCachedTokens() == 32);
  StreamAccounting b(false);
  b.onEvent({"", R"({"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}})"}, 1);
  CHECK(b.usageCachedTokens() == -1);
}

TEST_CASE("multi-turn: fleet hit rate, the unbounded-cache ceiling and the history a next turn hit",
          "[bench][multiturn]") {
  // Blocks of 4. Request 0: 10 prompt ids, 6 generated. Request 1, its next turn: the 16 ids
  // of history and 3 new ones. Request 2 shares nothing.
  std::vector<PlannedRequest> p = plan(3);
  p[1].parent = 0;
  std::vector<RequestRecord> recs(3);
  for (int i = 0; i < 3; ++i) {
    recs[size_t(i)].ok = true;
    recs[size_t(i)].startS = i;
  }
  recs[0].promptIds = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  recs[0].generatedIds = {11, 12, 13, 14, 15, 16};
  recs[0].cachedTokens = 0;
  recs[1].promptIds = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 90, 91, 92};
  recs[1].cachedTokens = 8;  // the server found the prompt's blocks only
  recs[2].promptIds = {70, 71, 72, 73, 74};
  recs[2].cachedTokens = 0;
  const TurnSummary s = summarizeTurns(p, recs, 4);
  CHECK(s.requests == 3);
  CHECK(s.promptTokens == 34);
  CHECK(s.cachedTokens == 8);
  // One cache holds request 0's computed blocks (15 of its 16 ids: three full blocks), so
  // request 1 could hit 12 tokens; request 2 nothing.
  CHECK(s.idealCachedTokens == 12);
  CHECK(s.turns == 1);
  CHECK(s.turnHistoryTokens == 12);
  CHECK(s.turnCachedTokens == 8);
  CHECK(s.hitRate() == Approx(8.0 / 34));
  const std::string text = formatTurns(s, 4);
  CHECK(text.find("Fleet prefix hit rate:") != std::string::npos);
  CHECK(text.find("23.5%") != std::string::npos);  // 8 of 34
  CHECK(text.find("35.3%") != std::string::npos);  // the ceiling: 12 of 34
}
