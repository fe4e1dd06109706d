// The CPU sampler kernel (pd/kernels/sampling.h) against a literal implementation of its
// definition (sort every kept token by key, cut, draw in id order), and pd::engine::sample()
// against the kernel, token for token, on random rows, parameters and draws. Runs on the CPU
// in every build. (The CUDA twin is compared with this kernel in cuda_sampling_test.cpp.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/sampling.h"
#include "pd/kernels/sampling.h"
#include "pd/kernels/sampling_math.h"

namespace sm = pd::kernels::sampling_math;
using pd::kernels::SampleRowParams;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Out {
  int32_t id = -1;
  float logprob = 0;
  std::vector<int32_t> topIds;
  std::vector<float> topLogprobs;
};

// The definition in pd/kernels/sampling.h, written the slow, obvious way.
Out reference(const float* l, int vocab, const SampleRowParams& p, int topN) {
  std::vector<int32_t> byKey(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i) byKey[size_t(i)] = i;
  std::sort(byKey.begin(), byKey.end(),
            [l](int32_t a, int32_t b) { return sm::orderKey(l[a], a) > sm::orderKey(l[b], b); });
  Out o;
  const int32_t argmax = byKey[0];
  const float lmax = l[argmax];
  float lse = std::numeric_limits<float>::infinity();
  o.id = argmax;
  if (lmax > kNegInf) {
    uint64_t raw = 0;
    for (int i = 0; i < vocab; ++i) raw += sm::fixedMass(sm::tokenWeight(l[i], lmax, 1.0f));
    lse = lmax + float(std::log(double(raw) * 0x1p-40));
    if (p.temperature >= pd::kernels::kSamplingGreedyTemperature) {
      const float invT = 1.0f / p.temperature;
      auto w = [&](int32_t i) { return sm::tokenWeight(l[i], lmax, invT); };
      std::vector<int32_t> kept;  // D in key order
      for (int32_t i : byKey) {
        if (w(i) > sm::kMinKeptWeight && w(i) >= p.minP) kept.push_back(i);
      }
      if (p.topK > 0 && p.topK < vocab && size_t(p.topK) < kept.size()) kept.resize(size_t(p.topK));
      uint64_t mass = 0;
      for (int32_t i : kept) mass += sm::fixedMass(w(i));
      if (p.topP < 1.0f) {
        const uint64_t limit = sm::nucleusLimit(p.topP, mass);
        uint64_t before = 0;
        size_t m = 0;
        while (m < kept.size() && before < limit) before += sm::fixedMass(w(kept[m++]));
        kept.resize(m);
        mass = before;
      }
      std::sort(kept.begin(), kept.end());
      const uint64_t target = sm::drawTarget(p.u, mass);
      uint64_t acc = 0;
      for (int32_t i : kept) {
        acc += sm::fixedMass(w(i));
        if (acc > target) {
          o.id = i;
          break;
        }
      }
    }
  }
  o.logprob = l[o.id] - lse;
  for (int j = 0; j < topN; ++j) {
    o.topIds.push_back(byKey[size_t(j)]);
    o.topLogprobs.push_back(l[byKey[size_t(j)]] - lse);
  }
  return o;
}

Out kernel(const float* l, int vocab, const SampleRowParams& p, int topN) {
  Out o;
  o.topIds.assign(size_t(topN), -7);
  o.topLogprobs.assign(size_t(topN), std::nanf(""));
  pd::kernels::cpu::sampleRows(l, vocab, 1, vocab, &p, topN, &o.id, &o.logprob, o.topIds.data(), o.topLogprobs.data());
  return o;
}

bool sameFloat(float a, float b) {
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= 1e-6f * std::max(1.0f, std::fabs(b));
}

// Random logits of different shapes: smooth (normal), peaked, with many exact ties (values
// on a coarse grid, as bf16 logits have), and with masked (-inf) tokens.
std::vector<float> randomLogits(int vocab, int kind, std::mt19937_64& rng) {
  std::vector<float> l(static_cast<size_t>(vocab));
  std::normal_distribution<float> normal(0.0f, kind == 1 ? 6.0f : 2.0f);
  std::uniform_int_distribution<int> grid(-12, 12);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (float& x : l) {
    x = kind == 2 ? float(grid(rng)) * 0.25f : normal(rng);
    if (kind == 3 && uni(rng) < 0.3f) x = kNegInf;
    if (x == 0.0f) x = 0.125f;
  }
  if (kind == 3) l[size_t(rng() % size_t(vocab))] = 1.0f;  // at least one finite
  return l;
}

// The CUDA kernel's algorithm run on the host: the same radix selection (sm::RadixSelect,
// the code the kernel's thread 0 runs) over histograms built here sequentially, the same
// passes in the same order. Checks the selection logic on the CPU (what it cannot check:
// the kernel's synchronisation and reductions, left to cuda_sampling_test on a GPU).
struct Emulated {
  Out out;
  int passes = 0;
};
Emulated emulateCudaKernel(const float* l, int vocab, const SampleRowParams& p, int topN) {
  Emulated e;
  uint64_t best = 0;
  for (int i = 0; i < vocab; ++i) best = std::max(best, sm::orderKey(l[i], i));
  const int32_t argmax = sm::keyId(best);
  const float lmax = l[argmax];
  const float invT = p.temperature >= pd::kernels::kSamplingGreedyTemperature ? 1.0f / p.temperature : 1.0f;
  auto minPMass = [&](int i) -> uint64_t {
    const float w = sm::tokenWeight(l[i], lmax, invT);
    return (w > sm::kMinKeptWeight && w >= p.minP) ? sm::fixedMass(w) : 0;
  };
  auto select = [&](bool useMinP, uint64_t floorKey, bool byMass, uint64_t need) {
    sm::RadixSelect sel;
    while (!sel.done) {
      uint64_t mass[sm::kRadixDigits] = {};
      uint32_t count[sm::kRadixDigits] = {};
      for (int i = 0; i < vocab; ++i) {
        const uint64_t key = sm::orderKey(l[i], i);
        if ((key & sel.prefixMask()) != sel.prefix || key < floorKey) continue;
        const uint64_t q = useMinP ? minPMass(i) : 0;
        if (useMinP && q == 0) continue;
        ++count[sel.digitOf(key)];
        mass[sel.digitOf(key)] += q;
      }
      sel.step(mass, count, byMass, need, floorKey);
      ++e.passes;
    }
    return sel;
  };
  int32_t chosen = argmax;
  float lse = std::numeric_limits<float>::infinity();
  if (lmax > kNegInf) {
    uint64_t raw = 0;
    for (int i = 0; i < vocab; ++i) raw += sm::fixedMass(sm::tokenWeight(l[i], lmax, 1.0f));
    lse = lmax + float(std::log(double(raw) * 0x1p-40));
    if (p.temperature >= pd::kernels::kSamplingGreedyTemperature) {
      uint64_t floorKey = 0, mass = 0;
      if (p.topK > 0 && p.topK < vocab) {
        const auto s = select(true, 0, false, uint64_t(p.topK));
        floorKey = s.threshold;
        mass = s.mass;
      } else {
        for (int i = 0; i < vocab; ++i) mass += minPMass(i);
      }
      if (p.topP < 1.0f) {
        const auto s = select(true, floorKey, true, sm::nucleusLimit(p.topP, mass));
        floorKey = s.threshold;
        mass = s.mass;
      }
      // The kernel's draw: 32 warps own contiguous id ranges of `chunk` ids; the warp whose
      // range holds the target scans it 32 ids at a time.
      const uint64_t target = sm::drawTarget(p.u, mass);
      constexpr int kWarps = 32;
      const int chunk = ((vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
      auto massOf = [&](int i, int end) -> uint64_t {
        if (i >= end || sm::orderKey(l[i], i) < floorKey) return 0;
        return minPMass(i);
      };
      uint64_t warpMass[kWarps] = {};
      for (int w = 0; w < kWarps; ++w) {
        const int begin = w * chunk, end = std::min(begin + chunk, vocab);
        for (int i = begin; i < end; ++i) warpMass[w] += massOf(i, end);
      }
      uint64_t acc = 0;
      int sel = kWarps - 1;
      for (int w = 0; w < kWarps; ++w) {
        if (acc + warpMass[w] > target) {
          sel = w;
          break;
        }
        acc += warpMass[w];
      }
      const uint64_t local = target - acc;
      const int begin = sel * chunk, end = std::min(begin + chunk, vocab);
      uint64_t base = 0;
      chosen = 0;  // the kernel's value when nothing is hit (never, when masses agree)
      for (int start = begin; start < end; start += 32) {
        uint64_t incl = 0;
        int hit = -1;
        for (int lane = 0; lane < 32; ++lane) {
          incl += massOf(start + lane, end);
          if (hit < 0 && base + incl > local) hit = lane;
        }
        if (hit >= 0) {
          chosen = start + hit;
          break;
        }
        base += incl;
      }
    }
  }
  e.out.id = chosen;
  e.out.logprob = l[chosen] - lse;
  if (topN > 0) {
    const auto s = select(false, 0, false, uint64_t(topN));
    std::vector<uint64_t> keys;
    for (int i = 0; i < vocab; ++i) {
      if (sm::orderKey(l[i], i) >= s.threshold) keys.push_back(sm::orderKey(l[i], i));
    }
    std::sort(keys.begin(), keys.end(), std::greater<>());
    for (uint64_t k : keys) {
      e.out.topIds.push_back(sm::keyId(k));
      e.out.topLogprobs.push_back(l[sm::keyId(k)] - lse);
    }
  }
  return e;
}

}  // namespace

TEST_CASE("the CUDA kernel's radix selection, run on the host, picks the CPU kernel's tokens", "[kernels][sampling]") {
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  const float temps[] = {0.0f, 0.5f, 1.0f, 1.7f};
  const int topKs[] = {0, 1, 20, 1000};
  const float topPs[] = {1.0f, 0.95f, 0.6f, 0.1f};
  const float minPs[] = {0.0f, 0.02f, 0.3f};
  int compared = 0, maxPasses = 0;
  for (int vocab : {1, 2, 33, 1000, 32000, 128256}) {
    for (int kind = 0; kind < 4; ++kind) {
      const auto l = randomLogits(vocab, kind, rng);
      for (int trial = 0; trial < (vocab > 100000 ? 12 : vocab > 10000 ? 40 : 200); ++trial) {
        SampleRowParams p;
        p.temperature = temps[rng() % 4];
        p.topK = topKs[rng() % 4];
        if (p.topK == 1000) p.topK = std::min(1000, vocab - 1);
        p.topP = topPs[rng() % 4];
        p.minP = minPs[rng() % 3];
        p.u = uni(rng);
        const int topN = std::min(int(rng() % 21), vocab);
        INFO("vocab " << vocab << " kind " << kind << " T " << p.temperature << " topK " << p.topK << " topP " << p.topP
                      << " minP " << p.minP << " u " << p.u);
        const Emulated gpu = emulateCudaKernel(l.data(), vocab, p, topN);
        const Out cpuOut = kernel(l.data(), vocab, p, topN);
        REQUIRE(gpu.out.id == cpuOut.id);
        REQUIRE(gpu.out.logprob == cpuOut.logprob);
        REQUIRE(gpu.out.topIds == cpuOut.topIds);
        REQUIRE(gpu.out.topLogprobs == cpuOut.topLogprobs);
        maxPasses = std::max(maxPasses, gpu.passes);
        ++compared;
      }
    }
  }
  CHECK(compared == 4 * 4 * 200 + 4 * 40 + 4 * 12);
  // Three selections at most (top-k, top-p, top-N), 8 digit passes each at most.
  CHECK(maxPasses <= 24);
}

TEST_CASE("the draw is an inverse CDF in id order over the kept tokens", "[kernels][sampling]") {
  const std::vector<float> equal(4, 0.5f);
  SampleRowParams p;
  p.u = 0.3;  // target 1.2 units: past id 0's unit, inside id 1's
  CHECK(kernel(equal.data(), 4, p, 0).id == 1);
  p.u = 0.99;
  CHECK(kernel(equal.data(), 4, p, 0).id == 3);
  // top-p 0.5 over four equal tokens keeps the two best keys: ids 0 and 1 (ties by lower id).
  p.topP = 0.5f;
  for (double u : {0.0, 0.49, 0.5, 0.75, 0.999}) {
    p.u = u;
    CHECK(kernel(equal.data(), 4, p, 0).id == (u < 0.5 ? 0 : 1));
  }
  // top-k 3 with logits 3,1,2,0: keeps ids 0,2,1; drawn in id order 0,1,2.
  const std::vector<float> l{3.0f, 1.0f, 2.0f, 0.0f};
  p = SampleRowParams{};
  p.topK = 3;
  p.temperature = 1000.0f;  // nearly flat: each kept token weighs about a third
  p.u = 0.5;
  CHECK(kernel(l.data(), 4, p, 0).id == 1);
  p.u = 0.9;
  CHECK(kernel(l.data(), 4, p, 0).id == 2);
}

TEST_CASE("the CPU sampler kernel computes its definition on random rows", "[kernels][sampling]") {
  std::mt19937_64 rng(12345);
  const int vocabs[] = {1, 2, 3, 17, 100, 1000, 4099, 32000};
  const float temps[] = {0.0f, 1e-6f, 0.3f, 0.7f, 1.0f, 1.5f, 20.0f};
  const int topKs[] = {0, 1, 2, 5, 50, 1000};
  const float topPs[] = {1.0f, 0.999f, 0.9f, 0.5f, 0.05f};
  const float minPs[] = {0.0f, 0.01f, 0.2f, 0.9f};
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  int cases = 0;
  for (int vocab : vocabs) {
    for (int kind = 0; kind < 4; ++kind) {
      const auto l = randomLogits(vocab, kind, rng);
      for (int trial = 0; trial < 60; ++trial) {
        SampleRowParams p;
        p.temperature = temps[rng() % std::size(temps)];
        p.topK = topKs[rng() % std::size(topKs)];
        if (rng() % 5 == 0) p.topK = vocab - 1;
        p.topP = topPs[rng() % std::size(topPs)];
        p.minP = minPs[rng() % std::size(minPs)];
        p.u = trial == 0 ? 0.0 : uni(rng);
        const int topN = std::min(int(rng() % 21), vocab);
        const Out want = reference(l.data(), vocab, p, topN);
        const Out got = kernel(l.data(), vocab, p, topN);
        INFO("vocab " << vocab << " kind " << kind << " T " << p.temperature << " topK " << p.topK << " topP " << p.topP
                      << " minP " << p.minP << " u " << p.u);
        REQUIRE(got.id == want.id);
        REQUIRE(sameFloat(got.logprob, want.logprob));
        REQUIRE(got.topIds == want.topIds);
        for (int j = 0; j < topN; ++j) REQUIRE(sameFloat(got.topLogprobs[j], want.topLogprobs[j]));
        ++cases;
      }
    }
  }
  CHECK(cases == int(std::size(vocabs)) * 4 * 60);
}

TEST_CASE("a batch of rows with a stride samples each row as alone", "[kernels][sampling]") {
  std::mt19937_64 rng(7);
  const int rows = 9, vocab = 3000, stride = 3011, topN = 5;
  std::vector<float> l(size_t(rows) * stride, std::nanf(""));  // the padding is never read
  std::vector<SampleRowParams> ps(rows);
  for (int r = 0; r < rows; ++r) {
    const auto row = randomLogits(vocab, r % 4, rng);
    std::copy(row.begin(), row.end(), l.begin() + ptrdiff_t(r) * stride);
    ps[size_t(r)].temperature = r % 3 == 0 ? 0.0f : 0.8f;
    ps[size_t(r)].topK = r % 2 ? 40 : 0;
    ps[size_t(r)].topP = r % 4 < 2 ? 0.9f : 1.0f;
    ps[size_t(r)].minP = r == 5 ? 0.1f : 0.0f;
    ps[size_t(r)].u = double(r) / rows;
  }
  std::vector<int32_t> ids(rows), topIds(size_t(rows) * topN);
  std::vector<float> lps(rows), topLps(size_t(rows) * topN);
  pd::kernels::cpu::sampleRows(l.data(), stride, rows, vocab, ps.data(), topN, ids.data(), lps.data(), topIds.data(),
                               topLps.data());
  for (int r = 0; r < rows; ++r) {
    const Out one = kernel(l.data() + size_t(r) * stride, vocab, ps[size_t(r)], topN);
    CHECK(ids[size_t(r)] == one.id);
    CHECK(lps[size_t(r)] == one.logprob);
    CHECK(std::vector<int32_t>(topIds.begin() + r * topN, topIds.begin() + (r + 1) * topN) == one.topIds);
  }
}

TEST_CASE("all-masked rows return the lowest id with logprob -inf", "[kernels][sampling]") {
  const std::vector<float> l(10, kNegInf);
  SampleRowParams p;
  p.u = 0.7;
  const Out o = kernel(l.data(), 10, p, 3);
  CHECK(o.id == 0);
  CHECK(o.logprob == kNegInf);
  CHECK(o.topIds == std::vector<int32_t>{0, 1, 2});
  CHECK(o.topLogprobs[0] == kNegInf);
}

TEST_CASE("pd::engine::sample() is the kernel on one row, token for token", "[kernels][sampling]") {
  std::mt19937_64 rng(99);
  int compared = 0;
  for (int vocab : {5, 1000, 32000, 151936}) {
    for (int kind = 0; kind < 4; ++kind) {
      const auto l = randomLogits(vocab, kind, rng);
      for (int trial = 0; trial < (vocab > 100000 ? 8 : 40); ++trial) {
        pd::engine::SamplingParams sp;
        sp.temperature = trial % 7 == 0 ? 0.0f : float(0.2 + 0.2 * (trial % 6));
        sp.topK = trial % 3 == 0 ? 0 : int(1 + rng() % 100);
        sp.topP = trial % 4 == 0 ? 1.0f : float(0.3 + 0.1 * (trial % 7));
        sp.minP = trial % 5 == 0 ? 0.05f : 0.0f;
        sp.logprobs = int(rng() % 21);
        sp.seed = rng();
        REQUIRE(sp.validate().isOk());
        const uint64_t step = rng() % 1000;
        const pd::engine::SampledToken t = pd::engine::sample(l.data(), vocab, sp, step);
        SampleRowParams p = pd::engine::rowParams(sp, step);
        if (!sp.greedy()) REQUIRE(p.u == pd::engine::samplingUniform(*sp.seed, step));
        const int topN = std::min(sp.logprobs, vocab);
        const Out k = kernel(l.data(), vocab, p, topN);
        const Out ref = reference(l.data(), vocab, p, topN);
        REQUIRE(t.id == k.id);
        REQUIRE(t.id == ref.id);
        REQUIRE(t.logprob == k.logprob);
        REQUIRE(t.topLogprobs.size() == size_t(topN));
        for (int j = 0; j < topN; ++j) {
          REQUIRE(t.topLogprobs[size_t(j)].first == k.topIds[size_t(j)]);
          REQUIRE(t.topLogprobs[size_t(j)].second == k.topLogprobs[size_t(j)]);
        }
        ++compared;
      }
    }
  }
  CHECK(compared == 3 * 4 * 40 + 4 * 8);
}
