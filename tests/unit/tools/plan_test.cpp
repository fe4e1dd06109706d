// `pdserve plan`'s simulator (tools/plan): the cost model by hand, one request through the
// real engine matching the cost model step by step, determinism, and the layout search.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <catch2/catch.hpp>

#include "engine/model_maker.h"
#include "engine/model_weights.h"
#include "tools/plan/calibrate.h"
#include "tools/plan/plan_report.h"
#include "tools/plan/planner.h"

using namespace pd::plan;
namespace engine = pd::engine;

namespace {

CostModel h100(const char* model = "llama-3-8b", int tp = 1) {
  auto m = findModel(model);
  REQUIRE(m.ok());
  auto g = findGpu("h100-sxm");
  REQUIRE(g.ok());
  return CostModel(*m, deviceOf(*g), tp);
}

std::vector<int32_t> promptOf(int n, int salt = 0) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 100 + (salt * 997) % 60000);
  return p;
}

double stepOf(const CostModel& c, int tokens, int startPos) {
  engine::SeqChunk ch;
  ch.numTokens = tokens;
  ch.startPos = startPos;
  ch.wantLogits = true;
  return c.stepSeconds(std::span<const engine::SeqChunk>(&ch, 1));
}

}  // namespace

TEST_CASE("plan: the cost model is the roofline of the step, by hand") {
  const CostModel c = h100();
  const auto& m = c.model().config;           // Llama-3-8B: 32 layers, 4096 hidden, 8 KV heads of 128
  REQUIRE(c.model().params() == 8030261248);  // the published 8.03B
  // One decode token at position 0: memory bound, the weights (and 1 token of KV) once.
  const double linear = 32.0 * (4096.0 * (4096 + 2 * 1024) + 4096.0 * 4096 + 3 * 4096.0 * 14336);
  const double flops = 2 * linear + 4.0 * 32 * 4096 * 1 + 2.0 * 4096 * 128256;
  const double bytes = 8030261248.0 * 2 + 1 * 2.0 * 32 * 1024 * 2;
  const double expected = 1e-3 + std::max(flops / (989e12 * 0.6), bytes / (3350e9 * 0.8));
  CHECK(stepOf(c, 1, 0) == Approx(expected).epsilon(1e-12));
  CHECK(m.numLayers == 32);
  // A 4,096-token prefill is compute bound: more than 100x the decode step.
  CHECK(stepOf(c, 4096, 0) > 5 * stepOf(c, 1, 0));
  // KV transfer: 128 KiB per token of Llama-3-8B; over 50 GB/s with no prefill to hide
  // behind, the whole; behind a long prefill, only the last layer.
  CHECK(c.model().kvBytesPerToken() == 131072);
  CHECK(c.kvTransferSeconds(1000, 50e9, 0) == Approx(1000 * 131072 / 50e9));
  CHECK(c.kvTransferSeconds(1000, 50e9, 10) == Approx(1000 * 131072 / 50e9 / 32));
}

TEST_CASE("plan: tensor parallelism only where the weights need it") {
  SimOptions so;
  CHECK(fittingTensorParallel(h100().model(), h100().device(), so, 8192) == 1);
  CHECK(fittingTensorParallel(h100("llama-3-70b").model(), h100().device(), so, 8192) == 2);
  auto l40s = findGpu("l40s");
  REQUIRE(l40s.ok());
  CHECK(fittingTensorParallel(h100("llama-3-70b").model(), deviceOf(*l40s), so, 8192) == 4);
}

TEST_CASE("plan: one colocated request is the cost model's steps through the real engine") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{0, 1, 1, 256};
  so.sloSizedPrefillChunks = false;
  const std::vector<SimRequest> one = {{0.5, promptOf(200), 4}};
  auto r = simulate(c, so, one);
  REQUIRE(r.ok());
  const RequestOutcome& o = r->outcomes.at(0);
  REQUIRE(o.finished);
  CHECK_FALSE(o.disaggregated);
  // Prefill of 200 tokens yields the first token; each decode step one more.
  CHECK(o.ttftS == Approx(stepOf(c, 200, 0)).epsilon(1e-6));
  REQUIRE(o.itlsS.size() == 3);
  for (int k = 0; k < 3; ++k) CHECK(o.itlsS[size_t(k)] == Approx(stepOf(c, 1, 200 + k)).epsilon(1e-6));
  CHECK(r->summary.good == 1);
  CHECK(r->summary.steps == 4);
}

TEST_CASE("plan: a long prompt is prefilled remotely and its KV moved before the first token") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{1, 1, 1, 256};
  so.kvLinkBytesPerS = 1e9;  // slow enough that the transfer is not hidden by the prefill
  const std::vector<SimRequest> one = {{0, promptOf(2000), 3}};
  auto r = simulate(c, so, one);
  REQUIRE(r.ok());
  const RequestOutcome& o = r->outcomes.at(0);
  REQUIRE(o.finished);
  CHECK(o.disaggregated);
  const double prefill = stepOf(c, 2000, 0);
  CHECK(o.ttftS == Approx(prefill + c.kvTransferSeconds(2000, 1e9, prefill)).epsilon(1e-6));
  REQUIRE(o.itlsS.size() == 2);
  CHECK(o.itlsS[0] == Approx(stepOf(c, 1, 2000)).epsilon(1e-6));
}

TEST_CASE("plan: a long prompt whose prefix the decode worker holds stays there, as the exact index routes it") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{1, 1, 1, 256};
  const std::vector<int32_t> first = promptOf(1000);
  std::vector<int32_t> follow = first;  // the same conversation, one turn on
  for (int i = 0; i < 100; ++i) follow.push_back(50000 + i);
  const std::vector<SimRequest> turns = {{0, first, 4}, {5, follow, 4}, {10, promptOf(1100, 7), 4}};
  auto r = simulate(c, so, turns);
  REQUIRE(r.ok());
  CHECK(r->outcomes[0].disaggregated);        // 1,000 tokens: to the prefill worker
  CHECK_FALSE(r->outcomes[1].disaggregated);  // 100 uncached tokens on the decode worker
  CHECK(r->outcomes[2].disaggregated);        // 1,100 new tokens
  // Without the prefix cache the router has nothing to route on.
  so.scheduler.enablePrefixCaching = false;
  auto plain = simulate(c, so, turns);
  REQUIRE(plain.ok());
  CHECK(plain->outcomes[1].disaggregated);
}

TEST_CASE("plan: the simulation is deterministic, and overload shows in the SLOs") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{1, 1, 1, 512};
  so.slo = Slo{0.5, 0.05, 99};
  so.overloadShedding = false;  // every request served, however late
  std::vector<SimRequest> rs;
  for (int i = 0; i < 300; ++i) rs.push_back({0.01 * i, promptOf(100 + (i * 37) % 3000, i), 20 + i % 50});
  auto a = simulate(c, so, rs);
  auto b = simulate(c, so, rs);
  INFO(a.status().toString());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->summary.finished == 300);
  for (size_t i = 0; i < rs.size(); ++i) {
    CHECK(a->outcomes[i].ttftS == b->outcomes[i].ttftS);
    CHECK(a->outcomes[i].itlsS == b->outcomes[i].itlsS);
  }
  // 300 requests in 3 s, up to 3,000-token prompts, on one prefill worker: TTFT piles up.
  CHECK(a->summary.ttftP99 > a->summary.ttftP50);
  CHECK(a->summary.attainment < 1.0);
}

TEST_CASE("plan: the router's admission control sheds in the simulation, and a shed request is a miss") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{1, 1, 1, 512};
  so.slo = Slo{0.5, 0.05, 99};
  std::vector<SimRequest> rs;
  for (int i = 0; i < 300; ++i) rs.push_back({0.01 * i, promptOf(100 + (i * 37) % 3000, i), 20 + i % 50});
  so.overloadShedding = false;
  auto all = simulate(c, so, rs);
  so.overloadShedding = true;
  auto shedding = simulate(c, so, rs);
  REQUIRE(all.ok());
  REQUIRE(shedding.ok());
  const SimSummary& a = all->summary;
  const SimSummary& s = shedding->summary;
  CHECK(a.shed == 0);
  CHECK(a.finished == 300);
  // The prefill worker's queue passes the 0.5 s target within the first second: admission
  // refuses what would wait past it, so those admitted get their first token in time.
  CHECK(s.shed > 20);
  CHECK(s.finished + s.shed == 300);
  CHECK(s.ttftP99 < a.ttftP99);
  CHECK(s.ttftP90 < so.slo.ttftS);
  int64_t shedCounted = 0;
  for (const auto& o : shedding->outcomes) {
    shedCounted += o.shed;
    if (o.shed) CHECK_FALSE(o.finished);
  }
  CHECK(shedCounted == s.shed);
  CHECK(s.attainment == Approx(double(s.good) / 300));
}

TEST_CASE("plan: the router's autoscaler starts workers under load and drains them when it passes") {
  const CostModel c = h100();
  SimOptions so;
  so.layout = Layout{1, 1, 1, 256};  // the minimum: where the pools start
  so.slo = Slo{1.0, 0.05, 99};
  Autoscaling as;
  as.minPrefill = 1, as.maxPrefill = 4, as.minDecode = 1, as.maxDecode = 4;
  as.startupS = 20;
  so.autoscaling = as;
  // 120 s at 40 requests/s of 2,000-token prompts (about 3 prefill workers' work), then one
  // request every 5 s for 5 minutes: the pools grow, then shrink back.
  std::vector<SimRequest> rs;
  for (int i = 0; i < 4800; ++i) rs.push_back({0.025 * i, promptOf(2000, i), 50});
  for (int i = 0; i < 60; ++i) rs.push_back({120.0 + 5 * i, promptOf(2000, 5000 + i), 50});
  auto r = simulate(c, so, rs);
  REQUIRE(r.ok());
  const SimSummary& m = r->summary;
  CHECK(m.workersStarted >= 2);
  CHECK(m.workersDrained >= 1);
  CHECK(m.peakDevices > 2);
  CHECK(m.peakDevices <= 8);
  CHECK(m.meanDevices > 2);
  CHECK(m.meanDevices < m.peakDevices);
  CHECK(m.deviceSeconds == Approx(m.meanDevices * m.durationS));
  // The same inputs, the same decisions.
  auto again = simulate(c, so, rs);
  REQUIRE(again.ok());
  CHECK(again->summary.deviceSeconds == m.deviceSeconds);
  CHECK(again->summary.good == m.good);
  // A fixed 1P + 1D over the same trace holds 2 devices throughout, and meets fewer SLOs.
  so.autoscaling.reset();
  auto fixed = simulate(c, so, rs);
  REQUIRE(fixed.ok());
  CHECK(fixed->summary.meanDevices == Approx(2));
  CHECK(fixed->summary.peakDevices == 2);
  CHECK(fixed->summary.good < m.good);
}

TEST_CASE("plan: the search ranks every layout and names why the others lose") {
  auto m = findModel("llama-3-8b");
  auto g = findGpu("a100-80gb");
  REQUIRE(m.ok());
  REQUIRE(g.ok());
  PlanOptions po;
  po.devices = 2;
  po.bisections = 2;
  po.thresholds = {512};
  po.sim.slo = Slo{1.0, 0.05, 99};
  RequestSource source = [](double rate) -> pd::Result<std::vector<SimRequest>> {
    std::vector<SimRequest> rs;
    const double gap = rate > 0 ? 1.0 / rate : 0.2;
    for (int i = 0; i < 40; ++i) rs.push_back({gap * i, promptOf(64 + (i * 211) % 2000, i), 32});
    return rs;
  };
  auto ranked = searchLayouts(*m, deviceOf(*g), po, source);
  INFO(ranked.status().toString());
  REQUIRE(ranked.ok());
  REQUIRE(ranked->size() == 2);  // colocated x2, 1P + 1D
  CHECK(ranked->front().verdict == "best");
  CHECK(ranked->front().maxRate >= ranked->back().maxRate);
  CHECK(ranked->front().maxRate > 0);
  CHECK_FALSE(ranked->back().verdict.empty());
  // The attainment curve: every rate simulated, by rate, and the max rate's point on it.
  for (const Candidate& c : *ranked) {
    REQUIRE(c.curve.size() >= 2);
    for (size_t i = 1; i < c.curve.size(); ++i) CHECK(c.curve[i - 1].rate < c.curve[i].rate);
    const auto at =
        std::find_if(c.curve.begin(), c.curve.end(), [&](const RatePoint& p) { return p.rate == c.maxRate; });
    REQUIRE(at != c.curve.end());
    CHECK(at->summary.attainment >= po.attainment);
    CHECK(at->summary.attainment == c.atMaxRate.attainment);
    for (const RatePoint& p : c.curve)  // the max rate is the highest that passed
      if (p.rate > c.maxRate) CHECK(p.summary.attainment < po.attainment);
  }
  PlanReportInfo info;
  info.commandLine = "pdserve plan --html <x>";
  info.attainment = po.attainment;
  const std::string html = planHtml(info, *ranked);
  CHECK(html.find("&lt;x&gt;") != std::string::npos);  // escaped
  size_t charts = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1)) ++charts;
  CHECK(charts == 3);
  for (const Candidate& c : *ranked) CHECK(html.find(c.layout.describe()) != std::string::npos);
  po.devices = 0;
  CHECK_FALSE(searchLayouts(*m, deviceOf(*g), po, source).ok());
}

TEST_CASE("plan: unknown names are refused with the known ones listed") {
  auto g = findGpu("h800");
  REQUIRE_FALSE(g.ok());
  CHECK_THAT(g.status().message(), Catch::Contains("h800") && Catch::Contains("h100-sxm, h200"));
  auto m = findModel("/nonexistent/model");
  REQUIRE_FALSE(m.ok());
  CHECK_THAT(m.status().message(), Catch::Contains("llama-3-8b"));
}

TEST_CASE("plan: a calibrated device's scale curve interpolates in log rows, flat past its ends") {
  const std::vector<Device::ScalePoint> curve = {{1, 0.8}, {4, 1.2}, {16, 1.0}};
  CHECK(scaleAt({}, 7) == 1);
  CHECK(scaleAt(curve, 0.5) == Approx(0.8));
  CHECK(scaleAt(curve, 1) == Approx(0.8));
  CHECK(scaleAt(curve, 2) == Approx(1.0));  // halfway in log between 1 and 4
  CHECK(scaleAt(curve, 4) == Approx(1.2));
  CHECK(scaleAt(curve, 8) == Approx(1.1));
  CHECK(scaleAt(curve, 1000) == Approx(1.0));
}

TEST_CASE("plan: calibration measures the real engine's steps and its file round-trips") {
  const std::string dir = "/tmp/pd_plan_test_tiny_" + std::to_string(::getpid());
  pd::engine::MakeModelOptions mo;
  mo.preset = "tiny";
  REQUIRE(pd::engine::makeModel(mo, dir).isOk());
  auto c = calibrateCpu(dir, 1);
  INFO(c.status().toString());
  REQUIRE(c.ok());
  REQUIRE(c->points.size() == 17);
  for (const auto& p : c->points) {
    CHECK(p.seconds > 0);
    CHECK(p.predicted > 0);
  }
  CHECK(c->flopsPerS > 0);
  CHECK(c->bytesPerS > 0);
  // A bigger prompt chunk takes longer, measured and fitted (points 0 and 5: 32 and 1,024
  // tokens), and so does a bigger decode batch (6 and 11: 1 and 32 streams) and one stream
  // at a longer context (12 and 15: 1,024 and 2,048 tokens).
  REQUIRE(c->points[5].tokensPerSeq == 1024);
  CHECK(c->points[5].seconds > c->points[0].seconds);
  CHECK(c->points[5].predicted > c->points[0].predicted);
  REQUIRE(c->points[11].batch == 32);
  CHECK(c->points[11].seconds > c->points[6].seconds);
  REQUIRE(c->points[15].context == 2048);
  CHECK(c->points[15].seconds > c->points[12].seconds);

  const std::string file = dir + "/calibration.json";
  REQUIRE(writeCalibration(file, *c).isOk());
  auto back = readCalibration(file);
  REQUIRE(back.ok());
  CHECK(back->flopsPerS == Approx(c->flopsPerS));
  CHECK(back->bytesPerS == Approx(c->bytesPerS));
  CHECK(back->halfRateTokens == c->halfRateTokens);
  CHECK(back->threads == 1);
  REQUIRE(back->points.size() == c->points.size());
  const Device d = deviceOf(*back, 2.5e9);
  CHECK(d.additive);
  CHECK(d.calibrated);
  CHECK(d.decodeScale.size() == 6);   // 1..32 streams (1, 4 and 8 at two contexts)
  CHECK(d.prefillScale.size() == 6);  // 32..1,024 prompt tokens
  // Scaled, the cost model gives a prompt chunk's measured time at each calibration point
  // (one point per size), and a decode batch's within the spread of its two contexts.
  ModelShape shape;
  shape.config = (*engine::loadModel(dir))->config;
  shape.weightBytes = shape.kvBytes = 4;
  const CostModel model(shape, d);
  for (const auto& p : back->points) {
    std::vector<engine::SeqChunk> batch(size_t(p.batch));
    std::vector<std::vector<int32_t>> tables(size_t(p.batch));
    for (size_t i = 0; i < batch.size(); ++i) {
      const int blocks = (p.context + p.tokensPerSeq + 15) / 16;
      tables[i].resize(size_t(blocks));
      batch[i].numTokens = p.tokensPerSeq;
      batch[i].startPos = p.context;
      batch[i].blockTable = tables[i].data();
      batch[i].numBlocks = blocks;
      batch[i].wantLogits = true;
    }
    INFO("batch " << p.batch << " tokens " << p.tokensPerSeq << " context " << p.context);
    if (p.tokensPerSeq > 1)
      CHECK(model.stepSeconds(batch) == Approx(p.seconds).epsilon(1e-6));
    else
      CHECK(model.stepSeconds(batch) == Approx(p.seconds).epsilon(0.5));
  }
  CHECK_FALSE(readCalibration(dir + "/missing.json").ok());
  {
    std::ofstream bad(dir + "/bad.json");
    bad << R"({"flops_per_s": 1e10, "bytes_per_s": 1e10, "kv_bytes_per_s": 1e10, "step_overhead_ms": 0,
               "half_rate_tokens": 0, "threads": 1, "dtype_bytes": 4, "points": [{"batch": 1}]})";
  }
  auto bad = readCalibration(dir + "/bad.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("points"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("plan: MoE presets hold every expert but a decode step reads the active ones") {
  struct Want {
    const char* name;
    double totalB, activeB;  // parameters in 1e9 (model cards: 46.7/12.9, 30.5/3.3, 235/22)
    int64_t kvBytesPerToken;
  };
  // Active: the model cards count the embedding table (paramsRead too); decodeWeightParams
  // leaves it out (a token reads one row of it).
  for (const Want& w :
       {Want{"mixtral-8x7b", 46.70, 12.88, 2 * 32 * 1024 * 2}, Want{"qwen3-30b-a3b", 30.53, 3.35, 2 * 48 * 512 * 2},
        Want{"qwen3-235b-a22b", 235.1, 22.1, 2 * 94 * 512 * 2},
        // Multi-head latent attention: (512 + 64) values per token and layer, no separate V
        // (~70 KB in bf16, against 320 KiB for Llama-3-70B). Model cards: 671 B / 37 B (the
        // 14 B multi-token-prediction module not counted here) and 1.04 T / 32 B.
        Want{"deepseek-v3", 671.0, 37.5, 61 * 576 * 2}, Want{"kimi-k2", 1026.4, 32.9, 61 * 576 * 2}}) {
    INFO(w.name);
    auto m = findModel(w.name);
    REQUIRE(m.ok());
    const auto& c = m->config;
    const double embed = double(c.vocabSize) * c.hiddenSize;
    CHECK(double(m->params()) / 1e9 == Approx(w.totalB).epsilon(0.01));
    CHECK(m->paramsRead(1) / 1e9 == Approx(w.activeB).epsilon(0.01));
    CHECK(double(c.decodeWeightParams()) == Approx(m->paramsRead(1) - embed).epsilon(1e-9));
    CHECK(m->kvBytesPerToken() == w.kvBytesPerToken);
    // Many tokens touch every expert: the whole model is read.
    CHECK(m->paramsRead(4096) == Approx(double(m->params())).epsilon(1e-6));
    CHECK(m->paramsRead(8) > m->paramsRead(1));
  }
  // Mixtral-8x7B's 93 GB of bf16 experts need two H100s; a batch-1 decode step on them costs
  // its active bytes, not all of them.
  SimOptions so;
  CHECK(fittingTensorParallel(h100("mixtral-8x7b").model(), h100().device(), so, 8192) == 2);
  const CostModel moe = h100("mixtral-8x7b", 2);
  CHECK(stepOf(moe, 1, 0) < 0.5 * (1e-3 + 46.7e9 * 2 / (3350e9 * 0.8) / 2));
}
