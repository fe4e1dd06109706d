// UTF-8 helpers shared by the tokenizer pipeline: code point iteration, validity checks,
// Unicode normalization (ICU), JavaScript-compatible whitespace trimming, and GPT-2's
// byte <-> printable-character table used by byte-level BPE.
//
// All functions are pure and thread-safe. Strings are UTF-8 byte strings; functions that need
// valid UTF-8 say so, and callers validate untrusted input first (isValidUtf8).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/status.h"

namespace pd::tok {

// Decodes the code point starting at s[pos] and advances pos. Invalid sequences yield
// U+FFFD and advance by one byte.
char32_t nextCodePoint(std::string_view s, size_t& pos);
void appendUtf8(std::string& out, char32_t cp);
bool isValidUtf8(std::string_view s);

// Length of the longest prefix of `s` that does not end inside a UTF-8 sequence which could
// still be completed by more bytes. Bytes that can never become valid are included (they
// decode to U+FFFD), so the prefix can always be emitted.
size_t completeUtf8Prefix(std::string_view s);

// Decodes arbitrary bytes the way a lossy UTF-8 decoder does (WHATWG / TextDecoder): each
// maximal invalid subpart becomes U+FFFD.
std::string lossyUtf8(std::string_view bytes);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// Requires valid UTF-8.
Result<std::string> normalizeUnicode(std::string_view s, NormalForm form);
Result<std::string> toLowerUnicode(std::string_view s);

// JavaScript's String.prototype.trim{Start,End} whitespace: WhiteSpace + LineTerminator.
bool isJsWhitespace(char32_t cp);
std::string_view trimStartJs(std::string_view s);
std::string_view trimEndJs(std::string_view s);
inline std::string_view trimJs(std::string_view s) { return trimEndJs(trimStartJs(s)); }

// GPT-2 bytes_to_unicode: every byte maps to a printable code point; the inverse maps
// back (-1 for code points outside the table).
const std::array<char32_t, 256>& byteToUnicode();
int unicodeToByte(char32_t cp);

// Converts a byte-level token string ("Ġhello") to its raw bytes (" hello"). Characters
// outside the table are kept as their own UTF-8 (lenient, as the reference decoders are).
std::string byteLevelToBytes(std::string_view token);
std::string bytesToByteLevel(std::string_view bytes);

}  // namespace pd::tok
