// Benchmark (not a ctest test): how much streaming the generator's one thread sustains.
//
// Ceiling: SSE decoding + token accounting alone on one core (no network), in chunks/s.
// Run: the generator against the scripted loopback server (its own thread) with S concurrent
// streams, each T tokens at a fixed gap; reports the chunks/s handled, the generator thread's
// CPU use (getrusage RUSAGE_THREAD), its start lag, and measured ITL against the scripted gap.
//
//   build/tests/unit/bench/bench_generator [streams=1000] [tokens=50] [itl_ms=20]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/base/cli.h"
#include "tests/unit/bench/fake_openai_server.h"
#include "tools/bench/client.h"
#include "tools/bench/sse.h"
#include "tools/bench/stats.h"
#include "tools/bench/workload.h"

using namespace pd::bench;

namespace {

double threadCpuS() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

double ceilingChunksPerS() {
  std::string chunk =
      "data: {\"id\":\"c1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"t\","
      "\"finish_reason\":null}]}\n\n";
  std::string stream;
  const int kChunks = 2000;
  for (int i = 0; i < kChunks; ++i) stream += chunk;
  const int kRounds = 50;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  for (int r = 0; r < kRounds; ++r) {
    SseDecoder d;
    StreamAccounting a(false);
    std::vector<SseEvent> ev;
    // Fed in 200-byte reads, about one chunk each, as a socket delivers them.
    for (size_t off = 0; off < stream.size(); off += 200) {
      ev.clear();
      d.feed(std::string_view(stream).substr(off, 200), &ev);
      for (const auto& e : ev) a.onEvent(e, static_cast<double>(off));
    }
    tokens += a.chunkTokens();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(tokens) / s;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t streams = 1000, tokens = 50;
  double itlMs = 20;
  CLI::App app{
      "bench_generator: the load generator's chunks/s against a fake server, next to "
      "its ceiling",
      "bench_generator"};
  pd::cli::configure(app);
  app.add_option("streams", streams, "concurrent streams")->capture_default_str();
  app.add_option("tokens", tokens, "tokens per stream")->capture_default_str();
  app.add_option("itl_ms", itlMs, "the fake server's inter-token gap in ms")->capture_default_str();
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;

  const double ceiling = ceilingChunksPerS();
  std::printf("ceiling: SSE decode + accounting on one core: %.0f chunks/s\n", ceiling);

  pd::bench::testing::FakeOpenAiServer server;
  WorkloadOptions wo;
  wo.promptLen = *parseLengthSpec("64", "p");
  wo.outputLen = *parseLengthSpec(std::to_string(tokens), "o");
  wo.numRequests = streams;
  auto w = buildWorkload(wo);
  if (!w.ok()) return 1;
  ClientOptions c;
  c.server = *parseServerUrl("http://127.0.0.1:" + std::to_string(server.port()));
  BodyOptions body;
  body.model = "test-model";
  body.ids = {10, 246};
  body.extraJson = "{\"test_ttft_ms\": 100, \"test_itl_ms\": " + std::to_string(itlMs) + "}";
  RunOptions ro;
  ro.makeBody = [&](const PlannedRequest& p) { return buildRequestBody(p, body); };
  const double cpu0 = threadCpuS();
  const auto t0 = std::chrono::steady_clock::now();
  auto out = runLoad(c, *w, ro);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = threadCpuS() - cpu0;
  if (!out.ok()) {
    std::fprintf(stderr, "%s\n", out.status().toString().c_str());
    return 1;
  }
  const Aggregate a = aggregate(out->records, out->durationS, Slo{});
  const double offered = static_cast<double>(streams) * 1000.0 / itlMs;
  std::printf("run: %lld streams x %lld tokens, scripted gap %.1f ms (offered %.0f chunks/s while all stream)\n",
              static_cast<long long>(streams), static_cast<long long>(tokens), itlMs, offered);
  std::printf("  completed %lld/%lld, peak concurrent %lld, wall %.2f s\n", static_cast<long long>(a.completed),
              static_cast<long long>(streams), static_cast<long long>(a.maxConcurrentRequests), wall);
  std::printf("  handled %.0f chunks/s; generator thread CPU %.2f s = %.0f%% of one core (ceiling %.0f chunks/s)\n",
              static_cast<double>(a.totalOutputTokens) / wall, cpu, 100.0 * cpu / wall, ceiling);
  std::printf("  start lag mean %.2f ms, max %.2f ms; ITL p50 %.2f ms, p99 %.2f ms (scripted %.1f)\n", a.lagMeanMs,
              a.lagMaxMs, a.itl.median, a.itl.p99, itlMs);
  return a.completed == streams ? 0 : 1;
}
