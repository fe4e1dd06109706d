// Chat templates (common/tokenizer/chat_template.h) rendered with fuzzed messages: the input
// is the JSON a client's "messages" becomes (an array), or an object {"messages": [...], ...}
// whose other keys are the extra template variables (tools, enable_thinking, ...). Byte 0
// picks the template: ChatML (the default), the unit tests' templates (Llama 2, Mistral,
// Zephyr, the feature template), the tiny tokenizer's and those of the tokenizers in
// $PD_FUZZ_TOKENIZERS (Llama 3, Qwen 3). Byte 1 bit 0: add_generation_prompt. Every render
// returns text or a Status; nothing may crash or throw.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/tokenizer/chat_template.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace pd;

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  PD_FUZZ_CHECK(in.good(), "the template fixture exists");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const std::vector<tok::ChatTemplate>& templates() {
  static auto* all = [] {
    auto* v = new std::vector<tok::ChatTemplate>();
    auto add = [&](Result<tok::ChatTemplate> t) {
      PD_FUZZ_CHECK(t.ok(), "the fixture template parses");
      v->push_back(std::move(*t));
    };
    add(tok::ChatTemplate::fromString(tok::kDefaultChatTemplate, "", ""));
    for (const char* name : {"llama2_chat", "mistral_instruct", "zephyr", "features"}) {
      add(tok::ChatTemplate::fromString(
          readFile(fuzz::repoDir() + "/tests/unit/tokenizer/templates/" + name + ".jinja"), "<s>", "</s>"));
    }
    for (const auto& dir : fuzz::tokenizerDirs()) {
      add(tok::ChatTemplate::forTokenizer(*fuzz::loadTokenizerOrDie(dir)));
    }
    return v;
  }();
  return *all;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)templates();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const auto& all = templates();
  const auto& t = all[data[0] % all.size()];
  tok::ChatOptions options;
  options.addGenerationPrompt = (data[1] & 1) != 0;
  auto j = nlohmann::ordered_json::parse(data + 2, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  nlohmann::ordered_json messages;
  if (j.is_object() && j.contains("messages")) {
    messages = j["messages"];
    j.erase("messages");
    options.extra = std::move(j);
  } else {
    messages = std::move(j);
  }
  auto r = t.render(messages, options);
  if (!r.ok()) PD_FUZZ_CHECK(!r.status().message().empty(), "render errors say why");
  return 0;
}
