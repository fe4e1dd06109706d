// The logits processors on known logits: each definition (logits_processors.h) checked by
// hand, their order, and that sampling reports the raw distribution's logprobs.
#include "engine/logits_processors.h"

#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

using namespace pd::engine;

namespace {

std::vector<float> processed(std::vector<float> logits, const SamplingParams& p, const std::vector<int32_t>& tokens,
                             size_t outputStart, int32_t eos = -1) {
  applyLogitsProcessors(logits.data(), int(logits.size()), p, tokens, outputStart, eos);
  return logits;
}

constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("frequency and presence penalties count the output only (OpenAI's definition)") {
  SamplingParams p;
  p.frequencyPenalty = 0.5f;
  p.presencePenalty = 0.25f;
  // Prompt {0, 1}, output {2, 2, 2, 3}: token 2 three times, token 3 once, 0 and 1 not at all.
  const auto l = processed({1, 1, 1, 1, 1}, p, {0, 1, 2, 2, 2, 3}, 2);
  CHECK(l[0] == 1.0f);
  CHECK(l[1] == 1.0f);
  CHECK(l[2] == Approx(1.0f - 0.5f * 3 - 0.25f));
  CHECK(l[3] == Approx(1.0f - 0.5f - 0.25f));
  CHECK(l[4] == 1.0f);
  // Negative penalties encourage repetition.
  p.frequencyPenalty = -1.0f;
  p.presencePenalty = 0.0f;
  CHECK(processed({0, 0, 0}, p, {2, 2}, 0)[2] == 2.0f);
}

TEST_CASE("repetition penalty: prompt and output, positive logits divided, negative multiplied (vLLM)") {
  SamplingParams p;
  p.repetitionPenalty = 2.0f;
  const auto l = processed({4, -4, 4, -4, 0}, p, {0, 1, 2}, 2);  // prompt {0, 1}, output {2}
  CHECK(l[0] == 2.0f);
  CHECK(l[1] == -8.0f);
  CHECK(l[2] == 2.0f);   // once, however often it occurs
  CHECK(l[3] == -4.0f);  // never seen
  CHECK(l[4] == 0.0f);
  p.repetitionPenalty = 0.5f;  // < 1 encourages
  CHECK(processed({4, -4}, p, {0, 1, 1}, 3) == std::vector<float>{8.0f, -2.0f});
}

TEST_CASE("logit_bias adds; min_tokens masks EOS and stop ids until enough are generated") {
  SamplingParams p;
  p.logitBias = {{1, 100.0f}, {3, -2.5f}};
  CHECK(processed({0, 0, 0, 1}, p, {0}, 1) == std::vector<float>{0, 100.0f, 0, -1.5f});

  SamplingParams m;
  m.minTokens = 2;
  m.stopTokenIds = {1};
  const int32_t eos = 3;
  CHECK(processed({1, 1, 1, 1}, m, {0}, 1, eos) == std::vector<float>{1, -kInf, 1, -kInf});
  CHECK(processed({1, 1, 1, 1}, m, {0, 2}, 1, eos) == std::vector<float>{1, -kInf, 1, -kInf});
  CHECK(processed({1, 1, 1, 1}, m, {0, 2, 2}, 1, eos) == std::vector<float>{1, 1, 1, 1});  // two generated
  m.ignoreEos = true;  // EOS does not stop it anyway: only the stop ids are masked
  CHECK(processed({1, 1, 1, 1}, m, {0}, 1, eos) == std::vector<float>{1, -kInf, 1, 1});
}

TEST_CASE("order: min_tokens and logit_bias first, then repetition, frequency and presence (vLLM V1)") {
  SamplingParams p;
  p.logitBias = {{0, 2.0f}};
  p.repetitionPenalty = 2.0f;
  p.frequencyPenalty = 1.0f;
  // l0 = ((1 + 2) / 2) - 1 * 1 = 0.5: the bias is divided by the repetition penalty.
  CHECK(processed({1, 5}, p, {0}, 0)[0] == 0.5f);
  // Out-of-vocabulary ids in the tokens are skipped.
  CHECK(processed({1, 5}, p, {7, 1}, 0) == std::vector<float>{3.0f, 1.5f});
}

TEST_CASE("sampling with processors: greedy picks the processed argmax, logprobs stay those of the raw row") {
  const std::vector<float> raw{3.0f, 2.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = 2;
  p.logitBias = {{3, 100.0f}};
  const std::vector<int32_t> tokens{0};
  const SampledToken t = sampleWithProcessors(raw.data(), 4, p, 0, tokens, 1, -1);
  CHECK(t.id == 3);
  double lse = 0;
  for (float x : raw) lse += std::exp(double(x));
  lse = std::log(lse);
  CHECK(t.logprob == Approx(0.0 - lse).margin(1e-5));
  REQUIRE(t.topLogprobs.size() == 2);
  CHECK(t.topLogprobs[0].first == 0);
  CHECK(t.topLogprobs[0].second == Approx(3.0 - lse).margin(1e-5));
  CHECK(t.topLogprobs[1].first == 1);

  // Without a processor that changes the winner, the result equals sample() on the raw row.
  SamplingParams q;
  q.temperature = 0.7f;
  q.seed = 9;
  q.logprobs = 3;
  q.presencePenalty = 1e-3f;  // on, but far too small to matter here
  const SampledToken a = sampleWithProcessors(raw.data(), 4, q, 5, tokens, 1, -1);
  const SampledToken b = sample(raw.data(), 4, q, 5);
  CHECK(a.id == b.id);
  CHECK(a.logprob == Approx(b.logprob).margin(1e-6));
  CHECK(a.topLogprobs.size() == b.topLogprobs.size());
}

TEST_CASE("SamplingParams::validate names each processor field's range") {
  auto bad = [](auto edit) {
    SamplingParams p;
    edit(p);
    return p.validate().message();
  };
  CHECK(bad([](SamplingParams& p) { p.presencePenalty = 3; }).find("presence_penalty") != std::string::npos);
  CHECK(bad([](SamplingParams& p) { p.frequencyPenalty = -2.5f; }).find("frequency_penalty") != std::string::npos);
  CHECK(bad([](SamplingParams& p) { p.repetitionPenalty = 0; }).find("repetition_penalty") != std::string::npos);
  CHECK(bad([](SamplingParams& p) { p.logitBias = {{1, 101.0f}}; }).find("logit_bias") != std::string::npos);
  CHECK(bad([](SamplingParams& p) { p.minTokens = -1; }).find("min_tokens") != std::string::npos);
  SamplingParams ok;
  ok.presencePenalty = 2;
  ok.repetitionPenalty = 2;
  ok.logitBias = {{1, -100.0f}};
  CHECK(ok.validate().isOk());
  CHECK(ok.processesLogits());
  CHECK_FALSE(SamplingParams{}.processesLogits());
}
