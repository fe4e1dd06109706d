// Streaming detokenization: ids arrive one at a time; text is released only once it is
// complete UTF-8, and everything released plus finish() equals Tokenizer::decode of all ids
// (with the same skipSpecialTokens; clean-up of tokenization spaces is never applied).
//
// One instance per generated sequence; not thread-safe (the router's loop owns it). Cost per
// id is proportional to the bytes it adds, not to the length of the text so far.
#pragma once

#include <memory>
#include <string>

#include "common/tokenizer/tokenizer.h"

namespace pd::tok {

class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer, bool skipSpecialTokens = false);

  // Appends one id and returns the text that became final (possibly empty). The returned
  // text is always valid UTF-8.
  std::string push(TokenId id);
  // Releases whatever is held back (an unfinished UTF-8 sequence becomes U+FFFD; trailing
  // characters the decoder strips are dropped). Call once, at the end of the sequence.
  std::string finish();

  // Everything released so far.
  const std::string& text() const { return text_; }

 private:
  std::string release(bool final);

  std::shared_ptr<const Tokenizer> tok_;
  bool skipSpecial_;
  std::string pending_;  // bytes not yet released
  std::string text_;
  int leadingStripped_ = 0;
  bool leadingDone_ = false;
};

}  // namespace pd::tok
