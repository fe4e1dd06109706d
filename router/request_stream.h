// One HTTP generation request after routing: the dispatch stage (Generate to the decode
// worker, one per choice) and the stream stage (each TokenChunk -> detokenized text, stop
// strings matched, SSE events or the final JSON), with the request's deadline timer.
//
// Ending, exactly once per request: every choice finished (the full answer, or usage and
// [DONE]); an error (a worker error, the deadline passed: an error event or an error
// response); or the client went away (nothing is answered). Every end cancels the choices
// still running on the decode worker; a stop-string match cancels its choice there too.
//
// Migration (docs/serving.md, "Request migration"): when the decode worker is lost (its
// connection closed) or gives the request up with an `unavailable` error (it drains or shuts
// down), the unfinished choices continue on another decode worker, at most
// router.max_migrations times per request: each is sent again as its prompt plus every token
// it already streamed, asking for the tokens it still may produce. The client's stream goes
// on with the next token; the detokenizer, stop strings and counts carry over, so nothing is
// duplicated or missing. Greedy choices continue exactly; a seeded sampled choice continues
// from a fresh generator (its tokens after the move differ from an unmoved run).
//
// Threads: every public method may be called from any thread and never blocks: it posts onto
// the stream's own strand, where all of its state lives. Streams therefore detokenize and
// send in parallel with each other and with the router loop. The spec is immutable and may
// be read from any thread. The owner (router/router_loop.h) must outlive the executor's
// threads; the stream keeps itself alive while work for it is queued.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/framed.h"
#include "common/net/http_server.h"
#include "common/tokenizer/detokenizer.h"
#include "router/openai_api.h"
#include "router/request_parser.h"
#include "router/responses_api.h"
#include "router/routing_policy.h"
#include "router/tool_calls.h"
#include "router/ttft_split.h"

namespace pd::router {

// What the request is: fixed before it is routed.
struct RequestSpec {
  ParsedGenerate parsed;
  std::vector<uint64_t> prefixBlocks;  // prompt block hashes (prefix-aware routing), or none
  SteadyTime received;
  int64_t createdUnixSeconds = 0;
};

// Where the router loop sent it.
struct Dispatch {
  std::string responseId;  // "cmpl-7"
  RoutePlan plan;
  net::ConnectionPtr decodeConn;
  std::string prefillAddress;              // disaggregated: where the decode worker dials the prefill worker
  std::string pullAddress;                 // a peer pull: the source's pull port
  std::vector<uint64_t> workerRequestIds;  // one per choice
};

// The token timing of one TokenChunk, for the autoscaler.
struct TokenTiming {
  SteadyTime at;
  std::optional<double> ttft;       // the request's first token
  Route route = Route::kColocated;  // the request's, as routed
  std::optional<double> itl;        // since this choice's previous token
  int zeroItls = 0;                 // further tokens in the same chunk
};

class RequestStream;

// The router loop, as a stream sees it. Every call is thread-safe and never blocks.
class StreamOwner {
 public:
  virtual ~StreamOwner() = default;
  // These choices ended here: drop them from the request table.
  virtual void choicesEnded(std::vector<uint64_t> workerRequestIds) = 0;
  virtual void observeTokens(const TokenTiming& timing) = 0;
  // Migration: the choices `oldIds` leave their decode worker `leftWorker`; route a prompt
  // of `promptTokens` tokens to another one and answer with stream->resume(): a Dispatch with one
  // new worker request id per old id (in order), or nullopt when no decode worker is left.
  virtual void migrate(std::shared_ptr<RequestStream> stream, std::vector<uint64_t> oldIds, int64_t promptTokens,
                       std::string leftWorker) = 0;
};

struct StreamSettings {
  std::string modelName;
  int64_t requestTimeoutMs = 0;
  int maxMigrations = 0;
  // router.requests.stream_heartbeat_ms: a streamed response silent this long gets an SSE
  // comment line (": keepalive"), which clients ignore and proxies' idle read timeouts count
  // as traffic (docs/deploy.md, "Proxies"); 0: never.
  int64_t streamHeartbeatMs = 0;
};

class RequestStream : public std::enable_shared_from_this<RequestStream> {
 public:
  static std::shared_ptr<RequestStream> create(boost::asio::io_context& io, RequestSpec spec,
                                               std::shared_ptr<net::HttpResponder> http,
                                               std::shared_ptr<const tok::Tokenizer> tokenizer, StreamOwner& owner,
                                               metrics::RouterMetrics& metrics, const StreamSettings& settings);

  const RequestSpec& spec() const { return spec_; }

  // Dispatch: sends Generate per choice, starts the SSE response, arms the deadline, and
  // watches for the client leaving. Called once, before any other call below.
  void start(Dispatch dispatch);
  // Routing found no worker: answers `error` (never started).
  // pool: where it was refused (pdserve_request_errors_total's pool label: router, prefill, decode).
  void refuse(ApiError error, std::string errorMetric, std::string_view pool);
  // A TokenChunk for one of the choices (late ones are ignored).
  void deliver(proto::TokenChunk chunk);
  // Ends the request with an error, if it has not ended.
  void fail(Status why);
  // The decode worker serving this request is gone (`why`): migrate, or fail when no
  // migration is left.
  void workerLost(Status why);
  // The router loop's answer to StreamOwner::migrate (nullopt: fail with `why`).
  void resume(std::optional<Dispatch> dispatch, Status why);

 private:
  struct Choice {
    int index = 0;
    uint64_t workerRequestId = 0;
    std::unique_ptr<tok::IncrementalDetokenizer> detok;
    std::string held;                    // text not yet sent: may be the start of a stop string
    std::string text;                    // everything sent (non-streaming: the answer)
    std::vector<TokenLogprob> logprobs;  // non-streaming
    std::vector<int32_t> tokenIds;       // non-streaming, with return_token_ids
    std::vector<int32_t> generated;      // every token received (a migration resends them)
    int tokensBeforeMove = 0;            // generated.size() when it moved to this worker
    int completionTokens = 0;
    int cachedPromptTokens = 0;  // the worker's prefix hit, any tier (Usage.cached_tokens)
    bool done = false;
    std::string finishReason;  // set when done
    std::optional<SteadyTime> lastTokenAt;
    std::unique_ptr<ToolCallStreamer> tools;  // chat with tools: the answer's calls come out
    std::vector<ToolCall> calls;              // non-streaming: the calls found
  };

  RequestStream(boost::asio::io_context& io, RequestSpec spec, std::shared_ptr<net::HttpResponder> http,
                std::shared_ptr<const tok::Tokenizer> tokenizer, StreamOwner& owner, metrics::RouterMetrics& metrics,
                const StreamSettings& settings);

  // On the strand.
  void startOnStrand(Dispatch dispatch);
  bool sendGenerate(const Choice& c, const Dispatch& d);
  void setDispatch(const Dispatch& d);
  void startResponse();
  // Streams: the next heartbeat is due streamHeartbeatMs after the last bytes sent.
  void armHeartbeat();
  const char* routeLabel() const;
  void onChunk(const proto::TokenChunk& chunk);
  void observeTiming(Choice& c, const proto::TokenChunk& chunk, SteadyTime now);
  TokenLogprob logprobOf(const proto::TokenLogprob& lp) const;
  bool applyStop(Choice& c, std::string& delta, bool final);
  void emit(Choice& c, std::string delta, std::vector<TokenLogprob> lps, std::vector<int32_t> ids,
            std::optional<std::string> finish);
  void endChoice(Choice& c);
  void maybeComplete();
  void failOnStrand(const Status& why);
  void migrateOnStrand(const Status& why, const char* reason);
  void resumeOnStrand(Dispatch d);
  void abort(const std::string& reason);
  void cancelOnWorker(const Choice& c, const std::string& reason);
  void endRequest();

  template <typename F>
  void onStrand(F&& f);

  boost::asio::strand<boost::asio::io_context::executor_type> strand_;
  boost::asio::steady_timer deadlineTimer_;
  boost::asio::steady_timer heartbeatTimer_;
  const RequestSpec spec_;
  const std::shared_ptr<net::HttpResponder> http_;
  const std::shared_ptr<const tok::Tokenizer> tokenizer_;
  StreamOwner& owner_;
  metrics::RouterMetrics& metrics_;
  const StreamSettings settings_;

  // Strand state.
  ResponseMeta meta_;
  Route route_ = Route::kColocated;
  bool recomputed_ = false;      // the decode worker recomputed the prompt (proto Timings.recomputed)
  int64_t predictedCached_ = 0;  // the plan's prefix-hit figures (RoutePlan)
  int64_t exactCached_ = -1;
  std::string plannedPrefiller_;              // the worker the plan's figures are about
  bool hitCounted_ = false;                   // metrics_.prefixHit ran
  std::string decodeWorker_, prefillWorker_;  // for the x-pdserve-* headers
  net::ConnectionPtr decodeConn_;
  std::vector<Choice> choices_;
  std::unique_ptr<ResponsesWriter> responses_;  // a Responses request: its output's shape
  bool firstTokenSeen_ = false;
  SteadyTime lastSentAt_;               // streams: the last event or heartbeat written
  SteadyTime dispatchedAt_;             // the first Generate went: the end of router_queue
  std::optional<TtftSplit> ttftSplit_;  // from the first token's chunk (router/ttft_split.h)
  bool finished_ = false;
  int migrations_ = 0;
  bool migrating_ = false;  // between migrateOnStrand and the loop's answer
  Status lostWhy_;          // why the last migration started
};

}  // namespace pd::router
