// engine::Request (docs/design.md §3): one generation request inside a worker.
//
// An explicit state machine; the legal moves (kLegal in request.cpp):
//   queued       -> prefilling (admitted here) | waiting_kv (blocks reserved, a prefill
//                   worker asked to push the prompt's KV)
//   prefilling   -> decoding (prompt done, first token) | finished (the first token ends
//                   it, or a prefill worker's request is done) | queued (preempted)
//   waiting_kv   -> decoding (PrefillDone: the KV is in place) | finished | queued
//                   | prefilling (remote prefill failed: recompute here)
//   decoding     -> finished | queued (preempted: blocks freed, recomputed later)
//   every non-terminal state -> failed | cancelled; finished, failed, cancelled are final.
//
// Any other transition returns kFailedPrecondition naming both states. Each transition is
// stamped with the request's Clock, and every latency figure (queue time, TTFT, ITL gaps,
// e2e) is computed from these stamps in timings(): latency is measured in one place.
//
// Threads: not thread-safe; owned by the worker loop thread like the scheduler and KV
// manager. The Clock must outlive the request.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/base/clock.h"
#include "common/base/enum_names.h"
#include "common/base/status.h"
#include "common/constraint/constraint.h"
#include "engine/sampling.h"

namespace pd::engine {

using TokenId = int32_t;

enum class RequestState : uint8_t {
  kQueued = 0,
  kPrefilling,
  kWaitingKv,
  kDecoding,
  kFinished,
  kFailed,
  kCancelled,
};
inline constexpr int kNumRequestStates = 7;
inline constexpr EnumNames<RequestState, kNumRequestStates> kRequestStateNames{
    {{RequestState::kQueued, "queued"},
     {RequestState::kPrefilling, "prefilling"},
     {RequestState::kWaitingKv, "waiting_kv"},
     {RequestState::kDecoding, "decoding"},
     {RequestState::kFinished, "finished"},
     {RequestState::kFailed, "failed"},
     {RequestState::kCancelled, "cancelled"}}};
inline const char* requestStateName(RequestState s) { return enumName(kRequestStateNames, s, "unknown"); }
bool isTerminal(RequestState s);
bool isLegalTransition(RequestState from, RequestState to);

enum class FinishReason : uint8_t { kNone = 0, kStop, kLength, kCancelled, kError };
// "stop", "length", ... (OpenAI's words).
inline constexpr EnumNames<FinishReason, 5> kFinishReasonNames{{{FinishReason::kNone, "none"},
                                                                {FinishReason::kStop, "stop"},
                                                                {FinishReason::kLength, "length"},
                                                                {FinishReason::kCancelled, "cancelled"},
                                                                {FinishReason::kError, "error"}}};
inline const char* finishReasonName(FinishReason r) { return enumName(kFinishReasonNames, r, "unknown"); }

// Latencies of one request in seconds, all from the request's own state stamps.
struct RequestTimings {
  double queueSeconds = 0;               // arrival -> first time it left `queued`
  std::optional<double> ttftSeconds;     // arrival -> first generated token
  std::vector<double> itlSeconds;        // gaps between consecutive generated tokens
  std::optional<double> e2eSeconds;      // arrival -> terminal state
  std::optional<double> prefillSeconds;  // first left `queued` -> first token
  int numPreemptions = 0;
  int cachedPromptTokens = 0;  // prompt tokens served from the prefix cache (at last admission)
};

class Request {
 public:
  // Validates the sampling params and the prompt (non-empty, ids in [0, vocab) when vocab
  // > 0). Resolves an unset seed to a random one so that the request samples
  // deterministically from here on, wherever it is sampled. State: queued, stamped now.
  static Result<Request> create(uint64_t id, std::vector<TokenId> prompt, SamplingParams params, const Clock& clock,
                                int vocab = 0);

  uint64_t id() const { return id_; }
  RequestState state() const { return state_; }
  const SamplingParams& params() const { return params_; }
  uint64_t seed() const { return *params_.seed; }

  // Tokens: the prompt followed by the generated tokens.
  const std::vector<TokenId>& tokens() const { return tokens_; }
  int numPromptTokens() const { return numPrompt_; }
  int numTokens() const { return int(tokens_.size()); }
  int numGenerated() const { return int(tokens_.size()) - numPrompt_; }
  std::span<const TokenId> prompt() const { return {tokens_.data(), size_t(numPrompt_)}; }
  std::span<const TokenId> generated() const { return {tokens_.data() + numPrompt_, size_t(numGenerated())}; }
  const std::vector<float>& generatedLogprobs() const { return logprobs_; }
  const std::vector<std::vector<std::pair<int32_t, float>>>& topLogprobs() const { return topLogprobs_; }

  // Tokens whose KV is in this worker's cache (the scheduler plans from here).
  int numComputed() const { return numComputed_; }
  Status setNumComputed(int n);
  // Prompt tokens served from the prefix cache on admission (for usage reporting).
  int numCachedPromptTokens() const { return numCachedPrompt_; }
  void setNumCachedPromptTokens(int n) { numCachedPrompt_ = n; }

  // Moves to `to`, stamping the time. Moving to queued from a running state counts as a
  // preemption and resets numComputed to 0 (the KV is recomputed).
  Status transition(RequestState to);

  // Constrained decoding (params().constraint): the compiled matcher, set once by the engine
  // on submit. The state is re-derived from the output so far -- the generated_in_prompt
  // tail of the prompt (a migrated request), then every appended token -- so whichever
  // worker holds the request continues where the text stands (docs/serving.md
  // "Structured outputs"). kInvalidArgument when that output already left the constraint.
  Status setConstraint(std::shared_ptr<const constraint::TokenMatcher> matcher);
  const constraint::TokenMatcher* constraint() const { return matcher_.get(); }
  constraint::State constraintState() const { return constraintState_; }

  // Appends a sampled token (stamped now) and returns why the request must finish, if it
  // must: kStop for a stop token id or EOS (`eosTokenId` < 0: none; ignored with
  // ignore_eos) or where a constraint's text is complete and nothing may follow, kLength
  // when max_tokens tokens exist. The caller then calls finish().
  // Errors: kFailedPrecondition unless prefilling/decoding/waiting_kv; kInvalidArgument for a
  // token a constraint does not allow (the token is not appended).
  Result<FinishReason> appendToken(const SampledToken& token, int32_t eosTokenId);
  // The sampling step of the next token (= numGenerated()): the counter for sample().
  uint64_t nextSampleStep() const { return uint64_t(numGenerated()); }

  // Terminal moves. finish(kStop|kLength) -> finished; cancel() -> cancelled; fail() ->
  // failed, keeping the error for the client.
  Status finish(FinishReason reason);
  Status cancel();
  Status fail(Status error);
  FinishReason finishReason() const { return finishReason_; }
  const Status& error() const { return error_; }
  // The stop token that ended the request, if one did.
  std::optional<TokenId> stopToken() const { return stopToken_; }

  // Stamps: first and last entry into each state (unset when never entered).
  std::optional<SteadyTime> firstEntered(RequestState s) const { return first_[size_t(s)]; }
  std::optional<SteadyTime> lastEntered(RequestState s) const { return last_[size_t(s)]; }
  SteadyTime arrival() const { return arrival_; }
  const std::vector<SteadyTime>& tokenTimes() const { return tokenTimes_; }
  RequestTimings timings() const;

 private:
  Request(uint64_t id, std::vector<TokenId> prompt, SamplingParams params, const Clock& clock);
  void stamp(RequestState s);

  uint64_t id_;
  const Clock* clock_;
  SamplingParams params_;
  std::vector<TokenId> tokens_;
  int numPrompt_;
  int numComputed_ = 0;
  int numCachedPrompt_ = 0;
  RequestState state_ = RequestState::kQueued;
  FinishReason finishReason_ = FinishReason::kNone;
  Status error_;
  std::optional<TokenId> stopToken_;
  std::vector<float> logprobs_;
  std::vector<std::vector<std::pair<int32_t, float>>> topLogprobs_;
  SteadyTime arrival_;
  std::optional<SteadyTime> firstLeftQueue_;
  std::array<std::optional<SteadyTime>, kNumRequestStates> first_{};
  std::array<std::optional<SteadyTime>, kNumRequestStates> last_{};
  std::vector<SteadyTime> tokenTimes_;
  int numPreemptions_ = 0;
  std::shared_ptr<const constraint::TokenMatcher> matcher_;
  constraint::State constraintState_ = 0;
};

}  // namespace pd::engine
