// Parsing an untrusted JSON request body (docs/security.md): the one entry point every router
// endpoint uses, so that nesting depth and error-message size are bounded everywhere.
//
// Why a pre-scan: nlohmann::json parses iteratively, but dump(), comparisons and the
// destructor of older releases recurse per nesting level, and a 140 KB body of 70k nested
// arrays overflowed an I/O thread's stack in `t.dump()` of an error message. The scan
// refuses such a body before a DOM exists, in O(bytes) and without recursion.
//
// Threads: pure functions, any thread.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <variant>

#include <nlohmann/json.hpp>

#include "router/openai_api.h"

namespace pd::router {

// Deeper than any OpenAI request needs (chat content parts are 5 levels; tool schemas ~20).
inline constexpr int kMaxJsonDepth = 64;
// User input quoted in an error message is cut to this many bytes.
inline constexpr size_t kMaxQuotedBytes = 64;

// The deepest nesting of objects/arrays in `text` (strings and escapes skipped), stopping
// early once `limit` is exceeded; `*at` gets the byte offset where the limit was crossed.
int jsonNestingDepth(std::string_view text, int limit, size_t* at);

// Parses a request body: a 400 naming the byte offset when it nests deeper than
// kMaxJsonDepth, is not JSON, or (when requireObject) is not an object. Never throws.
std::variant<nlohmann::json, ApiError> parseJsonBody(const std::string& text, bool requireObject = true);

// `s` for an error message: at most kMaxQuotedBytes, with "... (N bytes)" when cut, and
// never ending inside a UTF-8 sequence.
std::string quoteForMessage(std::string_view s, size_t maxBytes = kMaxQuotedBytes);

}  // namespace pd::router
