// The client side of an OpenAI streaming response: server-sent-event framing (SseDecoder)
// and the per-request token accounting built on it (StreamAccounting). No I/O here, so the
// rules that decide TTFT and every inter-token gap are tested without a network.
//
// Contract: one object per stream, used from one thread (the generator's io thread).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace pd::bench {

struct SseEvent {
  std::string event;  // the `event:` field; empty for plain data events
  std::string data;   // `data:` lines joined with '\n'
};

// Splits a byte stream into events (lines end with \n, \r\n or \r; a blank line ends an
// event; ':' lines are comments). Bytes may arrive split anywhere.
class SseDecoder {
 public:
  void feed(std::string_view bytes, std::vector<SseEvent>* out);

 private:
  void endLine(std::vector<SseEvent>* out);
  std::string line_;
  SseEvent cur_;
  bool haveData_ = false;
  bool lastCr_ = false;
};

// Token accounting for one streamed completion. A chunk carries k tokens, where k comes from
// (first that applies) the growth of cumulative usage (vLLM continuous_usage_stats), the
// length of choices[0].token_ids, the number of logprobs entries, else 1 for a non-empty
// text/content delta and 0 for an empty one (a chat role chunk, a finish chunk).
// TTFT is the time of the first chunk with k > 0. After that each chunk with k > 0 adds one
// gap (time since the previous token chunk) and k-1 zero gaps, so a stream of N tokens yields
// exactly N-1 inter-token gaps; with one token per chunk this is vLLM's ITL.
class StreamAccounting {
 public:
  explicit StreamAccounting(bool chat) : chat_(chat) {}

  // Handles one event received tMs after the request was sent.
  void onEvent(const SseEvent& ev, double tMs);

  bool done() const { return done_; }  // [DONE] seen
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }  // "stream error: ..." / "malformed chunk: ..."
  double ttftMs() const { return ttftMs_; }            // NaN until a token arrived
  double lastTokenMs() const { return lastMs_; }
  double doneMs() const { return doneMs_; }
  const std::vector<double>& itlsMs() const { return itls_; }
  std::vector<double> takeItls() { return std::move(itls_); }
  int64_t chunkTokens() const { return tokens_; }
  int64_t usagePromptTokens() const { return usagePrompt_; }          // -1 when absent
  int64_t usageCompletionTokens() const { return usageCompletion_; }  // -1 when absent
  // usage.prompt_tokens_details.cached_tokens (OpenAI's field): -1 when absent.
  int64_t usageCachedTokens() const { return usageCached_; }
  // The generated ids the chunks carried in choices[0].token_ids (return_token_ids), in order.
  const std::vector<int32_t>& tokenIds() const { return tokenIds_; }
  std::vector<int32_t> takeTokenIds() { return std::move(tokenIds_); }
  const std::string& finishReason() const { return finishReason_; }
  // pdserve's TTFT split from the usage chunk's "pdserve_timing" (router/ttft_split.h):
  // phase -> ms (the "<phase>_ms" keys, "ttft" among them), and its route; empty when the
  // server sent none (any other server).
  const std::map<std::string, double>& ttftSplitMs() const { return split_; }
  const std::string& ttftSplitRoute() const { return splitRoute_; }

 private:
  void fail(std::string why);
  bool chat_;
  bool done_ = false;
  std::string error_;
  double ttftMs_ = std::numeric_limits<double>::quiet_NaN();
  double lastMs_ = std::numeric_limits<double>::quiet_NaN();
  double doneMs_ = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> itls_;
  int64_t tokens_ = 0;
  int64_t usagePrompt_ = -1, usageCompletion_ = -1, usageCached_ = -1;
  std::vector<int32_t> tokenIds_;
  int64_t cumulativeSeen_ = 0;
  std::string finishReason_;
  std::map<std::string, double> split_;
  std::string splitRoute_;
};

}  // namespace pd::bench
