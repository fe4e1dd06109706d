// Token vocabularies, per-state token masks and the compile cache (constraint.h).
#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/constraint/constraint.h"
#include "common/constraint/grammar_impl.h"

namespace pd::constraint {

// ---- TokenVocabulary ---------------------------------------------------------------------------

TokenVocabulary::TokenVocabulary(std::vector<std::string> tokenBytes, std::vector<bool> usable)
    : bytes_(std::move(tokenBytes)), usable_(std::move(usable)) {
  usable_.resize(bytes_.size(), false);
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (bytes_[i].empty()) usable_[i] = false;
  // Sorted byte strings give the trie's nodes in depth-first order: each token adds the
  // nodes past its common prefix with the one before it.
  std::vector<int32_t> order;
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (usable_[i]) order.push_back(int32_t(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[size_t(a)] != bytes_[size_t(b)] ? bytes_[size_t(a)] < bytes_[size_t(b)] : a < b;
  });
  Trie& t = trie_;
  std::vector<int32_t> path;  // node index per depth of the current token
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& b = bytes_[size_t(id)];
    size_t lcp = 0;
    if (prev)
      while (lcp < prev->size() && lcp < b.size() && (*prev)[lcp] == b[lcp]) ++lcp;
    while (path.size() > lcp) {
      t.next[size_t(path.back())] = int32_t(t.byte.size());
      path.pop_back();
    }
    for (size_t d = lcp; d < b.size(); ++d) {
      path.push_back(int32_t(t.byte.size()));
      t.byte.push_back(uint8_t(b[d]));
      t.next.push_back(-1);
      t.tokBegin.push_back(int32_t(t.tokens.size()));
      t.tokEnd.push_back(int32_t(t.tokens.size()));
    }
    // This token ends at the deepest node; its tokens are contiguous (sorted, and a
    // duplicate byte string comes right after the first).
    t.tokens.push_back(id);
    t.tokEnd[size_t(path.back())] = int32_t(t.tokens.size());
    prev = &b;
  }
  for (int32_t n : path) t.next[size_t(n)] = int32_t(t.byte.size());
}

namespace {

// GPT-2's byte alphabet: the code point each byte is written as in a byte-level vocabulary.
std::vector<int> byteLevelDecodeTable() {
  std::vector<int> cpOfByte(256, -1);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    cpOfByte[size_t(b)] = printable ? b : 256 + extra++;
  }
  std::vector<int> byteOfCp(512, -1);
  for (int b = 0; b < 256; ++b) byteOfCp[size_t(cpOfByte[size_t(b)])] = b;
  return byteOfCp;
}

bool nextCp(const std::string& s, size_t* i, uint32_t* cp) {
  const unsigned char c = uint8_t(s[*i]);
  int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || *i + size_t(n) > s.size()) return false;
  uint32_t v = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < n; ++k) v = (v << 6) | (uint8_t(s[*i + size_t(k)]) & 0x3F);
  *i += size_t(n);
  *cp = v;
  return true;
}

}  // namespace

Result<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::fromTokenizerJson(const std::string& path,
                                                                                  int vocabSize) {
  std::ifstream in(path);
  if (!in) return notFound(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalidArgument(path + ": not JSON");
  if (!j.contains("model") || !j["model"].contains("vocab") || !j["model"]["vocab"].is_object())
    return unimplemented(path + ": only tokenizer.json files with a model.vocab object are supported");
  const std::string decoder = j.contains("decoder") ? j["decoder"].dump() : "";
  const std::string preTok = j.contains("pre_tokenizer") ? j["pre_tokenizer"].dump() : "";
  const bool byteLevel = decoder.find("\"ByteLevel\"") != std::string::npos ||
                         (decoder.empty() && preTok.find("\"ByteLevel\"") != std::string::npos);
  const auto byteOfCp = byteLevelDecodeTable();
  const std::string kSpaceMark = "\xE2\x96\x81";  // U+2581, SentencePiece's space

  std::vector<std::string> bytes;
  std::vector<bool> usable;
  auto put = [&](int64_t id, std::string b, bool ok) {
    if (id < 0 || id >= int64_t(1) << 24) return;
    if (size_t(id) >= bytes.size()) {
      bytes.resize(size_t(id) + 1);
      usable.resize(size_t(id) + 1, false);
    }
    bytes[size_t(id)] = std::move(b);
    usable[size_t(id)] = ok;
  };
  for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
    if (!it.value().is_number_integer()) continue;
    const std::string& piece = it.key();
    std::string b;
    bool ok = true;
    if (byteLevel) {
      size_t i = 0;
      uint32_t cp;
      while (i < piece.size()) {
        if (!nextCp(piece, &i, &cp) || cp >= byteOfCp.size() || byteOfCp[cp] < 0) {
          ok = false;
          break;
        }
        b += char(byteOfCp[cp]);
      }
    } else if (piece.size() == 6 && piece.rfind("<0x", 0) == 0 && piece[5] == '>') {
      b += char(std::stoi(piece.substr(3, 2), nullptr, 16));
    } else {
      for (size_t i = 0; i < piece.size();) {
        if (piece.compare(i, kSpaceMark.size(), kSpaceMark) == 0) {
          b += ' ';
          i += kSpaceMark.size();
        } else {
          b += piece[i++];
        }
      }
    }
    put(it.value().get<int64_t>(), ok ? b : "", ok);
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const auto& t : j["added_tokens"]) {
      if (!t.contains("id") || !t.contains("content") || !t["id"].is_number_integer() || !t["content"].is_string())
        continue;
      const bool special = t.value("special", false);
      put(t["id"].get<int64_t>(), t["content"].get<std::string>(), !special);
    }
  }
  if (vocabSize > 0) {
    if (bytes.size() > size_t(vocabSize))
      return invalidArgument(path + ": token ids reach " + std::to_string(bytes.size() - 1) +
                             ", past the model's vocabulary of " + std::to_string(vocabSize));
    bytes.resize(size_t(vocabSize));
    usable.resize(size_t(vocabSize), false);
  }
  return std::shared_ptr<const TokenVocabulary>(std::make_shared<TokenVocabulary>(std::move(bytes), std::move(usable)));
}

// ---- TokenMatcher ------------------------------------------------------------------------------

TokenMatcher::TokenMatcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocab)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)) {}

const TokenMask& TokenMatcher::allowed(State s) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = masks_.find(s);
    if (it != masks_.end()) return *it->second;
  }
  auto mask = std::make_unique<TokenMask>();
  mask->words.assign((size_t(vocab_->size()) + 63) / 64, 0);
  if (s != kDeadState) {
    // One depth-first walk of the trie from `s`: a subtree whose prefix leaves the language
    // is skipped whole, so the cost is the number of live prefixes, not of tokens.
    const TokenVocabulary::Trie& t = vocab_->trie();
    Grammar::Impl& g = *grammar_->impl_;
    std::lock_guard<std::mutex> lock(g.mu);
    struct Frame {
      int32_t end;
      State state;
    };
    std::vector<Frame> stack;
    stack.reserve(64);
    const int32_t n = int32_t(t.byte.size());
    for (int32_t i = 0; i < n;) {
      while (!stack.empty() && stack.back().end <= i) stack.pop_back();
      const State parent = stack.empty() ? s : stack.back().state;
      const State next = g.step(parent, t.byte[size_t(i)]);
      if (next == kDeadState) {
        i = t.next[size_t(i)];
        continue;
      }
      for (int32_t k = t.tokBegin[size_t(i)]; k < t.tokEnd[size_t(i)]; ++k) {
        const int32_t id = t.tokens[size_t(k)];
        mask->words[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
        ++mask->count;
      }
      stack.push_back({t.next[size_t(i)], next});
      ++i;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (masks_.size() >= kMaxCachedMasks) masks_.clear();
  auto [it, inserted] = masks_.try_emplace(s, std::move(mask));
  return *it->second;
}

State TokenMatcher::advance(State s, int32_t token) const {
  if (s == kDeadState || token < 0 || token >= vocab_->size() || !vocab_->usable(token)) return kDeadState;
  return grammar_->walk(s, vocab_->bytes(token));
}

size_t TokenMatcher::cachedMasks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return masks_.size();
}

// ---- ConstraintCache -----------------------------------------------------------------------

ConstraintCache::ConstraintCache(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity)
    : vocab_(std::move(vocab)), capacity_(std::max<size_t>(capacity, 1)) {}

Result<std::shared_ptr<const TokenMatcher>> ConstraintCache::get(const ConstraintSpec& spec) {
  const std::string key = spec.cacheKey();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  // Compiled outside the lock: a slow schema does not hold up hits on others.
  auto g = compileGrammar(spec);
  if (!g.ok()) return g.status();
  auto m = std::make_shared<const TokenMatcher>(std::move(g).value(), vocab_);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it != index_.end()) return it->second->second;
  lru_.emplace_front(key, m);
  index_[key] = lru_.begin();
  while (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return std::shared_ptr<const TokenMatcher>(m);
}

size_t ConstraintCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

}  // namespace pd::constraint
