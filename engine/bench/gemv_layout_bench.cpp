// gemv_layout_bench: batch-1 GEMV over the mixture-of-experts presets' expert shapes, one
// thread, in two weight layouts, next to a plain sequential read of the same bytes measured in
// the same run (docs/performance.md, "Engine: CPU backend, mixture of experts"):
//   row-major    the backend's kernel (pd::kernels::cpu::linearSkinny: eight rows at a time,
//                eight address streams, the next group prefetched);
//   interleaved  groups of R rows stored 8 floats of each row in turn (R x 32 bytes a step),
//                so the GEMV reads one sequential stream; same accumulators and summation order
//                per output as the row-major kernel, so the outputs are compared bit for bit.
// Each shape gets a working set of about --mb MB of matrices (far beyond the caches, as a
// decode step's weights are), and the three passes (read, row-major, interleaved) run
// alternated --passes times; the figures are each pass's thread CPU time, median and best.
//
//   build/engine/bench/gemv_layout_bench [--mb 94] [--passes 15]
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/base/cli.h"
#include "engine/model_weights.h"
#include "kernels/cpu/simd_avx2.h"
#include "pd/kernels/linear.h"

namespace {

double threadCpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

using pd::kernels::cpu::detail::hsum;  // the kernels' reduction order: outputs compared bit for bit

// Row-major [n][k] -> groups of R rows, each group [k/8][R][8] (k % 8 == 0 and n % R == 0 here).
template <int R>
void interleave(const float* w, float* out, int n, int k) {
  for (int g = 0; g < n / R; ++g)
    for (int c = 0; c < k / 8; ++c)
      for (int r = 0; r < R; ++r)
        std::memcpy(out + size_t(g) * k * R + size_t(c) * 8 * R + r * 8, w + size_t(g * R + r) * k + c * 8,
                    8 * sizeof(float));
}

// y[j] = dot(row j, x) over the interleaved layout; `ahead` bytes of software prefetch (0: none).
template <int R>
void gemvInterleaved(const float* x, const float* w, float* y, int n, int k, int ahead) {
  for (int g = 0; g < n / R; ++g) {
    const float* p = w + size_t(g) * k * R;
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
    for (int c = 0; c < k; c += 8, p += 8 * R) {
      if (ahead)
        for (int line = 0; line < R * 32 / 64; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(p) + ahead + line * 64, _MM_HINT_T0);
      const __m256 xv = _mm256_loadu_ps(x + c);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p + r * 8), xv, a[r]);
    }
    for (int r = 0; r < R; ++r) y[g * R + r] = hsum(a[r]);
  }
}

float readPass(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  double mb = 94;
  int passes = 15;
  CLI::App app{"gemv_layout_bench: batch-1 GEMV over the experts' shapes in two weight layouts", "gemv_layout_bench"};
  pd::cli::configure(app);
  app.add_option("--mb", mb, "MB of matrices a shape")->check(CLI::Range(0.1, 1e5))->capture_default_str();
  app.add_option("--passes", passes, "alternated passes counted")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"mixtral expert gate|up", 1376, 512},
                          {"mixtral expert down", 512, 688},
                          {"qwen3-moe expert gate|up", 688, 512},
                          {"qwen3-moe expert down", 512, 344}};
  std::printf(
      "1 thread, ~%.0f MB of matrices a shape, %d passes alternated (read, row-major, interleaved R=8, "
      "R=8 + prefetch 1 KiB, R=4); thread CPU-ms a pass, median (best); share = read / GEMV\n",
      mb, passes);
  for (const Shape& s : shapes) {
    const size_t per = size_t(s.n) * s.k;
    const int count = std::max(1, int(mb * 1e6 / (per * sizeof(float))));
    const size_t total = per * count;
    pd::engine::WeightBuffer rm(total), il8(total), il4(total), rd(total);
    unsigned seed = 1;
    for (size_t i = 0; i < total; ++i) {
      seed = seed * 1664525u + 1013904223u;
      rm.data()[i] = float(int(seed >> 9) - (1 << 22)) / float(1 << 22);
      rd.data()[i] = float(i & 7);
    }
    for (int m = 0; m < count; ++m) {
      interleave<8>(rm.data() + m * per, il8.data() + m * per, s.n, s.k);
      interleave<4>(rm.data() + m * per, il4.data() + m * per, s.n, s.k);
    }
    std::vector<float> x(s.k), y0(size_t(s.n) * count), y1(y0.size()), y2(y0.size()), y3(y0.size());
    for (int p = 0; p < s.k; ++p) x[p] = float(p % 13) / 13.0f - 0.5f;
    std::vector<double> tRead, tRm, tIl, tIlPf, tIl4;
    volatile float sink = 0;
    auto timed = [&](std::vector<double>& into, auto&& fn) {
      const double c0 = threadCpu();
      fn();
      into.push_back(threadCpu() - c0);
    };
    for (int pass = 0; pass < passes + 1; ++pass) {  // pass 0 warms up and is not counted
      std::vector<double> scratch;
      const bool keep = pass > 0;
      timed(keep ? tRead : scratch, [&] { sink = sink + readPass(rd.data(), total); });
      timed(keep ? tRm : scratch, [&] {
        for (int m = 0; m < count; ++m)
          pd::kernels::cpu::linearSkinny(x.data(), s.k, rm.data() + m * per, y0.data() + size_t(m) * s.n, s.n, 1, s.k,
                                         0, s.n, 0.0f);
      });
      timed(keep ? tIl : scratch, [&] {
        for (int m = 0; m < count; ++m)
          gemvInterleaved<8>(x.data(), il8.data() + m * per, y1.data() + size_t(m) * s.n, s.n, s.k, 0);
      });
      timed(keep ? tIlPf : scratch, [&] {
        for (int m = 0; m < count; ++m)
          gemvInterleaved<8>(x.data(), il8.data() + m * per, y2.data() + size_t(m) * s.n, s.n, s.k, 1024);
      });
      timed(keep ? tIl4 : scratch, [&] {
        for (int m = 0; m < count; ++m)
          gemvInterleaved<4>(x.data(), il4.data() + m * per, y3.data() + size_t(m) * s.n, s.n, s.k, 0);
      });
    }
    const bool same = y0 == y1 && y0 == y2;
    const double r = median(tRead);
    auto col = [&](const std::vector<double>& t) {
      std::printf("  %6.2f (%5.2f) %4.0f%%", median(t) * 1e3, *std::min_element(t.begin(), t.end()) * 1e3,
                  100.0 * r / median(t));
    };
    std::printf("%-26s n %4d k %3d, %3d x %.1f MB: read %5.2f (%5.2f) ms; row-major", s.name, s.n, s.k, count,
                per * 4 / 1e6, r * 1e3, *std::min_element(tRead.begin(), tRead.end()) * 1e3);
    col(tRm);
    std::printf("; R8");
    col(tIl);
    std::printf("; R8+pf");
    col(tIlPf);
    std::printf("; R4");
    col(tIl4);
    std::printf("; R8 bits %s, R4 %s\n", same ? "equal" : "DIFFER", y0 == y3 ? "equal" : "differ");
  }
  return 0;
}
