#include "common/tokenizer/tokenizer.h"

#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/tokenizer/pipeline.h"
#include "common/tokenizer/regex.h"
#include "common/tokenizer/unicode.h"

namespace pd::tok {

using json = nlohmann::json;

// Byte trie over added-token contents; leftmost-longest matching as the references do.
struct Tokenizer::TrieNode {
  std::map<unsigned char, std::unique_ptr<TrieNode>> children;
  int addedIndex = -1;
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

namespace {

Result<std::string> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return notFound(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return dataLoss(path + ": read error");
  return ss.str();
}

// tokenizer_config.json spells tokens as strings or {"__type": "AddedToken", "content": ...}.
std::string tokenField(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return "";
}

std::string replaceAll(std::string s, const Regex& re, const std::string& content) {
  auto matches = re.findAll(s);
  if (matches.empty()) return s;
  std::string out;
  size_t prev = 0;
  for (auto [b, e] : matches) {
    if (b == e) continue;
    out.append(s, prev, b - prev);
    out.append(content);
    prev = e;
  }
  out.append(s, prev, std::string::npos);
  return out;
}

}  // namespace

Result<std::shared_ptr<const Tokenizer>> Tokenizer::loadDir(const std::string& dir) {
  PD_ASSIGN_OR_RETURN(std::string tj, readFile(dir + "/tokenizer.json"));
  std::string cfg;
  auto c = readFile(dir + "/tokenizer_config.json");
  if (c.ok()) cfg = std::move(c).value();
  auto r = fromJson(tj, cfg);
  if (!r.ok()) return r.status().withContext("loading tokenizer from " + dir);
  return r;
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::fromJson(std::string_view tokenizerJson,
                                                             std::string_view configJson) {
  std::shared_ptr<Tokenizer> t(new Tokenizer());
  PD_RETURN_IF_ERROR(t->load(tokenizerJson, configJson));
  return std::shared_ptr<const Tokenizer>(std::move(t));
}

Status Tokenizer::load(std::string_view tokenizerJson, std::string_view configJson) {
  json tj, cfg = json::object();
  try {
    tj = json::parse(tokenizerJson);
  } catch (const json::exception& e) {
    return invalidArgument(std::string("tokenizer.json is not valid JSON: ") + e.what());
  }
  if (!configJson.empty()) {
    try {
      cfg = json::parse(configJson);
    } catch (const json::exception& e) {
      return invalidArgument(std::string("tokenizer_config.json is not valid JSON: ") + e.what());
    }
  }
  if (!tj.is_object()) return invalidArgument("tokenizer.json: top level is not an object");
  if (!cfg.is_object()) return invalidArgument("tokenizer_config.json: top level is not an object");

  try {
    PD_ASSIGN_OR_RETURN(normalizer_, makeNormalizer(tj.value("normalizer", json())));
    PD_ASSIGN_OR_RETURN(preTokenizer_, makePreTokenizer(tj.value("pre_tokenizer", json())));
    bool byteLevel = preTokenizer_ && preTokenizer_->byteLevel();
    if (!tj.contains("model")) return invalidArgument("tokenizer.json: no 'model'");
    PD_ASSIGN_OR_RETURN(model_, BpeModel::fromJson(tj["model"], byteLevel));

    // Added tokens.
    addedTrie_ = std::make_unique<TrieNode>();
    if (tj.contains("added_tokens") && tj["added_tokens"].is_array()) {
      for (const auto& a : tj["added_tokens"]) {
        AddedToken t;
        t.content = a.value("content", std::string());
        t.id = a.value("id", -1);
        t.special = a.value("special", false);
        t.lstrip = a.value("lstrip", false);
        t.rstrip = a.value("rstrip", false);
        if (t.content.empty() || t.id < 0) return invalidArgument("tokenizer.json: added token without content or id");
        if (a.value("single_word", false)) {
          return unimplemented("tokenizer.json: added token '" + t.content +
                               "' uses single_word, which is not supported");
        }
        model_->addToken(t.content, t.id);
        if (t.special) specialIds_.insert(t.id);
        TrieNode* node = addedTrie_.get();
        for (unsigned char c : t.content) {
          auto& child = node->children[c];
          if (!child) child = std::make_unique<TrieNode>();
          node = child.get();
        }
        node->addedIndex = static_cast<int>(added_.size());
        added_.push_back(std::move(t));
      }
    }
    if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
      for (const auto& s : cfg["additional_special_tokens"]) {
        std::string name =
            s.is_string() ? s.get<std::string>() : (s.is_object() ? s.value("content", std::string()) : "");
        TokenId id;
        if (!name.empty() && model_->tokenToId(name, &id)) specialIds_.insert(id);
      }
    }

    // Config: special tokens, chat template, clean-up default.
    bosToken_ = tokenField(cfg, "bos_token");
    eosToken_ = tokenField(cfg, "eos_token");
    TokenId id;
    if (!bosToken_.empty() && model_->tokenToId(bosToken_, &id)) bosId_ = id;
    if (!eosToken_.empty() && model_->tokenToId(eosToken_, &id)) eosId_ = id;
    if (cfg.contains("chat_template")) {
      const auto& ct = cfg["chat_template"];
      if (ct.is_string()) {
        chatTemplate_ = ct.get<std::string>();
      } else if (ct.is_array()) {  // [{name, template}, ...]: the "default" one
        for (const auto& e : ct) {
          if (e.is_object() && e.value("name", std::string()) == "default")
            chatTemplate_ = e.value("template", std::string());
        }
        if (chatTemplate_.empty()) return invalidArgument("tokenizer_config.json: chat_template list has no 'default'");
      }
    }
    if (cfg.contains("clean_up_tokenization_spaces") && cfg["clean_up_tokenization_spaces"].is_boolean())
      cleanUpDefault_ = cfg["clean_up_tokenization_spaces"].get<bool>();

    // Post-processor -> ids around the sequence.
    std::function<Status(const json&)> post = [&](const json& p) -> Status {
      if (p.is_null()) return Status::ok();
      std::string type = p.value("type", std::string());
      if (type == "ByteLevel") return Status::ok();  // offsets only
      if (type == "Sequence") {
        for (const auto& q : p.value("processors", json::array())) PD_RETURN_IF_ERROR(post(q));
        return Status::ok();
      }
      if (type == "TemplateProcessing") {
        prefixIds_.clear();
        suffixIds_.clear();
        bool seenA = false;
        const json specials = p.value("special_tokens", json::object());
        for (const auto& item : p.value("single", json::array())) {
          if (item.contains("Sequence")) {
            seenA = true;
          } else if (item.contains("SpecialToken")) {
            std::string name = item["SpecialToken"].value("id", std::string());
            if (!specials.contains(name))
              return invalidArgument("post_processor: special token '" + name + "' not defined");
            for (const auto& i : specials[name].value("ids", json::array()))
              (seenA ? suffixIds_ : prefixIds_).push_back(i.get<TokenId>());
          }
        }
        return Status::ok();
      }
      return unimplemented("post_processor type '" + type +
                           "' is not supported (supported: TemplateProcessing, ByteLevel, Sequence)");
    };
    PD_RETURN_IF_ERROR(post(tj.value("post_processor", json())));
    bool hasBosFlag = cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean();
    bool hasEosFlag = cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean();
    if (hasBosFlag || hasEosFlag) {
      bool addBos = hasBosFlag ? cfg["add_bos_token"].get<bool>() : false;
      bool addEos = hasEosFlag ? cfg["add_eos_token"].get<bool>() : false;
      if (!hasBosFlag) addBos = bosId_ && !prefixIds_.empty() && prefixIds_.front() == *bosId_;
      if (!hasEosFlag) addEos = eosId_ && !suffixIds_.empty() && suffixIds_.back() == *eosId_;
      prefixIds_.clear();
      suffixIds_.clear();
      if (addBos && bosId_) prefixIds_.push_back(*bosId_);
      if (addEos && eosId_) suffixIds_.push_back(*eosId_);
    }

    // Decoder -> bytes per id + text-level strip.
    const json dec = tj.value("decoder", json());
    if (dec.is_null()) return unimplemented("tokenizer.json has no decoder; decoding needs one");
    std::vector<json> steps;
    if (dec.value("type", std::string()) == "Sequence") {
      for (const auto& d : dec.value("decoders", json::array())) steps.push_back(d);
    } else {
      steps.push_back(dec);
    }
    std::vector<bool> isAdded(model_->vocabSize(), false);
    for (const auto& a : added_)
      if (static_cast<size_t>(a.id) < isAdded.size()) isAdded[static_cast<size_t>(a.id)] = true;
    tokenBytes_.assign(model_->vocabSize(), std::string());
    for (size_t i = 0; i < tokenBytes_.size(); ++i) tokenBytes_[i] = model_->idToToken(static_cast<TokenId>(i));
    bool fused = false;
    for (const auto& d : steps) {
      std::string type = d.value("type", std::string());
      if (fused && type != "Strip") {
        return unimplemented("decoder '" + type + "' after Fuse is not supported");
      }
      if (type == "Fuse") {
        fused = true;
      } else if (type == "Replace") {
        auto p = d.value("pattern", json::object());
        std::shared_ptr<const Regex> re;
        if (p.contains("String")) {
          PD_ASSIGN_OR_RETURN(re, Regex::compile(regexEscape(p["String"].get<std::string>())));
        } else if (p.contains("Regex")) {
          PD_ASSIGN_OR_RETURN(re, Regex::compile(p["Regex"].get<std::string>()));
        } else {
          return invalidArgument("decoder Replace: 'pattern' must hold 'String' or 'Regex'");
        }
        std::string content = d.value("content", std::string());
        for (auto& t : tokenBytes_) t = replaceAll(std::move(t), *re, content);
      } else if (type == "ByteFallback") {
        for (auto& t : tokenBytes_) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::isxdigit(static_cast<unsigned char>(t[3])) && std::isxdigit(static_cast<unsigned char>(t[4]))) {
            t = std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
          }
        }
      } else if (type == "ByteLevel") {
        for (size_t i = 0; i < tokenBytes_.size(); ++i)
          if (!isAdded[i]) tokenBytes_[i] = byteLevelToBytes(tokenBytes_[i]);
      } else if (type == "Metaspace") {
        std::string rep = d.value("replacement", std::string("\xE2\x96\x81"));
        auto re = Regex::compile(regexEscape(rep));
        if (!re.ok()) return re.status();
        for (auto& t : tokenBytes_) t = replaceAll(std::move(t), **re, " ");
        bool prefix = d.value("add_prefix_space", true) && d.value("prepend_scheme", std::string("always")) != "never";
        if (prefix) textStrip_ = TextStrip{" ", 1, 0};
      } else if (type == "Strip") {
        std::string content = d.value("content", std::string(" "));
        int start = d.value("start", 0), stop = d.value("stop", 0);
        if (fused || steps.size() == 1) {
          textStrip_ = TextStrip{content, start, stop};
        } else {
          for (auto& t : tokenBytes_) t = applyTextStrip(std::move(t), TextStrip{content, start, stop});
        }
      } else {
        return unimplemented("decoder type '" + type +
                             "' is not supported (supported: ByteLevel, Replace, ByteFallback, "
                             "Fuse, Strip, Metaspace, Sequence)");
      }
    }
  } catch (const json::exception& e) {
    return invalidArgument(std::string("tokenizer.json: unexpected structure: ") + e.what());
  }
  return Status::ok();
}

void Tokenizer::splitAddedTokens(std::string_view text, std::span<const TextRange> literal,
                                 std::vector<std::pair<std::string_view, int>>& out) const {
  auto overlapsLiteral = [&](size_t begin, size_t end) {
    for (const auto& r : literal)
      if (begin < r.end && r.begin < end) return true;
    return false;
  };
  size_t start = 0, i = 0, n = text.size();
  const auto& rootChildren = addedTrie_->children;
  while (i < n) {
    auto first = rootChildren.find(static_cast<unsigned char>(text[i]));
    if (first == rootChildren.end()) {
      ++i;
      continue;
    }
    const TrieNode* node = first->second.get();
    int match = -1;
    size_t matchLen = 0;
    size_t j = i + 1;
    for (;;) {
      if (node->addedIndex >= 0) {
        match = node->addedIndex;
        matchLen = j - i;
      }
      if (j >= n) break;
      auto it = node->children.find(static_cast<unsigned char>(text[j]));
      if (it == node->children.end()) break;
      node = it->second.get();
      ++j;
    }
    if (match < 0 || (isSpecial(added_[match].id) && overlapsLiteral(i, i + matchLen))) {
      ++i;
      continue;
    }
    if (i > start) out.emplace_back(text.substr(start, i - start), -1);
    out.emplace_back(text.substr(i, matchLen), match);
    i += matchLen;
    start = i;
  }
  if (start < n) out.emplace_back(text.substr(start), -1);
}

std::vector<TextRange> Tokenizer::findSpecialTokens(std::string_view text) const {
  std::vector<std::pair<std::string_view, int>> sections;
  splitAddedTokens(text, {}, sections);
  std::vector<TextRange> out;
  for (const auto& [sv, a] : sections) {
    if (a < 0 || !isSpecial(added_[a].id)) continue;
    size_t begin = size_t(sv.data() - text.data());
    out.push_back({begin, begin + sv.size()});
  }
  return out;
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text, bool addSpecialTokens) const {
  return encode(text, addSpecialTokens, {});
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text, bool addSpecialTokens,
                                               std::span<const TextRange> literal) const {
  if (!isValidUtf8(text)) return invalidArgument("tokenize: text is not valid UTF-8");
  std::vector<std::pair<std::string_view, int>> sections;
  splitAddedTokens(text, literal, sections);
  for (size_t i = 0; i < sections.size(); ++i) {
    int a = sections[i].second;
    if (a < 0) continue;
    if (added_[a].lstrip && i > 0 && sections[i - 1].second < 0)
      sections[i - 1].first = trimEndJs(sections[i - 1].first);
    if (added_[a].rstrip && i + 1 < sections.size() && sections[i + 1].second < 0)
      sections[i + 1].first = trimStartJs(sections[i + 1].first);
  }
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 4);
  if (addSpecialTokens) ids.insert(ids.end(), prefixIds_.begin(), prefixIds_.end());
  std::vector<std::string> pieces;
  for (size_t i = 0; i < sections.size(); ++i) {
    auto [sv, a] = sections[i];
    if (a >= 0) {
      ids.push_back(added_[a].id);
      continue;
    }
    if (sv.empty()) continue;
    std::string s(sv);
    if (normalizer_) PD_RETURN_IF_ERROR(normalizer_->normalize(s));
    if (s.empty()) continue;
    pieces.clear();
    pieces.push_back(std::move(s));
    if (preTokenizer_) preTokenizer_->split(pieces, i);
    for (const auto& p : pieces) model_->encodeWord(p, ids);
  }
  if (addSpecialTokens) ids.insert(ids.end(), suffixIds_.begin(), suffixIds_.end());
  return ids;
}

std::string applyTextStrip(std::string text, const Tokenizer::TextStrip& strip) {
  if (strip.content.empty()) return text;
  const std::string& c = strip.content;
  size_t begin = 0;
  for (int i = 0; i < strip.start && text.compare(begin, c.size(), c) == 0; ++i) begin += c.size();
  size_t end = text.size();
  for (int i = 0; i < strip.stop && end >= begin + c.size() && text.compare(end - c.size(), c.size(), c) == 0; ++i)
    end -= c.size();
  return text.substr(begin, end - begin);
}

std::string cleanUpTokenization(std::string_view text) {
  // The replacements of transformers' clean_up_tokenization, applied in its order.
  static const std::pair<const char*, const char*> kRules[] = {
      {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  std::string s(text);
  for (auto [from, to] : kRules) {
    std::string out;
    std::string_view f(from);
    size_t prev = 0, pos;
    while ((pos = s.find(f, prev)) != std::string::npos) {
      out.append(s, prev, pos - prev);
      out.append(to);
      prev = pos + f.size();
    }
    out.append(s, prev, std::string::npos);
    s = std::move(out);
  }
  return s;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, const DecodeOptions& options) const {
  std::string bytes;
  for (TokenId id : ids) {
    if (options.skipSpecialTokens && isSpecial(id)) continue;
    bytes += tokenBytes(id);
  }
  std::string text = applyTextStrip(lossyUtf8(bytes), textStrip_);
  if (options.cleanUpTokenizationSpaces) text = cleanUpTokenization(text);
  return text;
}

const std::string& Tokenizer::tokenBytes(TokenId id) const {
  static const std::string kEmpty;
  if (id < 0 || static_cast<size_t>(id) >= tokenBytes_.size()) return kEmpty;
  return tokenBytes_[static_cast<size_t>(id)];
}

const std::string& Tokenizer::idToToken(TokenId id) const { return model_->idToToken(id); }

std::optional<TokenId> Tokenizer::tokenToId(std::string_view token) const {
  TokenId id;
  if (model_->tokenToId(token, &id)) return id;
  return std::nullopt;
}

size_t Tokenizer::vocabSize() const { return model_->vocabSize(); }

}  // namespace pd::tok
