// The Jinja parser and interpreter (common/tokenizer/jinja.h) with fuzzed template text, as a
// model's tokenizer_config.json would carry it, rendered with a fixed chat context. Parse and
// render return a Status for anything they do not take; nothing may crash or throw.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/tokenizer/jinja.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

const nlohmann::ordered_json& context() {
  static const auto* ctx = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Hi <b>there</b>"},
      {"role": "assistant", "content": "Hello.", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
      {"role": "tool", "content": "42"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true
  })"));
  return *ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view source(reinterpret_cast<const char*>(data), size);
  auto t = pd::tok::JinjaTemplate::parse(source);
  if (!t.ok()) {
    PD_FUZZ_CHECK(!t.status().message().empty(), "parse errors say why");
    return 0;
  }
  auto r = t->render(context());
  if (!r.ok()) PD_FUZZ_CHECK(!r.status().message().empty(), "render errors say why");
  return 0;
}
