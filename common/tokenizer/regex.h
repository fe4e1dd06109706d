// A compiled PCRE2 pattern in UTF + UCP mode (\s, \w, \d and case folding are Unicode-aware,
// as the JavaScript `u` flag and the Rust tokenizers' Oniguruma are), JIT-compiled when the
// platform allows. Pre-tokenizer patterns use Unicode properties and look-ahead.
//
// A Regex is immutable after construction and may be shared between threads: each call uses
// its own match data.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/base/status.h"

namespace pd::tok {

class Regex {
 public:
  // Compiles `pattern`; the error names the pattern and PCRE2's reason and offset.
  static Result<std::shared_ptr<const Regex>> compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Every non-overlapping match in `text` (valid UTF-8) as [begin, end) byte offsets, left to
  // right. An empty match advances by one code point, as JavaScript's matchAll does.
  std::vector<std::pair<size_t, size_t>> findAll(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  Regex() = default;
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
};

// Escapes a literal for use inside a pattern.
std::string regexEscape(std::string_view literal);

}  // namespace pd::tok
