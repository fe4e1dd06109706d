// attention_bench: a decode token's paged attention (pd::kernels::cpu::pagedAttention, f32 pool)
// over every layer's KV, one thread, next to two reads of the same bytes measured in the same
// run (docs/performance.md, "The attention's KV read"):
//   sequential    each block of the sequence read front to back (the block table's order: the
//                 fastest order the pool's layout allows);
//   kernel order  the kernel's order without its arithmetic: a tile of 32 key positions, kv
//                 head by kv head, each head's K rows then its V rows (2 KB apart at 4 kv
//                 heads of 128).
// Before each layer a buffer of --evict-mb MB is read, as a decode step's weights evict the
// caches between two layers' attention. The three passes run alternated --passes times; the
// figures are thread CPU time, median (best), and share = the sequential read's time over the
// pass's. The block table is shuffled (a pool after some traffic) unless --in-order.
//
//   build/engine/bench/attention_bench [--ctx 512] [--heads 8] [--kv-heads 4] [--head-dim 128]
//       [--layers 8] [--block 16] [--evict-mb 12] [--passes 41] [--in-order]
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "common/base/cli.h"
#include "kernels/cpu/simd_avx2.h"
#include "pd/kernels/attention.h"

namespace {

double threadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + ts.tv_nsec * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Sums n floats from p (loads only); the result keeps the loads from being optimised away.
float readSpan(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
  }
  float s = pd::kernels::cpu::detail::hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += p[i];
  return s;
}

struct Options {
  int ctx = 512, heads = 8, kvHeads = 4, headDim = 128, layers = 8, block = 16, passes = 41;
  double evictMb = 12;
  bool inOrder = false;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"attention_bench: a decode token's paged attention next to reads of the same KV", "attention_bench"};
  pd::cli::configure(app);
  const CLI::Range positive(1, 1 << 24);
  app.add_option("--ctx", o.ctx, "positions of context")->check(positive)->capture_default_str();
  app.add_option("--heads", o.heads, "query heads")->check(positive)->capture_default_str();
  app.add_option("--kv-heads", o.kvHeads, "kv heads (divides --heads)")->check(positive)->capture_default_str();
  app.add_option("--head-dim", o.headDim, "values a head")->check(positive)->capture_default_str();
  app.add_option("--layers", o.layers, "layers, each its own pool")->check(positive)->capture_default_str();
  app.add_option("--block", o.block, "positions a KV block")->check(positive)->capture_default_str();
  app.add_option("--passes", o.passes, "alternated passes counted")->check(positive)->capture_default_str();
  app.add_option("--evict-mb", o.evictMb, "MB read before each layer")
      ->check(CLI::Range(0.0, 1e5))
      ->capture_default_str();
  app.add_flag("--in-order", o.inOrder, "the block table in order (default: shuffled)");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  if (o.heads % o.kvHeads != 0) {
    std::fprintf(stderr, "attention_bench: --kv-heads %d does not divide --heads %d\n", o.kvHeads, o.heads);
    return pd::cli::kUsageExit;
  }
  const int blocks = (o.ctx + o.block - 1) / o.block;
  const size_t tokenFloats = size_t(o.kvHeads) * o.headDim;      // one token's K (or V) row, every kv head
  const size_t blockFloats = 2 * size_t(o.block) * tokenFloats;  // [K rows][V rows]
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  if (!o.inOrder) std::shuffle(table.begin(), table.end(), rng);
  std::vector<std::vector<float>> pools(o.layers, std::vector<float>(blockFloats * blocks));
  for (auto& pool : pools)
    for (float& x : pool) x = normal(rng);
  std::vector<float> q(size_t(o.heads) * o.headDim), out(q.size());
  for (float& x : q) x = normal(rng);
  std::vector<float> evict(size_t(o.evictMb * 1e6 / sizeof(float)) + 16, 1.0f);
  const float scale = 1.0f / std::sqrt(float(o.headDim));
  volatile float sink = 0;

  auto sequential = [&](const std::vector<float>& pool) {
    float s = 0;
    for (int b = 0; b < blocks; ++b) s += readSpan(pool.data() + size_t(table[b]) * blockFloats, blockFloats);
    return s;
  };
  auto kernelOrder = [&](const std::vector<float>& pool) {
    constexpr int kTile = 32;  // the kernel's tile (kernels/cpu/attention.cpp)
    float s = 0;
    for (int p0 = 0; p0 < o.ctx; p0 += kTile)
      for (int g = 0; g < o.kvHeads; ++g)
        for (int v = 0; v < 2; ++v)
          for (int p = p0; p < std::min(o.ctx, p0 + kTile); ++p)
            s += readSpan(pool.data() + size_t(table[p / o.block]) * blockFloats +
                              (size_t(v) * o.block + p % o.block) * tokenFloats + size_t(g) * o.headDim,
                          o.headDim);
    return s;
  };
  auto attention = [&](const std::vector<float>& pool) {
    pd::kernels::cpu::pagedAttention(q.data(), int(q.size()), pool.data(), table.data(), 1, o.ctx - 1, o.block, o.heads,
                                     o.kvHeads, o.headDim, 0, o.kvHeads, scale, out.data(), int(q.size()));
    return out[0];
  };
  // One pass: every layer, the evicting read before each, only the layer's work timed.
  auto pass = [&](auto&& perLayer) {
    double ms = 0;
    for (const auto& pool : pools) {
      sink = sink + readSpan(evict.data(), evict.size());
      const double t0 = threadCpuMs();
      sink = sink + perLayer(pool);
      ms += threadCpuMs() - t0;
    }
    return ms;
  };
  std::vector<double> tSeq, tOrder, tAttn;
  for (int i = 0; i < o.passes + 1; ++i) {  // pass 0 warms up and is not counted
    const double s = pass(sequential), k = pass(kernelOrder), a = pass(attention);
    if (i == 0) continue;
    tSeq.push_back(s);
    tOrder.push_back(k);
    tAttn.push_back(a);
  }
  const double mb = double(o.layers) * blocks * blockFloats * sizeof(float) / 1e6;
  const double seq = median(tSeq);
  std::printf(
      "1 thread: ctx %d, %d heads / %d kv heads of %d, %d layers, blocks of %d (%s), %.1f MB of KV; %.0f MB read "
      "before each layer; %d passes alternated; thread CPU-ms a token, median (best), share = sequential / pass\n",
      o.ctx, o.heads, o.kvHeads, o.headDim, o.layers, o.block, o.inOrder ? "in order" : "shuffled", mb, o.evictMb,
      o.passes);
  auto row = [&](const char* name, const std::vector<double>& t) {
    const double m = median(t);
    std::printf("  %-26s %7.3f (%7.3f) ms  %5.1f GB/s  %4.0f%%\n", name, m, *std::min_element(t.begin(), t.end()),
                mb / m, 100.0 * seq / m);
  };
  row("sequential read (ceiling)", tSeq);
  row("read in the kernel's order", tOrder);
  row("pagedAttention", tAttn);
  return 0;
}
