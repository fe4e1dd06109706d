#include "tools/plan/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "tools/bench/report.h"

namespace pd::plan {

namespace {

using bench::ChartMarker;
using bench::ChartSeries;
using bench::htmlEscape;

constexpr const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};

std::string fmt(const char* format, double v) {
  char b[64];
  std::snprintf(b, sizeof b, format, v);
  return b;
}

// One series per drawn layout: y(point) of each rate the search simulated.
template <class Y>
std::vector<ChartSeries> curves(const std::vector<Candidate>& drawn, Y y) {
  std::vector<ChartSeries> out;
  for (size_t i = 0; i < drawn.size(); ++i) {
    ChartSeries s{drawn[i].layout.describe(), kColors[i % std::size(kColors)], {}, ChartSeries::Style::kLine};
    for (const RatePoint& p : drawn[i].curve) s.points.emplace_back(p.rate, y(p.summary));
    out.push_back(std::move(s));
  }
  return out;
}

// A horizontal line at `value` across the rates drawn: an SLO or the attainment target.
ChartSeries targetLine(const std::string& name, const std::vector<ChartSeries>& series, double value) {
  double lo = 0, hi = 0;
  bool any = false;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      lo = any ? std::min(lo, x) : x;
      hi = any ? std::max(hi, x) : x;
      any = true;
    }
  ChartSeries t{name, "#999999", {}, ChartSeries::Style::kLine};
  if (any) t.points = {{lo, value}, {hi, value}};
  return t;
}

}  // namespace

std::string planHtml(const PlanReportInfo& info, const std::vector<Candidate>& ranked) {
  const std::vector<Candidate> drawn(
      ranked.begin(), ranked.begin() + long(std::min<size_t>(ranked.size(), size_t(std::max(1, info.curves)))));
  std::vector<ChartMarker> maxRates;
  for (const Candidate& c : drawn)
    if (c.maxRate > 0) maxRates.push_back({c.maxRate, c.layout.describe()});

  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>pdserve plan</title>\n"
       "<style>body{font-family:sans-serif;margin:24px;max-width:1100px} table{border-collapse:collapse}"
       " td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} td:first-child,th:first-child,"
       "td:last-child{text-align:left} code{background:#f4f4f4;padding:1px 4px}</style></head><body>\n";
  o << "<h1>pdserve plan</h1>\n<p><code>" << htmlEscape(info.commandLine) << "</code></p>\n";
  o << "<p>" << htmlEscape(info.trace) << "; " << htmlEscape(info.model) << " on " << htmlEscape(info.device)
    << ". SLO: TTFT " << fmt("%.0f", 1000 * info.slo.ttftS) << " ms and ITL p" << fmt("%g", info.slo.percentile) << " "
    << fmt("%.0f", 1000 * info.slo.itlS) << " ms per request; a layout's max rate is the highest Poisson "
    << "rate at which " << fmt("%.0f", 100 * info.attainment) << "% of the requests meet both.</p>\n";
  if (ranked.empty()) return o.str() + "<p>No layout was simulated.</p></body></html>\n";

  o << "<h2>SLO attainment against request rate</h2>\n<p>Every rate the search simulated for the " << drawn.size()
    << " best layouts; the vertical lines are their max rates.</p>\n";
  auto attainment = curves(drawn, [](const SimSummary& s) { return 100 * s.attainment; });
  attainment.push_back(
      targetLine("target " + fmt("%.0f", 100 * info.attainment) + "%", attainment, 100 * info.attainment));
  o << bench::svgChart("SLO attainment", "request rate (req/s, log scale)", "% of requests meeting both SLOs",
                       attainment, maxRates, /*logX=*/true);
  auto ttft = curves(drawn, [](const SimSummary& s) { return 1000 * s.ttftP99; });
  ttft.push_back(targetLine("TTFT SLO", ttft, 1000 * info.slo.ttftS));
  o << bench::svgChart("p99 TTFT", "request rate (req/s, log scale)", "ms", ttft, {}, /*logX=*/true);
  auto itl = curves(drawn, [](const SimSummary& s) { return 1000 * s.itlP99; });
  itl.push_back(targetLine("ITL SLO", itl, 1000 * info.slo.itlS));
  o << bench::svgChart("p99 ITL (every gap)", "request rate (req/s, log scale)", "ms", itl, {}, /*logX=*/true);

  o << "<h2>Layouts, best first</h2>\n<table><tr><th>layout</th><th>max req/s</th><th>per device</th>"
       "<th>TTFT p99 (ms)</th><th>ITL p99 (ms)</th><th>attained</th><th>at the trace's rate</th>"
       "<th>disaggregated</th><th>verdict</th></tr>\n";
  for (const Candidate& c : ranked) {
    const SimSummary& m = c.atMaxRate;
    const double disagg = c.summary.requests ? 100.0 * double(c.summary.disaggregated) / double(c.summary.requests) : 0;
    o << "<tr><td>" << htmlEscape(c.layout.describe()) << "</td><td>" << fmt("%.2f", c.maxRate) << "</td><td>"
      << fmt("%.3f", c.maxRate / c.layout.devices()) << "</td><td>" << fmt("%.0f", 1000 * m.ttftP99) << "</td><td>"
      << fmt("%.1f", 1000 * m.itlP99) << "</td><td>" << fmt("%.1f%%", 100 * m.attainment) << "</td><td>"
      << fmt("%.1f%%", 100 * c.summary.attainment) << "</td><td>" << fmt("%.0f%%", disagg) << "</td><td>"
      << htmlEscape(c.verdict) << "</td></tr>\n";
  }
  o << "</table>\n</body></html>\n";
  return o.str();
}

Status writePlanHtml(const std::string& path, const PlanReportInfo& info, const std::vector<Candidate>& ranked) {
  return bench::writeFile(path, planHtml(info, ranked));
}

}  // namespace pd::plan
