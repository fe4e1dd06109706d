// JinjaTemplate (jinja.h): the Status boundary over the lexer, parser and interpreter in
// jinja/ (value model, lexer, parser, interpreter, each with its internal header).
#include "common/tokenizer/jinja.h"

#include <exception>
#include <memory>
#include <string>

#include "common/tokenizer/jinja/jinja_interpreter.h"
#include "common/tokenizer/jinja/jinja_lexer.h"
#include "common/tokenizer/jinja/jinja_parser.h"

// Errors travel as a JinjaError exception from deep in the recursive parser and evaluator up
// to JinjaTemplate::parse()/render() (jinja.cpp), which turn them into a Status. Nothing throws
// across the public API, threads or callbacks.

namespace pd::tok {

Result<JinjaTemplate> JinjaTemplate::parse(std::string_view source) {
  try {
    JinjaTemplate t;
    t.root_ = jinja::parseTokens(jinja::tokenize(std::string(source)));
    return t;
  } catch (const jinja::JinjaError& e) {
    return invalidArgument(e.what());
  } catch (const std::exception& e) {  // std::stoll overflow and the like
    return invalidArgument(std::string("jinja: malformed template: ") + e.what());
  }
}

Result<std::string> JinjaTemplate::render(const nlohmann::ordered_json& context) const {
  if (!root_) return failedPrecondition("jinja: template was not parsed");
  std::string out;
  try {
    auto scope = std::make_shared<jinja::Scope>();
    scope->parent = jinja::makeGlobals(context);
    jinja::renderTree(std::const_pointer_cast<jinja::Node>(root_), scope, out);
  } catch (const jinja::JinjaError& e) {
    return invalidArgument(e.what());
  } catch (const jinja::BreakSignal&) {
    return invalidArgument("jinja: 'break' outside a for loop");
  } catch (const jinja::ContinueSignal&) {
    return invalidArgument("jinja: 'continue' outside a for loop");
  } catch (const std::exception& e) {
    return invalidArgument(std::string("jinja: render failed: ") + e.what());
  }
  return out;
}

}  // namespace pd::tok
