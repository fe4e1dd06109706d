// `pdserve plan`: size the prefill and decode pools for a trace and SLOs on a named GPU by
// simulating every layout with the production scheduler and routing policy
// (tools/plan/planner.h; docs/plan.md says how to read the output).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "tools/bench/workload.h"
#include "tools/commands.h"
#include "tools/plan/calibrate.h"
#include "tools/plan/plan_report.h"
#include "tools/plan/planner.h"
#include "tools/plan/step_spread.h"

namespace pd::tools {

namespace {

constexpr const char* kSummary = "size prefill/decode pools for a trace and SLOs on a named GPU (simulated)";
constexpr const char* kDetails =
    "Simulates every "
    "layout of --gpus devices (colocated; each prefill/decode split with short-prompt "
    "thresholds 256/512/1024/2048) serving the trace, with pdserve's own scheduler and router "
    "policy, and prints them best first by goodput (requests/s meeting both SLOs). Needs "
    "--trace, one of --gpu or --calibration, and --slo; or --calibrate --model DIR --out F. "
    "Progress goes to stderr.";

struct Args {
  std::map<std::string, std::string> values;
};

struct OptionHelp {
  const char* name;
  const char* help;
};

const OptionHelp kOptions[] = {
    {"--trace", "Azure LLM (CSV) or Mooncake (JSONL) trace, as pdserve bench reads it"},
    {"--gpu", "h100-sxm | h200 | a100-80gb | l40s | b200"},
    {"--model",
     "llama-3-8b (default) | llama-3-70b | llama-2-13b | qwen2.5-7b | mixtral-8x7b | qwen3-30b-a3b | "
     "qwen3-235b-a22b | deepseek-v3 | kimi-k2 | a model dir / config.json"},
    {"--slo", "ttft_ms=A,itl_ms=B[,percentile=P]: targets (percentile default 99)"},
    {"--gpus", "devices in all (default 8)"},
    {"--duration", "only the trace's first S seconds (after --time-scale)"},
    {"--time-scale", "multiply the trace's gaps by X (0.5: twice the rate)"},
    {"--num-requests",
     "only the first N requests (with --rate and no --duration: N Poisson arrivals, as "
     "pdserve bench --num-requests --rate sends them)"},
    {"--seed",
     "pdserve bench's --seed: Poisson arrivals and prompt tokens; also seeds the --step-trace "
     "draws (default 0)"},
    {"--max-prompt-tokens", "as in pdserve bench"},
    {"--length-scale", "as in pdserve bench"},
    {"--max-output-tokens", "as in pdserve bench"},
    {"--max-batch-tokens", "engine.max_batch_tokens (default 8192)"},
    {"--max-running-requests", "engine.max_running_requests (default 256)"},
    {"--kv-link-gbps", "KV link between workers, Gb/s (default: the GPU's NIC)"},
    {"--attainment", "percent of requests that must meet both SLOs (default 90)"},
    {"--layout",
     "simulate only this layout: colocated:N or NpMd (e.g. 1p1d), at the trace's arrivals or "
     "at --rate R (Poisson); prints its percentiles"},
    {"--threshold", "router.routing.short_prompt_tokens for --layout (default 256)"},
    {"--rate", "with --layout: Poisson arrivals at R requests/s"},
    {"--requests-csv",
     "with --layout: each request's simulated route (or shed), TTFT, ITL and the TTFT "
     "admission control predicted for it, one row per request in pdserve bench's order (its "
     "--out CSV's index)"},
    {"--calibration",
     "a CPU device measured by --calibrate instead of a --gpu; its workers get "
     "--kv-cache-bytes (default 268435456) and --kv-link-gbps (default 20)"},
    {"--kv-cache-bytes", "with --calibration: each worker's KV cache bytes"},
    {"--html",
     "also write the SLO-attainment curves against rate of the best layouts (every rate the "
     "search simulated) and the ranking, as one HTML page"},
    {"--autoscale",
     "with --layout: the pools follow the router's autoscaler (router.autoscaler defaults) "
     "between MIN (colocated:N or NpMd) and --layout, starting at MIN; a started worker "
     "serves after --startup-s (default 60); prints the devices held over the run"},
    {"--startup-s", "with --autoscale: seconds before a started worker serves (default 60)"},
    {"--step-trace",
     "F[,F...]: workers' step traces (logging.step_trace_dir) from a run of this device: each "
     "simulated step takes its modelled time times a measured / modelled ratio drawn from "
     "that run's steps of the same kind (docs/plan.md)"},
    {"--threads", "with --calibrate: threads (default 1)"},
    {"--out", "with --calibrate: the fitted device's file"},
};
const OptionHelp kFlags[] = {
    {"--calibrate",
     "measure the CPU backend's steps on --model DIR with --threads (default 1) and write the "
     "fitted device to --out"},
    {"--no-slo-sized-chunks", "engine.slo_sized_prefill_chunks: false (prompts in max_batch_tokens chunks)"},
    {"--no-overload-shedding",
     "router.admission.overload_shedding: false (admit every request; by default the router's admission "
     "control sheds what it predicts would miss, and a shed request counts as a miss)"},
};

Status number(const Args& a, const char* key, double* out) {
  auto it = a.values.find(key);
  if (it == a.values.end()) return Status::ok();
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end || errno || !std::isfinite(v) || v < 0)
    return invalidArgument(std::string(key) + ": '" + it->second + "' is not a non-negative number");
  *out = v;
  return Status::ok();
}

Result<plan::Slo> parseSlo(const std::string& spec) {
  plan::Slo slo;
  bool ttft = false, itl = false;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string item = spec.substr(pos, comma - pos);
    const size_t eq = item.find('=');
    char* end = nullptr;
    const double v = eq == std::string::npos ? 0 : std::strtod(item.c_str() + eq + 1, &end);
    if (eq == std::string::npos || !end || *end || !(v > 0))
      return invalidArgument("--slo: '" + item + "' is not key=positive number");
    const std::string key = item.substr(0, eq);
    if (key == "ttft_ms")
      slo.ttftS = v / 1000, ttft = true;
    else if (key == "itl_ms")
      slo.itlS = v / 1000, itl = true;
    else if (key == "percentile" && v <= 100)
      slo.percentile = v;
    else
      return invalidArgument("--slo: unknown key or value '" + item + "' (keys: ttft_ms, itl_ms, percentile)");
    pos = comma + 1;
  }
  if (!ttft || !itl) return invalidArgument("--slo: needs both ttft_ms and itl_ms");
  return slo;
}

int usageError(const Status& s) {
  std::fprintf(stderr, "pdserve plan: %s\n", s.message().c_str());
  return 2;
}

// "colocated:N" or "NpMd" (case-insensitive), e.g. "1p1d".
Result<plan::Layout> parseLayout(const char* option, std::string text, int64_t threshold) {
  for (auto& ch : text) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  plan::Layout l;
  l.shortPromptTokens = threshold;
  int p = 0, d = 0, n = 0;
  char tail = 0;
  if (std::sscanf(text.c_str(), "colocated:%d%c", &n, &tail) == 1 && n >= 1) {
    l.prefillWorkers = 0, l.decodeWorkers = n;
    return l;
  }
  if (std::sscanf(text.c_str(), "%dp%dd%c", &p, &d, &tail) == 2 && p >= 0 && d >= 1) {
    l.prefillWorkers = p, l.decodeWorkers = d;
    return l;
  }
  return invalidArgument(std::string(option) + ": '" + text + "' (expected colocated:N or NpMd, e.g. 1p1d)");
}

int runCalibrate(const Args& a) {
  if (!a.values.count("--model") || !a.values.count("--out"))
    return usageError(invalidArgument("--calibrate needs --model DIR (a model with weights) and --out FILE"));
  double threads = 1;
  if (Status s = number(a, "--threads", &threads); !s.isOk() || threads < 1)
    return usageError(invalidArgument("--threads: a positive integer"));
  const std::string dir = a.values.at("--model");
  std::fprintf(stderr, "pdserve plan --calibrate: measuring %s on %d thread(s)\n", dir.c_str(), int(threads));
  auto c = plan::calibrateCpu(dir, int(threads));
  if (!c.ok()) {
    std::fprintf(stderr, "pdserve plan: %s\n", c.status().message().c_str());
    return 1;
  }
  std::printf("%6s %8s %8s %12s %12s %8s\n", "batch", "tokens", "context", "measured ms", "fitted ms", "error");
  for (const auto& p : c->points)
    std::printf("%6d %8d %8d %12.3f %12.3f %7.1f%%\n", p.batch, p.tokensPerSeq, p.context, 1000 * p.seconds,
                1000 * p.predicted, 100 * (p.predicted - p.seconds) / p.seconds);
  std::printf(
      "fitted: %.1f GFLOP/s (half of it at %.0f tokens a step), weights %.2f GB/s, KV %.2f GB/s, %.3f ms per "
      "step (rms error %.1f%%)\n",
      c->flopsPerS / 1e9, c->halfRateTokens, c->bytesPerS / 1e9, c->kvBytesPerS / 1e9, c->stepOverheadMs,
      100 * c->rmsRelativeError);
  if (Status s = plan::writeCalibration(a.values.at("--out"), *c); !s.isOk()) {
    std::fprintf(stderr, "pdserve plan: %s\n", s.message().c_str());
    return 1;
  }
  return 0;
}

void printSummaryLine(const char* label, const plan::SimSummary& s) {
  std::printf(
      "%-10s TTFT p50/p90/p99 %7.1f %7.1f %7.1f ms | ITL p50/p90/p99 %6.1f %6.1f %6.1f ms | %lld/%lld finished, "
      "%lld shed, %.1f%% within the SLOs, %lld disaggregated\n",
      label, 1000 * s.ttftP50, 1000 * s.ttftP90, 1000 * s.ttftP99, 1000 * s.itlP50, 1000 * s.itlP90, 1000 * s.itlP99,
      (long long)s.finished, (long long)s.requests, (long long)s.shed, 100 * s.attainment, (long long)s.disaggregated);
}

// One row per simulated request, in the order pdserve bench sends them (its CSV's index).
Status writeRequestsCsv(const std::string& path, const std::vector<plan::SimRequest>& requests,
                        const std::vector<plan::RequestOutcome>& outcomes) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return invalidArgument("--requests-csv: cannot write " + path + ": " + std::strerror(errno));
  // Latencies a request has not got (unfinished, or a single token) are "-", as in bench's CSV.
  auto ms = [](bool known, double s) { return known ? std::to_string(1000 * s) : std::string("-"); };
  std::fprintf(f,
               "index,arrival_s,prompt_tokens,output_tokens,route,finished,ttft_ms,itl_p99_ms,itl_max_ms,"
               "admission_ttft_ms\n");
  for (size_t i = 0; i < requests.size() && i < outcomes.size(); ++i) {
    const plan::RequestOutcome& o = outcomes[i];
    const bool gaps = o.finished && !o.itlsS.empty();
    const double itlMax = gaps ? *std::max_element(o.itlsS.begin(), o.itlsS.end()) : 0;
    const char* route = o.shed ? "shed" : o.disaggregated ? "disaggregated" : "colocated";
    std::fprintf(f, "%zu,%.6f,%zu,%d,%s,%d,%s,%s,%s,%s\n", i, requests[i].arrivalS, requests[i].prompt.size(),
                 requests[i].outputTokens, route, o.finished ? 1 : 0, ms(o.finished, o.ttftS).c_str(),
                 ms(gaps, gaps ? plan::percentileOf(o.itlsS, 99) : 0).c_str(), ms(gaps, itlMax).c_str(),
                 ms(o.admissionTtftS >= 0, o.admissionTtftS).c_str());
  }
  if (std::fclose(f) != 0) return invalidArgument("--requests-csv: writing " + path + " failed");
  return Status::ok();
}

int runPlan(const Args& a) {
  if (a.values.count("--calibrate")) return runCalibrate(a);
  auto get = [&](const char* k, const char* def) {
    auto it = a.values.find(k);
    return it == a.values.end() ? std::string(def) : it->second;
  };
  if (!a.values.count("--trace")) return usageError(invalidArgument("--trace is required"));
  if (a.values.count("--gpu") == a.values.count("--calibration"))
    return usageError(invalidArgument("give one device: --gpu NAME or --calibration FILE"));
  if (!a.values.count("--slo")) return usageError(invalidArgument("--slo is required"));
  auto model = plan::findModel(get("--model", "llama-3-8b"));
  if (!model.ok()) return usageError(model.status());
  auto slo = parseSlo(get("--slo", ""));
  if (!slo.ok()) return usageError(slo.status());

  const bool cpu = a.values.count("--calibration") != 0;
  double gpus = cpu ? 1 : 8, duration = 0, timeScale = 1, numRequests = 0, maxPrompt = 0, lengthScale = 0,
         maxOutput = 0;
  double maxBatch = 8192, maxRunning = 256, linkGbps = cpu ? 20 : 0, attainment = 90, threshold = 256, rate = 0;
  double kvCacheBytes = cpu ? 268435456 : 0, seed = 0, startupS = 60;
  for (Status s :
       {number(a, "--gpus", &gpus), number(a, "--duration", &duration), number(a, "--time-scale", &timeScale),
        number(a, "--num-requests", &numRequests), number(a, "--max-prompt-tokens", &maxPrompt),
        number(a, "--length-scale", &lengthScale), number(a, "--max-output-tokens", &maxOutput),
        number(a, "--max-batch-tokens", &maxBatch), number(a, "--max-running-requests", &maxRunning),
        number(a, "--kv-link-gbps", &linkGbps), number(a, "--attainment", &attainment),
        number(a, "--threshold", &threshold), number(a, "--rate", &rate), number(a, "--kv-cache-bytes", &kvCacheBytes),
        number(a, "--seed", &seed), number(a, "--startup-s", &startupS)})
    if (!s.isOk()) return usageError(s);

  plan::Device device;
  std::string deviceDescription;
  if (cpu) {
    auto c = plan::readCalibration(get("--calibration", ""));
    if (!c.ok()) return usageError(c.status());
    device = plan::deviceOf(*c, linkGbps * 1e9 / 8);
    model->weightBytes = model->kvBytes = c->dtypeBytes;
    deviceDescription = device.name;
  } else {
    auto gpu = plan::findGpu(get("--gpu", ""));
    if (!gpu.ok()) return usageError(gpu.status());
    device = plan::deviceOf(*gpu);
    deviceDescription = gpu->description;
  }
  bench::WorkloadOptions w;
  w.tracePath = get("--trace", "");
  w.durationS = duration;
  w.timeScale = timeScale;
  w.numRequests = int64_t(numRequests);
  w.maxPromptTokens = int64_t(maxPrompt);
  w.lengthScale = lengthScale;
  w.maxOutputTokens = int64_t(maxOutput);
  w.seed = uint64_t(seed);
  auto traceWorkload = bench::buildWorkload(w);
  if (!traceWorkload.ok()) return usageError(traceWorkload.status());
  if (traceWorkload->requests.size() < 2) return usageError(invalidArgument("--trace: fewer than 2 requests selected"));
  const double traceSpanS = traceWorkload->requests.back().scheduledS - traceWorkload->requests.front().scheduledS;
  const int vocab = model->config.vocabSize;
  auto toSim = [vocab, &w](const bench::Workload& wl) {
    std::vector<plan::SimRequest> out;
    for (const auto& r : wl.requests) {
      plan::SimRequest s;
      s.arrivalS = r.scheduledS;
      s.prompt = bench::promptTokenIds(r, {10, vocab - 10}, w.seed);
      s.outputTokens = int(std::max<int64_t>(1, r.outputTokens));
      out.push_back(std::move(s));
    }
    return out;
  };
  // Rate 0: the trace as selected. Otherwise Poisson arrivals at `rate` for --duration (as
  // pdserve bench --rate --duration sends them), or --num-requests of them (as bench
  // --rate --num-requests), else over the selected rows' span (shorter where the trace's
  // first rows are sparse), with the trace's lengths in its order (bench's workload).
  plan::RequestSource source = [&](double rate) -> Result<std::vector<plan::SimRequest>> {
    if (rate <= 0) return toSim(*traceWorkload);
    bench::WorkloadOptions p = w;
    p.rate = rate;
    const bool counted = duration <= 0 && numRequests > 0;
    p.durationS = duration > 0 ? duration : counted ? 0 : std::max(traceSpanS, 1.0);
    p.numRequests = counted ? int64_t(numRequests) : 0;
    auto wl = bench::buildWorkload(p);
    if (!wl.ok()) return wl.status();
    return toSim(*wl);
  };
  const size_t traceRequests = traceWorkload->requests.size();

  plan::PlanOptions po;
  if (!(attainment > 0 && attainment <= 100)) return usageError(invalidArgument("--attainment: must be in (0, 100]"));
  po.devices = int(gpus);
  po.attainment = attainment / 100;
  po.sim.slo = *slo;
  po.sim.scheduler.maxBatchTokens = int(maxBatch);
  po.sim.scheduler.maxNumSeqs = int(maxRunning);
  po.sim.kvLinkBytesPerS = linkGbps * 1e9 / 8;
  po.sim.kvCacheBytes = kvCacheBytes;
  po.sim.layout.shortPromptTokens = int64_t(threshold);
  po.sim.sloSizedPrefillChunks = !a.values.count("--no-slo-sized-chunks");
  po.sim.seed = uint64_t(seed);
  po.sim.overloadShedding = !a.values.count("--no-overload-shedding");
  if (Status s = po.sim.scheduler.validate(); !s.isOk()) return usageError(s);
  std::fprintf(stderr, "pdserve plan: %zu requests (%s), %s on %s\n", traceRequests, traceWorkload->describe.c_str(),
               model->name.c_str(), deviceDescription.c_str());
  std::string costNote = device.calibrated ? "calibrated on this machine" : "uncalibrated: docs/plan.md";
  if (a.values.count("--step-trace")) {
    std::vector<std::string> paths;
    std::stringstream list(a.values.at("--step-trace"));
    for (std::string path; std::getline(list, path, ',');) paths.push_back(path);
    auto spread = plan::StepSpread::read(paths, plan::CostModel(*model, device, 1));
    if (!spread.ok()) return usageError(spread.status());
    std::printf("steps: %zu measured in %zu trace(s), measured / modelled by kind:\n%s", spread->rows(), paths.size(),
                spread->describe().c_str());
    po.sim.stepSpread = std::make_shared<const plan::StepSpread>(std::move(*spread));
    costNote += ", steps spread as measured";
  }

  if (a.values.count("--layout")) {
    if (a.values.count("--html"))
      return usageError(invalidArgument("--html draws the layout search's curves; it does not go with --layout"));
    auto layout = parseLayout("--layout", get("--layout", ""), int64_t(threshold));
    if (!layout.ok()) return usageError(layout.status());
    auto requests = source(rate);
    if (!requests.ok()) return usageError(requests.status());
    plan::SimOptions so = po.sim;
    so.layout = *layout;
    if (a.values.count("--autoscale")) {
      auto lower = parseLayout("--autoscale", get("--autoscale", ""), int64_t(threshold));
      if (!lower.ok()) return usageError(lower.status());
      if ((lower->prefillWorkers == 0) != (layout->prefillWorkers == 0) ||
          lower->prefillWorkers > layout->prefillWorkers || lower->decodeWorkers > layout->decodeWorkers)
        return usageError(invalidArgument("--autoscale " + get("--autoscale", "") +
                                          ": the minimum must be a layout of "
                                          "the same kind no larger than --layout " +
                                          get("--layout", "")));
      plan::Autoscaling as;
      as.minPrefill = lower->prefillWorkers, as.maxPrefill = layout->prefillWorkers;
      as.minDecode = lower->decodeWorkers, as.maxDecode = layout->decodeWorkers;
      as.startupS = startupS;
      so.autoscaling = as;
      so.layout.prefillWorkers = lower->prefillWorkers, so.layout.decodeWorkers = lower->decodeWorkers;
    } else if (a.values.count("--startup-s")) {
      return usageError(invalidArgument("--startup-s goes with --autoscale"));
    }
    const plan::CostModel cost(*model, device, 1);
    auto r = plan::simulate(cost, so, *requests);
    if (!r.ok()) {
      std::fprintf(stderr, "pdserve plan: %s\n", r.status().message().c_str());
      return 1;
    }
    std::printf("%s, %s (%s), %s:\n", layout->describe().c_str(), device.name.c_str(), costNote.c_str(),
                rate > 0 ? ("Poisson " + std::to_string(rate) + " req/s").c_str() : "the trace's arrivals");
    printSummaryLine("simulated", r->summary);
    const plan::SimSummary& m = r->summary;
    std::printf("devices: %.1f on average over %.0f s (%.2f device-hours), %d at most", m.meanDevices, m.durationS,
                m.deviceSeconds / 3600, m.peakDevices);
    if (so.autoscaling)
      std::printf("; autoscaled from %s: %d workers started, %d drained", get("--autoscale", "").c_str(),
                  m.workersStarted, m.workersDrained);
    std::printf("\n");
    if (a.values.count("--requests-csv")) {
      if (Status s = writeRequestsCsv(a.values.at("--requests-csv"), *requests, r->outcomes); !s.isOk()) {
        std::fprintf(stderr, "pdserve plan: %s\n", s.message().c_str());
        return 1;
      }
    }
    return 0;
  }
  for (const char* k : {"--requests-csv", "--autoscale", "--startup-s"})
    if (a.values.count(k)) return usageError(invalidArgument(std::string(k) + " goes with --layout"));

  auto ranked = plan::searchLayouts(*model, device, po, source, [](int done, int total, const plan::Layout& l) {
    std::fprintf(stderr, "  [%d/%d] %s: done\n", done + 1, total, l.describe().c_str());
  });
  if (!ranked.ok()) {
    std::fprintf(stderr, "pdserve plan: %s\n", ranked.status().message().c_str());
    return 1;
  }
  const auto& best = ranked->front();
  const double offered = best.maxRateScale > 0 ? best.maxRate / best.maxRateScale : 0;
  std::printf(
      "best: %s -- up to %.2f req/s (%.2fx the trace's mean %.2f req/s) with %.0f%% of requests within "
      "TTFT %.0f ms and ITL p%g %.0f ms\n",
      best.layout.describe().c_str(), best.maxRate, best.maxRateScale, offered, 100 * po.attainment, 1000 * slo->ttftS,
      slo->percentile, 1000 * slo->itlS);
  std::printf(
      "  (%lld KV blocks of %d tokens per worker; cost model: %s roofline at %.0f%% compute / %.0f%% "
      "bandwidth efficiency, %s)\n\n",
      (long long)best.summary.kvBlocksPerWorker, po.sim.blockSize, device.name.c_str(), 100 * device.efficiency.compute,
      100 * device.efficiency.memory, costNote.c_str());
  std::printf("%-34s %9s %8s | %8s %8s %8s | %7s %6s  %s\n", "layout", "max req/s", "per GPU", "TTFT p99", "ITL p99",
              "attained", "at 1x", "disagg", "verdict");
  for (const auto& c : *ranked) {
    const auto& m = c.atMaxRate;
    std::printf("%-34s %9.2f %8.3f | %6.0fms %6.1fms %7.1f%% | %6.1f%% %5.0f%%  %s\n", c.layout.describe().c_str(),
                c.maxRate, c.maxRate / c.layout.devices(), 1000 * m.ttftP99, 1000 * m.itlP99, 100 * m.attainment,
                100 * c.summary.attainment,
                c.summary.requests ? 100.0 * double(c.summary.disaggregated) / double(c.summary.requests) : 0.0,
                c.verdict.c_str());
  }
  std::printf(
      "\nmax req/s: the highest Poisson rate, with the trace's lengths over its %.0f s, at which >= %.0f%%\n"
      "of the requests meet both SLOs; TTFT/ITL p99 and attained are at that rate; at 1x and disagg\n"
      "replay the trace's own arrivals.\n",
      traceSpanS, 100 * po.attainment);
  if (a.values.count("--html")) {
    plan::PlanReportInfo info;
    info.commandLine = commandLine();
    info.trace = std::to_string(traceRequests) + " requests (" + traceWorkload->describe + ")";
    info.model = model->name;
    info.device = deviceDescription + " (" + costNote + ")";
    info.slo = *slo;
    info.attainment = po.attainment;
    if (Status s = plan::writePlanHtml(get("--html", ""), info, *ranked); !s.isOk()) {
      std::fprintf(stderr, "pdserve plan: --html: %s\n", s.message().c_str());
      return 1;
    }
    std::printf("wrote %s\n", get("--html", "").c_str());
  }
  return 0;
}

}  // namespace

void addPlanCommand(CLI::App& pdserve, CommandRun& run) {
  CLI::App* cmd = pdserve.add_subcommand("plan", kSummary);
  cmd->footer(kDetails);
  auto args = std::make_shared<Args>();
  for (const OptionHelp& o : kOptions) addTextOption(*cmd, args->values, o.name, o.help);
  for (const OptionHelp& f : kFlags) addTextFlag(*cmd, args->values, f.name, f.help);
  cmd->callback([args, &run] { run = [args] { return runPlan(*args); }; });
}

}  // namespace pd::tools
