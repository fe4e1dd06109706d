// Structured outputs by constrained decoding (docs/serving.md "Structured outputs"; design in
// docs/design.md "Constraint module"). A ConstraintSpec (spec.h) compiles once into a Grammar:
// a byte-level automaton whose states are small integers. A TokenMatcher joins a Grammar with
// a model's vocabulary (token id -> bytes) and answers, for a state, which tokens keep the
// output a prefix of some text the spec accepts; the mask of each state is computed once (one
// walk of the vocabulary's byte trie) and kept, so a decode step costs a lookup.
//
// Every spec kind is a regular language here: a JSON schema without recursion is one, and
// json_object (any JSON object) is bounded to kMaxJsonObjectDepth levels of nesting. JSON is
// generated in one canonical layout: no whitespace except one space after ':' and ','
// (`{"a": 1, "b": [true, null]}`), properties in the schema's order.
//
// Contract:
//   - validateSpec / compileGrammar refuse what is not implemented by name (a JSON-schema
//     keyword, a regex construct) with kInvalidArgument or kUnimplemented; never ignore it.
//   - State is an int32; kDeadState means the output left the language (never reached by a
//     token the mask allowed). The start state is grammar.start().
//   - EOS and stop token ids are not in a mask: the sampler allows them exactly where
//     canEnd(state), and must end the output where mustEnd(state).
// Threads: Grammar, TokenVocabulary and TokenMatcher may be shared between threads; their
// lazily built tables are guarded by a mutex each (uncontended on a worker: one loop thread).
// A mask reference from allowed() lasts until the next allowed() on that matcher, so masks
// are read by one thread at a time (the engine's loop).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/base/status.h"
#include "common/constraint/spec.h"

namespace pd::constraint {

using State = int32_t;
inline constexpr State kDeadState = -1;
// json_object: objects and arrays nest at most this deep (the top-level object is level 1).
inline constexpr int kMaxJsonObjectDepth = 6;
// Bounds that keep a compiled automaton small; a spec over them is refused by name.
inline constexpr size_t kMaxSpecBytes = 64 * 1024;
inline constexpr int kMaxRepeat = 256;  // {m,n}, minItems/maxItems, minLength/maxLength
inline constexpr size_t kMaxNfaStates = 200000;
// Masks a TokenMatcher keeps (each is vocabulary/8 bytes: 16 KiB for 128k tokens); past it the
// cache starts over, so a schema with very many states costs recomputation, not memory.
inline constexpr size_t kMaxCachedMasks = 1024;

class Nfa;  // grammar.cpp

// A compiled spec: a lazily determinised byte automaton.
class Grammar {
 public:
  ~Grammar();
  State start() const { return 0; }
  // The state after `byte`, kDeadState when no accepted text continues that way.
  State step(State s, uint8_t byte) const;
  // The state after all of `bytes` (kDeadState once dead).
  State walk(State s, std::string_view bytes) const;
  bool accepting(State s) const;  // the text so far is a complete value
  bool hasNext(State s) const;    // some byte may follow
  size_t numDfaStates() const;    // built so far (grows as texts are walked)

 private:
  friend Result<std::shared_ptr<const Grammar>> compileGrammar(const ConstraintSpec&);
  friend class TokenMatcher;
  Grammar();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Checks a spec as compileGrammar does, without keeping the result: the router's
// request-time check. The message names the field or keyword.
Status validateSpec(const ConstraintSpec& spec);
Result<std::shared_ptr<const Grammar>> compileGrammar(const ConstraintSpec& spec);

// A model's tokens as bytes, and the byte trie over them.
class TokenVocabulary {
 public:
  // tokenBytes[id]: the bytes a token decodes to; usable[id] false for special tokens (never
  // part of constrained text) and ids without bytes.
  TokenVocabulary(std::vector<std::string> tokenBytes, std::vector<bool> usable);
  // Reads a Hugging Face tokenizer.json: byte-level BPE (GPT-2 byte alphabet) or
  // SentencePiece-style (U+2581 for space, <0xNN> byte tokens). Ids >= the file's entries up
  // to vocabSize are unusable (padding rows of the embedding).
  static Result<std::shared_ptr<const TokenVocabulary>> fromTokenizerJson(const std::string& path, int vocabSize);

  int size() const { return int(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  bool usable(int32_t id) const { return usable_[size_t(id)]; }

  // Trie in depth-first order: node i has byte `byte[i]`, ends the tokens in
  // [tokBegin[i], tokEnd[i]) of `trieTokens`, and its subtree spans nodes (i, next[i]).
  struct Trie {
    std::vector<uint8_t> byte;
    std::vector<int32_t> next;
    std::vector<int32_t> tokBegin, tokEnd;
    std::vector<int32_t> tokens;
  };
  const Trie& trie() const { return trie_; }

 private:
  std::vector<std::string> bytes_;
  std::vector<bool> usable_;
  Trie trie_;
};

// A set of token ids (one bit each).
struct TokenMask {
  std::vector<uint64_t> words;
  int count = 0;  // bits set
  bool test(int32_t id) const { return (words[size_t(id) >> 6] >> (id & 63)) & 1; }
};

// A Grammar over a vocabulary: masks per state, cached.
class TokenMatcher {
 public:
  TokenMatcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocab);
  State start() const { return grammar_->start(); }
  // Tokens whose bytes keep the text a prefix of an accepted one from `s` (not EOS: see
  // canEnd). The reference stays valid until the next allowed() call (the cache may start
  // over then: kMaxCachedMasks).
  const TokenMask& allowed(State s) const;
  State advance(State s, int32_t token) const;
  bool canEnd(State s) const { return s != kDeadState && grammar_->accepting(s); }
  bool mustEnd(State s) const { return canEnd(s) && !grammar_->hasNext(s); }
  const Grammar& grammar() const { return *grammar_; }
  const TokenVocabulary& vocabulary() const { return *vocab_; }
  size_t cachedMasks() const;

 private:
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  mutable std::mutex mu_;
  mutable std::unordered_map<State, std::unique_ptr<TokenMask>> masks_;
};

// Compiled matchers by spec (ConstraintSpec::cacheKey), least recently used dropped past
// `capacity`; a matcher in use stays alive through its shared_ptr.
class ConstraintCache {
 public:
  ConstraintCache(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity = 32);
  Result<std::shared_ptr<const TokenMatcher>> get(const ConstraintSpec& spec);
  size_t size() const;
  const std::shared_ptr<const TokenVocabulary>& vocabulary() const { return vocab_; }

 private:
  std::shared_ptr<const TokenVocabulary> vocab_;
  size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<const TokenMatcher>>> lru_;
  std::unordered_map<std::string, decltype(lru_)::iterator> index_;
};

}  // namespace pd::constraint
