#include "tools/bench/timeline.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

namespace pd::bench {
namespace {

bool nameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool nameChar(char c) { return nameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// Prometheus' value forms: a float (Go's ParseFloat), NaN, +Inf, -Inf, Inf.
bool parseValue(std::string_view t, double* out) {
  if (t == "NaN" || t == "nan") return *out = std::numeric_limits<double>::quiet_NaN(), true;
  if (t == "+Inf" || t == "Inf" || t == "inf" || t == "+inf") return *out = INFINITY, true;
  if (t == "-Inf" || t == "-inf") return *out = -INFINITY, true;
  if (!t.empty() && t.front() == '+') t.remove_prefix(1);
  if (t.empty()) return false;
  auto r = std::from_chars(t.data(), t.data() + t.size(), *out);
  return r.ec == std::errc() && r.ptr == t.data() + t.size();
}

// One sample line; false when malformed.
bool parseLine(std::string_view line, PromSample* s) {
  size_t i = 0;
  if (i >= line.size() || !nameStart(line[i])) return false;
  while (i < line.size() && nameChar(line[i])) ++i;
  s->name = std::string(line.substr(0, i));
  s->labels.clear();
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (true) {
      while (i < line.size() && line[i] == ' ') ++i;
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      const size_t ks = i;
      if (i >= line.size() || !nameStart(line[i])) return false;
      while (i < line.size() && nameChar(line[i])) ++i;
      const std::string key(line.substr(ks, i - ks));
      if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') return false;
      i += 2;
      std::string value;
      while (true) {
        if (i >= line.size()) return false;
        const char c = line[i++];
        if (c == '"') break;
        if (c == '\\') {
          if (i >= line.size()) return false;
          const char e = line[i++];
          value.push_back(e == 'n' ? '\n' : e);  // \" \\ and \n are the only escapes
        } else {
          value.push_back(c);
        }
      }
      s->labels[key] = std::move(value);
      while (i < line.size() && line[i] == ' ') ++i;
      if (i < line.size() && line[i] == ',')
        ++i;
      else if (i < line.size() && line[i] == '}')
        continue;
      else
        return false;
    }
  }
  if (i >= line.size() || (line[i] != ' ' && line[i] != '\t')) return false;
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  const size_t vs = i;
  while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
  if (!parseValue(line.substr(vs, i - vs), &s->value)) return false;
  // An optional integer timestamp (ms) may follow; anything else is malformed.
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  if (i < line.size()) {
    std::string_view ts = line.substr(i);
    while (!ts.empty() && (ts.back() == ' ' || ts.back() == '\t')) ts.remove_suffix(1);
    if (!ts.empty() && ts.front() == '-') ts.remove_prefix(1);
    if (ts.empty() || ts.find_first_not_of("0123456789") != std::string_view::npos) return false;
  }
  return true;
}

std::string escapeLabel(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '"' || c == '\\') o.push_back('\\');
    if (c == '\n')
      o += "\\n";
    else
      o.push_back(c);
  }
  return o;
}

}  // namespace

std::string PromSample::key() const {
  std::string k = name;
  if (labels.empty()) return k;
  k += '{';
  bool first = true;
  for (const auto& [n, v] : labels) {
    if (!first) k += ',';
    first = false;
    k += n + "=\"" + escapeLabel(v) + "\"";
  }
  return k + "}";
}

PromText parsePrometheusText(std::string_view text) {
  PromText out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    if (line.empty() || line.front() == '#') continue;
    PromSample s;
    if (parseLine(line, &s))
      out.samples.push_back(std::move(s));
    else
      ++out.malformedLines;
  }
  return out;
}

bool timelineKeeps(const PromSample& s) {
  const std::string& n = s.name;
  auto starts = [&](const char* p) { return n.rfind(p, 0) == 0; };
  auto ends = [&](const char* p) {
    const size_t l = std::char_traits<char>::length(p);
    return n.size() >= l && n.compare(n.size() - l, l, p) == 0;
  };
  if (ends("_workers") && s.labels.count("pool")) return true;
  if (n == "pdserve_desired_replicas" || n == "pdserve_short_prompt_tokens" || n == "pdserve_route_decisions_total")
    return true;
  if (starts("pdserve_slo_") || starts("pdserve_autoscaler_")) return true;
  if (starts("pdserve_") && n.find("role") != std::string::npos) return true;
  return false;
}

void MetricsTimeline::addScrape(double tS, const PromText& text, double scrapeMs) {
  TimelineSample s;
  s.tS = tS;
  s.ok = true;
  s.scrapeMs = scrapeMs;
  for (const auto& p : text.samples) {
    if (!timelineKeeps(p)) continue;
    const std::string k = p.key();
    s.values[k] = p.value;
    if (!info.count(k)) info[k] = {p.name, p.labels};
  }
  samples.push_back(std::move(s));
}

void MetricsTimeline::addGap(double tS, std::string error, double scrapeMs) {
  TimelineSample s;
  s.tS = tS;
  s.ok = false;
  s.error = std::move(error);
  s.scrapeMs = scrapeMs;
  samples.push_back(std::move(s));
}

void MetricsTimeline::shift(double offsetS) {
  for (auto& s : samples) s.tS -= offsetS;
}

std::vector<std::pair<double, double>> MetricsTimeline::series(const std::string& key) const {
  std::vector<std::pair<double, double>> pts;
  for (const auto& s : samples) {
    if (!s.ok) continue;
    auto it = s.values.find(key);
    if (it != s.values.end()) pts.emplace_back(s.tS, it->second);
  }
  return pts;
}

std::vector<std::string> MetricsTimeline::keys() const {
  std::vector<std::string> k;
  for (const auto& [key, _] : info) k.push_back(key);
  return k;
}

int64_t MetricsTimeline::failedScrapes() const {
  return std::count_if(samples.begin(), samples.end(), [](const TimelineSample& s) { return !s.ok; });
}

nlohmann::json timelineJson(const MetricsTimeline& t) {
  using nlohmann::json;
  json j;
  j["url"] = t.url;
  j["interval_ms"] = t.intervalMs;
  j["scrapes"] = static_cast<int64_t>(t.samples.size());
  j["failed_scrapes"] = t.failedScrapes();
  json gaps = json::array();
  for (const auto& s : t.samples)
    if (!s.ok) gaps.push_back({{"t_s", s.tS}, {"error", s.error}});
  j["gaps"] = std::move(gaps);
  json series = json::array();
  for (const auto& [key, meta] : t.info) {
    json pts = json::array();
    for (const auto& [x, y] : t.series(key)) pts.push_back({x, std::isfinite(y) ? json(y) : json(nullptr)});
    json labels = json::object();
    for (const auto& [n, v] : meta.labels) labels[n] = v;
    series.push_back({{"key", key}, {"name", meta.name}, {"labels", labels}, {"points", std::move(pts)}});
  }
  j["series"] = std::move(series);
  return j;
}

}  // namespace pd::bench
