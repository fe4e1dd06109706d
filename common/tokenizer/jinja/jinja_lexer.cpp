// The Jinja lexer (jinja_lexer.h).
#include "common/tokenizer/jinja/jinja_lexer.h"

#include <algorithm>

#include "common/tokenizer/jinja/jinja_value.h"
#include "common/tokenizer/unicode.h"

namespace pd::tok::jinja {

bool isSpaceChar(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// transformers' environment: trim_blocks + lstrip_blocks, one trailing newline dropped.
std::string preprocess(std::string src) {
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::string out;
  out.reserve(src.size());
  // lstrip_blocks: spaces/tabs at the start of a line before "{%", "{#" (or "{-").
  size_t i = 0;
  while (i < src.size()) {
    bool lineStart = i == 0 || src[i - 1] == '\n';
    if (lineStart) {
      size_t j = i;
      while (j < src.size() && (src[j] == ' ' || src[j] == '\t')) ++j;
      if (j > i && j + 1 < src.size() && src[j] == '{' &&
          (src[j + 1] == '%' || src[j + 1] == '#' || src[j + 1] == '-')) {
        i = j;
      }
    }
    out.push_back(src[i]);
    ++i;
  }
  // trim_blocks: the newline right after "%}", "#}" or "-}".
  std::string res;
  res.reserve(out.size());
  for (size_t k = 0; k < out.size(); ++k) {
    res.push_back(out[k]);
    if (out[k] == '}' && k > 0 && (out[k - 1] == '%' || out[k - 1] == '#' || out[k - 1] == '-') && k + 1 < out.size() &&
        out[k + 1] == '\n') {
      ++k;
    }
  }
  return res;
}

std::vector<Token> tokenize(const std::string& source) {
  std::string src = preprocess(source);
  std::vector<Token> toks;
  size_t pos = 0, n = src.size();
  int line = 1;
  auto countLines = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k)
      if (src[k] == '\n') ++line;
  };
  auto stripTrailing = [&] {
    if (!toks.empty() && toks.back().type == Tok::kText) {
      std::string_view v = trimEndJs(toks.back().text);
      toks.back().text.resize(v.size());
      if (toks.back().text.empty()) toks.pop_back();
    }
  };
  auto skipLeading = [&] {
    size_t start = pos;
    while (pos < n && isSpaceChar(src[pos])) ++pos;
    countLines(start, pos);
  };
  while (pos < n) {
    // Text up to the next tag.
    size_t start = pos;
    while (pos < n &&
           !(src[pos] == '{' && pos + 1 < n && (src[pos + 1] == '%' || src[pos + 1] == '{' || src[pos + 1] == '#')))
      ++pos;
    if (pos > start) {
      toks.push_back({Tok::kText, src.substr(start, pos - start), line});
      countLines(start, pos);
    }
    if (pos >= n) break;
    char kind = src[pos + 1];
    pos += 2;
    bool stripBefore = pos < n && src[pos] == '-';
    if (stripBefore) ++pos;
    if (kind == '#') {
      size_t end = src.find("#}", pos);
      if (end == std::string::npos) fail(line, "comment is not closed ('#}' missing)");
      bool stripAfter = end > pos && src[end - 1] == '-';
      if (stripBefore) stripTrailing();
      countLines(pos, end);
      pos = end + 2;
      if (stripAfter) skipLeading();
      continue;
    }
    if (stripBefore) stripTrailing();
    toks.push_back({kind == '%' ? Tok::kOpenStmt : Tok::kOpenExpr, "", line});
    const char* close = kind == '%' ? "%}" : "}}";
    int depth = 0;  // brackets, so "}}" inside a dict literal does not close the tag
    for (;;) {
      size_t ws = pos;
      while (pos < n && isSpaceChar(src[pos])) ++pos;
      countLines(ws, pos);
      if (pos >= n) fail(line, std::string("tag is not closed ('") + close + "' missing)");
      if (src[pos] == '-' && pos + 2 < n && src[pos + 1] == close[0] && src[pos + 2] == close[1] && depth == 0) {
        toks.push_back({kind == '%' ? Tok::kCloseStmt : Tok::kCloseExpr, "", line});
        pos += 3;
        skipLeading();
        break;
      }
      if (src[pos] == close[0] && pos + 1 < n && src[pos + 1] == close[1] && depth == 0) {
        toks.push_back({kind == '%' ? Tok::kCloseStmt : Tok::kCloseExpr, "", line});
        pos += 2;
        break;
      }
      char c = src[pos];
      if (c == '\'' || c == '"') {
        std::string s;
        ++pos;
        while (pos < n && src[pos] != c) {
          if (src[pos] == '\\' && pos + 1 < n) {
            char e = src[++pos];
            switch (e) {
              case 'n':
                s += '\n';
                break;
              case 't':
                s += '\t';
                break;
              case 'r':
                s += '\r';
                break;
              case 'b':
                s += '\b';
                break;
              case 'f':
                s += '\f';
                break;
              case 'v':
                s += '\v';
                break;
              case '\\':
                s += '\\';
                break;
              case '\'':
                s += '\'';
                break;
              case '"':
                s += '"';
                break;
              case '\n':
                break;
              case 'x':
              case 'u': {
                size_t len = e == 'x' ? 2 : 4;
                if (pos + len >= n) fail(line, "bad escape in string literal");
                char32_t cp = static_cast<char32_t>(std::stoul(src.substr(pos + 1, len), nullptr, 16));
                appendUtf8(s, cp);
                pos += len;
                break;
              }
              default:
                fail(line, std::string("unknown escape '\\") + e + "' in string literal");
            }
            ++pos;
            continue;
          }
          if (src[pos] == '\n') ++line;
          s.push_back(src[pos++]);
        }
        if (pos >= n) fail(line, "string literal is not closed");
        ++pos;
        toks.push_back({Tok::kString, s, line});
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t b = pos;
        while (pos < n && (std::isdigit(static_cast<unsigned char>(src[pos])) || src[pos] == '_')) ++pos;
        bool isFloat = false;
        if (pos + 1 < n && src[pos] == '.' && std::isdigit(static_cast<unsigned char>(src[pos + 1])) &&
            !(toks.size() && toks.back().type == Tok::kOp && toks.back().text == ".")) {
          isFloat = true;
          ++pos;
          while (pos < n && std::isdigit(static_cast<unsigned char>(src[pos]))) ++pos;
        }
        std::string num = src.substr(b, pos - b);
        num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
        toks.push_back({isFloat ? Tok::kFloat : Tok::kInt, num, line});
        continue;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t b = pos;
        while (pos < n && (std::isalnum(static_cast<unsigned char>(src[pos])) || src[pos] == '_')) ++pos;
        toks.push_back({Tok::kName, src.substr(b, pos - b), line});
        continue;
      }
      static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                   ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
      bool matched = false;
      for (const char* op : kOps) {
        size_t len = std::strlen(op);
        if (src.compare(pos, len, op) == 0) {
          if (op[0] == '(' || op[0] == '[' || op[0] == '{') ++depth;
          if (op[0] == ')' || op[0] == ']' || op[0] == '}') --depth;
          toks.push_back({Tok::kOp, op, line});
          pos += len;
          matched = true;
          break;
        }
      }
      if (!matched) fail(line, std::string("unexpected character '") + c + "'");
    }
  }
  toks.push_back({Tok::kEnd, "", line});
  return toks;
}

}  // namespace pd::tok::jinja
