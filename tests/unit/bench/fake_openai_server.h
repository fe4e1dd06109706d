// A scripted OpenAI-compatible streaming server on 127.0.0.1 for unit tests of the bench
// client (not a model: it streams a known token sequence with known delays).
//
// Requests: GET /v1/models lists "test-model". POST /v1/completions or /v1/chat/completions
// with model "test-model" streams max_tokens tokens; the body may script the stream with
// test_ttft_ms (delay before the first token), test_itl_ms (delay between token chunks),
// test_chunk (tokens per chunk, sent with token_ids) and test_fail_after (send an error
// event after that many tokens). Model "busy" gets HTTP 503, any other model HTTP 404, both
// with an OpenAI error body.
// Threads: the server runs its own io_context thread; the destructor stops and joins it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace pd::bench::testing {

class FakeOpenAiServer {
 public:
  FakeOpenAiServer();
  ~FakeOpenAiServer();
  FakeOpenAiServer(const FakeOpenAiServer&) = delete;
  FakeOpenAiServer& operator=(const FakeOpenAiServer&) = delete;

  uint16_t port() const;
  int64_t requestsServed() const;
  int64_t peakOpenStreams() const;
  int64_t connectionsAccepted() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::bench::testing
