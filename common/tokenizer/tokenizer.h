// A Hugging Face tokenizer loaded from a model directory (tokenizer.json +
// tokenizer_config.json): encode text to ids, decode ids to text, and the pieces needed for
// streaming detokenization and chat templates.
//
// Supported: BPE models, byte-level (GPT-2, Llama 3, Qwen) and SentencePiece-style with byte
// fallback and the ▁ convention (Llama 2, TinyLlama, Mistral); the normalizers,
// pre-tokenizers, post-processors and decoders those files use. Anything else is refused at
// load with an error naming the unsupported part (docs/tokenizer.md lists them).
//
// Encoding follows the reference implementations step by step: added tokens are matched
// first (longest match, never split, lstrip/rstrip honoured), each text section between them
// is normalized, pre-tokenized and BPE-encoded, then the post-processor adds BOS/EOS.
// BOS/EOS: tokenizer.json's post_processor decides (TemplateProcessing), as HF fast
// tokenizers do; when tokenizer_config.json sets add_bos_token / add_eos_token explicitly,
// those flags decide instead (as transformers' LlamaTokenizerFast rebuilds its template).
//
// Thread-safety: a loaded Tokenizer is immutable (its BPE cache is internally locked) and is
// shared as shared_ptr<const Tokenizer> between any threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "common/base/status.h"
#include "common/tokenizer/bpe.h"

namespace pd::tok {

class Normalizer;
class PreTokenizer;

struct AddedToken {
  std::string content;
  TokenId id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
};

// A byte range [begin, end) of a text.
struct TextRange {
  size_t begin = 0;
  size_t end = 0;
};

struct DecodeOptions {
  // Drop special tokens (added tokens marked special, plus additional_special_tokens).
  bool skipSpecialTokens = false;
  // transformers' clean_up_tokenization (" ." -> ".", " 's" -> "'s", ...). Off by default:
  // streamed text is never cleaned up, and decode must equal the concatenated stream.
  bool cleanUpTokenizationSpaces = false;
};

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json and DIR/tokenizer_config.json (the latter optional).
  static Result<std::shared_ptr<const Tokenizer>> loadDir(const std::string& dir);
  // The two files' contents; `configJson` may be empty.
  static Result<std::shared_ptr<const Tokenizer>> fromJson(std::string_view tokenizerJson, std::string_view configJson);
  ~Tokenizer();

  // Fails only for text that is not valid UTF-8.
  Result<std::vector<TokenId>> encode(std::string_view text, bool addSpecialTokens = true) const;
  // The same, except that special tokens' text overlapping a `literal` range is encoded as
  // plain text, never as the special token (client text must not become <|eot_id|> unless the
  // request asks for it). Added tokens that are not special still match, as in the reference.
  // Text without special-token strings in those ranges encodes exactly as encode() does.
  Result<std::vector<TokenId>> encode(std::string_view text, bool addSpecialTokens,
                                      std::span<const TextRange> literal) const;
  // The ranges of `text` that match a special token (as encode() would split them).
  std::vector<TextRange> findSpecialTokens(std::string_view text) const;

  // Ids outside the vocabulary decode to nothing. Invalid UTF-8 produced by byte tokens
  // becomes U+FFFD, as the reference decoders do.
  std::string decode(std::span<const TokenId> ids, const DecodeOptions& options = {}) const;

  // The vocabulary string of an id as tokenizer.json spells it (for display); empty if none.
  const std::string& idToToken(TokenId id) const;
  std::optional<TokenId> tokenToId(std::string_view token) const;
  size_t vocabSize() const;
  bool isSpecial(TokenId id) const { return specialIds_.count(id) != 0; }
  const std::vector<AddedToken>& addedTokens() const { return added_; }

  // From tokenizer_config.json (empty / nullopt when not set).
  const std::string& bosToken() const { return bosToken_; }
  const std::string& eosToken() const { return eosToken_; }
  std::optional<TokenId> bosTokenId() const { return bosId_; }
  std::optional<TokenId> eosTokenId() const { return eosId_; }
  // The model's chat_template string; empty when the model has none.
  const std::string& chatTemplate() const { return chatTemplate_; }
  // tokenizer_config.json's clean_up_tokenization_spaces (reference default: true).
  bool configCleanUpTokenizationSpaces() const { return cleanUpDefault_; }

  // ---- For IncrementalDetokenizer: decode = finish(concat(tokenBytes(id))) -------------
  // The raw bytes one id contributes (before UTF-8 decoding and the text-level steps).
  const std::string& tokenBytes(TokenId id) const;
  // Characters the decoder strips at the start / end of the whole text (Strip after Fuse,
  // Metaspace's prefix space): applied by finishText.
  struct TextStrip {
    std::string content;  // one character (UTF-8); empty: nothing stripped
    int start = 0;
    int stop = 0;
  };
  const TextStrip& textStrip() const { return textStrip_; }

 private:
  Tokenizer();
  Status load(std::string_view tokenizerJson, std::string_view configJson);
  // Splits text into plain sections (-1) and added-token matches (their index in added_);
  // special tokens overlapping a literal range are not matched.
  void splitAddedTokens(std::string_view text, std::span<const TextRange> literal,
                        std::vector<std::pair<std::string_view, int>>& out) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> preTokenizer_;
  std::unique_ptr<BpeModel> model_;

  std::vector<AddedToken> added_;
  struct TrieNode;
  std::unique_ptr<TrieNode> addedTrie_;
  std::unordered_set<TokenId> specialIds_;

  std::vector<TokenId> prefixIds_;  // post-processing: ids before and after the sequence
  std::vector<TokenId> suffixIds_;

  std::vector<std::string> tokenBytes_;  // decode plan: bytes per id
  TextStrip textStrip_;

  std::string bosToken_, eosToken_, chatTemplate_;
  std::optional<TokenId> bosId_, eosId_;
  bool cleanUpDefault_ = true;
};

// transformers' clean_up_tokenization.
std::string cleanUpTokenization(std::string_view text);
// Applies a TextStrip to decoded text.
std::string applyTextStrip(std::string text, const Tokenizer::TextStrip& strip);

}  // namespace pd::tok
