#include "router/json_body.h"

namespace pd::router {

using nlohmann::json;

int jsonNestingDepth(std::string_view text, int limit, size_t* at) {
  int depth = 0, deepest = 0;
  bool inString = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (inString) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        inString = false;
      continue;
    }
    if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (depth > limit) {
        if (at) *at = i;
        return depth;
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

std::variant<json, ApiError> parseJsonBody(const std::string& text, bool requireObject) {
  size_t at = 0;
  if (jsonNestingDepth(text, kMaxJsonDepth, &at) > kMaxJsonDepth) {
    return ApiError::invalidRequest("request body nests arrays/objects deeper than " + std::to_string(kMaxJsonDepth) +
                                    " levels (at byte " + std::to_string(at) + ")");
  }
  // A DOM parse with exceptions off: a syntax error is a discarded value, never a throw.
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return ApiError::invalidRequest("request body is not valid JSON");
  if (requireObject && !parsed.is_object()) return ApiError::invalidRequest("request body must be a JSON object");
  return parsed;
}

std::string quoteForMessage(std::string_view s, size_t maxBytes) {
  if (s.size() <= maxBytes) return std::string(s);
  size_t cut = maxBytes;
  // Back off continuation bytes (10xxxxxx) so the cut never splits a UTF-8 sequence.
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return std::string(s.substr(0, cut)) + "... (" + std::to_string(s.size()) + " bytes)";
}

}  // namespace pd::router
