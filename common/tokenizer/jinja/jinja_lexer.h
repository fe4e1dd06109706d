// Internal to the Jinja interpreter: the lexer. preprocess() applies transformers'
// whitespace rules (trim_blocks, lstrip_blocks, one trailing newline dropped); tokenize()
// turns the template into text / tag / expression tokens, failing (JinjaError) with the line.
#pragma once

#include <string>
#include <vector>

namespace pd::tok::jinja {

enum class Tok { kText, kOpenStmt, kCloseStmt, kOpenExpr, kCloseExpr, kName, kString, kInt, kFloat, kOp, kEnd };

struct Token {
  Tok type;
  std::string text;
  int line;
};

bool isSpaceChar(char c);
std::string preprocess(std::string src);
std::vector<Token> tokenize(const std::string& source);

}  // namespace pd::tok::jinja
