#include "common/tokenizer/pipeline.h"

#include <nlohmann/json.hpp>

#include "common/tokenizer/regex.h"
#include "common/tokenizer/unicode.h"

namespace pd::tok {
namespace {

using json = nlohmann::json;

std::string typeOf(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

std::string strField(const json& j, const char* key, const std::string& dflt = "") {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return dflt;
  return it->get<std::string>();
}

bool boolField(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_boolean()) return dflt;
  return it->get<bool>();
}

// {"String": "..."} or {"Regex": "..."}: both become a Regex (a string is escaped).
Result<std::shared_ptr<const Regex>> patternOf(const json& j, const std::string& where) {
  auto p = j.find("pattern");
  if (p == j.end() || !p->is_object()) return invalidArgument(where + ": missing 'pattern'");
  if (p->contains("Regex") && (*p)["Regex"].is_string()) {
    return Regex::compile((*p)["Regex"].get<std::string>());
  }
  if (p->contains("String") && (*p)["String"].is_string()) {
    return Regex::compile(regexEscape((*p)["String"].get<std::string>()));
  }
  return invalidArgument(where + ": 'pattern' must hold 'String' or 'Regex'");
}

// ---- Normalizers ----------------------------------------------------------------------------

class SequenceNormalizer final : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> parts;
  Status normalize(std::string& text) const override {
    for (const auto& n : parts) PD_RETURN_IF_ERROR(n->normalize(text));
    return Status::ok();
  }
};

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm f) : form_(f) {}
  Status normalize(std::string& text) const override {
    // ASCII is invariant under every normal form.
    bool ascii = true;
    for (unsigned char c : text) {
      if (c >= 0x80) {
        ascii = false;
        break;
      }
    }
    if (ascii) return Status::ok();
    auto r = normalizeUnicode(text, form_);
    if (!r.ok()) return r.status();
    text = std::move(r).value();
    return Status::ok();
  }

 private:
  NormalForm form_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string p) : prefix_(std::move(p)) {}
  Status normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
    return Status::ok();
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::shared_ptr<const Regex> re, std::string content)
      : re_(std::move(re)), content_(std::move(content)) {}
  Status normalize(std::string& text) const override {
    auto matches = re_->findAll(text);
    if (matches.empty()) return Status::ok();
    std::string out;
    out.reserve(text.size() + matches.size() * content_.size());
    size_t prev = 0;
    for (auto [b, e] : matches) {
      if (b == e) continue;
      out.append(text, prev, b - prev);
      out.append(content_);
      prev = e;
    }
    out.append(text, prev, std::string::npos);
    text = std::move(out);
    return Status::ok();
  }

 private:
  std::shared_ptr<const Regex> re_;
  std::string content_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool l, bool r) : left_(l), right_(r) {}
  Status normalize(std::string& text) const override {
    std::string_view v = text;
    if (left_) v = trimStartJs(v);
    if (right_) v = trimEndJs(v);
    text = std::string(v);
    return Status::ok();
  }

 private:
  bool left_, right_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  Status normalize(std::string& text) const override {
    auto r = toLowerUnicode(text);
    if (!r.ok()) return r.status();
    text = std::move(r).value();
    return Status::ok();
  }
};

// ---- Pre-tokenizers -------------------------------------------------------------------------

class SequencePreTokenizer final : public PreTokenizer {
 public:
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  void split(std::vector<std::string>& pieces, size_t section) const override {
    for (const auto& p : parts) p->split(pieces, section);
  }
  bool byteLevel() const override {
    for (const auto& p : parts)
      if (p->byteLevel()) return true;
    return false;
  }
};

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext };

// Splits each piece on regex matches. Shared by Split and ByteLevel(use_regex).
void regexSplit(const Regex& re, SplitBehavior behavior, bool invert, std::vector<std::string>& pieces) {
  std::vector<std::string> out;
  out.reserve(pieces.size() * 4);
  for (const auto& piece : pieces) {
    auto matches = re.findAll(piece);
    if (invert) {  // keep only the matches
      for (auto [b, e] : matches)
        if (e > b) out.emplace_back(piece, b, e - b);
      continue;
    }
    size_t prev = 0;
    std::string carry;  // for MergedWithNext: a delimiter waiting for its following text
    for (auto [b, e] : matches) {
      if (e == b) continue;
      if (b > prev) {
        std::string gap = piece.substr(prev, b - prev);
        if (behavior == SplitBehavior::kMergedWithNext && !carry.empty()) {
          gap.insert(0, carry);
          carry.clear();
        }
        out.push_back(std::move(gap));
      }
      std::string delim = piece.substr(b, e - b);
      switch (behavior) {
        case SplitBehavior::kIsolated:
          out.push_back(std::move(delim));
          break;
        case SplitBehavior::kRemoved:
          break;
        case SplitBehavior::kMergedWithPrevious:
          if (b > prev && !out.empty())
            out.back() += delim;
          else
            out.push_back(std::move(delim));
          break;
        case SplitBehavior::kMergedWithNext:
          carry += delim;
          break;
      }
      prev = e;
    }
    if (prev < piece.size()) {
      std::string rest = piece.substr(prev);
      if (!carry.empty()) rest.insert(0, carry), carry.clear();
      out.push_back(std::move(rest));
    }
    if (!carry.empty()) out.push_back(std::move(carry));
  }
  pieces = std::move(out);
}

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::shared_ptr<const Regex> re, SplitBehavior b, bool invert)
      : re_(std::move(re)), behavior_(b), invert_(invert) {}
  void split(std::vector<std::string>& pieces, size_t) const override { regexSplit(*re_, behavior_, invert_, pieces); }

 private:
  std::shared_ptr<const Regex> re_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool addPrefixSpace, std::shared_ptr<const Regex> re)
      : addPrefixSpace_(addPrefixSpace), re_(std::move(re)) {}
  // The byte -> character mapping itself is done by the model, which works on raw bytes.
  void split(std::vector<std::string>& pieces, size_t) const override {
    if (addPrefixSpace_) {
      for (auto& p : pieces)
        if (p.empty() || p[0] != ' ') p.insert(p.begin(), ' ');
    }
    if (re_) regexSplit(*re_, SplitBehavior::kIsolated, false, pieces);
  }
  bool byteLevel() const override { return true; }

 private:
  bool addPrefixSpace_;
  std::shared_ptr<const Regex> re_;
};

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  enum class Scheme { kAlways, kFirst, kNever };
  MetaspacePreTokenizer(std::string replacement, Scheme scheme, bool splitOnReplacement)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(splitOnReplacement) {}
  void split(std::vector<std::string>& pieces, size_t section) const override {
    std::vector<std::string> out;
    for (auto& p : pieces) {
      std::string s;
      for (char c : p) {
        if (c == ' ')
          s += replacement_;
        else
          s.push_back(c);
      }
      bool prepend = scheme_ == Scheme::kAlways || (scheme_ == Scheme::kFirst && section == 0);
      if (prepend && s.compare(0, replacement_.size(), replacement_) != 0) s.insert(0, replacement_);
      if (!split_) {
        out.push_back(std::move(s));
        continue;
      }
      // Split before each replacement character, keeping it with the following text.
      size_t start = 0;
      size_t pos = s.find(replacement_, 1);
      while (pos != std::string::npos) {
        out.push_back(s.substr(start, pos - start));
        start = pos;
        pos = s.find(replacement_, pos + replacement_.size());
      }
      out.push_back(s.substr(start));
    }
    pieces = std::move(out);
  }

 private:
  std::string replacement_;
  Scheme scheme_;
  bool split_;
};

}  // namespace

Result<std::unique_ptr<Normalizer>> makeNormalizer(const json& j) {
  if (j.is_null()) return std::unique_ptr<Normalizer>();
  std::string type = typeOf(j);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNormalizer>();
    if (!j.contains("normalizers") || !j["normalizers"].is_array())
      return invalidArgument("normalizer Sequence: missing 'normalizers' array");
    for (const auto& n : j["normalizers"]) {
      PD_ASSIGN_OR_RETURN(auto part, makeNormalizer(n));
      if (part) seq->parts.push_back(std::move(part));
    }
    return std::unique_ptr<Normalizer>(std::move(seq));
  }
  if (type == "NFC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfc));
  if (type == "NFD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfd));
  if (type == "NFKC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkc));
  if (type == "NFKD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkd));
  if (type == "Prepend") {
    return std::unique_ptr<Normalizer>(new PrependNormalizer(strField(j, "prepend")));
  }
  if (type == "Replace") {
    PD_ASSIGN_OR_RETURN(auto re, patternOf(j, "normalizer Replace"));
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(re, strField(j, "content")));
  }
  if (type == "Strip") {
    return std::unique_ptr<Normalizer>(
        new StripNormalizer(boolField(j, "strip_left", true), boolField(j, "strip_right", true)));
  }
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  return unimplemented("normalizer type '" + type +
                       "' is not supported (supported: Sequence, NFC, NFD, NFKC, NFKD, Prepend, "
                       "Replace, Strip, Lowercase)");
}

Result<std::unique_ptr<PreTokenizer>> makePreTokenizer(const json& j) {
  if (j.is_null()) return std::unique_ptr<PreTokenizer>();
  std::string type = typeOf(j);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePreTokenizer>();
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
      return invalidArgument("pre_tokenizer Sequence: missing 'pretokenizers' array");
    for (const auto& n : j["pretokenizers"]) {
      PD_ASSIGN_OR_RETURN(auto part, makePreTokenizer(n));
      if (part) seq->parts.push_back(std::move(part));
    }
    return std::unique_ptr<PreTokenizer>(std::move(seq));
  }
  if (type == "Split") {
    PD_ASSIGN_OR_RETURN(auto re, patternOf(j, "pre_tokenizer Split"));
    std::string b = strField(j, "behavior", "Isolated");
    SplitBehavior behavior;
    if (b == "Isolated")
      behavior = SplitBehavior::kIsolated;
    else if (b == "Removed")
      behavior = SplitBehavior::kRemoved;
    else if (b == "MergedWithPrevious")
      behavior = SplitBehavior::kMergedWithPrevious;
    else if (b == "MergedWithNext")
      behavior = SplitBehavior::kMergedWithNext;
    else
      return unimplemented("pre_tokenizer Split: behavior '" + b + "' is not supported");
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(re, behavior, boolField(j, "invert", false)));
  }
  if (type == "ByteLevel") {
    std::shared_ptr<const Regex> re;
    if (boolField(j, "use_regex", true)) {
      PD_ASSIGN_OR_RETURN(re, Regex::compile(kGpt2Pattern));
    }
    return std::unique_ptr<PreTokenizer>(new ByteLevelPreTokenizer(boolField(j, "add_prefix_space", false), re));
  }
  if (type == "Metaspace") {
    // Older files say add_prefix_space, newer ones prepend_scheme; an explicit
    // add_prefix_space=false wins (as in the JS reference).
    std::string scheme = strField(j, "prepend_scheme", "always");
    MetaspacePreTokenizer::Scheme s = MetaspacePreTokenizer::Scheme::kAlways;
    if (!boolField(j, "add_prefix_space", true)) {
      s = MetaspacePreTokenizer::Scheme::kNever;
    } else if (scheme == "first") {
      s = MetaspacePreTokenizer::Scheme::kFirst;
    } else if (scheme == "never") {
      s = MetaspacePreTokenizer::Scheme::kNever;
    } else if (scheme != "always") {
      return invalidArgument("pre_tokenizer Metaspace: prepend_scheme '" + scheme + "' unknown");
    }
    return std::unique_ptr<PreTokenizer>(
        new MetaspacePreTokenizer(strField(j, "replacement", "\xE2\x96\x81"), s, boolField(j, "split", false)));
  }
  if (type == "Digits") {
    PD_ASSIGN_OR_RETURN(auto re, Regex::compile(boolField(j, "individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)"));
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(re, SplitBehavior::kIsolated, false));
  }
  if (type == "WhitespaceSplit") {
    PD_ASSIGN_OR_RETURN(auto re, Regex::compile(R"(\S+)"));
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(re, SplitBehavior::kIsolated, true));
  }
  return unimplemented("pre_tokenizer type '" + type +
                       "' is not supported (supported: Sequence, Split, ByteLevel, Metaspace, "
                       "Digits, WhitespaceSplit)");
}

}  // namespace pd::tok
