// Greedy runs of one request through an engine::Engine, for tests that compare a prompt served
// from the KV cache or its tiers (a warm run) with its cold recompute: the ids generated and
// how many prompt tokens came from the cache. Used on the cpu backend (engine_tiers_test.cpp)
// and on cuda (tests/kernels/cuda_kv_tiers_test.cpp). Test-only: it REQUIREs on failure.
#pragma once

#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/engine.h"

namespace pd::engine::test {

// A prompt of `n` ids below `vocabSize`, the same for the same seed.
inline std::vector<int32_t> tierPrompt(int seed, int n, int vocabSize) {
  std::vector<int32_t> p(static_cast<size_t>(n), 0);
  for (int i = 0; i < n; ++i) p[size_t(i)] = (seed * 131 + i * 37 + i * i) % vocabSize;
  return p;
}

struct GreedyRun {
  std::vector<int32_t> ids;
  int cachedTokens = 0;
};

// Submits `prompt` as request `id` (greedy, 8 tokens, EOS ignored) and steps `engine` until it
// has no work. cachedTokens: the prompt tokens the finished request counted as cached (while it
// runs, the request's own count).
inline GreedyRun generateGreedy(Engine& engine, uint64_t id, const std::vector<int32_t>& prompt, int vocabSize) {
  SamplingParams p;
  p.temperature = 0;
  p.maxTokens = 8;
  p.ignoreEos = true;
  auto r = Request::create(id, prompt, p, SystemClock::instance(), vocabSize);
  REQUIRE(r.ok());
  REQUIRE(engine.submit(std::move(r).value()).isOk());
  GreedyRun out;
  for (int guard = 0; engine.hasWork() && guard < 10000; ++guard) {
    if (const Request* req = engine.find(id)) out.cachedTokens = req->numCachedPromptTokens();
    std::vector<EngineEvent> events;
    const Status st = engine.step(&events);
    INFO(st.toString());
    REQUIRE(st.isOk());
    for (auto& e : events) {
      if (e.kind == EngineEvent::Kind::kToken && e.requestId == id) out.ids.push_back(e.token.id);
      if (e.kind == EngineEvent::Kind::kFinished && e.requestId == id) out.cachedTokens = e.timings.cachedPromptTokens;
    }
  }
  REQUIRE(out.ids.size() == 8);
  return out;
}

}  // namespace pd::engine::test
