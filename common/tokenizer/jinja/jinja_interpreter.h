// Internal to the Jinja interpreter: evaluates a syntax tree against variables. Runtime errors
// (raise_exception, unknown filter, type errors) are JinjaError; `break` / `continue` outside a
// loop escape as BreakSignal / ContinueSignal, which JinjaTemplate::render() reports.
// Rendering only reads the tree; every render has its own scopes and output.
#pragma once

#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/tokenizer/jinja/jinja_ast.h"

namespace pd::tok::jinja {

struct Scope {
  std::map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
  Value* lookup(const std::string& k) {
    for (Scope* s = this; s; s = s->parent.get()) {
      auto it = s->vars.find(k);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopeP = std::shared_ptr<Scope>;

struct BreakSignal {};
struct ContinueSignal {};

// The globals (range, namespace, dict, raise_exception, strftime_now) plus the top-level keys
// of `context` as variables.
ScopeP makeGlobals(const nlohmann::ordered_json& context);

// Renders `root` in `scope`, appending to `out`.
void renderTree(const NodeP& root, const ScopeP& scope, std::string& out);

}  // namespace pd::tok::jinja
