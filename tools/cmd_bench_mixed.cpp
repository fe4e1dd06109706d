// `pdserve bench mixed`: the mixed-load benchmark (tools/bench/mixed.h, docs/bench.md). This
// file is the command line only.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tools/bench/client.h"
#include "tools/bench/mixed.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

using namespace pd::bench;

const char kUsage[] = R"(usage: pdserve bench mixed [options]

S short streams decode while L long prompts arrive at a fixed spacing. The short streams run
twice in the same run, alone (the solo baseline) and with the long prompts, and their
inter-token gaps are compared. Prints one table per run.

  --url URL              server base URL (default http://127.0.0.1:8000)
  --model NAME           model name (default: the first one /v1/models lists)
  --label TEXT           the table's title (default: the URL)
  --short-streams S      (default 2)       --short-prompt N (default 100)  --short-output N (default 400)
  --long-prompts L       (default 4)       --long-prompt N  (default 2000) --long-output N  (default 16)
  --long-start S         seconds after the short streams start (default 1)
  --long-spacing S       seconds between long prompts (default 1)
  --vocab-size V         token ids are drawn from [10, V-10) (default 256)
  --seed N               prompt seed (default 0)
  --check MAX,P99        exit 1 unless there were no errors, max gap <= MAX x solo p99 and
                         p99 gap <= P99 x solo p99 (the issue's bound is 3,1.5)
)";

int fail(const std::string& why, int rc = 2) {
  std::fprintf(stderr, "pdserve bench mixed: %s\n", why.c_str());
  return rc;
}

bool parseNumber(const char* s, double* out) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s, &end);
  if (!*s || *end || errno || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

}  // namespace

int runBenchMixed(int argc, char** argv) {
  MixedOptions o;
  std::string url = "http://127.0.0.1:8000", model, label;
  double vocab = 256, seed = 0, maxRatio = 0, p99Ratio = 0;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) return fail(arg + " needs a value (see --help)");
    const char* v = argv[++i];
    double d = 0;
    auto num = [&](auto* out) {
      if (!parseNumber(v, &d) || d < 0) return false;
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(d);
      return true;
    };
    bool ok = true;
    if (arg == "--url")
      url = v;
    else if (arg == "--model")
      model = v;
    else if (arg == "--label")
      label = v;
    else if (arg == "--short-streams")
      ok = num(&o.shortStreams);
    else if (arg == "--short-prompt")
      ok = num(&o.shortPromptTokens);
    else if (arg == "--short-output")
      ok = num(&o.shortOutputTokens);
    else if (arg == "--long-prompts")
      ok = num(&o.longPrompts);
    else if (arg == "--long-prompt")
      ok = num(&o.longPromptTokens);
    else if (arg == "--long-output")
      ok = num(&o.longOutputTokens);
    else if (arg == "--long-start")
      ok = num(&o.longStartS);
    else if (arg == "--long-spacing")
      ok = num(&o.longSpacingS);
    else if (arg == "--vocab-size")
      ok = num(&vocab);
    else if (arg == "--seed")
      ok = num(&seed);
    else if (arg == "--check") {
      check = std::sscanf(v, "%lf,%lf", &maxRatio, &p99Ratio) == 2 && maxRatio > 0 && p99Ratio > 0;
      if (!check) return fail("--check: expected MAX,P99 ratios such as 3,1.5, got '" + std::string(v) + "'");
    } else
      return fail("unknown option '" + arg + "' (see --help)");
    if (!ok) return fail(arg + ": '" + v + "' is not a non-negative number");
  }
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

}  // namespace pd::tools
