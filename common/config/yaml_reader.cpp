#include "common/config/yaml_reader.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

namespace pd::config::detail {

namespace {

// A quoted scalar ("8000") is a string even when it looks like a number: a config that quotes
// a port most likely holds something else in the author's mind, and YAML says it is a string.
bool isPlainScalar(const YAML::Node& n) { return n.IsScalar() && n.Tag() != "!"; }

bool parseInt(const std::string& s, int64_t* out) {
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, *out);
  return ec == std::errc() && p == e && b != e;
}

bool parseDouble(const std::string& s, double* out) {
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, *out, std::chars_format::general);
  return ec == std::errc() && p == e && b != e && std::isfinite(*out);
}

std::string rangeText(int64_t lo, int64_t hi) { return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]"; }

}  // namespace

void ErrorList::add(const YAML::Node& where, std::string text) {
  int line = -1;
  if (where.IsDefined()) line = where.Mark().line;
  items_.push_back({line, std::move(text)});
}

std::string ErrorList::join(const std::string& source) const {
  std::vector<ErrorItem> sorted = items_;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const ErrorItem& a, const ErrorItem& b) { return a.line < b.line; });
  std::string out;
  for (const auto& item : sorted) {
    if (!out.empty()) out += "\n";
    out += source + ": " + item.text;
  }
  return out;
}

std::vector<std::string> ErrorList::texts() const {
  std::vector<ErrorItem> sorted = items_;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const ErrorItem& a, const ErrorItem& b) { return a.line < b.line; });
  std::vector<std::string> out;
  for (auto& item : sorted) out.push_back(std::move(item.text));
  return out;
}

std::string suggestKey(std::string_view key, const std::vector<std::string>& candidates) {
  // Optimal string alignment distance: insertions, deletions, substitutions and adjacent
  // transpositions ("prot" -> "port" is one edit), the typos people actually make.
  auto distance = [](std::string_view a, std::string_view b) {
    std::vector<std::vector<int>> d(a.size() + 1, std::vector<int>(b.size() + 1));
    for (size_t i = 0; i <= a.size(); ++i) d[i][0] = static_cast<int>(i);
    for (size_t j = 0; j <= b.size(); ++j) d[0][j] = static_cast<int>(j);
    for (size_t i = 1; i <= a.size(); ++i) {
      for (size_t j = 1; j <= b.size(); ++j) {
        int cost = a[i - 1] == b[j - 1] ? 0 : 1;
        d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
        if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
          d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
        }
      }
    }
    return d[a.size()][b.size()];
  };
  std::string best;
  int bestDistance = 3;
  for (const auto& c : candidates) {
    int dist = distance(key, c);
    // A two-letter key is two edits from every other two-letter key: demand closeness.
    if (dist < bestDistance && dist < static_cast<int>(std::max(key.size(), c.size())) - 1) {
      best = c;
      bestDistance = dist;
    }
  }
  return best;
}

std::string formatDouble(double v) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, p) : std::string("?");
}

MapReader::MapReader(YAML::Node node, std::string path, ErrorList* errors)
    : node_(std::move(node)), path_(std::move(path)), errors_(errors) {
  if (!node_.IsDefined() || node_.IsNull()) {
    valid_ = false;  // absent section: every key keeps its default
    return;
  }
  if (!node_.IsMap()) {
    errors_->add(node_, (path_.empty() ? std::string("the document") : path_) + ": expected a map of keys, got " +
                            describe(node_));
    valid_ = false;
  }
}

std::string MapReader::pathOf(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

std::string MapReader::describe(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "an empty value";
  if (n.IsMap()) return "a map";
  if (n.IsSequence()) return "a list";
  return "\"" + n.Scalar() + "\"";
}

YAML::Node MapReader::lookup(std::string_view key) {
  known_.emplace_back(key);
  if (!valid_) return YAML::Node(YAML::NodeType::Undefined);
  // Iterate rather than node_[key]: indexing a non-const node can add a zombie entry.
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    if (it->first.IsScalar() && it->first.Scalar() == key) return it->second;
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

bool MapReader::has(std::string_view key) {
  YAML::Node n = lookup(key);
  return n.IsDefined();
}

YAML::Node MapReader::peek(std::string_view key) const {
  if (!valid_) return YAML::Node(YAML::NodeType::Undefined);
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    if (it->first.IsScalar() && it->first.Scalar() == key) return it->second;
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

void MapReader::declareMoved(std::string_view oldKey, std::string newKey) {
  moved_.emplace_back(std::string(oldKey), std::move(newKey));
}

YAML::Node MapReader::scalarOrError(std::string_view key, const std::string& expected) {
  YAML::Node n = lookup(key);
  if (!n.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
  if (!n.IsScalar()) {
    errors_->add(n, pathOf(key) + ": expected " + expected + ", got " + describe(n));
    return YAML::Node(YAML::NodeType::Undefined);
  }
  return n;
}

YAML::Node MapReader::sequenceOrError(std::string_view key, const std::string& expected) {
  YAML::Node n = lookup(key);
  if (!n.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
  if (!n.IsSequence()) {
    errors_->add(n, pathOf(key) + ": expected " + expected + ", got " + describe(n));
    return YAML::Node(YAML::NodeType::Undefined);
  }
  return n;
}

void MapReader::readInt(std::string_view key, int64_t* out, int64_t lo, int64_t hi) {
  YAML::Node n = scalarOrError(key, "an integer");
  if (!n) return;
  int64_t v = 0;
  if (!isPlainScalar(n) || !parseInt(n.Scalar(), &v)) {
    errors_->add(n, pathOf(key) + ": expected an integer, got " + describe(n));
    return;
  }
  if (v < lo || v > hi) {
    errors_->add(n, pathOf(key) + ": " + n.Scalar() + " is out of range " + rangeText(lo, hi));
    return;
  }
  *out = v;
}

void MapReader::readInt(std::string_view key, int* out, int64_t lo, int64_t hi) {
  int64_t v = *out;
  readInt(key, &v, lo, hi);
  *out = static_cast<int>(v);  // in range by construction (callers pass int bounds)
}

void MapReader::readIntChoice(std::string_view key, int* out, const std::vector<int>& allowed) {
  std::string list;
  for (int a : allowed) list += (list.empty() ? "" : ", ") + std::to_string(a);
  YAML::Node n = scalarOrError(key, "one of " + list);
  if (!n) return;
  int64_t v = 0;
  if (!isPlainScalar(n) || !parseInt(n.Scalar(), &v)) {
    errors_->add(n, pathOf(key) + ": expected one of " + list + ", got " + describe(n));
    return;
  }
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
    errors_->add(n, pathOf(key) + ": " + n.Scalar() + " is not one of " + list);
    return;
  }
  *out = static_cast<int>(v);
}

void MapReader::readDouble(std::string_view key, double* out, double lo, bool loOpen, double hi) {
  YAML::Node n = scalarOrError(key, "a number");
  if (!n) return;
  double v = 0;
  if (!isPlainScalar(n) || !parseDouble(n.Scalar(), &v)) {
    errors_->add(n, pathOf(key) + ": expected a number, got " + describe(n));
    return;
  }
  if ((loOpen ? v <= lo : v < lo) || v > hi) {
    errors_->add(n, pathOf(key) + ": " + n.Scalar() + " is out of range " + (loOpen ? "(" : "[") + formatDouble(lo) +
                        ", " + formatDouble(hi) + "]");
    return;
  }
  *out = v;
}

void MapReader::readBool(std::string_view key, bool* out) {
  YAML::Node n = scalarOrError(key, "true or false");
  if (!n) return;
  const std::string& s = n.Scalar();
  if (isPlainScalar(n) && s == "true") {
    *out = true;
  } else if (isPlainScalar(n) && s == "false") {
    *out = false;
  } else {
    errors_->add(n, pathOf(key) + ": expected true or false, got " + describe(n));
  }
}

void MapReader::readString(std::string_view key, std::string* out, bool allowEmpty) {
  YAML::Node n = lookup(key);
  if (!n.IsDefined()) return;
  if (n.IsNull() && allowEmpty) {
    out->clear();
    return;
  }
  if (!n.IsScalar() || n.IsNull()) {
    errors_->add(n, pathOf(key) + ": expected a string, got " + describe(n));
    return;
  }
  if (n.Scalar().empty() && !allowEmpty) {
    errors_->add(n, pathOf(key) + ": must not be empty");
    return;
  }
  *out = n.Scalar();
}

void MapReader::readBuckets(std::string_view key, std::vector<double>* out) {
  YAML::Node n = sequenceOrError(key, "a list of bucket bounds in seconds");
  if (!n) return;
  std::vector<double> result;
  bool ok = true;
  for (size_t i = 0; i < n.size(); ++i) {
    std::string p = pathOf(key) + "[" + std::to_string(i) + "]";
    double v = 0;
    if (!isPlainScalar(n[i]) || !parseDouble(n[i].Scalar(), &v)) {
      errors_->add(n[i], p + ": expected a number, got " + describe(n[i]));
      ok = false;
      continue;
    }
    if (v <= 0) {
      errors_->add(n[i], p + ": " + n[i].Scalar() + " is not positive");
      ok = false;
      continue;
    }
    if (!result.empty() && v <= result.back()) {
      errors_->add(n[i], p + ": " + n[i].Scalar() + " is not greater than the previous bound " +
                             formatDouble(result.back()) + " (bounds must be strictly increasing)");
      ok = false;
      continue;
    }
    result.push_back(v);
  }
  if (ok && result.empty()) {
    errors_->add(n, pathOf(key) + ": must list at least one bound");
    ok = false;
  }
  if (ok) *out = std::move(result);
}

void MapReader::readStringList(std::string_view key, std::vector<std::string>* out) {
  YAML::Node n = lookup(key);
  if (!n.IsDefined()) return;
  if (n.IsNull()) {
    out->clear();
    return;
  }
  if (!n.IsSequence()) {
    errors_->add(n, pathOf(key) + ": expected a list of strings, got " + describe(n));
    return;
  }
  std::vector<std::string> result;
  bool ok = true;
  for (size_t i = 0; i < n.size(); ++i) {
    std::string p = pathOf(key) + "[" + std::to_string(i) + "]";
    if (!n[i].IsScalar() || n[i].Scalar().empty()) {
      errors_->add(n[i], p + ": expected a non-empty string, got " + describe(n[i]));
      ok = false;
      continue;
    }
    if (std::find(result.begin(), result.end(), n[i].Scalar()) != result.end()) {
      // Do not echo the value: this list holds API keys.
      errors_->add(n[i], p + ": duplicate of an earlier entry");
      ok = false;
      continue;
    }
    result.push_back(n[i].Scalar());
  }
  if (ok) *out = std::move(result);
}

MapReader MapReader::child(std::string_view key) {
  YAML::Node n = lookup(key);
  return MapReader(n, pathOf(key), errors_);
}

void MapReader::finish() {
  if (!valid_) return;
  std::vector<std::string> seen;
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    if (!it->first.IsScalar()) {
      errors_->add(it->first, (path_.empty() ? std::string("the document") : path_) +
                                  ": keys must be plain words, got " + describe(it->first));
      continue;
    }
    const std::string& k = it->first.Scalar();
    if (std::find(seen.begin(), seen.end(), k) != seen.end()) {
      errors_->add(it->first, pathOf(k) + ": duplicate key");
      continue;
    }
    seen.push_back(k);
    if (std::find(known_.begin(), known_.end(), k) != known_.end()) continue;
    std::vector<std::string> candidates = known_;
    bool moved = false;
    for (const auto& [from, to] : moved_) {
      moved = moved || from == k;
      candidates.push_back(from);
    }
    if (moved) continue;
    std::string hint = suggestKey(k, candidates);
    for (const auto& [from, to] : moved_) {
      if (hint == from) hint = to;  // suggest where the key lives now
    }
    if (!hint.empty()) {
      errors_->add(it->first, pathOf(k) + ": unknown key (did you mean " + hint + "?)");
    } else {
      std::string allowed;
      for (const auto& kk : known_) allowed += (allowed.empty() ? "" : ", ") + kk;
      errors_->add(it->first, pathOf(k) + ": unknown key (allowed: " + allowed + ")");
    }
  }
}

}  // namespace pd::config::detail
