// The BPE model of a tokenizer.json: vocabulary, merges by rank, byte fallback, and a cache
// of encoded words.
//
// Two symbol spaces:
//  - byte-level (GPT-2, Llama 3, Qwen): words are raw bytes; vocabulary strings are mapped
//    back from GPT-2's printable characters at load, so encoding never builds mapped strings;
//  - character-level (SentencePiece-style, Llama 2, Mistral): words are UTF-8 and start as
//    code points; characters missing from the vocabulary become <0xNN> byte tokens when
//    byte_fallback is set, else the unknown token.
// Merges apply lowest rank first, leftmost first among equal ranks.
//
// Thread-safety: encodeWord may be called from any thread; the word cache is guarded by a
// mutex. Everything else is immutable after load.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/base/status.h"

namespace pd::tok {

using TokenId = int32_t;

// Hash and equality that accept std::string_view, so lookups never allocate.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Open-addressing table for merges: (left id, right id) -> (rank, merged id). The BPE inner
// loop does one lookup per candidate pair; std::unordered_map's prime-modulo hashing and
// node chasing cost several times more.
class MergeTable {
 public:
  void reserve(size_t n);
  // Keeps the first insertion of a pair (the lowest rank).
  void insert(TokenId left, TokenId right, int32_t rank, TokenId merged);
  bool find(TokenId left, TokenId right, int32_t* rank, TokenId* merged) const {
    if (slots_.empty()) return false;
    uint64_t key = pack(left, right);
    for (size_t i = hash(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.rank < 0) return false;
      if (s.key == key) {
        *rank = s.rank;
        *merged = s.merged;
        return true;
      }
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int32_t rank = -1;  // -1: empty
    TokenId merged = -1;
  };
  static uint64_t pack(TokenId l, TokenId r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }
  // Fibonacci hashing: the top bits of the product mix every bit of both ids.
  size_t hash(uint64_t k) const { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
};

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object (type BPE). Errors name the field at fault.
  static Result<std::unique_ptr<BpeModel>> fromJson(const nlohmann::json& model, bool byteLevel);

  // Appends the ids of one pre-tokenized word.
  void encodeWord(std::string_view word, std::vector<TokenId>& out) const;

  // Registers an id <-> string pair that is not in the model's vocabulary (added tokens).
  void addToken(const std::string& content, TokenId id);

  size_t vocabSize() const { return idToToken_.size(); }
  // The vocabulary string of `id` as tokenizer.json spells it ("Ġhello", "▁the", "<0x0A>").
  // Empty for ids without a token.
  const std::string& idToToken(TokenId id) const;
  // Looks up a vocabulary string as tokenizer.json spells it.
  bool tokenToId(std::string_view token, TokenId* id) const;
  bool byteLevel() const { return byteLevel_; }

 private:
  BpeModel() = default;
  void mergeWord(std::string_view word, std::vector<TokenId>& out) const;
  void appendUnknown(std::string_view bytes, std::vector<TokenId>& out) const;

  bool byteLevel_ = false;
  bool ignoreMerges_ = false;
  bool byteFallback_ = false;
  TokenId unkId_ = -1;
  // Keys in the model's symbol space (raw bytes when byte-level).
  StringMap<TokenId> vocab_;
  StringMap<TokenId> tokenStrings_;  // as spelled in the file
  std::vector<std::string> idToToken_;
  MergeTable merges_;
  std::array<TokenId, 256> byteIds_{};      // byte-level: the token of each single byte
  std::array<TokenId, 256> fallbackIds_{};  // <0xNN> tokens
  // Character-level models: the token of each single code point below kCharTableSize
  // (-1: none), so the first step of BPE does no hashing.
  static constexpr char32_t kCharTableSize = 0x30000;
  std::vector<TokenId> charIds_;

  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 17;
  mutable std::mutex cacheMu_;
  mutable StringMap<std::vector<TokenId>> cache_;
};

}  // namespace pd::tok
