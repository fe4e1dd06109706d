#include "router/pull_cost.h"

#include <algorithm>
#include <cstdio>

namespace pd::router {

namespace {
std::string fmtMs(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f ms", ms);
  return buf;
}
}  // namespace

PullDecision decidePull(const PullInputs& in) {
  PullDecision d;
  if (in.pullTokens <= 0) {
    d.why = "nothing to pull";
    return d;
  }
  if (in.kvBytesPerToken <= 0) {
    d.why = "KV bytes per token not reported";
    return d;
  }
  if (in.targetPrefillTokensPerS <= 0) {
    d.why = "target's prefill rate not measured yet";
    return d;
  }
  if (in.lane.bytesPerS <= 0) {
    d.why = "no measured bandwidth for lane '" + in.lane.transport + "'";
    return d;
  }
  const double bytes = double(in.movedTokens > 0 ? in.movedTokens : in.pullTokens) * double(in.kvBytesPerToken);
  const double diskBytes = double(std::max<int64_t>(0, in.diskTokens)) * double(in.kvBytesPerToken);
  d.pullMs = in.lane.setupMs + 1e3 * bytes / in.lane.bytesPerS + 1e3 * diskBytes / kDiskReadBytesPerS;
  d.recomputeMs = 1e3 * double(in.pullTokens) / in.targetPrefillTokensPerS;
  d.pull = d.pullMs < d.recomputeMs;
  d.why = std::to_string(in.pullTokens) + " tokens over " + in.lane.transport +
          (in.diskTokens > 0 ? " (" + std::to_string(in.diskTokens) + " read from disk)" : "") + ": pull " +
          fmtMs(d.pullMs) + (d.pull ? " < " : " >= ") + "recompute " + fmtMs(d.recomputeMs);
  return d;
}

std::optional<LaneCost> pullLane(const PullCandidate& source, const std::string& targetHost) {
  const LaneCost* best = nullptr;
  for (const LaneCost& l : source.lanes) {
    if (l.bytesPerS <= 0) continue;
    if (l.transport == "cma") {
      // cma moves bytes between processes of one host only.
      if (!source.host.empty() && source.host == targetHost) return l;
      continue;
    }
    if (!best || l.bytesPerS > best->bytesPerS) best = &l;
  }
  if (!best) return std::nullopt;
  return *best;
}

std::optional<PullChoice> choosePull(const std::string& target, const std::string& targetHost, int64_t targetCached,
                                     double targetPrefillTokensPerS, int64_t kvBytesPerToken,
                                     const std::vector<PullCandidate>& candidates, std::string* rejected) {
  std::optional<PullChoice> best;
  int64_t mostHeld = 0;
  std::string mostHeldWhy;
  for (const PullCandidate& c : candidates) {
    if (c.id == target || !c.healthy || !c.servesPulls || c.cachedTokens <= targetCached) continue;
    PullChoice choice;
    choice.source = c.id;
    choice.pullTokens = c.cachedTokens - std::max<int64_t>(0, targetCached);
    choice.prefixTokens = c.cachedTokens;
    const std::optional<LaneCost> lane = pullLane(c, targetHost);
    if (lane) choice.lane = *lane;
    choice.decision =
        decidePull(PullInputs{choice.pullTokens, choice.prefixTokens, kvBytesPerToken, targetPrefillTokensPerS,
                              lane.value_or(LaneCost{"none", 0, 0}), std::min(c.diskTokens, c.cachedTokens)});
    if (!lane) choice.decision.why = "source " + c.id + " reported no measured lane to this host";
    if (choice.pullTokens > mostHeld) {
      mostHeld = choice.pullTokens;
      mostHeldWhy = c.id + ": " + choice.decision.why;
    }
    if (!choice.decision.pull) continue;
    const double saving = choice.decision.recomputeMs - choice.decision.pullMs;
    if (!best || saving > best->decision.recomputeMs - best->decision.pullMs) best = std::move(choice);
  }
  if (!best && rejected) *rejected = mostHeld > 0 ? mostHeldWhy : "no other worker holds more of the prompt";
  return best;
}

}  // namespace pd::router
