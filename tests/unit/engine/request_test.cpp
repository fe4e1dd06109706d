#include "engine/request.h"

#include <set>

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::engine;
using namespace std::chrono_literals;
using S = RequestState;

namespace {

Request make(const Clock& clock, SamplingParams p = {}, std::vector<TokenId> prompt = {1, 2, 3}) {
  auto r = Request::create(7, std::move(prompt), std::move(p), clock, 100);
  REQUIRE(r.ok());
  return std::move(r).value();
}

SampledToken tok(int32_t id) {
  SampledToken t;
  t.id = id;
  t.logprob = -0.5f;
  return t;
}

}  // namespace

TEST_CASE("Request::create validates the prompt and params and resolves the seed") {
  ManualClock clock;
  auto empty = Request::create(1, {}, {}, clock);
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.status().message() == "request 1: the prompt has no tokens");
  auto oov = Request::create(2, {1, 500}, {}, clock, 100);
  REQUIRE_FALSE(oov.ok());
  CHECK(oov.status().message().find("prompt token 1 has id 500, outside the vocabulary [0, 100)") != std::string::npos);
  SamplingParams bad;
  bad.topP = 2;
  auto badP = Request::create(3, {1}, bad, clock);
  REQUIRE_FALSE(badP.ok());
  CHECK(badP.status().message().find("request 3: sampling: top_p") != std::string::npos);

  // Unseeded requests get a seed at creation (so prefill and decode agree); seeded keep it.
  std::set<uint64_t> seeds;
  for (int i = 0; i < 8; ++i) seeds.insert(make(clock).seed());
  CHECK(seeds.size() == 8);
  SamplingParams s;
  s.seed = 1234;
  CHECK(make(clock, s).seed() == 1234);
}

TEST_CASE("the transition table allows exactly the documented moves") {
  const std::set<std::pair<S, S>> legal = {
      {S::kQueued, S::kPrefilling},   {S::kQueued, S::kWaitingKv},     {S::kQueued, S::kFailed},
      {S::kQueued, S::kCancelled},    {S::kPrefilling, S::kQueued},    {S::kPrefilling, S::kDecoding},
      {S::kPrefilling, S::kFinished}, {S::kPrefilling, S::kFailed},    {S::kPrefilling, S::kCancelled},
      {S::kWaitingKv, S::kQueued},    {S::kWaitingKv, S::kPrefilling}, {S::kWaitingKv, S::kDecoding},
      {S::kWaitingKv, S::kFinished},  {S::kWaitingKv, S::kFailed},     {S::kWaitingKv, S::kCancelled},
      {S::kDecoding, S::kQueued},     {S::kDecoding, S::kFinished},    {S::kDecoding, S::kFailed},
      {S::kDecoding, S::kCancelled},
  };
  for (int f = 0; f < kNumRequestStates; ++f) {
    for (int t = 0; t < kNumRequestStates; ++t) {
      INFO(requestStateName(S(f)) << " -> " << requestStateName(S(t)));
      CHECK(isLegalTransition(S(f), S(t)) == (legal.count({S(f), S(t)}) == 1));
    }
  }
  for (S terminal : {S::kFinished, S::kFailed, S::kCancelled}) CHECK(isTerminal(terminal));
}

TEST_CASE("an illegal transition is refused and names both states") {
  ManualClock clock;
  Request r = make(clock);
  Status s = r.transition(S::kDecoding);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message() == "request 7: illegal transition queued -> decoding");
  CHECK(r.state() == S::kQueued);
  REQUIRE(r.transition(S::kPrefilling).isOk());
  REQUIRE(r.transition(S::kDecoding).isOk());
  REQUIRE(r.finish(FinishReason::kLength).isOk());
  Status again = r.transition(S::kQueued);
  CHECK(again.message() == "request 7: illegal transition finished -> queued");
  CHECK(r.cancel().code() == StatusCode::kFailedPrecondition);
  CHECK(r.finishReason() == FinishReason::kLength);
}

TEST_CASE("TTFT, ITL, queue time and e2e come from the state stamps") {
  ManualClock clock;
  Request r = make(clock);
  clock.advance(10ms);  // queued
  REQUIRE(r.transition(S::kPrefilling).isOk());
  clock.advance(40ms);  // prefill
  REQUIRE(r.transition(S::kDecoding).isOk());
  auto f0 = r.appendToken(tok(5), -1);
  REQUIRE(f0.ok());
  CHECK(*f0 == FinishReason::kNone);
  clock.advance(20ms);
  REQUIRE(r.appendToken(tok(6), -1).ok());
  clock.advance(30ms);
  REQUIRE(r.appendToken(tok(7), -1).ok());
  clock.advance(5ms);
  REQUIRE(r.finish(FinishReason::kStop).isOk());

  RequestTimings t = r.timings();
  CHECK(t.queueSeconds == Approx(0.010));
  REQUIRE(t.ttftSeconds);
  CHECK(*t.ttftSeconds == Approx(0.050));
  REQUIRE(t.prefillSeconds);
  CHECK(*t.prefillSeconds == Approx(0.040));
  REQUIRE(t.itlSeconds.size() == 2);
  CHECK(t.itlSeconds[0] == Approx(0.020));
  CHECK(t.itlSeconds[1] == Approx(0.030));
  REQUIRE(t.e2eSeconds);
  CHECK(*t.e2eSeconds == Approx(0.105));
  CHECK(r.generated().size() == 3);
  CHECK(r.generatedLogprobs() == std::vector<float>{-0.5f, -0.5f, -0.5f});
  CHECK(r.firstEntered(S::kDecoding).has_value());
  CHECK_FALSE(r.firstEntered(S::kWaitingKv).has_value());
}

TEST_CASE("a disaggregated request measures TTFT across the remote prefill") {
  ManualClock clock;
  Request r = make(clock);
  clock.advance(2ms);
  REQUIRE(r.transition(S::kWaitingKv).isOk());
  clock.advance(80ms);
  REQUIRE(r.transition(S::kDecoding).isOk());
  REQUIRE(r.appendToken(tok(9), -1).ok());
  CHECK(*r.timings().ttftSeconds == Approx(0.082));
  CHECK(r.timings().queueSeconds == Approx(0.002));
  CHECK(r.timings().itlSeconds.empty());
  CHECK_FALSE(r.timings().e2eSeconds);
}

TEST_CASE("appendToken reports stop tokens, EOS and length") {
  ManualClock clock;
  SamplingParams p;
  p.maxTokens = 3;
  p.stopTokenIds = {42};
  {
    Request r = make(clock, p);
    CHECK(r.appendToken(tok(1), 2).status().code() == StatusCode::kFailedPrecondition);
    REQUIRE(r.transition(S::kPrefilling).isOk());
    CHECK(*r.appendToken(tok(1), 2) == FinishReason::kNone);
    CHECK(*r.appendToken(tok(42), 2) == FinishReason::kStop);
    CHECK(r.stopToken() == 42);
  }
  {
    Request r = make(clock, p);
    REQUIRE(r.transition(S::kPrefilling).isOk());
    CHECK(*r.appendToken(tok(2), 2) == FinishReason::kStop);  // EOS
  }
  {
    p.ignoreEos = true;
    Request r = make(clock, p);
    REQUIRE(r.transition(S::kPrefilling).isOk());
    CHECK(*r.appendToken(tok(2), 2) == FinishReason::kNone);
    CHECK(*r.appendToken(tok(2), 2) == FinishReason::kNone);
    CHECK(*r.appendToken(tok(2), 2) == FinishReason::kLength);
    CHECK(r.nextSampleStep() == 3);
    REQUIRE(r.finish(FinishReason::kLength).isOk());
    CHECK(std::string(finishReasonName(r.finishReason())) == "length");
  }
}

TEST_CASE("preemption requeues, resets computed tokens and keeps generated ones") {
  ManualClock clock;
  Request r = make(clock);
  REQUIRE(r.transition(S::kPrefilling).isOk());
  REQUIRE(r.setNumComputed(3).isOk());
  REQUIRE(r.transition(S::kDecoding).isOk());
  REQUIRE(r.appendToken(tok(4), -1).ok());
  CHECK(r.setNumComputed(5).code() == StatusCode::kInvalidArgument);
  REQUIRE(r.transition(S::kQueued).isOk());
  CHECK(r.numComputed() == 0);
  CHECK(r.numTokens() == 4);
  CHECK(r.timings().numPreemptions == 1);
  // Queue time is measured to the first admission, not the re-admission.
  clock.advance(100ms);
  REQUIRE(r.transition(S::kPrefilling).isOk());
  CHECK(r.timings().queueSeconds == Approx(0.0));
  REQUIRE(r.fail(unavailable("prefill worker p1 unreachable")).isOk());
  CHECK(r.state() == S::kFailed);
  CHECK(r.finishReason() == FinishReason::kError);
  CHECK(r.error().message() == "prefill worker p1 unreachable");
}
