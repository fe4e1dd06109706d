#include "common/tokenizer/chat_template.h"

namespace pd::tok {

const char* const kDefaultChatTemplate =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

Result<ChatTemplate> ChatTemplate::fromString(const std::string& source, std::string bosToken,
                                              std::string eosToken) {
  auto parsed = JinjaTemplate::parse(source);
  if (!parsed.ok()) return parsed.status().withContext("chat template");
  ChatTemplate t;
  t.template_ = std::move(parsed).value();
  t.source_ = source;
  if (!bosToken.empty()) t.tokens_["bos_token"] = std::move(bosToken);
  if (!eosToken.empty()) t.tokens_["eos_token"] = std::move(eosToken);
  return t;
}

Result<ChatTemplate> ChatTemplate::forTokenizer(const Tokenizer& tokenizer) {
  bool useDefault = tokenizer.chatTemplate().empty();
  auto t = fromString(useDefault ? std::string(kDefaultChatTemplate) : tokenizer.chatTemplate(),
                      tokenizer.bosToken(), tokenizer.eosToken());
  if (t.ok()) t->isDefault_ = useDefault;
  return t;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& messages,
                                         const ChatOptions& options) const {
  if (!messages.is_array()) return invalidArgument("chat: messages must be an array");
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      return invalidArgument("chat: messages[" + std::to_string(i) + "] needs a string 'role'");
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null())
      return invalidArgument("chat: messages[" + std::to_string(i) +
                             "].content must be a string (content parts are not supported)");
  }
  if (!options.extra.is_object()) return invalidArgument("chat: extra variables must be an object");
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = options.addGenerationPrompt;
  for (auto it = tokens_.begin(); it != tokens_.end(); ++it) ctx[it.key()] = it.value();
  for (auto it = options.extra.begin(); it != options.extra.end(); ++it) ctx[it.key()] = it.value();
  return template_.render(ctx);
}

}  // namespace pd::tok
