// `pdserve bench`: the load generator (tools/bench, docs/bench.md). This file is the command
// line only: it parses options, runs pd_bench and writes the reports.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/bench/client.h"
#include "tools/bench/multiturn.h"
#include "tools/bench/report.h"
#include "tools/bench/scraper.h"
#include "tools/bench/stats.h"
#include "tools/bench/workload.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

using namespace pd::bench;

constexpr const char* kSummary = "load-test an OpenAI-compatible server (TTFT, ITL, goodput)";
constexpr const char* kDetails =
    "Drives an OpenAI-compatible server with streaming requests and reports TTFT, TPOT, ITL, "
    "end-to-end latency, throughput and goodput (docs/bench.md).";

struct Args {
  std::map<std::string, std::string> values;  // value options and flags ("") as given
  std::vector<std::string> phases;            // --phase, in order (the only repeatable option)
};

struct OptionHelp {
  const char* group;
  const char* name;
  const char* help;
};

const OptionHelp kValueOptions[] = {
    {"server", "--url", "server base URL (default http://127.0.0.1:8000)"},
    {"server", "--model", "model name (default: the first one /v1/models lists)"},
    {"server", "--api-key", "bearer token (default $OPENAI_API_KEY)"},
    {"server", "--endpoint", "completions|chat (default completions: token-id prompts, exact lengths)"},
    {"workload", "--trace", "replay an Azure 2023 CSV or Mooncake FAST'25 JSONL trace"},
    {"workload", "--prompt-len", "synthetic prompt length: N | uniform:MIN:MAX | lognormal:MEAN:SIGMA (default 256)"},
    {"workload", "--output-len", "synthetic output length, same forms (default 64)"},
    {"workload", "--num-requests", "requests to send (default: every trace row)"},
    {"workload", "--duration", "send nothing new after S seconds"},
    {"workload", "--rate", "Poisson arrivals at R requests/s (instead of the trace's times)"},
    {"workload", "--time-scale", "multiply trace timestamps by F (0.5 = twice as fast; default 1)"},
    {"workload", "--concurrency", "at most N requests in flight; alone it makes a closed loop"},
    {"workload", "--max-prompt-tokens",
     "scale trace prompts (and prefix blocks) so the longest fits N; cap synthetic prompts at N"},
    {"workload", "--length-scale", "multiply trace prompt lengths by F instead"},
    {"workload", "--max-output-tokens", "cap output lengths at N"},
    {"workload", "--warmup", "warm-up requests before the measured run (excluded; default 0)"},
    {"workload", "--seed", "seed for lengths, arrivals and prompt tokens (default 0)"},
    {"workload", "--sample-conversations",
     "Mooncake trace: keep one conversation in K (whole conversations; thins the load)"},
    {"workload", "--turn-min-tokens", "--multi-turn: the shortest new message of a next turn (default 16)"},
    {"report", "--kv-block-size",
     "--multi-turn: the servers' KV block size in tokens, for the unbounded-cache ceiling (default 16)"},
    {"workload", "--vocab-size", "token ids are drawn from [10, V-10) (default 256)"},
    {"workload", "--token-ids", "MIN:MAX: token ids from [MIN, MAX) instead (keep special ids out)"},
    {"workload", "--temperature", "send this temperature (default: server default)"},
    {"workload", "--extra-body", "a JSON object merged into every request body"},
    {"workload", "--request-timeout", "whole-request bound in seconds (default 900)"},
    {"workload", "--idle-timeout", "longest silence inside one stream in seconds (default 120)"},
    {"report", "--slo", "ttft_ms=A,itl_ms=B: goodput targets (also tpot_ms, e2el_ms; itl_pct=P, default 99)"},
    {"report", "--metrics-url",
     "scrape this Prometheus endpoint during the run (the router's http://HOST:PORT/metrics) "
     "into a timeline: JSON and HTML charts"},
    {"report", "--metrics-interval-ms", "scrape period (default 1000)"},
    {"report", "--metrics-timeout-ms",
     "bound on one scrape (default: the period, at most 5000); a failed scrape is a gap in the "
     "timeline, never an abort"},
    {"report", "--metrics-token", "bearer token for the metrics endpoint (router.http.metrics_auth)"},
    {"report", "--out", "write PREFIX.json, PREFIX.csv, PREFIX.html (default bench-<date>)"},
};
const OptionHelp kFlagOptions[] = {
    {"server", "--no-model-check", "skip the GET /v1/models check before the run"},
    {"workload", "--spread-ticks", "spread rows sharing one trace timestamp over the gap to the next"},
    {"workload", "--multi-turn",
     "Mooncake trace: replay conversations; a next turn's prompt is the previous prompt, its answer's ids and a "
     "new message, sent once the previous turn finished"},
    {"workload", "--no-ignore-eos", "do not send ignore_eos (outputs may end early)"},
    {"workload", "--continuous-usage", "ask for stream_options.continuous_usage_stats (vLLM)"},
    {"report", "--progress", "live progress on stderr (default: when stderr is a terminal)"},
    {"report", "--no-progress", "no live progress on stderr"},
};

template <typename T>
Status number(const Args& a, const char* key, T* out) {
  auto it = a.values.find(key);
  if (it == a.values.end()) return Status::ok();
  const std::string& s = it->second;
  char* end = nullptr;
  errno = 0;
  if constexpr (std::is_floating_point_v<T>) {
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end || errno || !std::isfinite(v))
      return invalidArgument(std::string(key) + ": '" + s + "' is not a number");
    *out = static_cast<T>(v);
  } else {
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end || errno || v < 0)
      return invalidArgument(std::string(key) + ": '" + s + "' is not a non-negative integer");
    *out = static_cast<T>(v);
  }
  return Status::ok();
}

bool hasFlag(const Args& a, const char* f) { return a.values.count(f) != 0; }

std::string utcStamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

void printProgress(const ProgressInfo& p) {
  const int width = 30;
  const double frac = p.total > 0 ? static_cast<double>(p.finished) / static_cast<double>(p.total) : 0;
  const int fill = static_cast<int>(frac * width);
  std::fprintf(stderr, "\r%s[%.*s%*s] %lld/%lld done, %lld failed, %lld in flight, %.1f s ", p.warmup ? "warm-up " : "",
               fill, "##############################", width - fill, "", static_cast<long long>(p.finished),
               static_cast<long long>(p.total), static_cast<long long>(p.failed), static_cast<long long>(p.inFlight),
               p.elapsedS);
  std::fflush(stderr);
}

int usageError(const Status& s) {
  std::fprintf(stderr, "pdserve bench: %s\n", s.message().c_str());
  return 2;
}

int runCheck(const std::vector<std::string>& paths, bool allowFailures) {
  if (paths.empty()) return usageError(invalidArgument("check: give a result JSON file"));
  int rc = 0;
  for (const auto& p : paths) {
    auto r = checkResult(p, allowFailures);
    if (r.ok()) {
      std::printf("%s\n", r->c_str());
    } else {
      std::fprintf(stderr, "pdserve bench check: %s\n", r.status().message().c_str());
      rc = 1;
    }
  }
  return rc;
}

int runCompare(const std::vector<std::string>& paths) {
  auto r = compareResults(paths);
  if (!r.ok()) {
    std::fprintf(stderr, "pdserve bench compare: %s\n", r.status().message().c_str());
    return paths.empty() ? 2 : 1;
  }
  std::fputs(r->c_str(), stdout);
  return 0;
}

int runBench(const Args& a) {
  auto get = [&](const char* k, std::string def) {
    auto it = a.values.find(k);
    return it == a.values.end() ? def : it->second;
  };

  // ---- workload
  WorkloadOptions w;
  w.tracePath = get("--trace", "");
  if (auto s = parseLengthSpec(get("--prompt-len", "256"), "--prompt-len"); s.ok())
    w.promptLen = *s;
  else
    return usageError(s.status());
  if (auto s = parseLengthSpec(get("--output-len", "64"), "--output-len"); s.ok())
    w.outputLen = *s;
  else
    return usageError(s.status());
  int64_t concurrency = 0, vocab = 256;
  for (Status s : {number(a, "--num-requests", &w.numRequests), number(a, "--duration", &w.durationS),
                   number(a, "--rate", &w.rate), number(a, "--time-scale", &w.timeScale),
                   number(a, "--concurrency", &concurrency), number(a, "--max-prompt-tokens", &w.maxPromptTokens),
                   number(a, "--length-scale", &w.lengthScale), number(a, "--max-output-tokens", &w.maxOutputTokens),
                   number(a, "--warmup", &w.warmup), number(a, "--seed", &w.seed), number(a, "--vocab-size", &vocab)})
    if (!s.isOk()) return usageError(s);
  w.spreadTicks = hasFlag(a, "--spread-ticks");
  w.multiTurn = hasFlag(a, "--multi-turn");
  int64_t kvBlockSize = 16;
  for (Status s : {number(a, "--turn-min-tokens", &w.turnMinTokens), number(a, "--kv-block-size", &kvBlockSize),
                   number(a, "--sample-conversations", &w.sampleConversations)})
    if (!s.isOk()) return usageError(s);
  if (!w.multiTurn)
    for (const char* k : {"--turn-min-tokens", "--kv-block-size"})
      if (a.values.count(k)) return usageError(invalidArgument(std::string(k) + " needs --multi-turn"));
  if (kvBlockSize < 1) return usageError(invalidArgument("--kv-block-size must be >= 1"));
  {
    PhaseSpec defaults;
    defaults.promptLen = w.promptLen;
    defaults.outputLen = w.outputLen;
    defaults.rate = w.rate;
    for (size_t k = 0; k < a.phases.size(); ++k) {
      auto p = parsePhaseSpec(a.phases[k], static_cast<int>(k + 1), defaults);
      if (!p.ok()) return usageError(p.status());
      w.phases.push_back(*p);
    }
  }
  // Phases carry their own rates: --concurrency is then only a cap.
  w.closedLoop = concurrency > 0 && w.rate <= 0 && a.values.count("--time-scale") == 0 && a.phases.empty();
  if (w.tracePath.empty() && (a.values.count("--time-scale")))
    return usageError(invalidArgument("--time-scale needs --trace"));

  // ---- request bodies
  BodyOptions body;
  const std::string ep = get("--endpoint", "completions");
  if (ep == "completions")
    body.endpoint = Endpoint::kCompletions;
  else if (ep == "chat")
    body.endpoint = Endpoint::kChat;
  else
    return usageError(invalidArgument("--endpoint: '" + ep + "' (allowed: completions, chat)"));
  body.model = get("--model", "");
  body.seed = w.seed;
  body.ignoreEos = !hasFlag(a, "--no-ignore-eos");
  body.continuousUsage = hasFlag(a, "--continuous-usage");
  if (Status s = number(a, "--temperature", &body.temperature); !s.isOk()) return usageError(s);
  if (vocab < 21) return usageError(invalidArgument("--vocab-size must be at least 21"));
  body.ids = {10, vocab - 10};
  if (a.values.count("--token-ids")) {
    const std::string t = a.values.at("--token-ids");
    long long lo = -1, hi = -1;
    char tail = 0;
    if (std::sscanf(t.c_str(), "%lld:%lld%c", &lo, &hi, &tail) != 2 || lo < 0 || hi <= lo || hi > (1ll << 31))
      return usageError(invalidArgument("--token-ids: '" + t + "' is not MIN:MAX with 0 <= MIN < MAX"));
    body.ids = {lo, hi};
  }
  if (w.multiTurn && body.endpoint != Endpoint::kCompletions)
    return usageError(invalidArgument(
        "--multi-turn sends token-id prompts (the previous answer's exact ids): use --endpoint completions"));
  body.returnTokenIds = w.multiTurn;
  body.extraJson = get("--extra-body", "");
  if (!body.extraJson.empty()) {
    auto j = nlohmann::json::parse(body.extraJson, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return usageError(invalidArgument("--extra-body: not a JSON object: " + body.extraJson));
  }

  // ---- client
  ClientOptions client;
  auto target = parseServerUrl(get("--url", "http://127.0.0.1:8000"));
  if (!target.ok()) return usageError(target.status());
  client.server = *target;
  client.endpoint = body.endpoint;
  const char* envKey = std::getenv("OPENAI_API_KEY");
  client.apiKey = get("--api-key", envKey ? envKey : "");
  for (Status s :
       {number(a, "--request-timeout", &client.requestTimeoutS), number(a, "--idle-timeout", &client.idleTimeoutS)})
    if (!s.isOk()) return usageError(s);

  Slo slo;
  if (a.values.count("--slo")) {
    auto s = parseSlo(a.values.at("--slo"));
    if (!s.ok()) return usageError(s.status());
    slo = *s;
  }
  std::optional<ScrapeOptions> scrape;
  if (a.values.count("--metrics-url")) {
    auto so = parseMetricsUrl(a.values.at("--metrics-url"));
    if (!so.ok()) return usageError(so.status());
    for (Status s :
         {number(a, "--metrics-interval-ms", &so->intervalMs), number(a, "--metrics-timeout-ms", &so->timeoutMs)})
      if (!s.isOk()) return usageError(s);
    if (so->intervalMs < 50 || so->intervalMs > 600000)
      return usageError(invalidArgument("--metrics-interval-ms must be in [50, 600000]"));
    if (!a.values.count("--metrics-timeout-ms")) so->timeoutMs = std::min<int64_t>(so->intervalMs, 5000);
    if (so->timeoutMs < 10) return usageError(invalidArgument("--metrics-timeout-ms must be >= 10"));
    so->bearer = get("--metrics-token", "");
    scrape = *so;
  } else {
    for (const char* k : {"--metrics-interval-ms", "--metrics-timeout-ms", "--metrics-token"})
      if (a.values.count(k)) return usageError(invalidArgument(std::string(k) + " needs --metrics-url"));
  }
  const std::string date = utcStamp();
  const std::string out = get("--out", "bench-" + date);

  auto workload = buildWorkload(w);
  if (!workload.ok()) {
    std::fprintf(stderr, "pdserve bench: %s\n", workload.status().message().c_str());
    return workload.status().code() == StatusCode::kInvalidArgument && w.tracePath.empty() ? 2 : 1;
  }

  if (!hasFlag(a, "--no-model-check")) {
    auto models = fetchModels(client, 10);
    if (!models.ok()) {
      std::fprintf(stderr, "pdserve bench: %s\n", models.status().message().c_str());
      return 1;
    }
    if (models->httpStatus == 200 && !models->ids.empty()) {
      if (body.model.empty()) {
        body.model = models->ids.front();
      } else if (std::find(models->ids.begin(), models->ids.end(), body.model) == models->ids.end()) {
        std::string list;
        for (const auto& id : models->ids) list += (list.empty() ? "" : ", ") + id;
        std::fprintf(stderr, "pdserve bench: model '%s' is not served by %s (it serves: %s)\n", body.model.c_str(),
                     client.server.url().c_str(), list.c_str());
        return 1;
      }
    } else if (models->httpStatus == 401 || models->httpStatus == 403) {
      std::fprintf(stderr, "pdserve bench: GET /v1/models: HTTP %d: %s\n", models->httpStatus, models->body.c_str());
      return 1;
    } else {
      std::fprintf(stderr, "pdserve bench: warning: GET /v1/models gave HTTP %d; continuing\n", models->httpStatus);
    }
  }

  RunOptions ro;
  ro.maxConcurrency = concurrency;
  ro.durationS = w.durationS;
  if (!workload->phases.empty()) ro.durationS = workload->phases.back().endS;
  ro.handleSignals = true;
  ro.makeBody = [&body](const PlannedRequest& p) { return buildRequestBody(p, body); };
  if (w.multiTurn) {
    ro.turnPromptIds = [&body](const PlannedRequest& p, const RequestRecord* previous) {
      if (p.parent < 0 || previous == nullptr) return promptTokenIds(p, body.ids, body.seed);
      std::vector<int32_t> history = previous->promptIds;
      history.insert(history.end(), previous->generatedIds.begin(), previous->generatedIds.end());
      return turnPromptIds(p, history, body.ids, body.seed);
    };
    ro.makeBodyIds = [&body](const PlannedRequest& p, const std::vector<int32_t>& ids) {
      return buildRequestBodyIds(p, ids, body);
    };
  }
  const bool progress = hasFlag(a, "--progress") || (!hasFlag(a, "--no-progress") && isatty(2));
  if (progress) ro.onProgress = printProgress;

  std::fprintf(stderr, "pdserve bench: %s -> %s%s\n", workload->describe.c_str(), client.server.url().c_str(),
               endpointPath(body.endpoint));
  // The scraper starts before the warm-ups so the timeline shows the cluster as the run found it.
  std::unique_ptr<MetricsScraper> scraper;
  if (scrape) {
    scraper = std::make_unique<MetricsScraper>(*scrape);
    scraper->start();
  }
  auto run = runLoad(client, *workload, ro);
  if (progress) std::fprintf(stderr, "\n");
  MetricsTimeline timeline;
  if (scraper) timeline = scraper->stop(run.ok() ? run->measuredStart : std::chrono::steady_clock::now());
  if (!run.ok()) {
    std::fprintf(stderr, "pdserve bench: %s\n", run.status().message().c_str());
    return 1;
  }

  RunInfo info;
  info.date = date;
  info.commandLine = commandLine();
  info.url = client.server.url();
  info.endpoint = endpointPath(body.endpoint);
  info.backend = body.endpoint == Endpoint::kChat ? "openai-chat" : "openai";
  info.model = body.model;
  info.workload = workload->describe;
  info.arrival = arrivalModeName(workload->arrival);
  info.requestRate = w.rate;
  info.maxConcurrency = concurrency;
  info.timeScale = w.timeScale;
  info.seed = w.seed;
  info.numPrompts = static_cast<int64_t>(run->records.size());
  info.plannedRequests = static_cast<int64_t>(workload->requests.size());
  info.warmupRequests = w.warmup;
  info.promptSource = body.endpoint == Endpoint::kChat
                          ? ByteTextPrompter().name()
                          : "token-ids[" + std::to_string(body.ids.minId) + "," + std::to_string(body.ids.maxId) + ")";
  info.slo = slo;
  info.abortReason = run->abortReason;
  info.phases = workload->phases;
  info.haveTimeline = scrape.has_value();
  info.timeline = std::move(timeline);
  if (info.haveTimeline && info.timeline.failedScrapes() > 0)
    std::fprintf(stderr, "pdserve bench: warning: %lld of %zu metrics scrapes failed (first: %s)\n",
                 static_cast<long long>(info.timeline.failedScrapes()), info.timeline.samples.size(),
                 std::find_if(info.timeline.samples.begin(), info.timeline.samples.end(), [](const TimelineSample& s) {
                   return !s.ok;
                 })->error.c_str());
  const Aggregate agg = aggregate(run->records, run->durationS, slo);
  std::fputs(formatTable(info, agg, run->records).c_str(), stdout);
  if (w.multiTurn) {
    const TurnSummary turns = summarizeTurns(workload->requests, run->records, static_cast<int>(kvBlockSize));
    std::fputs(formatTurns(turns, static_cast<int>(kvBlockSize)).c_str(), stdout);
    nlohmann::json j = {{"block_size", kvBlockSize},
                        {"requests", turns.requests},
                        {"prompt_tokens", turns.promptTokens},
                        {"cached_tokens", turns.cachedTokens},
                        {"requests_with_cached_tokens", turns.withCachedUsage},
                        {"ideal_cached_tokens", turns.idealCachedTokens},
                        {"next_turns", turns.turns},
                        {"next_turn_prompt_tokens", turns.turnPromptTokens},
                        {"next_turn_cached_tokens", turns.turnCachedTokens},
                        {"next_turn_history_tokens", turns.turnHistoryTokens}};
    if (Status s = writeFile(out + ".turns.json", j.dump(2) + "\n"); !s.isOk()) {
      std::fprintf(stderr, "pdserve bench: %s\n", s.message().c_str());
      return 1;
    }
  }
  for (Status s : {writeJson(out + ".json", info, agg, run->records), writeCsv(out + ".csv", run->records, slo),
                   writeHtml(out + ".html", info, agg, run->records, run->durationS)}) {
    if (!s.isOk()) {
      std::fprintf(stderr, "pdserve bench: %s\n", s.message().c_str());
      return 1;
    }
  }
  std::printf("wrote %s.json, %s.csv, %s.html\n", out.c_str(), out.c_str(), out.c_str());
  if (!run->abortReason.empty()) {
    std::fprintf(stderr, "pdserve bench: aborted: %s\n", run->abortReason.c_str());
    return 1;
  }
  return agg.completed > 0 ? 0 : 1;
}

}  // namespace

void addBenchCommand(CLI::App& pdserve, CommandRun& run) {
  CLI::App* cmd = pdserve.add_subcommand("bench", kSummary);
  cmd->footer(kDetails);
  auto args = std::make_shared<Args>();
  for (const OptionHelp& o : kValueOptions) {
    addTextOption(*cmd, args->values, o.name, o.help);
    cmd->get_option(o.name)->group(o.group);
  }
  cmd->add_option("--phase", args->phases,
                  "one phase of a phased synthetic run (repeat it; phases run in order): "
                  "prompt-len=LEN,output-len=LEN,rate=R,duration=S (LEN as --prompt-len; "
                  "left-out lengths and rate default to --prompt-len/--output-len/--rate)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->allow_extra_args(false)
      ->group("workload");
  for (const OptionHelp& o : kFlagOptions) {
    addTextFlag(*cmd, args->values, o.name, o.help);
    cmd->get_option(o.name)->group(o.group);
  }

  CLI::App* compare = cmd->add_subcommand("compare", "compare result JSON files of earlier runs side by side");
  auto comparePaths = std::make_shared<std::vector<std::string>>();
  compare->add_option("results", *comparePaths, "A.json B.json ...: the runs' --out JSON files");
  compare->callback([comparePaths, &run] { run = [comparePaths] { return runCompare(*comparePaths); }; });

  CLI::App* check =
      cmd->add_subcommand("check", "check result JSON files: exit 1 unless each run completed requests cleanly");
  auto checkPaths = std::make_shared<std::vector<std::string>>();
  auto allowFailures = std::make_shared<bool>(false);
  check->add_option("results", *checkPaths, "RESULT.json ...: the runs' --out JSON files");
  check->add_flag("--allow-failures", *allowFailures, "failed requests do not fail the check");
  check->callback([checkPaths, allowFailures, &run] {
    run = [checkPaths, allowFailures] { return runCheck(*checkPaths, *allowFailures); };
  });

  addBenchMixedCommand(*cmd, run);
  cmd->callback([cmd, args, &run] {
    if (cmd->get_subcommands().empty()) run = [args] { return runBench(*args); };
  });
}

}  // namespace pd::tools
