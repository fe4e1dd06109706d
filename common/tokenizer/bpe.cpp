#include "common/tokenizer/bpe.h"

#include <queue>

#include <nlohmann/json.hpp>

#include "common/tokenizer/unicode.h"

namespace pd::tok {

using json = nlohmann::json;

void MergeTable::reserve(size_t n) {
  size_t cap = 16;
  int bits = 4;
  while (cap < n * 2) cap <<= 1, ++bits;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  shift_ = 64 - bits;
  size_ = 0;
}

void MergeTable::insert(TokenId left, TokenId right, int32_t rank, TokenId merged) {
  if ((size_ + 1) * 2 > slots_.size()) {  // grow: rehash everything
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(16, (size_ + 1) * 2));
    for (const Slot& s : old)
      if (s.rank >= 0)
        insert(static_cast<TokenId>(s.key >> 32), static_cast<TokenId>(s.key & 0xFFFFFFFFu), s.rank, s.merged);
  }
  uint64_t key = pack(left, right);
  for (size_t i = hash(key);; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.rank < 0) {
      s = Slot{key, rank, merged};
      ++size_;
      return;
    }
    if (s.key == key) return;
  }
}

Result<std::unique_ptr<BpeModel>> BpeModel::fromJson(const json& m, bool byteLevel) {
  if (!m.is_object()) return invalidArgument("tokenizer.json: 'model' is not an object");
  std::string type = m.value("type", std::string("BPE"));
  if (type != "BPE") {
    return unimplemented("tokenizer.json: model type '" + type + "' is not supported (only BPE)");
  }
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"] != 0.0) {
    return unimplemented("tokenizer.json: BPE dropout is not supported (inference only)");
  }
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(k) && m[k].is_string() && !m[k].get<std::string>().empty()) {
      return unimplemented(std::string("tokenizer.json: BPE ") + k + " is not supported");
    }
  }
  std::unique_ptr<BpeModel> bpe(new BpeModel());
  bpe->byteLevel_ = byteLevel;
  bpe->ignoreMerges_ = m.value("ignore_merges", false);
  bpe->byteFallback_ = m.value("byte_fallback", false);
  bpe->byteIds_.fill(-1);
  bpe->fallbackIds_.fill(-1);

  if (!m.contains("vocab") || !m["vocab"].is_object())
    return invalidArgument("tokenizer.json: model.vocab is missing or not an object");
  const auto& vocab = m["vocab"];
  bpe->vocab_.reserve(vocab.size() * 2);
  bpe->tokenStrings_.reserve(vocab.size() * 2);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer())
      return invalidArgument("tokenizer.json: model.vocab['" + it.key() + "'] is not an integer");
    int64_t id = it.value().get<int64_t>();
    if (id < 0 || id > (1 << 26))
      return invalidArgument("tokenizer.json: model.vocab['" + it.key() + "'] = " + std::to_string(id) +
                             " is out of range");
    bpe->addToken(it.key(), static_cast<TokenId>(id));
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto f = bpe->tokenStrings_.find(name);
    if (f != bpe->tokenStrings_.end()) bpe->fallbackIds_[b] = f->second;
    if (byteLevel) {
      auto v = bpe->vocab_.find(std::string(1, static_cast<char>(b)));
      if (v != bpe->vocab_.end()) bpe->byteIds_[b] = v->second;
    }
  }
  if (!byteLevel) {
    bpe->charIds_.assign(kCharTableSize, -1);
    for (const auto& [key, id] : bpe->vocab_) {
      size_t pos = 0;
      if (key.empty()) continue;
      char32_t cp = nextCodePoint(key, pos);
      if (pos == key.size() && cp < kCharTableSize && cp != 0xFFFD) bpe->charIds_[cp] = id;
    }
    auto rep = bpe->vocab_.find(std::string_view("\xEF\xBF\xBD"));
    if (rep != bpe->vocab_.end()) bpe->charIds_[0xFFFD] = rep->second;
  }
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto f = bpe->tokenStrings_.find(m["unk_token"].get<std::string>());
    if (f != bpe->tokenStrings_.end()) bpe->unkId_ = f->second;
  }

  if (m.contains("merges")) {
    const auto& merges = m["merges"];
    if (!merges.is_array()) return invalidArgument("tokenizer.json: model.merges is not an array");
    bpe->merges_.reserve(merges.size());
    int32_t rank = 0;
    for (const auto& mg : merges) {
      std::string a, b;
      if (mg.is_string()) {  // legacy "a b" form
        const std::string& s = mg.get_ref<const std::string&>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos) return invalidArgument("tokenizer.json: merge '" + s + "' has no space");
        a = s.substr(0, sp);
        size_t sp2 = s.find(' ', sp + 1);
        b = s.substr(sp + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp - 1);
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        a = mg[0].get<std::string>();
        b = mg[1].get<std::string>();
      } else {
        return invalidArgument("tokenizer.json: merge #" + std::to_string(rank) + " is neither \"a b\" nor [a, b]");
      }
      auto ia = bpe->tokenStrings_.find(a);
      auto ib = bpe->tokenStrings_.find(b);
      auto im = bpe->tokenStrings_.find(a + b);
      // A merge whose parts or result are not in the vocabulary can never produce a token.
      if (ia != bpe->tokenStrings_.end() && ib != bpe->tokenStrings_.end() && im != bpe->tokenStrings_.end()) {
        bpe->merges_.insert(ia->second, ib->second, rank, im->second);
      }
      ++rank;
    }
  }
  return bpe;
}

void BpeModel::addToken(const std::string& content, TokenId id) {
  if (static_cast<size_t>(id) >= idToToken_.size()) idToToken_.resize(static_cast<size_t>(id) + 1);
  idToToken_[static_cast<size_t>(id)] = content;
  tokenStrings_.emplace(content, id);
  vocab_.emplace(byteLevel_ ? byteLevelToBytes(content) : content, id);
}

const std::string& BpeModel::idToToken(TokenId id) const {
  static const std::string kEmpty;
  if (id < 0 || static_cast<size_t>(id) >= idToToken_.size()) return kEmpty;
  return idToToken_[static_cast<size_t>(id)];
}

bool BpeModel::tokenToId(std::string_view token, TokenId* id) const {
  auto it = tokenStrings_.find(token);
  if (it == tokenStrings_.end()) return false;
  *id = it->second;
  return true;
}

void BpeModel::appendUnknown(std::string_view bytes, std::vector<TokenId>& out) const {
  if (byteFallback_) {
    bool all = true;
    for (unsigned char c : bytes) all = all && fallbackIds_[c] >= 0;
    if (all) {
      for (unsigned char c : bytes) out.push_back(fallbackIds_[c]);
      return;
    }
  }
  if (unkId_ >= 0) out.push_back(unkId_);
}

void BpeModel::encodeWord(std::string_view word, std::vector<TokenId>& out) const {
  if (word.empty()) return;
  if (byteLevel_ && word.size() == 1) {  // common (punctuation, spaces): no merge possible
    TokenId id = byteIds_[static_cast<unsigned char>(word[0])];
    if (id >= 0) out.push_back(id);
    return;
  }
  bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cacheMu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t before = out.size();
  auto whole = ignoreMerges_ ? vocab_.find(word) : vocab_.end();
  if (whole != vocab_.end()) {
    out.push_back(whole->second);  // ignore_merges: a word in the vocabulary is one token
  } else {
    mergeWord(word, out);
  }
  if (cacheable) {
    std::vector<TokenId> ids(out.begin() + static_cast<std::ptrdiff_t>(before), out.end());
    std::lock_guard<std::mutex> lock(cacheMu_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();  // bounded memory; refills quickly
    cache_.emplace(std::string(word), std::move(ids));
  }
}

void BpeModel::mergeWord(std::string_view word, std::vector<TokenId>& out) const {
  struct Sym {
    TokenId id;
    int prev, next;
    uint32_t start, len;  // byte span in `word` (for byte fallback of unknown characters)
  };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  if (byteLevel_) {
    for (size_t i = 0; i < word.size(); ++i) {
      syms.push_back({byteIds_[static_cast<unsigned char>(word[i])], static_cast<int>(i) - 1, static_cast<int>(i) + 1,
                      static_cast<uint32_t>(i), 1});
    }
  } else {
    size_t pos = 0;
    while (pos < word.size()) {
      size_t start = pos;
      char32_t cp = nextCodePoint(word, pos);
      TokenId id = -1;
      if (cp < kCharTableSize) {
        id = charIds_[cp];
      } else {
        auto it = vocab_.find(word.substr(start, pos - start));
        if (it != vocab_.end()) id = it->second;
      }
      int idx = static_cast<int>(syms.size());
      syms.push_back({id, idx - 1, idx + 1, static_cast<uint32_t>(start), static_cast<uint32_t>(pos - start)});
    }
  }
  syms.back().next = -1;

  struct Cand {
    int32_t rank;
    int pos;
    TokenId merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  auto lookup = [&](int i, Cand* c) {
    int j = syms[i].next;
    if (j < 0 || syms[i].id < 0 || syms[j].id < 0) return false;
    int32_t rank;
    TokenId merged;
    if (!merges_.find(syms[i].id, syms[j].id, &rank, &merged)) return false;
    *c = {rank, i, merged};
    return true;
  };
  std::vector<Cand> storage;
  storage.reserve(syms.size() * 2);
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue(std::greater<Cand>(), std::move(storage));
  Cand c;
  for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i)
    if (lookup(i, &c)) queue.push(c);
  while (!queue.empty()) {
    Cand top = queue.top();
    queue.pop();
    Sym& left = syms[top.pos];
    if (left.len == 0 || left.next < 0) continue;  // merged away
    Cand now;
    if (!lookup(top.pos, &now) || now.rank != top.rank || now.merged != top.merged) continue;
    Sym& right = syms[left.next];
    left.id = top.merged;
    left.len += right.len;
    left.next = right.next;
    right.len = 0;
    if (left.next >= 0) syms[left.next].prev = top.pos;
    if (left.prev >= 0 && lookup(left.prev, &c)) queue.push(c);
    if (lookup(top.pos, &c)) queue.push(c);
  }
  for (int i = 0; i >= 0; i = syms[i].next) {
    if (syms[i].id >= 0)
      out.push_back(syms[i].id);
    else
      appendUnknown(word.substr(syms[i].start, syms[i].len), out);
  }
}

}  // namespace pd::tok
