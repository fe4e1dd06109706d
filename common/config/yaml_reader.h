// Internal to common/config: a strict reader over a yaml-cpp map node that knows its key path.
//
// Each read*() declares a key as known, leaves the output untouched when the key is absent
// (so the struct's default stands), and records "<path>: <problem>" when the value has the
// wrong type or is out of range. finish() reports every key nobody read as unknown, with a
// did-you-mean suggestion. Nothing throws; errors accumulate in an ErrorList in file order.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pd::config::detail {

struct ErrorItem {
  int line;  // 0-based line of the offending node, for ordering; -1 when unknown
  std::string text;
};

class ErrorList {
 public:
  void add(const YAML::Node& where, std::string text);
  bool empty() const { return items_.empty(); }
  // The messages sorted by line, each prefixed with "<source>: ", joined by newlines.
  std::string join(const std::string& source) const;
  // The messages sorted by line, without a prefix.
  std::vector<std::string> texts() const;

 private:
  std::vector<ErrorItem> items_;
};

// Closest candidate within an edit distance (adjacent swaps count once) of 2, or "".
std::string suggestKey(std::string_view key, const std::vector<std::string>& candidates);

// Shortest decimal text that round-trips a double ("0.25", "1e-06").
std::string formatDouble(double v);

template <typename E>
using Choices = std::vector<std::pair<std::string_view, E>>;

class MapReader {
 public:
  // node absent or null: an empty section. node of another kind: an error, and reads nothing.
  MapReader(YAML::Node node, std::string path, ErrorList* errors);

  bool has(std::string_view key);  // present (declares the key known)
  // The key's value, or an undefined node; unlike has(), does not declare the key known.
  YAML::Node peek(std::string_view key) const;
  std::string pathOf(std::string_view key) const;
  // A key that moved elsewhere (newKey, relative to this map: "http.port"): finish() accepts
  // it without listing it as allowed, and suggests newKey for a typo of it. The caller reads
  // it (another MapReader over the same node) and warns.
  void declareMoved(std::string_view oldKey, std::string newKey);

  void readInt(std::string_view key, int64_t* out, int64_t lo, int64_t hi);
  void readInt(std::string_view key, int* out, int64_t lo, int64_t hi);
  void readIntChoice(std::string_view key, int* out, const std::vector<int>& allowed);
  // Range: lo (exclusive when loOpen) .. hi (inclusive).
  void readDouble(std::string_view key, double* out, double lo, bool loOpen, double hi);
  void readBool(std::string_view key, bool* out);
  void readString(std::string_view key, std::string* out, bool allowEmpty);
  // Strictly increasing positive numbers, at least one.
  void readBuckets(std::string_view key, std::vector<double>* out);
  // Non-empty, no duplicates, each non-empty.
  void readStringList(std::string_view key, std::vector<std::string>* out);

  template <typename E>
  void readEnum(std::string_view key, E* out, const Choices<E>& choices) {
    YAML::Node n = scalarOrError(key, "one of " + joinChoices(choices));
    if (!n) return;
    if (!matchChoice(n, pathOf(key), choices, out)) return;
  }

  // A non-empty list of distinct choices.
  template <typename E>
  void readEnumList(std::string_view key, std::vector<E>* out, const Choices<E>& choices) {
    YAML::Node n = sequenceOrError(key, "a list of " + joinChoices(choices));
    if (!n) return;
    std::vector<E> result;
    bool ok = true;
    for (size_t i = 0; i < n.size(); ++i) {
      std::string p = pathOf(key) + "[" + std::to_string(i) + "]";
      E v{};
      if (!n[i].IsScalar()) {
        errors_->add(n[i], p + ": expected one of " + joinChoices(choices) + ", got " + describe(n[i]));
        ok = false;
        continue;
      }
      if (!matchChoice(n[i], p, choices, &v)) {
        ok = false;
        continue;
      }
      for (E seen : result) {
        if (seen == v) {
          errors_->add(n[i], p + ": " + n[i].Scalar() + " is listed twice");
          ok = false;
        }
      }
      result.push_back(v);
    }
    if (ok && result.empty()) {
      errors_->add(n, pathOf(key) + ": must list at least one of " + joinChoices(choices));
      ok = false;
    }
    if (ok) *out = std::move(result);
  }

  MapReader child(std::string_view key);
  void finish();

  static std::string describe(const YAML::Node& n);
  ErrorList* errors() const { return errors_; }
  const YAML::Node& node() const { return node_; }

 private:
  YAML::Node lookup(std::string_view key);
  YAML::Node scalarOrError(std::string_view key, const std::string& expected);
  YAML::Node sequenceOrError(std::string_view key, const std::string& expected);

  template <typename E>
  static std::string joinChoices(const Choices<E>& choices) {
    std::string s;
    for (const auto& c : choices) {
      if (!s.empty()) s += ", ";
      s += c.first;
    }
    return s;
  }
  template <typename E>
  bool matchChoice(const YAML::Node& n, const std::string& path, const Choices<E>& choices, E* out) {
    for (const auto& c : choices) {
      if (n.Scalar() == c.first) {
        *out = c.second;
        return true;
      }
    }
    errors_->add(n, path + ": " + n.Scalar() + " is not one of " + joinChoices(choices));
    return false;
  }

  YAML::Node node_;
  std::string path_;
  ErrorList* errors_;
  bool valid_ = true;
  std::vector<std::string> known_;
  std::vector<std::pair<std::string, std::string>> moved_;  // old key -> new key
};

}  // namespace pd::config::detail
