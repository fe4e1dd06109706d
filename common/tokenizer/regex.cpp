#include "common/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/base/log.h"

namespace pd::tok {

Result<std::shared_ptr<const Regex>> Regex::compile(std::string_view pattern) {
  int errCode = 0;
  PCRE2_SIZE errOffset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &errCode, &errOffset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(errCode, buf, sizeof(buf));
    return invalidArgument("regex '" + std::string(pattern) + "' does not compile at offset " +
                           std::to_string(errOffset) + ": " + reinterpret_cast<char*>(buf));
  }
  // JIT is an optimisation only: if unavailable the interpreter gives the same matches.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  auto re = std::shared_ptr<Regex>(new Regex());
  re->pattern_ = std::string(pattern);
  re->code_ = code;
  return std::shared_ptr<const Regex>(std::move(re));
}

Regex::~Regex() {
  if (code_ != nullptr) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

std::vector<std::pair<size_t, size_t>> Regex::findAll(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  auto* code = static_cast<pcre2_code*>(code_);
  // Match data is per call (and per thread); a thread_local keeps allocation off the hot path.
  thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create(8, nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos <= text.size()) {
    int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (rc < 0) {
      // A resource limit (not seen with the real patterns even on megabyte-long runs): the
      // rest stays one unsplit piece, so no text is lost, and the reason is logged.
      if (rc != PCRE2_ERROR_NOMATCH) {
        PCRE2_UCHAR buf[256];
        pcre2_get_error_message(rc, buf, sizeof(buf));
        PD_LOG(kError, "tokenizer") << "regex '" << pattern_ << "' stopped at byte " << pos << " of " << text.size()
                                    << ": " << reinterpret_cast<char*>(buf);
      }
      break;
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    size_t b = ov[0], e = ov[1];
    out.emplace_back(b, e);
    if (e == b) {
      if (e >= text.size()) break;
      // Step over one whole code point so offsets stay on character boundaries.
      size_t next = e + 1;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
      pos = next;
    } else {
      pos = e;
    }
  }
  return out;
}

std::string regexEscape(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}/-").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

}  // namespace pd::tok
