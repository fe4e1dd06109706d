// Internal to the Jinja interpreter: the parser, tokens -> syntax tree. Fails (JinjaError)
// naming the construct and its line ("jinja: line 3: unknown tag 'call'").
#pragma once

#include <vector>

#include "common/tokenizer/jinja/jinja_ast.h"
#include "common/tokenizer/jinja/jinja_lexer.h"

namespace pd::tok::jinja {

NodeP parseTokens(std::vector<Token> tokens);

}  // namespace pd::tok::jinja
