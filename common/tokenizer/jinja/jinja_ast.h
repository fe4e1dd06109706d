// Internal to the Jinja interpreter: the syntax tree the parser builds and the interpreter
// walks. A parsed tree is never modified, so one may be rendered from many threads at once.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/tokenizer/jinja/jinja_value.h"

namespace pd::tok::jinja {

enum class NK {
  // statements
  kBlock,
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kMacro,
  kBreak,
  kContinue,
  // expressions
  kLiteral,
  kName,
  kList,
  kTuple,
  kDict,
  kAttr,
  kIndex,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNot,
  kNeg,
  kBinary,
  kAnd,
  kOr,
  kTernary
};

struct Node {
  NK kind;
  int line = 0;
  std::string name;  // text, identifier, operator, filter/test/attribute name
  Value value;       // literal
  std::vector<std::shared_ptr<Node>> kids;
  std::vector<std::string> names;  // for targets / macro params
  std::vector<std::pair<std::string, std::shared_ptr<Node>>> kwargs;
  bool negated = false;
};
using NodeP = std::shared_ptr<Node>;

inline NodeP mk(NK k, int line) {
  auto n = std::make_shared<Node>();
  n->kind = k;
  n->line = line;
  return n;
}

}  // namespace pd::tok::jinja
