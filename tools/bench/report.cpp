#include "tools/bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pd::bench {
namespace {

using nlohmann::json;

std::string fmt(double v, int prec = 2) {
  if (std::isnan(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

json num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// The TTFT split's phases in the order a request passes them (router/ttft_split.h).
constexpr const char* kPhaseOrder[] = {"router_queue",    "decode_admission", "kv_connect",         "prefill_queue",
                                       "prefill_compute", "kv_transfer",      "decode_first_token", "other"};

// The phases present in that order, then any the server added that this build does not know,
// then the TTFT itself.
std::vector<std::string> phaseOrder(const std::map<std::string, Summary>& phases) {
  std::vector<std::string> out;
  for (const char* p : kPhaseOrder)
    if (phases.count(p)) out.push_back(p);
  for (const auto& [p, s] : phases)
    if (p != "ttft" && std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  if (phases.count("ttft")) out.push_back("ttft");
  return out;
}

void addMetric(json& j, const char* name, const Summary& s) {
  const std::string n(name);
  j["mean_" + n + "_ms"] = num(s.mean);
  j["median_" + n + "_ms"] = num(s.median);
  j["std_" + n + "_ms"] = num(s.stddev);
  j["p90_" + n + "_ms"] = num(s.p90);
  j["p95_" + n + "_ms"] = num(s.p95);
  j["p99_" + n + "_ms"] = num(s.p99);
  j["min_" + n + "_ms"] = num(s.min);
  j["max_" + n + "_ms"] = num(s.max);
}

}  // namespace

double sloAttainment(const Aggregate& a) {
  const int64_t n = a.completed + a.failed;
  if (!a.haveSlo || n == 0) return kNaN;
  return static_cast<double>(a.goodRequests) / static_cast<double>(n);
}

std::vector<PhaseResult> phaseResults(const RunInfo& info, const std::vector<RequestRecord>& records) {
  std::vector<PhaseResult> out;
  for (const auto& w : info.phases) {
    std::vector<RequestRecord> in;
    for (const auto& r : records)
      if (r.scheduledS >= w.startS && r.scheduledS < w.endS) in.push_back(r);
    PhaseResult pr;
    pr.window = w;
    pr.requests = static_cast<int64_t>(in.size());
    pr.agg = aggregate(in, w.endS - w.startS, info.slo);
    pr.sloAttainment = sloAttainment(pr.agg);
    out.push_back(std::move(pr));
  }
  return out;
}

Status writeFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return unavailable(path + ": cannot open for writing");
  out << text;
  out.flush();
  if (!out) return unavailable(path + ": write failed");
  return Status::ok();
}

std::string htmlEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o.push_back(c);
    }
  }
  return o;
}

namespace {

std::string csvField(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) {
    if (c == '"')
      o += "\"\"";
    else if (c == '\n' || c == '\r')
      o += ' ';
    else
      o.push_back(c);
  }
  return o + "\"";
}

// Axis ticks at 1/2/5 x 10^k steps covering [lo, hi].
std::vector<double> niceTicks(double lo, double hi, int target = 5) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step)
    t.push_back(std::abs(v) < step * 1e-9 ? 0 : v);
  return t;
}

std::string tickLabel(double v) {
  char buf[32];
  if (std::abs(v) >= 10000)
    std::snprintf(buf, sizeof buf, "%.0fk", v / 1000);
  else if (std::abs(v) >= 100 || v == std::floor(v))
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else
    std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace

std::string formatTable(const RunInfo& info, const Aggregate& a, const std::vector<RequestRecord>& records) {
  std::ostringstream o;
  auto row = [&](const std::string& k, const std::string& v) { o << std::left << std::setw(42) << k << v << "\n"; };
  auto sect = [&](const std::string& title) {
    const int pad = std::max(0, 50 - static_cast<int>(title.size()));
    o << std::string(static_cast<size_t>(pad / 2), '-') << title << std::string(static_cast<size_t>(pad - pad / 2), '-')
      << "\n";
  };
  o << "============ Serving Benchmark Result ============\n";
  row("Successful requests:", std::to_string(a.completed));
  row("Failed requests:", std::to_string(a.failed));
  if (info.maxConcurrency > 0) row("Maximum request concurrency:", std::to_string(info.maxConcurrency));
  if (info.requestRate > 0) row("Request rate configured (RPS):", fmt(info.requestRate));
  row("Benchmark duration (s):", fmt(a.durationS));
  row("Total input tokens:", std::to_string(a.totalInputTokens));
  row("Total generated tokens:", std::to_string(a.totalOutputTokens));
  row("Request throughput (req/s):", fmt(a.requestThroughput));
  if (a.haveSlo) row("Request goodput (req/s):", fmt(a.requestGoodput));
  row("Output token throughput (tok/s):", fmt(a.outputThroughput));
  row("Peak output token throughput (tok/s):", fmt(a.maxOutputTokensPerS));
  row("Peak concurrent requests:", std::to_string(a.maxConcurrentRequests));
  row("Total Token throughput (tok/s):", fmt(a.totalTokenThroughput));
  auto metric = [&](const char* title, const char* abbr, const Summary& s) {
    sect(title);
    const std::string n(abbr);
    row("Mean " + n + " (ms):", fmt(s.mean));
    row("Median " + n + " (ms):", fmt(s.median));
    row("P90 " + n + " (ms):", fmt(s.p90));
    row("P95 " + n + " (ms):", fmt(s.p95));
    row("P99 " + n + " (ms):", fmt(s.p99));
  };
  metric("Time to First Token", "TTFT", a.ttft);
  metric("Time per Output Token (excl. 1st token)", "TPOT", a.tpot);
  metric("Inter-token Latency", "ITL", a.itl);
  metric("End-to-end Latency", "E2EL", a.e2el);
  for (const auto& [route, phases] : a.ttftSplit) {
    sect("TTFT split, " + (route.empty() ? std::string("-") : route) + " (server, ms)");
    o << std::left << std::setw(22) << "phase" << std::right << std::setw(10) << "p50" << std::setw(10) << "p90"
      << std::setw(10) << "p99" << std::setw(8) << "n"
      << "\n";
    for (const auto& phase : phaseOrder(phases)) {
      const Summary& s = phases.at(phase);
      o << std::left << std::setw(22) << phase << std::right << std::setw(10) << fmt(s.median, 3) << std::setw(10)
        << fmt(s.p90, 3) << std::setw(10) << fmt(s.p99, 3) << std::setw(8) << s.count << "\n";
    }
  }
  if (a.haveSlo) {
    sect("SLO " + info.slo.describe());
    row("Requests meeting every target:", std::to_string(a.goodRequests) + " of " + std::to_string(a.completed));
    if (info.slo.ttftMs) row("Missed TTFT:", std::to_string(a.missedTtft));
    if (info.slo.itlMs) row("Missed ITL:", std::to_string(a.missedItl));
    if (info.slo.tpotMs) row("Missed TPOT:", std::to_string(a.missedTpot));
    if (info.slo.e2elMs) row("Missed E2EL:", std::to_string(a.missedE2el));
    row("SLO attainment (good / sent):", fmt(100 * sloAttainment(a), 1) + "%");
  }
  if (!info.phases.empty()) {
    sect("Phases");
    o << std::left << std::setw(7) << "phase" << std::right << std::setw(9) << "start s" << std::setw(6) << "reqs"
      << std::setw(6) << "good" << std::setw(9) << "attain%" << std::setw(10) << "goodput" << std::setw(11)
      << "p99 TTFT" << std::setw(10) << "p99 ITL"
      << "\n";
    int k = 0;
    for (const auto& ph : phaseResults(info, records)) {
      o << std::left << std::setw(7) << ++k << std::right << std::setw(9) << fmt(ph.window.startS, 1) << std::setw(6)
        << ph.requests << std::setw(6) << ph.agg.goodRequests << std::setw(9)
        << (std::isnan(ph.sloAttainment) ? std::string("-") : fmt(100 * ph.sloAttainment, 1)) << std::setw(10)
        << (ph.agg.haveSlo ? fmt(ph.agg.requestGoodput, 3) : std::string("-")) << std::setw(11)
        << fmt(ph.agg.ttft.p99, 1) << std::setw(10) << fmt(ph.agg.itl.p99, 1) << "\n";
    }
    o << "  (phase k: requests scheduled in it; goodput = good / phase length; ms)\n";
  }
  if (info.haveTimeline)
    row("Metrics timeline:", std::to_string(info.timeline.samples.size()) + " scrapes, " +
                                 std::to_string(info.timeline.failedScrapes()) + " failed, " +
                                 std::to_string(info.timeline.info.size()) + " series");
  sect("Generator");
  row("Start lag mean / max (ms):", fmt(a.lagMeanMs, 3) + " / " + fmt(a.lagMaxMs, 3));
  row("Late starts (> " + fmt(kLateStartMs, 0) + " ms):", std::to_string(a.lateStarts));
  if (a.lateStarts > 0 && a.lagMaxMs > 100)
    o << "  note: the generator itself was late; figures may understate the server's capacity\n";
  if (a.shed > 0) {
    sect("Shed (HTTP 429)");
    row("Requests shed:",
        std::to_string(a.shed) + " (" + fmt(100.0 * double(a.shed) / double(a.completed + a.failed), 1) + "%)");
    row("First 429 sent at (s):", fmt(a.firstShedS, 2));
  }
  if (!a.errorsByKind.empty()) {
    sect("Errors");
    for (const auto& [k, v] : a.errorsByKind) row(k + ":", std::to_string(v));
  }
  if (!info.abortReason.empty()) o << "ABORTED: " << info.abortReason << "\n";
  o << "==================================================\n";
  return o.str();
}

std::string resultJson(const RunInfo& info, const Aggregate& a, const std::vector<RequestRecord>& records) {
  json j;
  j["date"] = info.date;
  j["backend"] = info.backend;
  j["endpoint"] = info.endpoint;
  j["base_url"] = info.url;
  j["model_id"] = info.model;
  j["tokenizer_id"] = info.promptSource;
  j["num_prompts"] = info.numPrompts;
  j["request_rate"] = info.requestRate > 0 ? json(info.requestRate) : json("inf");
  j["burstiness"] = 1.0;
  j["max_concurrency"] = info.maxConcurrency > 0 ? json(info.maxConcurrency) : json(nullptr);
  j["duration"] = a.durationS;
  j["completed"] = a.completed;
  j["failed"] = a.failed;
  j["total_input_tokens"] = a.totalInputTokens;
  j["total_output_tokens"] = a.totalOutputTokens;
  j["request_throughput"] = a.requestThroughput;
  j["request_goodput"] = a.haveSlo ? json(a.requestGoodput) : json(nullptr);
  j["output_throughput"] = a.outputThroughput;
  j["total_token_throughput"] = a.totalTokenThroughput;
  j["max_output_tokens_per_s"] = a.maxOutputTokensPerS;
  j["max_concurrent_requests"] = a.maxConcurrentRequests;
  addMetric(j, "ttft", a.ttft);
  addMetric(j, "tpot", a.tpot);
  addMetric(j, "itl", a.itl);
  addMetric(j, "e2el", a.e2el);
  json inputLens = json::array(), outputLens = json::array(), ttfts = json::array(), itls = json::array(),
       e2els = json::array(), errors = json::array();
  for (const auto& r : records) {
    inputLens.push_back(r.promptTokens);
    outputLens.push_back(r.outputTokens);
    ttfts.push_back(num(r.ttftMs / 1000.0));
    e2els.push_back(num(r.e2eMs / 1000.0));
    json g = json::array();
    for (double v : r.itlsMs) g.push_back(v / 1000.0);
    itls.push_back(std::move(g));
    errors.push_back(r.error);
  }
  j["input_lens"] = std::move(inputLens);
  j["output_lens"] = std::move(outputLens);
  j["ttfts"] = std::move(ttfts);
  j["itls"] = std::move(itls);
  j["e2els"] = std::move(e2els);
  j["errors"] = std::move(errors);
  json p;
  p["format_version"] = 1;
  p["command"] = info.commandLine;
  p["workload"] = info.workload;
  p["arrival"] = info.arrival;
  p["time_scale"] = info.timeScale;
  p["seed"] = info.seed;
  p["warmup_requests"] = info.warmupRequests;
  p["planned_requests"] = info.plannedRequests;
  p["prompt_source"] = info.promptSource;
  json slo = json::object();
  if (info.slo.ttftMs) slo["ttft_ms"] = *info.slo.ttftMs;
  if (info.slo.itlMs) {
    slo["itl_ms"] = *info.slo.itlMs;
    slo["itl_pct"] = info.slo.itlPercentile;
  }
  if (info.slo.tpotMs) slo["tpot_ms"] = *info.slo.tpotMs;
  if (info.slo.e2elMs) slo["e2el_ms"] = *info.slo.e2elMs;
  p["slo"] = slo;
  p["good_requests"] = a.goodRequests;
  p["slo_missed"] = {{"ttft", a.missedTtft}, {"itl", a.missedItl}, {"tpot", a.missedTpot}, {"e2el", a.missedE2el}};
  p["generator_lag"] = {{"mean_ms", a.lagMeanMs},
                        {"max_ms", a.lagMaxMs},
                        {"late_starts", a.lateStarts},
                        {"late_threshold_ms", kLateStartMs}};
  json kinds = json::object();
  for (const auto& [k, v] : a.errorsByKind) kinds[k] = v;
  p["errors_by_kind"] = kinds;
  json split = json::object();
  for (const auto& [route, phases] : a.ttftSplit)
    for (const auto& [phase, s] : phases)
      split[route][phase] = {{"count", s.count},
                             {"mean_ms", num(s.mean)},
                             {"p50_ms", num(s.median)},
                             {"p90_ms", num(s.p90)},
                             {"p99_ms", num(s.p99)}};
  p["ttft_split"] = split;
  p["shed_requests"] = a.shed;
  p["first_shed_s"] = std::isnan(a.firstShedS) ? json(nullptr) : json(a.firstShedS);
  p["aborted"] = info.abortReason.empty() ? json(nullptr) : json(info.abortReason);
  p["slo_attainment"] = num(sloAttainment(a));
  if (!info.phases.empty()) {
    json phases = json::array();
    for (const auto& ph : phaseResults(info, records))
      phases.push_back({{"start_s", ph.window.startS},
                        {"end_s", ph.window.endS},
                        {"workload", ph.window.spec.describe()},
                        {"prompt_len", ph.window.spec.promptLen.describe()},
                        {"output_len", ph.window.spec.outputLen.describe()},
                        {"rate", ph.window.spec.rate},
                        {"requests", ph.requests},
                        {"completed", ph.agg.completed},
                        {"failed", ph.agg.failed},
                        {"good_requests", ph.agg.goodRequests},
                        {"slo_attainment", num(ph.sloAttainment)},
                        {"request_goodput", ph.agg.haveSlo ? json(ph.agg.requestGoodput) : json(nullptr)},
                        {"p99_ttft_ms", num(ph.agg.ttft.p99)},
                        {"p99_itl_ms", num(ph.agg.itl.p99)},
                        {"mean_ttft_ms", num(ph.agg.ttft.mean)},
                        {"mean_itl_ms", num(ph.agg.itl.mean)}});
    p["phases"] = std::move(phases);
  }
  if (info.haveTimeline) p["timeline"] = timelineJson(info.timeline);
  j["pdserve"] = std::move(p);
  return j.dump(1);
}

Status writeJson(const std::string& path, const RunInfo& info, const Aggregate& a,
                 const std::vector<RequestRecord>& records) {
  return writeFile(path, resultJson(info, a, records) + "\n");
}

Status writeCsv(const std::string& path, const std::vector<RequestRecord>& records, const Slo& slo) {
  std::ostringstream o;
  o << "index,scheduled_s,eligible_s,start_s,lag_ms,ok,http_status,prompt_tokens,planned_prompt_tokens,"
       "output_tokens,planned_output_tokens,chunk_tokens,ttft_ms,tpot_ms,e2el_ms,itl_count,itl_mean_ms,"
       "itl_p99_ms,itl_max_ms,slo_ok,finish_reason,error,route";
  for (const char* phase : kPhaseOrder) o << ',' << phase << "_ms";
  o << "\n";
  for (const auto& r : records) {
    const Summary g = summarize(r.itlsMs);
    const bool sloOk = slo.empty() ? r.ok : checkSlo(r, slo).good;
    o << r.index << ',' << fmt(r.scheduledS, 6) << ',' << fmt(r.eligibleS, 6) << ',' << fmt(r.startS, 6) << ','
      << fmt(r.lagMs(), 3) << ',' << (r.ok ? 1 : 0) << ',' << r.httpStatus << ',' << r.promptTokens << ','
      << r.plannedPromptTokens << ',' << r.outputTokens << ',' << r.plannedOutputTokens << ',' << r.chunkTokens << ','
      << fmt(r.ttftMs, 3) << ',' << fmt(r.tpotMs(), 3) << ',' << fmt(r.e2eMs, 3) << ',' << r.itlsMs.size() << ','
      << fmt(g.mean, 3) << ',' << fmt(g.p99, 3) << ',' << fmt(g.max, 3) << ',' << (sloOk ? 1 : 0) << ','
      << csvField(r.finishReason) << ',' << csvField(r.error) << ','
      << csvField(r.ttftSplitRoute.empty() ? "-" : r.ttftSplitRoute);
    for (const char* phase : kPhaseOrder) {
      const auto it = r.ttftSplitMs.find(phase);
      o << ',' << fmt(it == r.ttftSplitMs.end() ? kNaN : it->second, 3);
    }
    o << "\n";
  }
  return writeFile(path, o.str());
}

std::vector<std::pair<double, double>> cdfPoints(std::vector<double> values, size_t maxPoints) {
  values.erase(std::remove_if(values.begin(), values.end(), [](double v) { return !std::isfinite(v); }), values.end());
  std::vector<std::pair<double, double>> pts;
  if (values.empty() || maxPoints < 2) return pts;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const size_t m = std::min(n, maxPoints);
  for (size_t k = 0; k < m; ++k) {
    const size_t idx = m == n ? k
                              : static_cast<size_t>(std::llround(static_cast<double>(k) * static_cast<double>(n - 1) /
                                                                 static_cast<double>(m - 1)));
    pts.emplace_back(values[idx], static_cast<double>(idx + 1) / static_cast<double>(n));
  }
  return pts;
}

std::string svgChart(const std::string& title, const std::string& xLabel, const std::string& yLabel,
                     const std::vector<ChartSeries>& series, const std::vector<ChartMarker>& xMarkers, bool logX) {
  const double W = 720, H = 360, L = 70, R = 20, T = 36, B = 50;
  double xmin = INFINITY, xmax = -INFINITY, ymin = 0, ymax = -INFINITY;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      if (!logX || x > 0) xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
      ymin = std::min(ymin, y);
    }
  for (const auto& m : xMarkers) {
    xmin = std::min(xmin, m.x);
    xmax = std::max(xmax, m.x * 1.05);
  }
  if (!std::isfinite(xmin)) xmin = 0, xmax = 1;
  if (!std::isfinite(ymax)) ymax = 1;
  if (!logX && xmin > 0 && xmin < 0.25 * xmax) xmin = 0;
  if (xmax <= xmin) xmax = xmin + 1;
  if (ymax <= ymin) ymax = ymin + 1;
  ymax += (ymax - ymin) * 0.04;  // headroom so the top points are not on the frame
  std::vector<double> xt;
  if (logX) {
    // Whole decades; values <= 0 (zero gaps) sit on the left edge.
    if (!(xmin > 0)) xmin = 1;
    xmin = std::pow(10.0, std::floor(std::log10(xmin)));
    xmax = std::pow(10.0, std::ceil(std::log10(std::max(xmax, xmin * 10))));
    for (double d = xmin; d <= xmax * 1.0001; d *= 10)
      for (double k : {1.0, 2.0, 5.0})
        if (d * k <= xmax * 1.0001) xt.push_back(d * k);
  } else {
    xt = niceTicks(xmin, xmax);
    xmin = std::min(xmin, xt.front());
    xmax = std::max(xmax, xt.back());
  }
  const auto yt = niceTicks(ymin, ymax);
  ymax = std::max(ymax, yt.back());
  auto X = [&](double x) {
    if (logX)
      return L +
             (std::log10(std::max(x, xmin)) - std::log10(xmin)) / (std::log10(xmax) - std::log10(xmin)) * (W - L - R);
    return L + (x - xmin) / (xmax - xmin) * (W - L - R);
  };
  auto Y = [&](double y) { return H - B - (y - ymin) / (ymax - ymin) * (H - T - B); };
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << ' ' << H << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"20\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">"
    << htmlEscape(title) << "</text>\n";
  for (double t : yt) {
    o << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << Y(t) << "\" y2=\"" << Y(t)
      << "\" stroke=\"#e4e4e4\"/><text x=\"" << L - 6 << "\" y=\"" << Y(t) + 4 << "\" text-anchor=\"end\">"
      << tickLabel(t) << "</text>\n";
  }
  for (double t : xt) {
    o << "<line x1=\"" << X(t) << "\" x2=\"" << X(t) << "\" y1=\"" << T << "\" y2=\"" << H - B
      << "\" stroke=\"#f0f0f0\"/><text x=\"" << X(t) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">"
      << tickLabel(t) << "</text>\n";
  }
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
    << "\" fill=\"none\" stroke=\"#888\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">" << htmlEscape(xLabel)
    << "</text>\n";
  o << "<text transform=\"translate(16," << (T + H - B) / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
    << htmlEscape(yLabel) << "</text>\n";
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    if (s.style == ChartSeries::Style::kDots) {
      o << "<g fill=\"" << s.color << "\" fill-opacity=\"0.55\">";
      for (const auto& [x, y] : s.points) o << "<circle cx=\"" << X(x) << "\" cy=\"" << Y(y) << "\" r=\"2\"/>";
      o << "</g>\n";
    } else {
      o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.6\" points=\"";
      double prevY = 0;
      bool first = true;
      for (const auto& [x, y] : s.points) {
        if (s.style == ChartSeries::Style::kStep && !first) o << X(x) << ',' << Y(prevY) << ' ';
        o << X(x) << ',' << Y(y) << ' ';
        prevY = y;
        first = false;
      }
      o << "\"/>\n";
    }
  }
  for (const auto& m : xMarkers) {
    o << "<line x1=\"" << X(m.x) << "\" x2=\"" << X(m.x) << "\" y1=\"" << T << "\" y2=\"" << H - B
      << "\" stroke=\"#d62728\" stroke-dasharray=\"5,4\" stroke-width=\"1.5\"/>";
    // Labels near the right edge go on the line's left so they stay inside the chart.
    const bool left = X(m.x) > W - R - 90;
    o << "<text x=\"" << (left ? X(m.x) - 4 : X(m.x) + 4) << "\" y=\"" << T + 14 << "\" fill=\"#d62728\""
      << (left ? " text-anchor=\"end\"" : "") << ">" << htmlEscape(m.label) << "</text>\n";
  }
  double ly = T + 14;
  for (const auto& s : series) {
    o << "<rect x=\"" << W - R - 170 << "\" y=\"" << ly + 10 << "\" width=\"10\" height=\"10\" fill=\"" << s.color
      << "\"/><text x=\"" << W - R - 155 << "\" y=\"" << ly + 19 << "\">" << htmlEscape(s.name) << "</text>\n";
    ly += 16;
  }
  o << "</svg>\n";
  return o.str();
}

namespace {

// Per-bin p99 and max of (time, value) points over bins of binS seconds; empty bins are left
// out (no point), so a line does not drop to zero where nothing happened.
void binnedTails(const std::vector<std::pair<double, double>>& pts, double binS,
                 std::vector<std::pair<double, double>>* p99, std::vector<std::pair<double, double>>* mx) {
  std::map<int64_t, std::vector<double>> bins;
  for (const auto& [t, v] : pts)
    if (std::isfinite(v) && t >= 0) bins[static_cast<int64_t>(std::floor(t / binS))].push_back(v);
  for (auto& [b, vs] : bins) {
    const double mid = (static_cast<double>(b) + 0.5) * binS;
    p99->emplace_back(mid, percentile(vs, 99));
    mx->emplace_back(mid, *std::max_element(vs.begin(), vs.end()));
  }
}

// The charts over time of a phased or scraped run: the pools' workers and desired replicas,
// the routing threshold, and the client's TTFT and ITL tails against the SLO, with the
// router's own observed percentile; phase boundaries are marked on each.
std::string overTimeSection(const RunInfo& info, const std::vector<RequestRecord>& records, double binS) {
  std::vector<ChartMarker> marks;
  for (size_t k = 0; k < info.phases.size(); ++k)
    marks.push_back({info.phases[k].startS, "phase " + std::to_string(k + 1)});
  double span = 0;
  for (const auto& r : records)
    if (std::isfinite(r.e2eMs)) span = std::max(span, r.startS + r.e2eMs / 1000.0);
  if (!info.phases.empty()) span = std::max(span, info.phases.back().endS);
  const MetricsTimeline& tl = info.timeline;
  // Only the run's own window (warm-up scrapes are before 0).
  auto inRun = [&](std::vector<std::pair<double, double>> v, double scale = 1) {
    std::vector<std::pair<double, double>> o;
    for (auto [t, y] : v)
      if (t >= 0 && std::isfinite(y)) o.emplace_back(t, y * scale);
    return o;
  };
  std::ostringstream o;
  o << "<h2>Over time</h2>\n";
  if (!info.phases.empty()) {
    o << "<table><tr><th>phase</th><th>from s</th><th>to s</th><th class=\"k\">workload</th><th>requests</th>"
         "<th>good</th><th>SLO attainment</th><th>goodput req/s</th><th>p99 TTFT ms</th><th>p99 ITL ms</th></tr>";
    int k = 0;
    for (const auto& ph : phaseResults(info, records))
      o << "<tr><td>" << ++k << "</td><td>" << fmt(ph.window.startS, 1) << "</td><td>" << fmt(ph.window.endS, 1)
        << "</td><td class=\"k\">" << htmlEscape(ph.window.spec.describe()) << "</td><td>" << ph.requests << "</td><td>"
        << ph.agg.goodRequests << "</td><td>"
        << (std::isnan(ph.sloAttainment) ? std::string("-") : fmt(100 * ph.sloAttainment, 1) + "%") << "</td><td>"
        << (ph.agg.haveSlo ? fmt(ph.agg.requestGoodput, 3) : std::string("-")) << "</td><td>" << fmt(ph.agg.ttft.p99, 1)
        << "</td><td>" << fmt(ph.agg.itl.p99, 1) << "</td></tr>";
    o << "</table>\n";
  }
  static const char* const kActual[] = {"#1f77b4", "#2ca02c", "#9467bd", "#8c564b"};
  static const char* const kDesired[] = {"#aec7e8", "#98df8a", "#c5b0d5", "#c49c94"};
  if (info.haveTimeline) {
    o << "<p>Router metrics from " << htmlEscape(tl.url) << " every " << tl.intervalMs << " ms: " << tl.samples.size()
      << " scrapes, " << tl.failedScrapes() << " failed (gaps).</p>\n";
    // Pools: every *_workers{pool} series and the matching desired replicas.
    std::vector<std::string> pools;
    for (const auto& [key, meta] : tl.info)
      if (meta.labels.count("pool") &&
          (meta.name == "pdserve_desired_replicas" ||
           (meta.name.size() > 8 && meta.name.compare(meta.name.size() - 8, 8, "_workers") == 0)))
        if (std::find(pools.begin(), pools.end(), meta.labels.at("pool")) == pools.end())
          pools.push_back(meta.labels.at("pool"));
    std::vector<ChartSeries> replicas;
    for (size_t i = 0; i < pools.size(); ++i) {
      for (const auto& [key, meta] : tl.info) {
        if (!meta.labels.count("pool") || meta.labels.at("pool") != pools[i]) continue;
        const bool desired = meta.name == "pdserve_desired_replicas";
        const bool workers = meta.name.size() > 8 && meta.name.compare(meta.name.size() - 8, 8, "_workers") == 0;
        if (!desired && !workers) continue;
        replicas.push_back({pools[i] + (desired ? " desired" : " workers"), (desired ? kDesired : kActual)[i % 4],
                            inRun(tl.series(key)), ChartSeries::Style::kStep});
      }
    }
    if (!replicas.empty())
      o << svgChart("Replicas per pool: workers and desired (router)", "time (s)", "replicas", replicas, marks);
    for (const auto& [key, meta] : tl.info)
      if (meta.name == "pdserve_short_prompt_tokens")
        o << svgChart("Routing threshold (pdserve_short_prompt_tokens)", "time (s)", "uncached prompt tokens",
                      {{"threshold", "#ff7f0e", inRun(tl.series(key)), ChartSeries::Style::kStep}}, marks);
  }
  std::vector<std::pair<double, double>> ttfts, gaps;
  for (const auto& r : records) {
    if (!r.ok || !std::isfinite(r.ttftMs)) continue;
    ttfts.emplace_back(r.startS, r.ttftMs);
    double t = r.startS + r.ttftMs / 1000.0;
    for (double g : r.itlsMs) {
      t += g / 1000.0;
      gaps.emplace_back(t, g);
    }
  }
  auto latencyChart = [&](const std::string& what, const std::vector<std::pair<double, double>>& pts,
                          const std::optional<double>& slo, const std::string& pool, const char* color) {
    std::vector<std::pair<double, double>> p99, mx;
    binnedTails(pts, binS, &p99, &mx);
    std::vector<ChartSeries> series{{"client p99 per bin", color, p99, ChartSeries::Style::kLine},
                                    {"client max per bin", "#bbbbbb", mx, ChartSeries::Style::kDots}};
    if (slo)
      series.push_back({"SLO " + fmt(*slo, 0) + " ms",
                        "#d62728",
                        {{0, *slo}, {std::max(span, binS), *slo}},
                        ChartSeries::Style::kLine});
    if (info.haveTimeline)
      for (const auto& [key, meta] : tl.info)
        if (meta.name == "pdserve_slo_observed_seconds" && meta.labels.count("pool") && meta.labels.at("pool") == pool)
          series.push_back(
              {"router " + pool + " window pct", "#17becf", inRun(tl.series(key), 1000.0), ChartSeries::Style::kStep});
    const std::string note = " (" + fmt(binS, binS < 1 ? 1 : 0) + " s bins)";
    o << svgChart(what + " over time" + note, "time (s)", "ms", series, marks);
  };
  latencyChart("TTFT (by request start)", ttfts, info.slo.ttftMs, "prefill", "#1f77b4");
  latencyChart("ITL (by token arrival)", gaps, info.slo.itlMs, "decode", "#2ca02c");
  return o.str();
}

}  // namespace

std::string htmlReport(const RunInfo& info, const Aggregate& a, const std::vector<RequestRecord>& records,
                       double durationS) {
  std::vector<double> ttft, itl;
  std::vector<std::pair<double, double>> ttftOverTime, tpotOverTime, e2eOverTime;
  for (const auto& r : records) {
    if (!r.ok) continue;
    ttft.push_back(r.ttftMs);
    itl.insert(itl.end(), r.itlsMs.begin(), r.itlsMs.end());
    ttftOverTime.emplace_back(r.startS, r.ttftMs);
    const double tpot = r.tpotMs();
    if (std::isfinite(tpot)) tpotOverTime.emplace_back(r.startS, tpot);
  }
  // Thousands of dots add little over a few thousand; keep the file small.
  auto thin = [](std::vector<std::pair<double, double>> v, size_t cap) {
    if (v.size() <= cap) return v;
    std::vector<std::pair<double, double>> o;
    for (size_t i = 0; i < cap; ++i) o.push_back(v[i * v.size() / cap]);
    return o;
  };
  std::vector<ChartMarker> ttftMarks, itlMarks;
  if (info.slo.ttftMs) ttftMarks.push_back({*info.slo.ttftMs, "SLO " + fmt(*info.slo.ttftMs, 0) + " ms"});
  if (info.slo.itlMs) itlMarks.push_back({*info.slo.itlMs, "SLO " + fmt(*info.slo.itlMs, 0) + " ms"});
  // About 60 bins whatever the run's length, at a 1/2/5 step, never under 0.1 s.
  double span = durationS;
  for (const auto& r : records)
    if (std::isfinite(r.e2eMs)) span = std::max(span, r.startS + r.e2eMs / 1000.0);
  double binS = 0.1;
  for (double m = 0.1; m <= 1e6; m *= 10) {
    bool found = false;
    for (double k : {1.0, 2.0, 5.0})
      if (span / (k * m) <= 60) {
        binS = k * m;
        found = true;
        break;
      }
    if (found) break;
  }
  const TimeSeries ts = timeSeries(records, durationS, binS);
  std::vector<std::pair<double, double>> tok, inflight, done;
  for (size_t i = 0; i < ts.outputTokensPerS.size(); ++i) {
    const double mid = (static_cast<double>(i) + 0.5) * binS;
    tok.emplace_back(mid, ts.outputTokensPerS[i]);
    inflight.emplace_back(static_cast<double>(i) * binS, ts.inFlight[i]);
    done.emplace_back(mid, ts.completedPerS[i]);
  }
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>pdserve bench " << htmlEscape(info.date)
    << "</title>\n<style>body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px "
       "0 "
       "16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}td.k{text-align:left}"
       "svg{margin:6px 0;border:1px solid #eee}pre{background:#f7f7f7;padding:8px}</style></head><body>\n";
  o << "<h1>pdserve bench</h1>\n<table>";
  auto kv = [&](const std::string& k, const std::string& v) {
    o << "<tr><td class=\"k\">" << htmlEscape(k) << "</td><td class=\"k\">" << htmlEscape(v) << "</td></tr>";
  };
  kv("date (UTC)", info.date);
  kv("server", info.url + info.endpoint);
  kv("model", info.model);
  kv("workload", info.workload);
  kv("prompts", info.promptSource);
  kv("max concurrency", info.maxConcurrency > 0 ? std::to_string(info.maxConcurrency) : "none");
  kv("SLO", info.slo.empty() ? "none" : info.slo.describe());
  kv("command", info.commandLine);
  if (!info.abortReason.empty()) kv("ABORTED", info.abortReason);
  o << "</table>\n<h2>Summary</h2>\n<table><tr><th>completed</th><th>failed</th><th>duration s</th><th>req/s</th>"
       "<th>goodput req/s</th><th>output tok/s</th><th>total tok/s</th><th>lag mean/max ms</th></tr><tr><td>"
    << a.completed << "</td><td>" << a.failed << "</td><td>" << fmt(a.durationS) << "</td><td>"
    << fmt(a.requestThroughput, 3) << "</td><td>" << (a.haveSlo ? fmt(a.requestGoodput, 3) : "-") << "</td><td>"
    << fmt(a.outputThroughput) << "</td><td>" << fmt(a.totalTokenThroughput) << "</td><td>" << fmt(a.lagMeanMs, 3)
    << " / " << fmt(a.lagMaxMs, 3) << "</td></tr></table>\n";
  o << "<table><tr><th "
       "class=\"k\">ms</th><th>mean</th><th>median</th><th>p90</th><th>p95</th><th>p99</th><th>max</th></tr>";
  auto line = [&](const char* name, const Summary& s) {
    o << "<tr><td class=\"k\">" << name << "</td><td>" << fmt(s.mean) << "</td><td>" << fmt(s.median) << "</td><td>"
      << fmt(s.p90) << "</td><td>" << fmt(s.p95) << "</td><td>" << fmt(s.p99) << "</td><td>" << fmt(s.max)
      << "</td></tr>";
  };
  line("TTFT", a.ttft);
  line("TPOT", a.tpot);
  line("ITL", a.itl);
  line("E2E", a.e2el);
  o << "</table>\n";
  if (a.haveSlo)
    o << "<p>Requests meeting every SLO target: " << a.goodRequests << " of " << a.completed << " (missed TTFT "
      << a.missedTtft << ", ITL " << a.missedItl << ", TPOT " << a.missedTpot << ", E2E " << a.missedE2el << ").</p>\n";
  o << "<h2>Charts</h2>\n";
  o << svgChart("TTFT CDF", "time to first token (ms, log scale)", "fraction of requests",
                {{"TTFT", "#1f77b4", cdfPoints(ttft), ChartSeries::Style::kStep}}, ttftMarks, /*logX=*/true);
  o << svgChart("ITL CDF", "inter-token latency (ms, log scale; zero gaps at the left edge)", "fraction of gaps",
                {{"ITL", "#2ca02c", cdfPoints(itl), ChartSeries::Style::kStep}}, itlMarks, /*logX=*/true);
  o << svgChart("Latency over time", "request start (s)", "ms",
                {{"TTFT", "#1f77b4", thin(ttftOverTime, 3000), ChartSeries::Style::kDots},
                 {"TPOT", "#ff7f0e", thin(tpotOverTime, 3000), ChartSeries::Style::kDots}},
                {});
  const std::string binNote = " (" + fmt(binS, binS < 1 ? 1 : 0) + " s bins)";
  o << svgChart("Throughput over time" + binNote, "time (s)", "output tokens per second",
                {{"output tokens/s", "#9467bd", tok, ChartSeries::Style::kLine}}, {});
  o << svgChart("Requests over time" + binNote, "time (s)", "requests",
                {{"in flight", "#17becf", inflight, ChartSeries::Style::kStep},
                 {"completed per second", "#8c564b", done, ChartSeries::Style::kLine}},
                {});
  if (info.haveTimeline || !info.phases.empty()) o << overTimeSection(info, records, binS);
  o << "<h2>Terminal table</h2>\n<pre>" << htmlEscape(formatTable(info, a, records)) << "</pre>\n</body></html>\n";
  return o.str();
}

Status writeHtml(const std::string& path, const RunInfo& info, const Aggregate& a,
                 const std::vector<RequestRecord>& records, double durationS) {
  return writeFile(path, htmlReport(info, a, records, durationS));
}

namespace {
Result<std::string> checkResultOrThrow(const std::string& path, bool allowFailures) {
  std::ifstream in(path);
  if (!in) return notFound(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalidArgument(path + ": not a JSON object");
  for (const char* k : {"num_prompts", "completed", "failed", "ttfts", "e2els", "itls", "output_lens", "errors"})
    if (!j.contains(k)) return invalidArgument(path + ": missing key '" + k + "'");
  std::vector<std::string> bad;
  auto fail = [&](std::string m) {
    if (bad.size() < 10) bad.push_back(std::move(m));
  };
  const int64_t n = j["num_prompts"].get<int64_t>();
  const int64_t completed = j["completed"].get<int64_t>(), failed = j["failed"].get<int64_t>();
  if (completed + failed != n)
    fail("completed " + std::to_string(completed) + " + failed " + std::to_string(failed) + " != num_prompts " +
         std::to_string(n));
  if (!allowFailures && failed > 0) fail(std::to_string(failed) + " requests failed");
  const size_t rows = j["ttfts"].size();
  if (rows != static_cast<size_t>(n) || j["e2els"].size() != rows || j["itls"].size() != rows ||
      j["output_lens"].size() != rows || j["errors"].size() != rows)
    fail("per-request lists hold " + std::to_string(rows) + " entries for " + std::to_string(n) + " requests");
  for (size_t i = 0; i < rows && i < j["e2els"].size() && i < j["itls"].size() && i < j["output_lens"].size(); ++i) {
    const std::string err = j["errors"][i].is_string() ? j["errors"][i].get<std::string>() : "";
    if (!err.empty()) {
      if (!allowFailures) fail("request " + std::to_string(i) + ": " + err.substr(0, 200));
      continue;
    }
    const auto& t = j["ttfts"][i];
    const auto& e = j["e2els"][i];
    if (!t.is_number() || !e.is_number()) {
      fail("request " + std::to_string(i) + ": no TTFT or E2EL");
      continue;
    }
    if (t.get<double>() > e.get<double>())
      fail("request " + std::to_string(i) + ": TTFT " + fmt(t.get<double>() * 1000, 3) + " ms > E2EL " +
           fmt(e.get<double>() * 1000, 3) + " ms");
    const int64_t out = j["output_lens"][i].get<int64_t>();
    const int64_t gaps = static_cast<int64_t>(j["itls"][i].size());
    if (gaps != out - 1)
      fail("request " + std::to_string(i) + ": " + std::to_string(gaps) + " inter-token gaps for " +
           std::to_string(out) + " output tokens");
  }
  if (!bad.empty()) {
    std::string m = path + ": " + std::to_string(bad.size()) + (bad.size() == 10 ? "+" : "") + " violations:";
    for (const auto& b : bad) m += "\n  " + b;
    return failedPrecondition(m);
  }
  return path + ": ok: " + std::to_string(n) + " requests accounted for (" + std::to_string(completed) +
         " completed, " + std::to_string(failed) + " failed); TTFT <= E2EL and output_tokens - 1 gaps for each";
}
}  // namespace

Result<std::string> checkResult(const std::string& path, bool allowFailures) {
  // Values of the wrong JSON type throw in nlohmann's accessors; report them as bad input.
  try {
    return checkResultOrThrow(path, allowFailures);
  } catch (const nlohmann::json::exception& e) {
    return invalidArgument(path + ": unexpected value type: " + e.what());
  }
}

Result<std::string> compareResults(const std::vector<std::string>& paths) {
  if (paths.empty()) return invalidArgument("compare: give at least one result JSON file");
  std::vector<json> runs;
  for (const auto& p : paths) {
    std::ifstream in(p);
    if (!in) return notFound(p + ": cannot open");
    std::stringstream ss;
    ss << in.rdbuf();
    json j = json::parse(ss.str(), nullptr, false);
    if (j.is_discarded() || !j.is_object()) return invalidArgument(p + ": not a JSON object");
    if (!j.contains("completed") || !j.contains("mean_ttft_ms"))
      return invalidArgument(p + ": not a bench result (no 'completed' / 'mean_ttft_ms' keys)");
    runs.push_back(std::move(j));
  }
  static const char* kKeys[] = {"completed",
                                "failed",
                                "duration",
                                "request_throughput",
                                "request_goodput",
                                "output_throughput",
                                "total_token_throughput",
                                "max_output_tokens_per_s",
                                "mean_ttft_ms",
                                "median_ttft_ms",
                                "p90_ttft_ms",
                                "p99_ttft_ms",
                                "mean_tpot_ms",
                                "median_tpot_ms",
                                "p99_tpot_ms",
                                "mean_itl_ms",
                                "median_itl_ms",
                                "p90_itl_ms",
                                "p99_itl_ms",
                                "mean_e2el_ms",
                                "median_e2el_ms",
                                "p99_e2el_ms"};
  std::ostringstream o;
  const int kw = 26, cw = 24;
  o << std::left << std::setw(kw) << "metric";
  for (size_t i = 0; i < paths.size(); ++i) {
    std::string name = paths[i];
    const size_t slash = name.find_last_of('/');
    if (slash != std::string::npos) name = name.substr(slash + 1);
    if (name.size() > static_cast<size_t>(cw - 2)) name = name.substr(0, static_cast<size_t>(cw - 2));
    o << std::right << std::setw(cw) << name;
  }
  o << "\n";
  auto valueOf = [](const json& j, const char* k) -> double {
    if (!j.contains(k) || !j[k].is_number()) return kNaN;
    return j[k].get<double>();
  };
  for (const char* k : kKeys) {
    o << std::left << std::setw(kw) << k;
    const double base = valueOf(runs[0], k);
    for (size_t i = 0; i < runs.size(); ++i) {
      const double v = valueOf(runs[i], k);
      std::string cell = std::isfinite(v) && v == std::floor(v) && std::abs(v) < 1e12 ? fmt(v, 0) : fmt(v);
      if (i > 0 && std::isfinite(v) && std::isfinite(base) && base != 0) cell += " (" + fmt(v / base) + "x)";
      o << std::right << std::setw(cw) << cell;
    }
    o << "\n";
  }
  o << "(ratios are each run's value over the first run's)\n";
  return o.str();
}

}  // namespace pd::bench
