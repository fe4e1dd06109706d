// The encode-side stages of a Hugging Face tokenizer.json: normalizers and pre-tokenizers,
// built from their JSON objects. Only the types real Llama/Mistral/Qwen files use are
// implemented; any other type is refused at load with an error naming it, so a tokenizer is
// never run with a silently skipped stage.
//
// Objects are immutable after construction and safe to share between threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/base/status.h"

namespace pd::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Rewrites `text` (valid UTF-8) in place.
  virtual Status normalize(std::string& text) const = 0;
};

// Types: Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace, Strip, Lowercase.
// Throws nothing; a null/absent JSON value yields nullptr (no normalizer).
Result<std::unique_ptr<Normalizer>> makeNormalizer(const nlohmann::json& config);

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits every piece of `pieces` further. `sectionIndex` is the index of the text section
  // between added tokens (Metaspace's prepend_scheme "first" depends on it).
  virtual void split(std::vector<std::string>& pieces, size_t sectionIndex) const = 0;
  // True for ByteLevel (anywhere in a Sequence): the model then works on raw bytes.
  virtual bool byteLevel() const { return false; }
};

// Types: Sequence, Split (Isolated, Removed, MergedWithPrevious, MergedWithNext; invert),
// ByteLevel, Metaspace, Digits, WhitespaceSplit.
Result<std::unique_ptr<PreTokenizer>> makePreTokenizer(const nlohmann::json& config);

}  // namespace pd::tok
