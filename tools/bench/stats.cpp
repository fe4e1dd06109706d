#include "tools/bench/stats.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>
#include <sstream>

namespace pd::bench {

double percentileSorted(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return kNaN;
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

double percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return percentileSorted(values, p);
}

double nearestRankSorted(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return kNaN;
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

Summary summarize(std::vector<double> values) {
  Summary s;
  values.erase(std::remove_if(values.begin(), values.end(), [](double v) { return std::isnan(v); }), values.end());
  s.count = values.size();
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  const double n = static_cast<double>(values.size());
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / n;
  double sq = 0;
  for (double v : values) sq += (v - s.mean) * (v - s.mean);
  s.stddev = std::sqrt(sq / n);
  s.min = values.front();
  s.max = values.back();
  s.median = percentileSorted(values, 50);
  s.p90 = percentileSorted(values, 90);
  s.p95 = percentileSorted(values, 95);
  s.p99 = percentileSorted(values, 99);
  return s;
}

double RequestRecord::tpotMs() const {
  if (!ok || outputTokens < 2 || std::isnan(ttftMs) || std::isnan(e2eMs)) return kNaN;
  return (e2eMs - ttftMs) / static_cast<double>(outputTokens - 1);
}

std::string Slo::describe() const {
  std::ostringstream o;
  const char* sep = "";
  auto add = [&](const char* k, const std::optional<double>& v) {
    if (!v) return;
    o << sep << k << "=" << *v;
    sep = ",";
  };
  add("ttft_ms", ttftMs);
  add("itl_ms", itlMs);
  add("tpot_ms", tpotMs);
  add("e2el_ms", e2elMs);
  if (itlMs) o << " (itl: each request's p" << itlPercentile << " gap)";
  return o.str();
}

Result<Slo> parseSlo(std::string_view spec) {
  Slo slo;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string_view::npos) comma = spec.size();
    std::string_view item = spec.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) {
      if (comma == spec.size()) break;
      continue;
    }
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      return invalidArgument("--slo: '" + std::string(item) + "' is not key=value (e.g. ttft_ms=500,itl_ms=50)");
    std::string key(item.substr(0, eq));
    std::string val(item.substr(eq + 1));
    double v = 0;
    auto r = std::from_chars(val.data(), val.data() + val.size(), v);
    if (r.ec != std::errc() || r.ptr != val.data() + val.size() || !(v > 0) || !std::isfinite(v))
      return invalidArgument("--slo: " + key + ": '" + val + "' is not a positive number");
    if (key == "ttft_ms" || key == "ttft")
      slo.ttftMs = v;
    else if (key == "itl_ms" || key == "itl")
      slo.itlMs = v;
    else if (key == "tpot_ms" || key == "tpot")
      slo.tpotMs = v;
    else if (key == "e2el_ms" || key == "e2el")
      slo.e2elMs = v;
    else if (key == "itl_pct") {
      if (v > 100) return invalidArgument("--slo: itl_pct: " + val + " is above 100");
      slo.itlPercentile = v;
    } else {
      return invalidArgument("--slo: unknown key '" + key + "' (known: ttft_ms, itl_ms, tpot_ms, e2el_ms, itl_pct)");
    }
    if (comma == spec.size()) break;
  }
  if (slo.empty()) return invalidArgument("--slo: no target given (e.g. ttft_ms=500,itl_ms=50)");
  return slo;
}

SloCheck checkSlo(const RequestRecord& r, const Slo& slo) {
  SloCheck c;
  if (!r.ok) return c;
  if (slo.ttftMs && !(r.ttftMs <= *slo.ttftMs)) c.missTtft = true;
  if (slo.itlMs && !r.itlsMs.empty() && !(percentile(r.itlsMs, slo.itlPercentile) <= *slo.itlMs)) c.missItl = true;
  if (slo.tpotMs) {
    const double t = r.tpotMs();
    if (!std::isnan(t) && !(t <= *slo.tpotMs)) c.missTpot = true;
  }
  if (slo.e2elMs && !(r.e2eMs <= *slo.e2elMs)) c.missE2el = true;
  c.good = !c.missTtft && !c.missItl && !c.missTpot && !c.missE2el;
  return c;
}

namespace {
std::string errorKind(const RequestRecord& r) {
  if (r.httpStatus != 0 && r.httpStatus != 200) return "HTTP " + std::to_string(r.httpStatus);
  const size_t colon = r.error.find(':');
  return colon == std::string::npos ? r.error : r.error.substr(0, colon);
}
}  // namespace

Aggregate aggregate(const std::vector<RequestRecord>& records, double durationS, const Slo& slo) {
  Aggregate a;
  a.durationS = durationS;
  a.haveSlo = !slo.empty();
  std::vector<double> ttft, tpot, itl, e2el;
  std::map<std::string, std::map<std::string, std::vector<double>>> split;
  std::vector<std::pair<double, int>> events;  // (time, +1 start / -1 end) for concurrency
  double lagSum = 0;
  for (const auto& r : records) {
    const double lag = std::max(0.0, r.lagMs());
    lagSum += lag;
    a.lagMaxMs = std::max(a.lagMaxMs, lag);
    if (lag > kLateStartMs) ++a.lateStarts;
    if (!std::isnan(r.e2eMs)) {
      events.emplace_back(r.startS, +1);
      events.emplace_back(r.startS + r.e2eMs / 1000.0, -1);
    }
    if (!r.ok) {
      ++a.failed;
      ++a.errorsByKind[errorKind(r)];
      if (r.httpStatus == 429) {
        ++a.shed;
        if (!(r.startS >= a.firstShedS)) a.firstShedS = r.startS;
      }
      continue;
    }
    ++a.completed;
    a.totalInputTokens += r.promptTokens;
    a.totalOutputTokens += r.outputTokens;
    ttft.push_back(r.ttftMs);
    e2el.push_back(r.e2eMs);
    tpot.push_back(r.tpotMs());
    itl.insert(itl.end(), r.itlsMs.begin(), r.itlsMs.end());
    for (const auto& [phase, ms] : r.ttftSplitMs) split[r.ttftSplitRoute][phase].push_back(ms);
    if (a.haveSlo) {
      const SloCheck c = checkSlo(r, slo);
      a.goodRequests += c.good;
      a.missedTtft += c.missTtft;
      a.missedItl += c.missItl;
      a.missedTpot += c.missTpot;
      a.missedE2el += c.missE2el;
    }
  }
  if (!records.empty()) a.lagMeanMs = lagSum / static_cast<double>(records.size());
  a.ttft = summarize(std::move(ttft));
  a.tpot = summarize(std::move(tpot));
  a.itl = summarize(std::move(itl));
  a.e2el = summarize(std::move(e2el));
  for (auto& [route, phases] : split)
    for (auto& [phase, values] : phases) a.ttftSplit[route][phase] = summarize(std::move(values));
  if (durationS > 0) {
    a.requestThroughput = static_cast<double>(a.completed) / durationS;
    a.outputThroughput = static_cast<double>(a.totalOutputTokens) / durationS;
    a.totalTokenThroughput = static_cast<double>(a.totalInputTokens + a.totalOutputTokens) / durationS;
    a.requestGoodput = static_cast<double>(a.goodRequests) / durationS;
  }
  // Ends sort before starts at the same instant, so back-to-back requests do not overlap.
  std::sort(events.begin(), events.end());
  int64_t cur = 0;
  for (const auto& e : events) {
    cur += e.second;
    a.maxConcurrentRequests = std::max(a.maxConcurrentRequests, cur);
  }
  const TimeSeries ts = timeSeries(records, durationS);
  for (double v : ts.outputTokensPerS) a.maxOutputTokensPerS = std::max(a.maxOutputTokensPerS, v);
  return a;
}

TimeSeries timeSeries(const std::vector<RequestRecord>& records, double durationS, double binS) {
  if (!(binS > 0)) binS = 1.0;
  double end = durationS;
  for (const auto& r : records)
    if (!std::isnan(r.e2eMs)) end = std::max(end, r.startS + r.e2eMs / 1000.0);
  const size_t bins = static_cast<size_t>(std::max(1.0, std::ceil(end / binS - 1e-9)));
  TimeSeries ts;
  ts.binS = binS;
  ts.outputTokensPerS.assign(bins, 0);
  ts.completedPerS.assign(bins, 0);
  ts.inFlight.assign(bins, 0);
  const double perS = 1.0 / binS;
  auto bin = [&](double t) { return std::min(bins - 1, static_cast<size_t>(std::max(0.0, t / binS))); };
  for (const auto& r : records) {
    if (std::isnan(r.e2eMs)) continue;
    const double endS = r.startS + r.e2eMs / 1000.0;
    for (size_t b = static_cast<size_t>(std::ceil(r.startS / binS)); b < bins && static_cast<double>(b) * binS < endS;
         ++b)
      ts.inFlight[b] += 1;
    if (!r.ok) continue;
    ts.completedPerS[bin(endS)] += perS;
    if (std::isnan(r.ttftMs)) continue;
    // Token arrival times: the first at TTFT, then one per recorded gap.
    double t = r.startS + r.ttftMs / 1000.0;
    double counted = 1;
    ts.outputTokensPerS[bin(t)] += perS;
    for (double g : r.itlsMs) {
      t += g / 1000.0;
      ts.outputTokensPerS[bin(t)] += perS;
      counted += 1;
    }
    // Tokens the usage reported beyond those seen in chunks land at the end of the stream.
    if (static_cast<double>(r.outputTokens) > counted)
      ts.outputTokensPerS[bin(endS)] += (static_cast<double>(r.outputTokens) - counted) * perS;
  }
  return ts;
}

}  // namespace pd::bench
