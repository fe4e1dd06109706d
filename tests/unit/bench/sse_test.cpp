// SSE framing and the token accounting that defines TTFT and the inter-token gaps.
#include "tools/bench/sse.h"

#include <cmath>

#include <catch2/catch.hpp>

using namespace pd::bench;

TEST_CASE("SSE events split anywhere and across line endings", "[bench][sse]") {
  const std::string stream = ": comment\r\ndata: {\"a\":1}\r\n\r\nevent: error\ndata: x\ndata: y\n\ndata:[DONE]\r\r";
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseDecoder d;
    std::vector<SseEvent> ev;
    d.feed(std::string_view(stream).substr(0, cut), &ev);
    d.feed(std::string_view(stream).substr(cut), &ev);
    REQUIRE(ev.size() == 3);
    CHECK(ev[0].data == "{\"a\":1}");
    CHECK(ev[0].event.empty());
    CHECK(ev[1].event == "error");
    CHECK(ev[1].data == "x\ny");
    CHECK(ev[2].data == "[DONE]");
  }
}

namespace {
SseEvent data(std::string s) { return SseEvent{"", std::move(s)}; }
std::string text(const std::string& t) {
  return R"({"id":"c","object":"text_completion","choices":[{"index":0,"text":")" + t + R"(","finish_reason":null}]})";
}
}  // namespace

TEST_CASE("completion stream: TTFT, one gap per later token, usage", "[bench][sse]") {
  StreamAccounting a(/*chat=*/false);
  a.onEvent(data(text("He")), 120);
  a.onEvent(data(text("")), 125);  // empty text carries no token
  a.onEvent(data(text("llo")), 150);
  a.onEvent(data(text(" w")), 190);
  a.onEvent(data(R"({"choices":[{"index":0,"text":"","finish_reason":"length"}]})"), 191);
  a.onEvent(data(R"({"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}})"), 192);
  a.onEvent(data("[DONE]"), 193);
  a.onEvent(data(text("after done")), 300);  // ignored
  CHECK(a.done());
  CHECK_FALSE(a.failed());
  CHECK(a.ttftMs() == 120);
  CHECK(a.chunkTokens() == 3);
  REQUIRE(a.itlsMs().size() == 2);
  CHECK(a.itlsMs()[0] == 30);
  CHECK(a.itlsMs()[1] == 40);
  CHECK(a.usagePromptTokens() == 7);
  CHECK(a.usageCompletionTokens() == 3);
  CHECK(a.finishReason() == "length");
  CHECK(a.doneMs() == 193);
}

TEST_CASE("a chunk with k tokens is one gap then k-1 zero gaps", "[bench][sse]") {
  StreamAccounting a(/*chat=*/false);
  a.onEvent(data(R"({"choices":[{"index":0,"text":"ab","token_ids":[5,6]}]})"), 100);
  a.onEvent(data(R"({"choices":[{"index":0,"text":"cde","token_ids":[7,8,9]}]})"), 130);
  CHECK(a.ttftMs() == 100);
  CHECK(a.chunkTokens() == 5);
  REQUIRE(a.itlsMs().size() == 4);  // tokens - 1
  CHECK(a.itlsMs() == std::vector<double>{0, 30, 0, 0});
  // Continuous usage stats give k as the growth of completion_tokens.
  StreamAccounting c(/*chat=*/true);
  c.onEvent(
      data(
          R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":{"prompt_tokens":4,"completion_tokens":0}})"),
      10);
  c.onEvent(
      data(R"({"choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"prompt_tokens":4,"completion_tokens":2}})"),
      50);
  c.onEvent(
      data(R"({"choices":[{"index":0,"delta":{"content":"y"}}],"usage":{"prompt_tokens":4,"completion_tokens":3}})"),
      70);
  CHECK(c.ttftMs() == 50);
  CHECK(c.chunkTokens() == 3);
  CHECK(c.itlsMs() == std::vector<double>{0, 20});
}

TEST_CASE("chat stream: the role chunk is not a token", "[bench][sse]") {
  StreamAccounting a(/*chat=*/true);
  a.onEvent(
      data(R"({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})"),
      5);
  CHECK(std::isnan(a.ttftMs()));
  a.onEvent(data(R"({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}]})"), 80);
  a.onEvent(
      data(
          R"({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":null},"finish_reason":"stop"}]})"),
      81);
  CHECK(a.ttftMs() == 80);
  CHECK(a.chunkTokens() == 1);
  CHECK(a.itlsMs().empty());
  CHECK(a.finishReason() == "stop");
}

TEST_CASE("errors inside the stream are surfaced", "[bench][sse]") {
  StreamAccounting a(false);
  a.onEvent(data(text("x")), 10);
  a.onEvent(data(R"({"error":{"message":"KV transfer failed","type":"InternalServerError","param":null,"code":500}})"),
            20);
  CHECK(a.failed());
  CHECK(a.error() == "stream error: KV transfer failed");
  StreamAccounting b(false);
  b.onEvent(data("{not json"), 10);
  CHECK(b.failed());
  CHECK_THAT(b.error(), Catch::Contains("malformed chunk"));
}

TEST_CASE("the usage chunk's pdserve_timing becomes the request's TTFT split", "[bench][sse]") {
  StreamAccounting a(/*chat=*/false);
  a.onEvent(data(text("He")), 20);
  a.onEvent(data(R"({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"pdserve_timing":)"
                 R"({"route":"disaggregated","ttft_ms":12.5,"router_queue_ms":0.25,"kv_transfer_ms":3,)"
                 R"("prefill_compute_ms":8,"other_ms":1.25,"note":"x","bad_ms":"y"}}})"),
            21);
  CHECK(a.ttftSplitRoute() == "disaggregated");
  const std::map<std::string, double> want{
      {"ttft", 12.5}, {"router_queue", 0.25}, {"kv_transfer", 3}, {"prefill_compute", 8}, {"other", 1.25}};
  CHECK(a.ttftSplitMs() == want);
  StreamAccounting plain(false);  // any other server: no split
  plain.onEvent(data(R"({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}})"), 5);
  CHECK(plain.ttftSplitMs().empty());
}
