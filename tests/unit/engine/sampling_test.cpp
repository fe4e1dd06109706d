#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::engine;

namespace {

std::vector<float> randomLogits(int vocab, uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> l(static_cast<size_t>(vocab));
  for (auto& x : l) x = n(rng);
  return l;
}

// Reference: log-softmax in double.
std::vector<double> logSoftmax(const std::vector<float>& l, double temperature = 1.0) {
  double mx = *std::max_element(l.begin(), l.end()) / temperature;
  double sum = 0;
  for (float x : l) sum += std::exp(x / temperature - mx);
  std::vector<double> out;
  for (float x : l) out.push_back(x / temperature - mx - std::log(sum));
  return out;
}

// Token ids sorted by (logit desc, id asc).
std::vector<int> sortedIds(const std::vector<float>& l) {
  std::vector<int> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return l[size_t(a)] > l[size_t(b)]; });
  return ids;
}

SamplingParams seeded(uint64_t seed, float temperature = 1.0f) {
  SamplingParams p;
  p.seed = seed;
  p.temperature = temperature;
  return p;
}

}  // namespace

TEST_CASE("greedy returns the argmax, ties to the lower id") {
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
  SamplingParams p;
  p.temperature = 0.0f;
  for (uint64_t step = 0; step < 10; ++step) CHECK(sample(l.data(), 5, p, step).id == 1);
  auto big = randomLogits(50000, 7);
  const int argmax = int(std::max_element(big.begin(), big.end()) - big.begin());
  CHECK(sample(big.data(), 50000, p, 0).id == argmax);
  // Below the greedy threshold counts as greedy even with a seed.
  p.temperature = 1e-6f;
  p.seed = 3;
  CHECK(sample(big.data(), 50000, p, 5).id == argmax);
}

TEST_CASE("a temperature near zero concentrates on the argmax") {
  auto l = randomLogits(1000, 11);
  const int argmax = int(std::max_element(l.begin(), l.end()) - l.begin());
  SamplingParams p = seeded(99, 1e-3f);
  for (uint64_t step = 0; step < 500; ++step) REQUIRE(sample(l.data(), 1000, p, step).id == argmax);
  // A high temperature does not.
  p.temperature = 5.0f;
  std::set<int> seen;
  for (uint64_t step = 0; step < 500; ++step) seen.insert(sample(l.data(), 1000, p, step).id);
  CHECK(seen.size() > 100);
}

TEST_CASE("seeded draws depend only on (seed, step)") {
  auto l = randomLogits(2000, 5, 0.5f);
  SamplingParams a = seeded(42);
  SamplingParams b = seeded(43);
  std::vector<int> first;
  for (uint64_t step = 0; step < 300; ++step) first.push_back(sample(l.data(), 2000, a, step).id);
  // Interleave other requests' draws (another batch composition), then replay in reverse
  // order (another process sampling only the later tokens): the same ids come back.
  for (uint64_t step = 300; step-- > 0;) {
    (void)sample(l.data(), 2000, b, step);
    REQUIRE(sample(l.data(), 2000, a, step).id == first[step]);
  }
  // Different steps give different draws: almost all distinct over a flat distribution.
  std::set<int> distinct(first.begin(), first.end());
  CHECK(distinct.size() > 200);
  // Different seeds disagree on most steps.
  int same = 0;
  for (uint64_t step = 0; step < 300; ++step) same += sample(l.data(), 2000, b, step).id == first[step];
  CHECK(same < 20);
  // The uniform draw is in [0, 1) with mean about 1/2.
  double mean = 0;
  for (uint64_t s = 0; s < 100000; ++s) {
    const double u = samplingUniform(7, s);
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
    mean += u;
  }
  CHECK(mean / 100000 == Approx(0.5).margin(0.005));
}

TEST_CASE("top-k never samples outside the k most likely tokens") {
  const int vocab = 5000;
  auto l = randomLogits(vocab, 21, 1.0f);
  auto order = sortedIds(l);
  SamplingParams p = seeded(7, 1.5f);
  p.topK = 5;
  std::set<int> topk(order.begin(), order.begin() + 5);
  std::set<int> seen;
  for (uint64_t step = 0; step < 10000; ++step) {
    const int id = sample(l.data(), vocab, p, step).id;
    REQUIRE(topk.count(id) == 1);
    seen.insert(id);
  }
  CHECK(seen.size() == 5);
  // Ties at the k-th place go to the lower id.
  std::vector<float> tie = {1.0f, 3.0f, 2.0f, 2.0f, 2.0f};
  p.topK = 2;
  for (uint64_t step = 0; step < 2000; ++step) {
    const int id = sample(tie.data(), 5, p, step).id;
    REQUIRE((id == 1 || id == 2));
  }
}

TEST_CASE("top-p keeps the smallest nucleus reaching p") {
  // probabilities 0.5, 0.3, 0.1, 0.05, 0.05 (temperature 1)
  std::vector<float> l;
  for (double q : {0.5, 0.3, 0.1, 0.05, 0.05}) l.push_back(float(std::log(q)));
  SamplingParams p = seeded(1);
  p.topP = 0.7f;  // 0.5 < 0.7, 0.8 >= 0.7: nucleus {0, 1}
  int counts[5] = {0, 0, 0, 0, 0};
  const int n = 20000;
  for (uint64_t step = 0; step < uint64_t(n); ++step) ++counts[sample(l.data(), 5, p, step).id];
  CHECK(counts[2] + counts[3] + counts[4] == 0);
  CHECK(double(counts[0]) / n == Approx(0.5 / 0.8).margin(0.02));
  // A tiny p still keeps the single most likely token.
  p.topP = 0.01f;
  for (uint64_t step = 0; step < 200; ++step) REQUIRE(sample(l.data(), 5, p, step).id == 0);

  // Large vocabulary (the incremental partial-sort path): draws stay inside the nucleus
  // computed here with a full sort.
  const int vocab = 60000;
  auto big = randomLogits(vocab, 33, 2.0f);
  SamplingParams q = seeded(5, 0.8f);
  q.topP = 0.9f;
  auto lp = logSoftmax(big, 0.8);
  auto order = sortedIds(big);
  std::set<int> nucleus;
  double before = 0;
  for (int id : order) {
    if (before >= 0.9) break;
    nucleus.insert(id);
    before += std::exp(lp[size_t(id)]);
  }
  REQUIRE(nucleus.size() > 64);  // beyond the first partial-sort window
  for (uint64_t step = 0; step < 1000; ++step) {
    REQUIRE(nucleus.count(sample(big.data(), vocab, q, step).id) == 1);
  }
}

TEST_CASE("min-p drops tokens below min_p times the top probability") {
  std::vector<float> l;
  for (double q : {0.4, 0.3, 0.15, 0.09, 0.06}) l.push_back(float(std::log(q)));
  SamplingParams p = seeded(2);
  p.minP = 0.3f;  // threshold 0.12: keeps {0, 1, 2}
  std::set<int> seen;
  for (uint64_t step = 0; step < 5000; ++step) {
    const int id = sample(l.data(), 5, p, step).id;
    REQUIRE(id <= 2);
    seen.insert(id);
  }
  CHECK(seen.size() == 3);
}

TEST_CASE("logprobs are the raw log-softmax of the chosen token and the top n") {
  const int vocab = 3000;
  auto l = randomLogits(vocab, 8);
  l[10] = l[11] = 20.0f;  // a tie at the top: the lower id comes first
  auto ref = logSoftmax(l);
  SamplingParams p = seeded(4, 0.7f);  // temperature does not change reported logprobs
  p.logprobs = 5;
  p.topK = 50;
  for (uint64_t step = 0; step < 20; ++step) {
    SampledToken t = sample(l.data(), vocab, p, step);
    CHECK(t.logprob == Approx(ref[size_t(t.id)]).margin(1e-4));
    REQUIRE(t.topLogprobs.size() == 5);
    CHECK(t.topLogprobs[0].first == 10);
    CHECK(t.topLogprobs[1].first == 11);
    auto order = sortedIds(l);
    for (size_t i = 0; i < 5; ++i) {
      CHECK(t.topLogprobs[i].first == order[i]);
      CHECK(t.topLogprobs[i].second == Approx(ref[size_t(order[i])]).margin(1e-4));
    }
  }
  p.logprobs = 0;
  CHECK(sample(l.data(), vocab, p, 0).topLogprobs.empty());
}

TEST_CASE("seeded draws follow the tempered softmax (chi-square)") {
  std::vector<float> l = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, 1.5f, -1.0f, 0.2f};
  const double temp = 0.8;
  auto lp = logSoftmax(l, temp);
  SamplingParams p = seeded(20260101, float(temp));
  const int n = 40000;
  std::vector<int> counts(l.size(), 0);
  for (uint64_t step = 0; step < uint64_t(n); ++step) ++counts[size_t(sample(l.data(), 8, p, step).id)];
  double chi2 = 0;
  for (size_t i = 0; i < l.size(); ++i) {
    const double expected = n * std::exp(lp[i]);
    chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  // 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
  CHECK(chi2 < 24.3);
}

TEST_CASE("sampling params are validated with the field named") {
  SamplingParams p;
  CHECK(p.validate().isOk());
  p.temperature = -1;
  CHECK(p.validate().message().find("temperature") != std::string::npos);
  p = {};
  p.topP = 0;
  CHECK(p.validate().message().find("top_p") != std::string::npos);
  p = {};
  p.minP = 1.5f;
  CHECK(p.validate().message().find("min_p") != std::string::npos);
  p = {};
  p.logprobs = 21;
  CHECK(p.validate().message().find("logprobs 21 must be in [0, 20]") != std::string::npos);
  p = {};
  p.maxTokens = 0;
  CHECK(p.validate().code() == StatusCode::kInvalidArgument);
  p = {};
  p.stopTokenIds = {3, -2};
  CHECK(p.validate().message().find("stop token id -2") != std::string::npos);
}

TEST_CASE("masks combine: min-p then top-k then top-p over what is left") {
  // probabilities 0.4 0.3 0.15 0.09 0.06
  std::vector<float> l;
  for (double q : {0.4, 0.3, 0.15, 0.09, 0.06}) l.push_back(float(std::log(q)));
  SamplingParams p = seeded(9);
  p.topK = 3;      // {0, 1, 2}, renormalised 0.47 0.35 0.18
  p.topP = 0.75f;  // 0.47 < 0.75, 0.82 >= 0.75: {0, 1}
  int counts[5] = {0, 0, 0, 0, 0};
  for (uint64_t step = 0; step < 8000; ++step) ++counts[sample(l.data(), 5, p, step).id];
  CHECK(counts[2] + counts[3] + counts[4] == 0);
  CHECK(double(counts[0]) / 8000 == Approx(0.4 / 0.7).margin(0.03));
  // top_k at or above the vocabulary is no mask at all.
  p = seeded(9);
  p.topK = 5;
  std::set<int> seen;
  for (uint64_t step = 0; step < 3000; ++step) seen.insert(sample(l.data(), 5, p, step).id);
  CHECK(seen.size() == 5);
  // Masked (-inf) logits are never drawn.
  std::vector<float> masked = {0.0f, -INFINITY, 0.0f, -INFINITY};
  p = seeded(3, 2.0f);
  for (uint64_t step = 0; step < 2000; ++step) {
    const int id = sample(masked.data(), 4, p, step).id;
    REQUIRE((id == 0 || id == 2));
  }
}
