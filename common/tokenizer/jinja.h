// A Jinja2 interpreter for the subset chat templates use (tokenizer_config.json's
// chat_template). Parsing and whitespace handling follow transformers' chat-template
// environment (trim_blocks and lstrip_blocks on, a single trailing newline dropped, as
// @huggingface/jinja does too).
//
// Supported: {{ }}, {% if/elif/else %}, {% for %} (tuple unpacking, `if` filter, else,
// loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem, break/continue),
// {% set %} (names, namespace attributes, block set), {% macro %}, comments, {%- -%}
// whitespace control; literals (strings, numbers, lists, dicts, tuples, true/false/none);
// operators (+ - * / // % ** ~, comparisons, in/not in, and/or/not, x if c else y), member
// access, indexing and slicing; filters, tests, string/dict/list methods and globals listed in
// docs/tokenizer.md (trim, length, tojson, join, default, selectattr, map, ...; defined,
// none, string, ...; strip/startswith/split/...; range, namespace, raise_exception).
// Anything else is an error naming the construct and its line, never a silently wrong prompt.
//
// A parsed JinjaTemplate is immutable and may be rendered from any thread concurrently.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/base/status.h"

namespace pd::tok {

namespace jinja {
struct Node;
}

class JinjaTemplate {
 public:
  // Parse errors name the construct and line ("jinja: line 3: unknown tag 'call'").
  static Result<JinjaTemplate> parse(std::string_view source);

  // Renders with the top-level keys of `context` (an object) as variables. Runtime errors
  // (raise_exception, unknown filter, type errors) come back as a Status naming the cause.
  Result<std::string> render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const jinja::Node> root_;
};

}  // namespace pd::tok
