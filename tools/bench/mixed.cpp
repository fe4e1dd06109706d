#include "tools/bench/mixed.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace pd::bench {
namespace {

PlannedRequest planned(int64_t index, double at, int64_t prompt, int64_t output) {
  PlannedRequest p;
  p.index = index;
  p.scheduledS = at;
  p.promptTokens = prompt;
  p.outputTokens = output;
  return p;
}

std::string fmt(double v, const char* spec = "%.1f") {
  if (std::isnan(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, spec, v);
  return buf;
}

}  // namespace

Status validate(const MixedOptions& o) {
  if (o.shortStreams < 1) return invalidArgument("--short-streams: at least 1");
  if (o.longPrompts < 0) return invalidArgument("--long-prompts: not negative");
  if (o.shortPromptTokens < 1 || o.longPromptTokens < 1) return invalidArgument("prompt lengths: at least 1 token");
  if (o.shortOutputTokens < 2) return invalidArgument("--short-output: at least 2 tokens (gaps need two)");
  if (o.longOutputTokens < 1) return invalidArgument("--long-output: at least 1 token");
  if (o.longStartS < 0 || o.longSpacingS < 0) return invalidArgument("--long-start / --long-spacing: not negative");
  return Status::ok();
}

Workload soloWorkload(const MixedOptions& o) {
  Workload w;
  w.arrival = ArrivalMode::kTrace;
  for (int i = 0; i < o.shortStreams; ++i)
    w.requests.push_back(planned(i, 0, o.shortPromptTokens, o.shortOutputTokens));
  w.describe = std::to_string(o.shortStreams) + " short streams (" + std::to_string(o.shortPromptTokens) + " -> " +
               std::to_string(o.shortOutputTokens) + " tokens) alone";
  return w;
}

Workload mixedWorkload(const MixedOptions& o) {
  Workload w = soloWorkload(o);
  for (int i = 0; i < o.longPrompts; ++i)
    w.requests.push_back(
        planned(o.shortStreams + i, o.longStartS + i * o.longSpacingS, o.longPromptTokens, o.longOutputTokens));
  w.describe = std::to_string(o.shortStreams) + " short streams + " + std::to_string(o.longPrompts) +
               " long prompts (" + std::to_string(o.longPromptTokens) + " tokens) every " +
               fmt(o.longSpacingS, "%.2f") + " s";
  return w;
}

GapStats gapStats(const std::vector<RequestRecord>& records) {
  std::vector<double> gaps;
  for (const auto& r : records) gaps.insert(gaps.end(), r.itlsMs.begin(), r.itlsMs.end());
  GapStats g;
  g.count = gaps.size();
  if (gaps.empty()) return g;
  std::sort(gaps.begin(), gaps.end());
  g.p50Ms = percentileSorted(gaps, 50);
  g.p99Ms = percentileSorted(gaps, 99);
  g.maxMs = gaps.back();
  return g;
}

MixedResult summarizeMixed(const std::vector<RequestRecord>& solo, const std::vector<RequestRecord>& mixed,
                           const MixedOptions& o) {
  MixedResult r;
  std::vector<RequestRecord> shortMixed;
  std::vector<double> longTtft;
  auto noteError = [&](const char* phase, const RequestRecord& rec, bool isShort) {
    if (rec.ok) return;
    r.errors.push_back(std::string(phase) + (isShort ? " short #" : " long #") + std::to_string(rec.index) + ": " +
                       rec.error);
  };
  for (const auto& rec : solo) noteError("solo", rec, true);
  for (const auto& rec : mixed) {
    const bool isShort = rec.index < o.shortStreams;
    noteError("mixed", rec, isShort);
    if (isShort)
      shortMixed.push_back(rec);
    else if (rec.ok)
      longTtft.push_back(rec.ttftMs);
  }
  r.solo = gapStats(solo);
  r.mixed = gapStats(shortMixed);
  r.longTtftMs = summarize(longTtft);
  return r;
}

std::string formatMixed(const std::string& label, const MixedResult& r) {
  std::string out = "== " + label + "\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-28s %8s %8s %8s %8s\n", "short-stream gaps (ms)", "count", "p50", "p99", "max");
  out += line;
  for (auto [name, g] :
       {std::pair<const char*, const GapStats&>{"solo (same run)", r.solo}, {"with long prompts", r.mixed}}) {
    std::snprintf(line, sizeof line, "%-28s %8zu %8s %8s %8s\n", name, g.count, fmt(g.p50Ms).c_str(),
                  fmt(g.p99Ms).c_str(), fmt(g.maxMs).c_str());
    out += line;
  }
  std::snprintf(line, sizeof line, "%-28s max/solo-p99 %sx, p99/solo-p99 %sx\n", "ratios",
                fmt(r.maxOverSoloP99(), "%.2f").c_str(), fmt(r.p99OverSoloP99(), "%.2f").c_str());
  out += line;
  std::snprintf(line, sizeof line, "%-28s n=%zu p50 %s ms, max %s ms\n", "long prompts' TTFT", r.longTtftMs.count,
                fmt(r.longTtftMs.median).c_str(), fmt(r.longTtftMs.max).c_str());
  out += line;
  out += "errors: " + std::to_string(r.errors.size()) + "\n";
  for (const auto& e : r.errors) out += "  " + e + "\n";
  return out;
}

std::string checkMixed(const MixedResult& r, double maxRatio, double p99Ratio) {
  std::string why;
  if (!r.errors.empty()) why += std::to_string(r.errors.size()) + " error(s); ";
  if (!(r.maxOverSoloP99() <= maxRatio))
    why += "max gap " + fmt(r.maxOverSoloP99(), "%.2f") + "x solo p99 > " + fmt(maxRatio, "%.1f") + "x; ";
  if (!(r.p99OverSoloP99() <= p99Ratio))
    why += "p99 gap " + fmt(r.p99OverSoloP99(), "%.2f") + "x solo p99 > " + fmt(p99Ratio, "%.1f") + "x; ";
  return why;
}

}  // namespace pd::bench
