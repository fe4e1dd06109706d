#include "common/tokenizer/detokenizer.h"

#include "common/tokenizer/unicode.h"

namespace pd::tok {

IncrementalDetokenizer::IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer, bool skipSpecialTokens)
    : tok_(std::move(tokenizer)), skipSpecial_(skipSpecialTokens) {
  leadingDone_ = tok_->textStrip().content.empty() || tok_->textStrip().start == 0;
}

std::string IncrementalDetokenizer::push(TokenId id) {
  if (skipSpecial_ && tok_->isSpecial(id)) return {};
  pending_ += tok_->tokenBytes(id);
  return release(false);
}

std::string IncrementalDetokenizer::finish() { return release(true); }

std::string IncrementalDetokenizer::release(bool final) {
  const auto& strip = tok_->textStrip();
  const std::string& c = strip.content;
  // The decoder strips up to `start` copies of `c` at the very start of the text: decide
  // that before releasing anything.
  while (!leadingDone_) {
    if (pending_.compare(0, c.size(), c) == 0 && pending_.size() >= c.size()) {
      pending_.erase(0, c.size());
      if (++leadingStripped_ >= strip.start) leadingDone_ = true;
    } else if (pending_.empty() || (pending_.size() < c.size() && c.compare(0, pending_.size(), pending_) == 0)) {
      if (!final) return {};
      leadingDone_ = true;
    } else {
      leadingDone_ = true;
    }
  }
  size_t n = final ? pending_.size() : completeUtf8Prefix(pending_);
  if (!c.empty() && strip.stop > 0) {
    // Hold back (or, at the end, drop) up to `stop` trailing copies of `c`.
    size_t end = n;
    for (int i = 0; i < strip.stop && end >= c.size() && pending_.compare(end - c.size(), c.size(), c) == 0; ++i)
      end -= c.size();
    if (final) {
      pending_.resize(end);
      n = end;
    } else {
      n = end;
    }
  }
  std::string out = lossyUtf8(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  if (final) pending_.clear();
  text_ += out;
  return out;
}

}  // namespace pd::tok
