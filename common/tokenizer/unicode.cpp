#include "common/tokenizer/unicode.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <vector>

namespace pd::tok {

char32_t nextCodePoint(std::string_view s, size_t& pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  unsigned char c = p[pos];
  if (c < 0x80) {
    ++pos;
    return c;
  }
  int len = 0;
  char32_t cp = 0;
  char32_t minCp = 0;
  if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1F, minCp = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0F, minCp = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07, minCp = 0x10000;
  } else {
    ++pos;
    return 0xFFFD;
  }
  if (pos + len > n) {
    ++pos;
    return 0xFFFD;
  }
  for (int i = 1; i < len; ++i) {
    unsigned char cc = p[pos + i];
    if ((cc & 0xC0) != 0x80) {
      ++pos;
      return 0xFFFD;
    }
    cp = (cp << 6) | (cc & 0x3F);
  }
  if (cp < minCp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    ++pos;
    return 0xFFFD;
  }
  pos += len;
  return cp;
}

void appendUtf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Length of the valid UTF-8 sequence at s[pos], 0 if invalid, -1 if truncated but still a
// valid prefix (Unicode's "maximal subpart" rules, as in the WHATWG decoder).
int sequenceAt(std::string_view s, size_t pos, size_t* invalidLen) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  unsigned char c = p[pos];
  *invalidLen = 1;
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int i = 1; i < len; ++i) {
    if (pos + i >= n) return -1;
    unsigned char cc = p[pos + i];
    unsigned char l = i == 1 ? lo : 0x80;
    unsigned char h = i == 1 ? hi : 0xBF;
    if (cc < l || cc > h) {
      *invalidLen = static_cast<size_t>(i);
      return 0;
    }
  }
  return len;
}

}  // namespace

bool isValidUtf8(std::string_view s) {
  size_t pos = 0;
  size_t bad;
  while (pos < s.size()) {
    int len = sequenceAt(s, pos, &bad);
    if (len <= 0) return false;
    pos += static_cast<size_t>(len);
  }
  return true;
}

size_t completeUtf8Prefix(std::string_view s) {
  size_t pos = 0;
  size_t bad;
  while (pos < s.size()) {
    int len = sequenceAt(s, pos, &bad);
    if (len < 0) return pos;  // could still be completed: hold it back
    pos += len == 0 ? bad : static_cast<size_t>(len);
  }
  return pos;
}

std::string lossyUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  size_t bad;
  while (pos < s.size()) {
    int len = sequenceAt(s, pos, &bad);
    if (len > 0) {
      out.append(s.substr(pos, static_cast<size_t>(len)));
      pos += static_cast<size_t>(len);
    } else if (len == 0) {
      out.append("\xEF\xBF\xBD");
      pos += bad;
    } else {  // truncated at the end: one replacement for the whole maximal subpart
      out.append("\xEF\xBF\xBD");
      break;
    }
  }
  return out;
}

namespace {

Result<std::string> fromUnicodeString(const icu::UnicodeString& u) {
  std::string out;
  u.toUTF8String(out);
  return out;
}

}  // namespace

Result<std::string> normalizeUnicode(std::string_view s, NormalForm form) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* norm = nullptr;
  switch (form) {
    case NormalForm::kNfc:
      norm = icu::Normalizer2::getNFCInstance(err);
      break;
    case NormalForm::kNfd:
      norm = icu::Normalizer2::getNFDInstance(err);
      break;
    case NormalForm::kNfkc:
      norm = icu::Normalizer2::getNFKCInstance(err);
      break;
    case NormalForm::kNfkd:
      norm = icu::Normalizer2::getNFKDInstance(err);
      break;
  }
  if (U_FAILURE(err) || norm == nullptr) {
    return internalError(std::string("ICU normalizer unavailable: ") + u_errorName(err));
  }
  // Fast path: most text (ASCII, already-composed) is unchanged; checked on UTF-8 directly.
  icu::StringPiece piece(s.data(), static_cast<int32_t>(s.size()));
  if (norm->isNormalizedUTF8(piece, err) && U_SUCCESS(err)) return std::string(s);
  err = U_ZERO_ERROR;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(piece);
  icu::UnicodeString out = norm->normalize(u, err);
  if (U_FAILURE(err)) return internalError(std::string("ICU normalize failed: ") + u_errorName(err));
  return fromUnicodeString(out);
}

Result<std::string> toLowerUnicode(std::string_view s) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), s.size()));
  u.toLower(icu::Locale::getRoot());
  return fromUnicodeString(u);
}

bool isJsWhitespace(char32_t c) {
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
    case 0xFEFF:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::string_view trimStartJs(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t next = pos;
    char32_t cp = nextCodePoint(s, next);
    if (!isJsWhitespace(cp)) break;
    pos = next;
  }
  return s.substr(pos);
}

std::string_view trimEndJs(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t p = start;
    char32_t cp = nextCodePoint(s, p);
    if (!isJsWhitespace(cp)) break;
    end = start;
  }
  return s.substr(0, end);
}

const std::array<char32_t, 256>& byteToUnicode() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    std::array<bool, 256> direct{};
    for (int b = '!'; b <= '~'; ++b) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) t[b] = direct[b] ? static_cast<char32_t>(b) : next++;
    return t;
  }();
  return table;
}

int unicodeToByte(char32_t cp) {
  static const std::vector<int> inverse = [] {
    std::vector<int> inv(512, -1);
    const auto& t = byteToUnicode();
    for (int b = 0; b < 256; ++b) inv[t[b]] = b;
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

std::string byteLevelToBytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    size_t start = pos;
    char32_t cp = nextCodePoint(token, pos);
    int b = unicodeToByte(cp);
    if (b >= 0) {
      out.push_back(static_cast<char>(b));
    } else {
      out.append(token.substr(start, pos - start));
    }
  }
  return out;
}

std::string bytesToByteLevel(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  const auto& t = byteToUnicode();
  for (unsigned char b : bytes) appendUtf8(out, t[b]);
  return out;
}

}  // namespace pd::tok
