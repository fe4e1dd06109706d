// `pdserve bench mixed`: the mixed-load benchmark (tools/bench/mixed.h, docs/bench.md). This
// file is the command line only.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "tools/bench/client.h"
#include "tools/bench/mixed.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

using namespace pd::bench;

int fail(const std::string& why, int rc = 2) {
  std::fprintf(stderr, "pdserve bench mixed: %s\n", why.c_str());
  return rc;
}

struct MixedArgs {
  MixedOptions o;
  std::string url = "http://127.0.0.1:8000", model, label;
  double vocab = 256, seed = 0, maxRatio = 0, p99Ratio = 0;
  bool check = false;
};

int runBenchMixed(MixedArgs& args) {
  MixedOptions& o = args.o;
  const std::string& url = args.url;
  std::string& model = args.model;
  const std::string& label = args.label;
  const double vocab = args.vocab, seed = args.seed, maxRatio = args.maxRatio, p99Ratio = args.p99Ratio;
  const bool check = args.check;

  if (Status s = validate(o); !s.isOk()) return fail(s.message());
  if (vocab < 21) return fail("--vocab-size must be at least 21");

  ClientOptions client;
  auto target = parseServerUrl(url);
  if (!target.ok()) return fail(target.status().message());
  client.server = *target;
  client.requestTimeoutS = 300;
  client.idleTimeoutS = 60;
  if (const char* key = std::getenv("OPENAI_API_KEY")) client.apiKey = key;
  if (model.empty()) {
    auto models = fetchModels(client, 10);
    if (!models.ok()) return fail(models.status().message(), 1);
    if (models->ids.empty())
      return fail("GET /v1/models listed no model (HTTP " + std::to_string(models->httpStatus) + ")", 1);
    model = models->ids.front();
  }
  BodyOptions body;
  body.model = model;
  body.ids = {10, static_cast<int64_t>(vocab) - 10};
  body.seed = static_cast<uint64_t>(seed);
  // Stream gaps per token: with token ids every chunk says how many tokens it carries, so a
  // token whose text is held back (an incomplete UTF-8 character) still ends its gap.
  body.extraJson = R"({"return_token_ids": true})";
  RunOptions ro;
  ro.abortOnRefusal = false;  // errors are what this benchmark reports
  ro.handleSignals = true;

  // One short request first: the first request on a fresh worker pays one-time costs.
  MixedOptions warm = o;
  warm.shortStreams = 1;
  warm.shortOutputTokens = 4;
  ro.makeBody = [&](const PlannedRequest& p) {
    PlannedRequest q = p;
    q.index += 1000000;  // its own prompt
    return buildRequestBody(q, body);
  };
  (void)runLoad(client, soloWorkload(warm), ro);

  ro.makeBody = [&](const PlannedRequest& p) { return buildRequestBody(p, body); };
  std::fprintf(stderr, "pdserve bench mixed: solo run: %s\n", soloWorkload(o).describe.c_str());
  auto solo = runLoad(client, soloWorkload(o), ro);
  if (!solo.ok()) return fail(solo.status().message(), 1);
  // The mixed run's prompts differ from the solo run's (no prefix-cache hits between them).
  body.seed += 1;
  std::fprintf(stderr, "pdserve bench mixed: mixed run: %s\n", mixedWorkload(o).describe.c_str());
  auto mixed = runLoad(client, mixedWorkload(o), ro);
  if (!mixed.ok()) return fail(mixed.status().message(), 1);

  const MixedResult r = summarizeMixed(solo->records, mixed->records, o);
  std::fputs(formatMixed(label.empty() ? url : label, r).c_str(), stdout);
  if (!check) return 0;
  const std::string why = checkMixed(r, maxRatio, p99Ratio);
  if (why.empty()) {
    std::printf("check: ok (max <= %.1fx, p99 <= %.1fx solo p99, no errors)\n", maxRatio, p99Ratio);
    return 0;
  }
  std::printf("check: FAILED: %s\n", why.c_str());
  return 1;
}

}  // namespace

void addBenchMixedCommand(CLI::App& bench, CommandRun& run) {
  CLI::App* cmd = bench.add_subcommand("mixed", "short streams vs arriving long prompts");
  cmd->footer(
      "S short streams decode while L long prompts "
      "arrive at a fixed spacing. The short streams run twice in the same run, alone (the solo "
      "baseline) and with the long prompts, and their inter-token gaps are compared. Prints one "
      "table per run.");
  auto args = std::make_shared<MixedArgs>();
  MixedOptions& o = args->o;
  auto number = [cmd](const char* name, auto& out, const char* description) {
    cmd->add_option(name, out, description)->check(CLI::NonNegativeNumber)->capture_default_str();
  };
  cmd->add_option("--url", args->url, "server base URL")->capture_default_str();
  cmd->add_option("--model", args->model, "model name (default: the first one /v1/models lists)");
  cmd->add_option("--label", args->label, "the table's title (default: the URL)");
  number("--short-streams", o.shortStreams, "S: short streams");
  number("--short-prompt", o.shortPromptTokens, "a short stream's prompt tokens");
  number("--short-output", o.shortOutputTokens, "a short stream's output tokens");
  number("--long-prompts", o.longPrompts, "L: long prompts");
  number("--long-prompt", o.longPromptTokens, "a long prompt's tokens");
  number("--long-output", o.longOutputTokens, "a long prompt's output tokens");
  number("--long-start", o.longStartS, "seconds after the short streams start");
  number("--long-spacing", o.longSpacingS, "seconds between long prompts");
  number("--vocab-size", args->vocab, "token ids are drawn from [10, V-10)");
  number("--seed", args->seed, "prompt seed");
  cmd->add_option_function<std::string>(
         "--check",
         [args](const std::string& v) {
           std::sscanf(v.c_str(), "%lf,%lf", &args->maxRatio, &args->p99Ratio);
           args->check = true;
         },
         "MAX,P99: exit 1 unless there were no errors, max gap <= MAX x solo p99 and p99 gap "
         "<= P99 x solo p99 (the issue's bound is 3,1.5)")
      ->check([](const std::string& v) {
        double maxRatio = 0, p99Ratio = 0;
        const bool ok = std::sscanf(v.c_str(), "%lf,%lf", &maxRatio, &p99Ratio) == 2 && maxRatio > 0 && p99Ratio > 0;
        return ok ? std::string() : "expected MAX,P99 ratios such as 3,1.5, got '" + v + "'";
      });
  cmd->callback([args, &run] { run = [args] { return runBenchMixed(*args); }; });
}

}  // namespace pd::tools
