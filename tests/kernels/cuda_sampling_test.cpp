// The CUDA sampler (pd/kernels/cuda/sampling.h) against its CPU twin on random logits:
// vocabularies 1k..152k, 1..128 rows, every combination of temperature / top-k / top-p /
// min-p spread over the rows, logits with many exact ties and with masked tokens, outputs
// NaN/-1-poisoned before each run. Token ids (and top-N ids) must be identical -- the twins
// use the same IEEE operations for the weights and exact integer masses, so there are no
// float near-ties to avoid; logprobs differ at most by the last bit of log(). A second run
// must return the same ids (no float atomics). Skips without a device.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "pd/kernels/cuda/sampling.h"
#include "pd/kernels/sampling.h"

namespace cpu = pd::kernels::cpu;
namespace kcu = pd::kernels::cuda;
using pd::kernels::SampleRowParams;
using namespace pd::kernels::cuda::test;

namespace {

std::vector<float> randomRows(int rows, int vocab, int kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, kind == 1 ? 6.0f : 2.0f);
  std::uniform_int_distribution<int> grid(-40, 40);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> l(size_t(rows) * vocab);
  for (float& x : l) {
    x = kind == 2 ? float(grid(rng)) * 0.125f : normal(rng);  // kind 2: ties everywhere
    if (kind == 3 && uni(rng) < 0.3f) x = -std::numeric_limits<float>::infinity();
    if (x == 0.0f) x = 0.0625f;
  }
  if (kind == 3)
    for (int r = 0; r < rows; ++r) l[size_t(r) * vocab + size_t(rng() % size_t(vocab))] = 1.0f;
  return l;
}

// Row r gets combination (r + offset) of the parameter grid.
std::vector<SampleRowParams> gridParams(int rows, int vocab, int offset, uint64_t seed) {
  const float temps[] = {0.0f, 0.5f, 1.0f, 1.7f};
  const int topKs[] = {0, 1, 20, 1000};
  const float topPs[] = {1.0f, 0.95f, 0.6f, 0.1f};
  const float minPs[] = {0.0f, 0.02f, 0.3f};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::vector<SampleRowParams> ps(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    int c = r + offset;
    SampleRowParams& p = ps[size_t(r)];
    p.temperature = temps[c % 4];
    c /= 4;
    p.topK = topKs[c % 4] == 1000 ? std::min(1000, vocab - 1) : topKs[c % 4];
    c /= 4;
    p.topP = topPs[c % 4];
    c /= 4;
    p.minP = minPs[c % 3];
    p.u = uni(rng);
  }
  return ps;
}

void compare(int rows, int vocab, int kind, int topN, int offset) {
  const auto logits = randomRows(rows, vocab, kind, uint64_t(vocab) * 131 + uint64_t(kind));
  const auto params = gridParams(rows, vocab, offset, uint64_t(rows) + uint64_t(offset));
  std::vector<int32_t> wantIds(static_cast<size_t>(rows)), wantTop(static_cast<size_t>(rows) * topN);
  std::vector<float> wantLp(static_cast<size_t>(rows)), wantTopLp(static_cast<size_t>(rows) * topN);
  cpu::sampleRows(logits.data(), vocab, rows, vocab, params.data(), topN, wantIds.data(), wantLp.data(), wantTop.data(),
                  wantTopLp.data());
  auto dl = upload(logits);
  auto dp = upload(params);
  DevBuf ids(static_cast<size_t>(rows) * 4), lp(static_cast<size_t>(rows) * 4), topIds(size_t(rows) * topN * 4),
      topLp(size_t(rows) * topN * 4);
  std::vector<int32_t> firstIds;
  for (int run = 0; run < 2; ++run) {
    ids.poison();
    lp.poison();
    topIds.poison();
    topLp.poison();
    PD_CUDA_CHECK(kcu::sampleRows(dl->as<float>(), vocab, rows, vocab, dp->as<SampleRowParams>(), topN,
                                  ids.as<int32_t>(), lp.as<float>(), topIds.as<int32_t>(), topLp.as<float>(), nullptr));
    const auto gotIds = download<int32_t>(ids.as(), size_t(rows));
    const auto gotLp = download<float>(lp.as(), size_t(rows));
    const auto gotTop = download<int32_t>(topIds.as(), size_t(rows) * topN);
    const auto gotTopLp = download<float>(topLp.as(), size_t(rows) * topN);
    for (int r = 0; r < rows; ++r) {
      const SampleRowParams& p = params[size_t(r)];
      INFO("row " << r << " T " << p.temperature << " topK " << p.topK << " topP " << p.topP << " minP " << p.minP
                  << " u " << p.u);
      REQUIRE(gotIds[size_t(r)] == wantIds[size_t(r)]);
      const float w = wantLp[size_t(r)], g = gotLp[size_t(r)];
      if (std::isinf(w)) {
        REQUIRE(g == w);
      } else {
        REQUIRE(std::fabs(g - w) <= 1e-5f * std::max(1.0f, std::fabs(w)));
      }
    }
    REQUIRE(gotTop == wantTop);
    for (size_t j = 0; j < gotTopLp.size(); ++j) {
      if (std::isinf(wantTopLp[j])) {
        REQUIRE(gotTopLp[j] == wantTopLp[j]);
      } else {
        REQUIRE(std::fabs(gotTopLp[j] - wantTopLp[j]) <= 1e-5f * std::max(1.0f, std::fabs(wantTopLp[j])));
      }
    }
    if (run == 0) firstIds = gotIds;
    REQUIRE(gotIds == firstIds);  // deterministic
  }
}

}  // namespace

TEST_CASE("cuda sampleRows picks the CPU twin's tokens", "[cuda][kernels][sampling]") {
  if (!haveGpu()) return;
  for (int vocab : {1000, 32000, 128256, 151936}) {
    for (int rows : {1, 7, 128}) {
      for (int kind = 0; kind < 4; ++kind) {
        for (int topN : {0, 20}) {
          DYNAMIC_SECTION("vocab " << vocab << " rows " << rows << " kind " << kind << " topN " << topN) {
            // Rows cycle through the 192 parameter combinations; the offset moves the cycle so
            // that 1-row and 7-row runs see different combinations too.
            compare(rows, vocab, kind, topN, kind * 37 + topN * 11 + vocab % 192);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda sampleRows: tiny vocabularies and a strided batch", "[cuda][kernels][sampling]") {
  if (!haveGpu()) return;
  for (int vocab : {1, 2, 3, 33}) compare(5, vocab, 0, std::min(vocab, 3), vocab);
  // Row stride larger than the vocabulary: the tail of every row is NaN and must not be read.
  const int rows = 4, vocab = 5000, stride = 5003;
  auto base = randomRows(rows, vocab, 0, 3);
  std::vector<float> l(size_t(rows) * stride, std::nanf(""));
  for (int r = 0; r < rows; ++r)
    std::copy(base.begin() + r * vocab, base.begin() + (r + 1) * vocab, l.begin() + r * stride);
  const auto params = gridParams(rows, vocab, 5, 9);
  std::vector<int32_t> want(rows);
  std::vector<float> wantLp(rows);
  cpu::sampleRows(l.data(), stride, rows, vocab, params.data(), 0, want.data(), wantLp.data(), nullptr, nullptr);
  auto dl = upload(l);
  auto dp = upload(params);
  DevBuf ids(rows * 4), lp(rows * 4);
  PD_CUDA_CHECK(kcu::sampleRows(dl->as<float>(), stride, rows, vocab, dp->as<SampleRowParams>(), 0, ids.as<int32_t>(),
                                lp.as<float>(), nullptr, nullptr, nullptr));
  CHECK(download<int32_t>(ids.as(), rows) == want);
  // Bad shapes are refused at the call.
  CHECK(kcu::sampleRows(dl->as<float>(), stride, 0, vocab, dp->as<SampleRowParams>(), 0, ids.as<int32_t>(),
                        lp.as<float>(), nullptr, nullptr, nullptr) == cudaErrorInvalidValue);
  CHECK(kcu::sampleRows(dl->as<float>(), stride, rows, vocab, dp->as<SampleRowParams>(), 21, ids.as<int32_t>(),
                        lp.as<float>(), nullptr, nullptr, nullptr) == cudaErrorInvalidValue);
}
