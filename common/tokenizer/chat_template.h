// Renders a model's chat template (tokenizer_config.json's chat_template) for a conversation.
//
// Variables given to the template: messages, add_generation_prompt, bos_token, eos_token
// (and unk_token / pad_token when the config names them), plus any extra variables the
// caller passes (tools, enable_thinking, ...). A model without a template gets
// kDefaultChatTemplate (ChatML, the default transformers used to apply; docs/tokenizer.md).
//
// A ChatTemplate is immutable after construction and may be rendered from any thread.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/status.h"
#include "common/tokenizer/jinja.h"
#include "common/tokenizer/tokenizer.h"

namespace pd::tok {

// ChatML: <|im_start|>{role}\n{content}<|im_end|>\n per message, then
// <|im_start|>assistant\n when a generation prompt is asked for.
extern const char* const kDefaultChatTemplate;

struct ChatOptions {
  bool addGenerationPrompt = true;
  // Extra template variables (an object), e.g. {"tools": [...], "enable_thinking": false}.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  // The tokenizer's own template, or the default when it has none.
  static Result<ChatTemplate> forTokenizer(const Tokenizer& tokenizer);
  static Result<ChatTemplate> fromString(const std::string& source, std::string bosToken, std::string eosToken);

  // `messages` is an array of objects with at least "role" and "content" (strings); other
  // fields (tool_calls, ...) pass through to the template. Errors name what is wrong.
  Result<std::string> render(const nlohmann::ordered_json& messages, const ChatOptions& options = {}) const;

  // A rendered conversation in which special-token text inside message contents stays plain
  // text: `literal` holds its ranges, for Tokenizer::encode(text, false, literal). The
  // template's own special tokens are untouched, and a conversation whose contents hold no
  // special-token text renders and encodes exactly as render() + encode() do.
  // How: each special-token string in a content is wrapped in U+FDD0 ... U+FDD1
  // (noncharacters, reserved for internal use) before rendering, and the markers are found
  // and removed afterwards. Errors (kInvalidArgument, naming the message): a content that
  // holds a marker itself, or a template that split or dropped a marked string.
  struct Rendered {
    std::string text;
    std::vector<TextRange> literal;
  };
  Result<Rendered> renderLiteral(const nlohmann::ordered_json& messages, const Tokenizer& tokenizer,
                                 const ChatOptions& options = {}) const;

  bool isDefault() const { return isDefault_; }
  const std::string& source() const { return source_; }

 private:
  JinjaTemplate template_;
  std::string source_;
  nlohmann::ordered_json tokens_ = nlohmann::ordered_json::object();
  bool isDefault_ = false;
};

}  // namespace pd::tok
