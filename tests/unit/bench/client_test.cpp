// The bench client against a scripted loopback server: measured TTFT and gaps against the
// scripted delays, token counts, error surfacing, and 1,000 concurrent streams on one thread.
#include "tools/bench/client.h"

#include <chrono>
#include <cmath>

#include <catch2/catch.hpp>

#include "tests/unit/bench/fake_openai_server.h"
#include "tools/bench/multiturn.h"
#include "tools/bench/stats.h"
#include "tools/bench/workload.h"

using namespace pd::bench;
using pd::bench::testing::FakeOpenAiServer;

namespace {

ClientOptions clientFor(const FakeOpenAiServer& s, Endpoint ep = Endpoint::kCompletions) {
  ClientOptions c;
  auto t = parseServerUrl("http://127.0.0.1:" + std::to_string(s.port()) + "/v1");
  REQUIRE(t.ok());
  c.server = *t;
  c.endpoint = ep;
  c.requestTimeoutS = 30;
  c.idleTimeoutS = 10;
  c.connectTimeoutS = 5;
  return c;
}

Workload fixedWorkload(int64_t n, int64_t prompt, int64_t output, int64_t warmup = 0) {
  WorkloadOptions o;
  o.promptLen = *parseLengthSpec(std::to_string(prompt), "p");
  o.outputLen = *parseLengthSpec(std::to_string(output), "o");
  o.numRequests = n;
  o.warmup = warmup;
  auto w = buildWorkload(o);
  REQUIRE(w.ok());
  return std::move(w).value();
}

RunOptions runOpts(BodyOptions& body, int64_t concurrency) {
  RunOptions r;
  r.maxConcurrency = concurrency;
  r.makeBody = [&body](const PlannedRequest& p) { return buildRequestBody(p, body); };
  return r;
}

BodyOptions bodyFor(const std::string& model, const std::string& script, Endpoint ep = Endpoint::kCompletions) {
  BodyOptions b;
  b.model = model;
  b.endpoint = ep;
  b.ids = {10, 246};
  b.extraJson = script;
  return b;
}

}  // namespace

TEST_CASE("URLs parse into host, port and prefix", "[bench][client]") {
  auto a = parseServerUrl("http://localhost:8000/v1/");
  REQUIRE(a.ok());
  CHECK(a->host == "localhost");
  CHECK(a->port == "8000");
  CHECK(a->basePath.empty());
  auto b = parseServerUrl("10.0.0.2:9/openai");
  REQUIRE(b.ok());
  CHECK(b->basePath == "/openai");
  CHECK_FALSE(parseServerUrl("https://x").ok());
  CHECK_FALSE(parseServerUrl("http://x:99999").ok());
}

TEST_CASE("measured TTFT and gaps follow the scripted delays", "[bench][client]") {
  FakeOpenAiServer server;
  const ClientOptions c = clientFor(server);
  auto models = fetchModels(c, 5);
  REQUIRE(models.ok());
  CHECK(models->httpStatus == 200);
  CHECK(models->ids == std::vector<std::string>{"test-model"});

  const Workload w = fixedWorkload(12, 33, 20, /*warmup=*/2);
  BodyOptions body = bodyFor("test-model", R"({"test_ttft_ms": 60, "test_itl_ms": 15})");
  auto out = runLoad(c, w, runOpts(body, 4));
  REQUIRE(out.ok());
  CHECK(out->abortReason.empty());
  CHECK(out->warmups.size() == 2);
  REQUIRE(out->records.size() == 12);
  std::vector<double> ttft, gaps;
  for (const auto& r : out->records) {
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.httpStatus == 200);
    CHECK(r.outputTokens == 20);
    CHECK(r.chunkTokens == 20);
    CHECK(r.promptTokens == 33);   // usage.prompt_tokens echoed by the server
    CHECK(r.itlsMs.size() == 19);  // tokens - 1
    CHECK(r.finishReason == "length");
    CHECK(r.ttftMs >= 59.0);
    CHECK(r.e2eMs >= r.ttftMs);
    ttft.push_back(r.ttftMs);
    gaps.insert(gaps.end(), r.itlsMs.begin(), r.itlsMs.end());
  }
  // Scripted: 60 ms to the first token, 15 ms between tokens. Loopback adds well under a
  // millisecond; timers never fire early, so the lower bounds are tight and the upper ones
  // absorb a busy CI machine (2 cores shared by many builds).
  CHECK(percentile(ttft, 50) >= 59.0);
  CHECK(percentile(ttft, 50) <= 60 + 25);
  CHECK(percentile(gaps, 50) >= 13.0);
  CHECK(percentile(gaps, 50) <= 15 + 8);
  CHECK(summarize(gaps).mean >= 14.0);
  CHECK(summarize(gaps).mean <= 15 + 8);
  const Aggregate a = aggregate(out->records, out->durationS, *parseSlo("ttft_ms=200,itl_ms=100"));
  CHECK(a.completed == 12);
  CHECK(a.totalOutputTokens == 240);
  CHECK(a.maxConcurrentRequests <= 4);
  CHECK(a.goodRequests == 12);
  // 12 requests, 4 at a time, ~345 ms each: about three waves.
  CHECK(out->durationS >= 3 * 0.345 - 0.05);
  CHECK(out->durationS <= 3 * 0.345 + 1.0);
  // Connections are kept alive and reused: 14 requests over at most 4 sockets (+1 for the
  // model list).
  CHECK(server.requestsServed() == 1 + 14);
  CHECK(server.connectionsAccepted() <= 1 + 4);
}

TEST_CASE("multi-token chunks and chat streams are accounted per token", "[bench][client]") {
  FakeOpenAiServer server;
  {
    const Workload w = fixedWorkload(3, 8, 10);
    BodyOptions body = bodyFor("test-model", R"({"test_ttft_ms": 10, "test_itl_ms": 10, "test_chunk": 3})");
    auto out = runLoad(clientFor(server), w, runOpts(body, 0));
    REQUIRE(out.ok());
    for (const auto& r : out->records) {
      REQUIRE(r.ok);
      CHECK(r.outputTokens == 10);
      REQUIRE(r.itlsMs.size() == 9);
      int zeros = 0;
      for (double g : r.itlsMs) zeros += g == 0;
      CHECK(zeros == 6);  // chunks of 3,3,3,1: two zero gaps in each of the first three
    }
  }
  {
    const Workload w = fixedWorkload(2, 8, 6);
    BodyOptions body = bodyFor("test-model", R"({"test_ttft_ms": 30, "test_itl_ms": 5})", Endpoint::kChat);
    auto out = runLoad(clientFor(server, Endpoint::kChat), w, runOpts(body, 0));
    REQUIRE(out.ok());
    for (const auto& r : out->records) {
      REQUIRE(r.ok);
      CHECK(r.outputTokens == 6);
      CHECK(r.itlsMs.size() == 5);
      CHECK(r.ttftMs >= 29);  // the role chunk, sent at once, is not the first token
    }
  }
}

TEST_CASE("error statuses and bodies are surfaced", "[bench][client]") {
  FakeOpenAiServer server;
  SECTION("a refused model stops the run with the status and body") {
    const Workload w = fixedWorkload(200, 8, 4);
    BodyOptions body = bodyFor("no-such-model", "");
    auto out = runLoad(clientFor(server), w, runOpts(body, 2));
    REQUIRE(out.ok());
    CHECK_THAT(out->abortReason, Catch::Contains("HTTP 404") && Catch::Contains("does not exist"));
    CHECK(out->records.size() < 200);
    REQUIRE_FALSE(out->records.empty());
    CHECK(out->records[0].httpStatus == 404);
    CHECK_THAT(out->records[0].error, Catch::Contains("model_not_found"));
  }
  SECTION("overload is recorded per request, and the run goes on") {
    const Workload w = fixedWorkload(5, 8, 4);
    BodyOptions body = bodyFor("busy", "");
    auto out = runLoad(clientFor(server), w, runOpts(body, 0));
    REQUIRE(out.ok());
    CHECK(out->abortReason.empty());
    REQUIRE(out->records.size() == 5);
    const Aggregate a = aggregate(out->records, out->durationS, Slo{});
    CHECK(a.failed == 5);
    CHECK(a.errorsByKind.at("HTTP 503") == 5);
    CHECK_THAT(out->records[4].error, Catch::Contains("all workers are busy"));
  }
  SECTION("an error event inside the stream fails the request") {
    const Workload w = fixedWorkload(2, 8, 10);
    BodyOptions body = bodyFor("test-model", R"({"test_ttft_ms": 5, "test_itl_ms": 1, "test_fail_after": 4})");
    auto out = runLoad(clientFor(server), w, runOpts(body, 0));
    REQUIRE(out.ok());
    for (const auto& r : out->records) {
      CHECK_FALSE(r.ok);
      CHECK(r.httpStatus == 200);
      CHECK(r.error == "stream error: scripted failure");
      CHECK(r.chunkTokens == 4);
    }
  }
  SECTION("a server that is not there") {
    ClientOptions c = clientFor(server);
    c.server.port = "1";
    const Workload w = fixedWorkload(2, 8, 4);
    BodyOptions body = bodyFor("test-model", "");
    auto out = runLoad(c, w, runOpts(body, 0));
    REQUIRE(out.ok());
    for (const auto& r : out->records) {
      CHECK_FALSE(r.ok);
      CHECK_THAT(r.error, Catch::Contains("connect") && Catch::Contains("127.0.0.1:1"));
    }
    auto m = fetchModels(c, 2);
    REQUIRE_FALSE(m.ok());
    CHECK_THAT(m.status().message(), Catch::Contains("cannot connect"));
  }
}

TEST_CASE("one thousand concurrent streams on one generator thread", "[bench][client]") {
  FakeOpenAiServer server;
  const Workload w = fixedWorkload(1000, 16, 8);
  // Every stream stays open >= 300 ms + 7 x 30 ms, so all 1,000 overlap.
  BodyOptions body = bodyFor("test-model", R"({"test_ttft_ms": 300, "test_itl_ms": 30})");
  const auto t0 = std::chrono::steady_clock::now();
  auto out = runLoad(clientFor(server), w, runOpts(body, 0));
  const double wallS = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(out.ok());
  REQUIRE(out->records.size() == 1000);
  int64_t ok = 0;
  for (const auto& r : out->records) {
    ok += r.ok;
    if (r.ok) CHECK(r.itlsMs.size() == 7);
  }
  CHECK(ok == 1000);
  const Aggregate a = aggregate(out->records, out->durationS, Slo{});
  CHECK(a.completed == 1000);
  CHECK(a.maxConcurrentRequests >= 900);
  CHECK(server.peakOpenStreams() >= 900);
  CHECK(wallS < 20);
  WARN("1000 streams: wall " << wallS << " s, generator lag mean " << a.lagMeanMs << " ms, max " << a.lagMaxMs
                             << " ms, TTFT p50 " << a.ttft.median << " ms, ITL p99 " << a.itl.p99 << " ms");
}

#ifdef PD_PDSERVE_BIN
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

TEST_CASE("the pdserve bench command against the scripted server", "[bench][client][cli]") {
  FakeOpenAiServer server;
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("pd_bench_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string out = (dir / "run").string();
  const std::string url = "http://127.0.0.1:" + std::to_string(server.port());
  const std::string bin = PD_PDSERVE_BIN;
  // The same flow as the cluster's end-to-end test: run, then check the result's invariants.
  const std::string cmd = bin + " bench --url " + url +
                          " --prompt-len uniform:20:60 --output-len uniform:4:12 --num-requests 30 --rate 200"
                          " --concurrency 8 --warmup 2 --seed 3 --slo ttft_ms=500,itl_ms=200 --no-progress"
                          " --extra-body '{\"test_ttft_ms\": 5, \"test_itl_ms\": 2}' --out " +
                          out + " > " + out + ".stdout 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  CHECK(std::system((bin + " bench check " + out + ".json > /dev/null").c_str()) == 0);
  std::ifstream in(out + ".json");
  std::stringstream ss;
  ss << in.rdbuf();
  const auto j = nlohmann::json::parse(ss.str());
  CHECK(j["model_id"] == "test-model");  // picked from GET /v1/models
  CHECK(j["completed"] == 30);
  CHECK(j["max_concurrency"] == 8);
  CHECK(j["pdserve"]["good_requests"] == 30);
  CHECK(fs::file_size(out + ".html") > 1000);
  CHECK(fs::file_size(out + ".csv") > 100);
  // A refused model: exit status 1 and the server's message on stderr.
  const std::string bad =
      bin + " bench --url " + url + " --model nope --num-requests 3 --out " + out + "-bad > " + out + ".bad 2>&1";
  CHECK(WEXITSTATUS(std::system(bad.c_str())) == 1);
  std::ifstream badIn(out + ".bad");
  std::stringstream badText;
  badText << badIn.rdbuf();
  CHECK_THAT(badText.str(), Catch::Contains("model 'nope' is not served") && Catch::Contains("test-model"));
  // A usage error: exit status 2.
  CHECK(WEXITSTATUS(std::system((bin + " bench --prompt-len gamma:1:2 > /dev/null 2>&1").c_str())) == 2);
  fs::remove_all(dir);
}
#endif

TEST_CASE("multi-turn: a next turn is sent after its previous turn, with its answer's ids", "[bench][client]") {
  FakeOpenAiServer server;
  BodyOptions body = bodyFor("test-model", R"({"test_ttft_ms": 30, "test_itl_ms": 5, "test_chunk": 2})");
  body.returnTokenIds = true;
  Workload w = fixedWorkload(3, 8, 6);
  for (auto& p : w.requests) p.scheduledS = 0;  // all due at once
  w.requests[1].parent = 0;
  w.requests[1].newTokens = 4;
  w.requests[2].parent = 1;
  w.requests[2].newTokens = 4;
  RunOptions ro = runOpts(body, 0);
  ro.turnPromptIds = [&body](const PlannedRequest& p, const RequestRecord* previous) {
    if (p.parent < 0) return promptTokenIds(p, body.ids, body.seed);
    REQUIRE(previous != nullptr);
    std::vector<int32_t> history = previous->promptIds;
    history.insert(history.end(), previous->generatedIds.begin(), previous->generatedIds.end());
    return turnPromptIds(p, history, body.ids, body.seed);
  };
  ro.makeBodyIds = [&body](const PlannedRequest& p, const std::vector<int32_t>& ids) {
    return buildRequestBodyIds(p, ids, body);
  };
  auto out = runLoad(clientFor(server), w, ro);
  REQUIRE(out.ok());
  REQUIRE(out->records.size() == 3);
  for (const auto& r : out->records) {
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.generatedIds.size() == 6);
  }
  const auto& recs = out->records;
  // Each turn waits for the one before: sent after it finished, its prompt that turn's
  // prompt and answer, then 4 new ids.
  for (size_t i = 1; i < 3; ++i) {
    CHECK(recs[i].startS >= recs[i - 1].endS);
    CHECK(recs[i].eligibleS >= recs[i - 1].endS);
    std::vector<int32_t> history = recs[i - 1].promptIds;
    history.insert(history.end(), recs[i - 1].generatedIds.begin(), recs[i - 1].generatedIds.end());
    REQUIRE(recs[i].promptIds.size() == history.size() + 4);
    CHECK(std::equal(history.begin(), history.end(), recs[i].promptIds.begin()));
  }
  CHECK(recs[0].promptIds.size() == 8);
}
