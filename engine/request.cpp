#include "engine/request.h"

#include <algorithm>

namespace pd::engine {
namespace {

using S = RequestState;

// The legal transitions, one row per source state (docs/design.md §3). Terminal rows are empty.
constexpr bool kLegal[kNumRequestStates][kNumRequestStates] = {
    //              queued prefil waitKv decode finish failed cancel
    /* queued    */ {false, true, true, false, false, true, true},
    /* prefilling*/ {true, false, false, true, true, true, true},
    /* waiting_kv*/ {true, true, false, true, true, true, true},
    /* decoding  */ {true, false, false, false, true, true, true},
    /* finished  */ {false, false, false, false, false, false, false},
    /* failed    */ {false, false, false, false, false, false, false},
    /* cancelled */ {false, false, false, false, false, false, false},
};

}  // namespace

bool isTerminal(RequestState s) { return s == S::kFinished || s == S::kFailed || s == S::kCancelled; }

bool isLegalTransition(RequestState from, RequestState to) { return kLegal[size_t(from)][size_t(to)]; }

Request::Request(uint64_t id, std::vector<TokenId> prompt, SamplingParams params, const Clock& clock)
    : id_(id),
      clock_(&clock),
      params_(std::move(params)),
      tokens_(std::move(prompt)),
      numPrompt_(int(tokens_.size())),
      arrival_(clock.now()) {
  first_[size_t(S::kQueued)] = arrival_;
  last_[size_t(S::kQueued)] = arrival_;
}

Result<Request> Request::create(uint64_t id, std::vector<TokenId> prompt, SamplingParams params, const Clock& clock,
                                int vocab) {
  const std::string what = "request " + std::to_string(id) + ": ";
  if (prompt.empty()) return invalidArgument(what + "the prompt has no tokens");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || (vocab > 0 && prompt[i] >= vocab)) {
      return invalidArgument(what + "prompt token " + std::to_string(i) + " has id " + std::to_string(prompt[i]) +
                             ", outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  Status st = params.validate();
  if (!st.isOk()) return st.withContext(what.substr(0, what.size() - 2));
  for (const auto& [tokenId, bias] : params.logitBias) {
    if (vocab > 0 && tokenId >= vocab) {
      return invalidArgument(what + "logit_bias token id " + std::to_string(tokenId) +
                             " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  if (params.generatedInPrompt > int(prompt.size())) {
    return invalidArgument(what + "generated_in_prompt " + std::to_string(params.generatedInPrompt) +
                           " exceeds the prompt's " + std::to_string(prompt.size()) + " tokens");
  }
  if (!params.seed) params.seed = randomSeed();
  return Request(id, std::move(prompt), std::move(params), clock);
}

void Request::stamp(RequestState s) {
  const SteadyTime now = clock_->now();
  if (!first_[size_t(s)]) first_[size_t(s)] = now;
  last_[size_t(s)] = now;
}

Status Request::transition(RequestState to) {
  if (!isLegalTransition(state_, to)) {
    return failedPrecondition("request " + std::to_string(id_) + ": illegal transition " + requestStateName(state_) +
                              " -> " + requestStateName(to));
  }
  if (state_ == S::kQueued && !firstLeftQueue_) firstLeftQueue_ = clock_->now();
  if (to == S::kQueued) {
    // Preempted or remote prefill abandoned: the KV is gone and will be recomputed.
    ++numPreemptions_;
    numComputed_ = 0;
  }
  state_ = to;
  stamp(to);
  return Status::ok();
}

Status Request::setNumComputed(int n) {
  if (n < 0 || n > numTokens()) {
    return invalidArgument("request " + std::to_string(id_) + ": " + std::to_string(n) +
                           " computed tokens, but it has " + std::to_string(numTokens()));
  }
  numComputed_ = n;
  return Status::ok();
}

Result<FinishReason> Request::appendToken(const SampledToken& token, int32_t eosTokenId) {
  if (state_ != S::kPrefilling && state_ != S::kDecoding && state_ != S::kWaitingKv) {
    return failedPrecondition("request " + std::to_string(id_) + ": cannot append a token in state " +
                              requestStateName(state_));
  }
  if (token.id < 0) {
    return invalidArgument("request " + std::to_string(id_) + ": sampled token id " + std::to_string(token.id) +
                           " is negative");
  }
  const auto& stops = params_.stopTokenIds;
  const bool isEnd = std::find(stops.begin(), stops.end(), token.id) != stops.end() ||
                     (!params_.ignoreEos && eosTokenId >= 0 && token.id == eosTokenId);
  if (matcher_) {
    if (isEnd ? !matcher_->canEnd(constraintState_) : false) {
      return invalidArgument("request " + std::to_string(id_) + ": token " + std::to_string(token.id) +
                             " ends the output before its constrained text is complete");
    }
    if (!isEnd) {
      const constraint::State next = matcher_->advance(constraintState_, token.id);
      if (next == constraint::kDeadState) {
        return invalidArgument("request " + std::to_string(id_) + ": token " + std::to_string(token.id) +
                               " is not allowed by the request's constraint here");
      }
      constraintState_ = next;
    }
  }
  tokens_.push_back(token.id);
  logprobs_.push_back(token.logprob);
  topLogprobs_.push_back(token.topLogprobs);
  tokenTimes_.push_back(clock_->now());
  if (isEnd) {
    stopToken_ = token.id;
    return FinishReason::kStop;
  }
  if (matcher_ && matcher_->mustEnd(constraintState_)) return FinishReason::kStop;
  if (numGenerated() >= params_.maxTokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

Status Request::setConstraint(std::shared_ptr<const constraint::TokenMatcher> matcher) {
  constraint::State s = matcher->start();
  for (int i = numPrompt_ - params_.generatedInPrompt; i < numPrompt_; ++i) s = matcher->advance(s, tokens_[size_t(i)]);
  for (TokenId t : generated()) s = matcher->advance(s, t);
  if (s == constraint::kDeadState) {
    return invalidArgument("request " + std::to_string(id_) + ": its output so far does not satisfy its constraint");
  }
  matcher_ = std::move(matcher);
  constraintState_ = s;
  return Status::ok();
}

Status Request::finish(FinishReason reason) {
  if (reason != FinishReason::kStop && reason != FinishReason::kLength) {
    return invalidArgument(std::string("request ") + std::to_string(id_) + ": finish() takes stop or length, not " +
                           finishReasonName(reason));
  }
  PD_RETURN_IF_ERROR(transition(S::kFinished));
  finishReason_ = reason;
  return Status::ok();
}

Status Request::cancel() {
  PD_RETURN_IF_ERROR(transition(S::kCancelled));
  finishReason_ = FinishReason::kCancelled;
  return Status::ok();
}

Status Request::fail(Status error) {
  PD_RETURN_IF_ERROR(transition(S::kFailed));
  finishReason_ = FinishReason::kError;
  error_ = error.isOk() ? internalError("request failed without a reason") : std::move(error);
  return Status::ok();
}

RequestTimings Request::timings() const {
  RequestTimings t;
  t.numPreemptions = numPreemptions_;
  t.cachedPromptTokens = numCachedPrompt_;
  const SteadyTime leftQueue =
      firstLeftQueue_ ? *firstLeftQueue_ : (isTerminal(state_) ? *last_[size_t(state_)] : clock_->now());
  t.queueSeconds = secondsBetween(arrival_, leftQueue);
  if (!tokenTimes_.empty()) {
    t.ttftSeconds = secondsBetween(arrival_, tokenTimes_.front());
    if (firstLeftQueue_) t.prefillSeconds = secondsBetween(*firstLeftQueue_, tokenTimes_.front());
    for (size_t i = 1; i < tokenTimes_.size(); ++i) {
      t.itlSeconds.push_back(secondsBetween(tokenTimes_[i - 1], tokenTimes_[i]));
    }
  }
  if (isTerminal(state_)) t.e2eSeconds = secondsBetween(arrival_, *last_[size_t(state_)]);
  return t;
}

}  // namespace pd::engine
