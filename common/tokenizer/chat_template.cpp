#include "common/tokenizer/chat_template.h"

#include <string_view>

namespace pd::tok {

const char* const kDefaultChatTemplate =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

Result<ChatTemplate> ChatTemplate::fromString(const std::string& source, std::string bosToken, std::string eosToken) {
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
  auto t = fromString(useDefault ? std::string(kDefaultChatTemplate) : tokenizer.chatTemplate(), tokenizer.bosToken(),
                      tokenizer.eosToken());
  if (t.ok()) t->isDefault_ = useDefault;
  return t;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& messages, const ChatOptions& options) const {
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

namespace {
constexpr std::string_view kOpen = "\xEF\xB7\x90";   // U+FDD0
constexpr std::string_view kClose = "\xEF\xB7\x91";  // U+FDD1
}  // namespace

Result<ChatTemplate::Rendered> ChatTemplate::renderLiteral(const nlohmann::ordered_json& messages,
                                                           const Tokenizer& tokenizer,
                                                           const ChatOptions& options) const {
  nlohmann::ordered_json marked = messages;
  bool anyMarked = false;
  if (marked.is_array()) {
    for (size_t i = 0; i < marked.size(); ++i) {
      auto& m = marked[i];
      if (!m.is_object() || !m.contains("content") || !m["content"].is_string()) continue;
      const std::string content = m["content"].get<std::string>();
      if (content.find(kOpen) != std::string::npos || content.find(kClose) != std::string::npos)
        return invalidArgument("chat: messages[" + std::to_string(i) +
                               "].content holds U+FDD0 or U+FDD1, which are reserved");
      auto specials = tokenizer.findSpecialTokens(content);
      if (specials.empty()) continue;
      std::string wrapped;
      size_t at = 0;
      for (const auto& r : specials) {
        wrapped.append(content, at, r.begin - at);
        wrapped.append(kOpen).append(content, r.begin, r.end - r.begin).append(kClose);
        at = r.end;
      }
      wrapped.append(content, at);
      m["content"] = std::move(wrapped);
      anyMarked = true;
    }
  }
  PD_ASSIGN_OR_RETURN(std::string text, render(marked, options));
  Rendered out;
  if (!anyMarked) {
    out.text = std::move(text);
    return out;
  }
  out.text.reserve(text.size());
  constexpr size_t kNone = std::string::npos;
  size_t open = kNone;  // where the marked text being read began in out.text
  const auto broken = [] {
    return invalidArgument(
        "chat: the chat template split special-token text inside a message's content; send "
        "split_special_tokens: false to let that text be special tokens");
  };
  for (size_t i = 0; i < text.size();) {
    std::string_view rest = std::string_view(text).substr(i);
    if (rest.starts_with(kOpen)) {
      if (open != kNone) return broken();
      open = out.text.size();
      i += kOpen.size();
    } else if (rest.starts_with(kClose)) {
      if (open == kNone) return broken();
      out.literal.push_back({open, out.text.size()});
      open = kNone;
      i += kClose.size();
    } else {
      out.text.push_back(text[i++]);
    }
  }
  if (open != kNone) return broken();
  return out;
}

}  // namespace pd::tok
