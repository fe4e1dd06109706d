// kv_tiers_bench: TTFT of one long prompt on the CPU engine when its prefix is recomputed,
// promoted from the host tier, or promoted from the disk tier (page cache warm, and dropped
// with posix_fadvise), next to the ceilings measured in the same run: memcpy bandwidth over
// the same bytes, and reading the same block files. docs/kv_cache.md, docs/performance.md.
//
// Without --model it makes the small preset (seed 1) under /tmp, as engine_bench does. Not a
// test: prints figures.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/base/cli.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/kv_tiers.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"

using namespace pd;
using namespace pd::engine;
namespace fs = std::filesystem;
using Steady = std::chrono::steady_clock;

namespace {

double msSince(Steady::time_point t) { return std::chrono::duration<double, std::milli>(Steady::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Bench {
  std::shared_ptr<const ModelWeights> model;
  int threads = 2;
  int numBlocks = 0;
  KvTierOptions tiers;

  std::unique_ptr<Engine> engine() const {
    auto layout = kvLayoutFor(model->config, numBlocks, 16);
    auto kv = KvCacheManager::create(layout);
    if (!kv.ok()) throw std::runtime_error(kv.status().toString());
    CpuBackendOptions o;
    o.numThreads = threads;
    auto backend = createCpuBackend(model, layout, (*kv)->data(), o);
    if (!backend.ok()) throw std::runtime_error(backend.status().toString());
    EngineOptions opts;
    opts.scheduler.maxBatchTokens = 2048;
    opts.scheduler.maxNumSeqs = 4;
    auto e = std::make_unique<Engine>(std::move(backend).value(), std::move(kv).value(), opts);
    auto t = KvTierStore::create(e->kv(), tiers, "small/bench/w0");
    if (!t.ok()) throw std::runtime_error(t.status().toString());
    e->setKvTiers(std::move(t).value());
    return e;
  }
};

// Submit to first token, in ms; `cached` gets the prompt tokens served from the cache.
double ttft(Engine& e, uint64_t id, const std::vector<int32_t>& prompt, int* cached) {
  SamplingParams p;
  p.temperature = 0;
  p.maxTokens = 1;
  p.ignoreEos = true;
  auto r = Request::create(id, prompt, p, SystemClock::instance(), e.modelConfig().vocabSize);
  if (!r.ok()) throw std::runtime_error(r.status().toString());
  const auto start = Steady::now();
  if (auto st = e.submit(std::move(r).value()); !st.isOk()) throw std::runtime_error(st.toString());
  double first = -1;
  while (e.hasWork()) {
    std::vector<EngineEvent> events;
    if (auto st = e.step(&events); !st.isOk()) throw std::runtime_error(st.toString());
    for (const auto& ev : events) {
      if (ev.kind == EngineEvent::Kind::kToken && first < 0) first = msSince(start);
      if (ev.kind == EngineEvent::Kind::kFinished) *cached = ev.timings.cachedPromptTokens;
    }
  }
  return first;
}

std::vector<int32_t> randomPrompt(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(n), 0);
  for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string modelDir;
  int threads = 2, tokens = 2000, rounds = 3;
  std::string diskDir = "/tmp/pdserve_kv_tiers_bench";
  CLI::App app{"kv_tiers_bench: TTFT recomputed vs promoted from the host and disk KV tiers", "kv_tiers_bench"};
  pd::cli::configure(app);
  app.add_option("--model", modelDir, "model directory (default: a small made model in /tmp/pdserve_bench_small)");
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_option("--tokens", tokens, "prompt tokens")->capture_default_str();
  app.add_option("--rounds", rounds, "rounds per figure (the median is printed)")->capture_default_str();
  app.add_option("--disk-dir", diskDir, "the disk tier's directory (emptied first)")->capture_default_str();
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  if (modelDir.empty()) {
    modelDir = "/tmp/pdserve_bench_small";
    if (!fs::exists(modelDir + "/config.json")) {
      MakeModelOptions o;
      o.preset = "small";
      if (auto st = makeModel(o, modelDir); !st.isOk()) {
        std::fprintf(stderr, "kv_tiers_bench: %s\n", st.toString().c_str());
        return 1;
      }
    }
  }
  auto model = loadModel(modelDir);
  if (!model.ok()) {
    std::fprintf(stderr, "kv_tiers_bench: %s\n", model.status().toString().c_str());
    return 1;
  }
  fs::remove_all(diskDir);
  Bench b;
  b.model = *model;
  b.threads = threads;
  const int promptBlocks = (tokens - 1) / 16;
  b.numBlocks = (tokens + 15) / 16 + 8;  // one prompt at a time: the next one evicts it
  b.tiers.hostBytes = int64_t(4) << 30;
  b.tiers.diskBytes = int64_t(8) << 30;
  b.tiers.diskPath = diskDir;
  b.tiers.diskWriteQueueBytes = int64_t(1) << 30;
  const int vocab = (*model)->config.vocabSize;

  try {
    std::vector<double> recompute, host, diskWarm, diskCold, regionHit;
    int cachedHost = 0, cachedDisk = 0, cachedCold = 0, cachedRecompute = 0;
    size_t stride = 0;
    std::vector<fs::path> files;
    for (int round = 0; round < rounds; ++round) {
      const auto prompt = randomPrompt(tokens, 1000 + uint32_t(round), vocab);
      const auto other = randomPrompt(tokens, 5000 + uint32_t(round), vocab);
      {
        auto e = b.engine();
        stride = e->kv().blockStrideBytes();
        recompute.push_back(ttft(*e, 1, prompt, &cachedRecompute));
        ttft(*e, 2, other, &cachedCold);  // evicts the prompt: its blocks demote to host
        host.push_back(ttft(*e, 3, prompt, &cachedHost));
        int cachedRegion = 0;  // the floor: every block in the region, one token computed
        regionHit.push_back(ttft(*e, 4, prompt, &cachedRegion));
        e->kvTiers()->disk()->drain(std::chrono::seconds(60));
        e->pollKvTiers();
      }
      // A new engine over the same directory: a restarted worker, the region and host empty.
      {
        auto e = b.engine();
        diskWarm.push_back(ttft(*e, 1, prompt, &cachedDisk));
      }
      {
        auto e = b.engine();
        files.clear();
        for (const auto& f : fs::recursive_directory_iterator(diskDir))
          if (f.path().extension() == ".kvb") files.push_back(f.path());
        for (const auto& f : files) {  // out of the page cache: what a cold disk costs
          int fd = ::open(f.c_str(), O_RDONLY);
          if (fd >= 0) {
            ::fdatasync(fd);
            ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            ::close(fd);
          }
        }
        diskCold.push_back(ttft(*e, 1, prompt, &cachedDisk));
      }
    }
    // Ceilings over the bytes one promotion moves: memcpy host -> host, and reading the
    // prompt's block files from the page cache.
    const size_t bytes = size_t(promptBlocks) * stride;
    std::vector<uint8_t> src(bytes, 1), dst(bytes, 0);
    std::memcpy(dst.data(), src.data(), bytes);  // fault both in
    std::vector<double> copyMs;
    for (int i = 0; i < 5; ++i) {
      const auto t = Steady::now();
      std::memcpy(dst.data(), src.data(), bytes);
      copyMs.push_back(msSince(t));
    }
    if (files.size() > size_t(promptBlocks)) files.resize(size_t(promptBlocks));  // one prompt's worth
    std::vector<char> buf(stride + 4096);
    std::vector<double> readRuns;
    size_t read = 0;
    for (int i = 0; i < 5; ++i) {
      read = 0;
      const auto t = Steady::now();
      for (const auto& f : files) {
        FILE* fp = std::fopen(f.c_str(), "rb");
        if (!fp) continue;
        read += std::fread(buf.data(), 1, buf.size(), fp);
        std::fclose(fp);
      }
      readRuns.push_back(msSince(t));
    }
    const double readMs = median(readRuns);
    const double mib = double(bytes) / (1 << 20);
    std::printf(
        "kv_tiers_bench: %d-token prompt, %d blocks of 16 tokens promoted = %.1f MiB of KV; %d threads; "
        "median of %d rounds\n",
        tokens, promptBlocks, mib, threads, rounds);
    std::printf("%-34s %10s %14s\n", "case", "TTFT ms", "cached tokens");
    std::printf("%-34s %10.1f %14d\n", "recomputed (cold)", median(recompute), cachedRecompute);
    std::printf("%-34s %10.1f %14d\n", "region hit (the floor)", median(regionHit), cachedHost);
    std::printf("%-34s %10.1f %14d\n", "promoted from host (+ demoting", median(host), cachedHost);
    std::printf("%-34s\n", "  the blocks it evicts)");
    std::printf("%-34s %10.1f %14d\n", "promoted from disk (page cache)", median(diskWarm), cachedDisk);
    std::printf("%-34s %10.1f %14d\n", "promoted from disk (fadvise drop)", median(diskCold), cachedDisk);
    std::printf(
        "ceiling: memcpy of %.1f MiB: %.2f ms (%.1f GB/s); reading the %zu block files (page cache): "
        "%.2f ms (%.1f GB/s)\n",
        mib, median(copyMs), double(bytes) / median(copyMs) / 1e6, files.size(), readMs, double(read) / readMs / 1e6);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "kv_tiers_bench: %s\n", ex.what());
    return 1;
  }
  fs::remove_all(diskDir);
  return 0;
}
