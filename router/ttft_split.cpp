#include "router/ttft_split.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace pd::router {
namespace {

double nonNegative(double s) { return std::isfinite(s) ? std::max(0.0, s) : 0.0; }

// Milliseconds, rounded to microseconds: enough for any phase, short in JSON.
double ms(double seconds) { return std::round(seconds * 1e6) / 1e3; }

}  // namespace

TtftSplit assembleTtftSplit(double ttftS, double routerQueueS, const proto::Timings& w) {
  TtftSplit s;
  // Recomputed: the prompt was computed here after a failed remote prefill; its phases are
  // the colocated ones (the failed attempt is inside prefill_compute).
  const bool recomputed = w.route() == proto::ROUTE_DISAGGREGATED && w.recomputed();
  const bool disaggregated = w.route() == proto::ROUTE_DISAGGREGATED && !recomputed;
  s.route = recomputed ? kRecomputedRoute : disaggregated ? "disaggregated" : "colocated";
  s.ttftS = nonNegative(ttftS);
  auto add = [&](const char* phase, double seconds) { s.phases.emplace_back(phase, nonNegative(seconds)); };
  add("router_queue", routerQueueS);
  add("decode_admission", w.queue_ms() / 1e3);
  // A peer pull (docs/kv_cache.md, "Peer pulls"): its time, done or fallen back, before the
  // local prefill of the rest.
  if (w.pull_ms() > 0) add("kv_pull", w.pull_ms() / 1e3);
  if (disaggregated) {
    add("kv_connect", w.kv_connect_ms() / 1e3);
    add("prefill_queue", w.prefill_queue_ms() / 1e3);
  }
  add("prefill_compute", w.prefill_ms() / 1e3);
  if (disaggregated) {
    add("kv_transfer", w.transfer_ms() / 1e3);
    add("decode_first_token", w.handoff_ms() / 1e3);
  }
  double sum = 0;
  for (const auto& [phase, seconds] : s.phases) sum += seconds;
  add("other", s.ttftS - sum);
  return s;
}

nlohmann::json ttftSplitJson(const TtftSplit& split) {
  nlohmann::json j = {{"route", split.route}, {"ttft_ms", ms(split.ttftS)}};
  for (const auto& [phase, seconds] : split.phases) j[phase + "_ms"] = ms(seconds);
  return j;
}

std::string serverTimingHeader(const TtftSplit& split) {
  std::string out;
  char buf[64];
  auto add = [&](const std::string& name, double seconds) {
    std::snprintf(buf, sizeof buf, ";dur=%.3f", seconds * 1e3);
    if (!out.empty()) out += ", ";
    out += name + buf;
  };
  for (const auto& [phase, seconds] : split.phases) add(phase, seconds);
  add("ttft", split.ttftS);
  return out;
}

}  // namespace pd::router
