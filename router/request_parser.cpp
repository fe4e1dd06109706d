#include "router/request_parser.h"

#include <algorithm>

#include "common/constraint/constraint.h"
#include "router/json_body.h"
#include "router/responses_api.h"

namespace pd::router {

using nlohmann::json;

RequestParser::RequestParser(std::shared_ptr<const tok::Tokenizer> tokenizer, std::unique_ptr<tok::ChatTemplate> chat,
                             ParserLimits limits)
    : tokenizer_(std::move(tokenizer)), chat_(std::move(chat)), limits_(std::move(limits)) {
  toolFormat_ =
      limits_.toolCallParser.value_or(detectToolCallFormat(chat_->source()).value_or(ToolCallFormat::kHermes));
  for (const std::string& marker : toolCallMarkers(toolFormat_)) {
    auto id = tokenizer_->tokenToId(marker);
    if (id && tokenizer_->isSpecial(*id)) markerTokens_.emplace_back(*id, marker);
  }
}

namespace {

// The call a tool_choice of required / a named function forces, in the model's syntax: the
// syntax's fixed text around a JSON value. Named (or a single tool): the value is the
// arguments (the tool's parameters schema); several tools: the whole {"name", "arguments"}
// object, one of the tools' shapes.
constraint::ConstraintSpec toolCallConstraint(ToolCallFormat f, const ToolRequest& t) {
  using ojson = nlohmann::ordered_json;
  constraint::ConstraintSpec spec;
  const ojson* only = nullptr;
  for (const auto& tool : t.ordered) {
    if (t.choice == ToolChoice::kNamed ? tool["function"]["name"] == t.namedFunction : t.ordered.size() == 1)
      only = &tool;
  }
  const char* argsKey = f == ToolCallFormat::kLlama3Json ? "parameters" : "arguments";
  std::string open, close;
  switch (f) {
    case ToolCallFormat::kHermes:
      open = "<tool_call>\n", close = "\n</tool_call>";
      break;
    case ToolCallFormat::kLlama3Json:
      break;
    case ToolCallFormat::kMistral:
      open = "[TOOL_CALLS][", close = "]";
      break;
  }
  if (only != nullptr) {
    const ojson& fn = (*only)["function"];
    // The canonical JSON layout of the constraint module: one space after ':' and ','.
    spec.prefix = open + "{\"name\": " + fn["name"].dump() + ", \"" + argsKey + "\": ";
    spec.suffix = "}" + close;
    if (fn.contains("parameters") && fn["parameters"].is_object()) {
      spec.kind = constraint::SpecKind::kJsonSchema;
      spec.body = fn["parameters"].dump();
    } else {
      spec.kind = constraint::SpecKind::kJsonObject;
    }
    return spec;
  }
  ojson anyOf = ojson::array();
  for (const auto& tool : t.ordered) {
    const ojson& fn = tool["function"];
    ojson params =
        fn.contains("parameters") && fn["parameters"].is_object() ? fn["parameters"] : ojson{{"type", "object"}};
    anyOf.push_back({{"type", "object"},
                     {"properties", {{"name", {{"const", fn["name"]}}}, {argsKey, params}}},
                     {"required", ojson::array({"name", argsKey})},
                     {"additionalProperties", false}});
  }
  spec.kind = constraint::SpecKind::kJsonSchema;
  spec.body = ojson{{"anyOf", anyOf}}.dump();
  spec.prefix = open;
  spec.suffix = close;
  return spec;
}

}  // namespace

Result<std::vector<int32_t>> RequestParser::encodePrompt(const std::string& text, bool addSpecialTokens,
                                                         bool splitSpecialTokens) const {
  const tok::TextRange all{0, text.size()};
  return tokenizer_->encode(text, addSpecialTokens,
                            splitSpecialTokens ? std::span(&all, 1) : std::span<const tok::TextRange>());
}

std::variant<std::vector<int32_t>, ApiError> RequestParser::promptIds(const GenerationRequest& req,
                                                                      std::string* text) const {
  if (req.endpoint == Endpoint::kChat) {
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    for (const auto& m : req.messages) {
      nlohmann::ordered_json message = {{"role", m.role}, {"content", m.content}};
      if (m.name) message["name"] = *m.name;
      if (m.toolCallId) message["tool_call_id"] = *m.toolCallId;
      if (m.toolCalls) message["tool_calls"] = nlohmann::ordered_json::parse(m.toolCalls->dump());
      messages.push_back(std::move(message));
    }
    tok::ChatOptions opts;
    opts.addGenerationPrompt = req.addGenerationPrompt;
    // As transformers' apply_chat_template(tools=...): the template decides how they read.
    if (!req.tools.tools.empty()) opts.extra["tools"] = req.tools.ordered;
    tok::ChatTemplate::Rendered rendered;
    if (req.splitSpecialTokens) {
      auto r = chat_->renderLiteral(messages, *tokenizer_, opts);
      if (!r.ok()) return ApiError::invalidRequest("messages: " + r.status().message(), "messages");
      rendered = std::move(r).value();
    } else {
      auto r = chat_->render(messages, opts);
      if (!r.ok()) return ApiError::invalidRequest("messages: " + r.status().message(), "messages");
      rendered.text = std::move(r).value();
    }
    *text = rendered.text;
    auto ids = tokenizer_->encode(*text, /*addSpecialTokens=*/false, rendered.literal);
    if (!ids.ok()) return ApiError::invalidRequest("messages: " + ids.status().message(), "messages");
    return ids.value();
  }
  if (req.promptIds) {
    for (int32_t id : *req.promptIds)
      if (id >= limits_.vocab)
        return ApiError::invalidRequest(
            "prompt: token id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(limits_.vocab),
            "prompt");
    if (req.echo) *text = tokenizer_->decode(*req.promptIds);
    return *req.promptIds;
  }
  *text = *req.promptText;
  auto ids = encodePrompt(*req.promptText, /*addSpecialTokens=*/true, req.splitSpecialTokens);
  if (!ids.ok()) return ApiError::invalidRequest("prompt: " + ids.status().message(), "prompt");
  return ids.value();
}

std::variant<ParsedGenerate, Rejection> RequestParser::parseGenerate(const std::string& body, Endpoint endpoint) const {
  auto parsed = endpoint == Endpoint::kResponses ? parseResponsesRequest(body) : parseGenerationRequest(body, endpoint);
  if (auto* e = std::get_if<ApiError>(&parsed)) return Rejection{*e, e->type};
  ParsedGenerate out;
  out.req = std::move(std::get<GenerationRequest>(parsed));
  // The body parses into sorted keys; the tools' own order is what templates render (one more
  // parse of a body that has tools only).
  if (!out.req.tools.tools.empty()) out.req.tools.ordered = orderedTools(body, endpoint == Endpoint::kResponses);
  if (endpoint == Endpoint::kResponses) endpoint = Endpoint::kChat;  // from here on, the chat request it means
  if (out.req.tools.active()) {
    out.toolFormat = toolFormat_;
    out.markerTokens = markerTokens_;
    if (out.req.tools.choice == ToolChoice::kRequired || out.req.tools.choice == ToolChoice::kNamed) {
      // One constraint per request: a forced call is that call, so it cannot also be held to
      // the request's own response_format / guided_* value.
      if (out.req.constraint.active()) {
        return Rejection{ApiError::invalidRequest(
                             out.req.constraintSource + ": not supported by pdserve together with tool_choice " +
                                 "required or a named function (one constraint per request)",
                             out.req.constraintSource.substr(0, out.req.constraintSource.find('.'))),
                         "invalid_request_error"};
      }
      out.req.constraint = toolCallConstraint(toolFormat_, out.req.tools);
      out.req.constraintSource = "tool_choice";
      // A parameters schema the constraint module cannot enforce is refused by name now,
      // never sent on to be ignored.
      // (A tool without parameters is any JSON object: nothing to check, and that automaton is
      // the costliest to build.)
      Status ok = out.req.constraint.kind == constraint::SpecKind::kJsonObject
                      ? Status::ok()
                      : constraint::validateSpec(out.req.constraint);
      if (!ok.isOk()) {
        return Rejection{ApiError::invalidRequest("tools: tool_choice " +
                                                      std::string(out.req.tools.choice == ToolChoice::kNamed
                                                                      ? "'" + out.req.tools.namedFunction + "'"
                                                                      : "required") +
                                                      " needs the tools' parameters enforced: " + ok.message(),
                                                  "tools"),
                         "invalid_request_error"};
      }
    }
  }
  if (!out.req.model.empty() && out.req.model != limits_.modelName) {
    return Rejection{ApiError::modelNotFound(out.req.model), "model_not_found"};
  }
  auto ids = promptIds(out.req, &out.promptText);
  if (auto* e = std::get_if<ApiError>(&ids)) return Rejection{*e, e->type};
  out.prompt = std::move(std::get<std::vector<int32_t>>(ids));
  const int64_t maxModelLen = limits_.maxModelLen;
  const int64_t limit =
      limits_.maxPromptTokens > 0 ? std::min<int64_t>(limits_.maxPromptTokens, maxModelLen) : maxModelLen;
  const int64_t promptTokens = int64_t(out.prompt.size());
  if (promptTokens >= limit) {
    return Rejection{
        ApiError::contextLengthExceeded("This model's maximum context length is " + std::to_string(limit) +
                                            " tokens; the prompt has " + std::to_string(promptTokens) + " tokens.",
                                        endpoint == Endpoint::kChat ? "messages" : "prompt"),
        "context_length_exceeded"};
  }
  if (out.prompt.empty()) return Rejection{ApiError::invalidRequest("prompt: must not be empty", "prompt"), ""};
  int maxTokens = out.req.maxTokens                    ? *out.req.maxTokens
                  : endpoint == Endpoint::kCompletions ? 16
                                                       : int(maxModelLen - promptTokens);
  if (promptTokens + maxTokens > maxModelLen) {
    return Rejection{
        ApiError::invalidRequest("max_tokens: " + std::to_string(maxTokens) + " + " + std::to_string(promptTokens) +
                                     " prompt tokens exceeds the context of " + std::to_string(maxModelLen) + " tokens",
                                 "max_tokens"),
        ""};
  }
  if (out.req.minTokens > maxTokens) {
    return Rejection{ApiError::invalidRequest("min_tokens: " + std::to_string(out.req.minTokens) +
                                                  " exceeds max_tokens " + std::to_string(maxTokens),
                                              "min_tokens"),
                     ""};
  }
  for (const auto& [id, bias] : out.req.logitBias) {
    if (id >= limits_.vocab) {
      return Rejection{ApiError::invalidRequest("logit_bias: token id " + std::to_string(id) +
                                                    " is outside the vocabulary of " + std::to_string(limits_.vocab),
                                                "logit_bias"),
                       ""};
    }
  }
  for (size_t i = 0; i < out.req.stopTokenIds.size(); ++i) {
    const int32_t id = out.req.stopTokenIds[i];
    if (id >= limits_.vocab) {
      return Rejection{
          ApiError::invalidRequest("stop_token_ids[" + std::to_string(i) + "]: token id " + std::to_string(id) +
                                       " is outside the vocabulary of " + std::to_string(limits_.vocab),
                                   "stop_token_ids"),
          ""};
    }
  }
  out.discardOutput = maxTokens == 0;  // echo-only (max_tokens 0 without echo was refused)
  out.maxTokens = maxTokens == 0 ? 1 : maxTokens;
  return out;
}

std::variant<json, ApiError> RequestParser::tokenize(const std::string& text) const {
  auto parsedBody = parseJsonBody(text);
  if (auto* e = std::get_if<ApiError>(&parsedBody)) return *e;
  const json& body = std::get<json>(parsedBody);
  // Every optional field is type-checked by name: json::value() would throw on a wrong type,
  // and an exception on the I/O thread used to leave the request unanswered (docs/security.md).
  for (const char* field :
       {"add_special_tokens", "return_token_strs", "add_generation_prompt", "split_special_tokens"}) {
    auto it = body.find(field);
    if (it != body.end() && !it->is_null() && !it->is_boolean()) {
      return ApiError::invalidRequest(std::string(field) + ": expected a boolean", field);
    }
  }
  auto flag = [&](const char* field, bool dflt) {
    auto it = body.find(field);
    return it == body.end() || it->is_null() ? dflt : it->get<bool>();
  };
  if (body.contains("model") && !body["model"].is_null() && !body["model"].is_string()) {
    return ApiError::invalidRequest("model: expected a string", "model");
  }
  if (body.contains("model") && body["model"].is_string() && body["model"] != limits_.modelName) {
    return ApiError::modelNotFound(body["model"].get<std::string>());
  }
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    // The chat fields /tokenize shares with generation; its own flags (return_token_strs,
    // add_special_tokens) are not generation fields, which the allow-list would refuse.
    json chat = json::object();
    for (const char* field : {"model", "messages", "add_generation_prompt", "split_special_tokens"})
      if (body.contains(field)) chat[field] = body[field];
    auto parsed = parseGenerationRequest(chat.dump(), Endpoint::kChat);
    if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
    std::string rendered;
    auto got = promptIds(std::get<GenerationRequest>(parsed), &rendered);
    if (auto* e = std::get_if<ApiError>(&got)) return *e;
    ids = std::get<std::vector<int32_t>>(got);
  } else {
    if (!body.contains("prompt") || !body["prompt"].is_string())
      return ApiError::invalidRequest("prompt: required string", "prompt");
    bool addSpecial = flag("add_special_tokens", true);
    auto got = encodePrompt(body["prompt"].get<std::string>(), addSpecial, flag("split_special_tokens", true));
    if (!got.ok()) return ApiError::invalidRequest("prompt: " + got.status().message(), "prompt");
    ids = got.value();
  }
  json out{{"count", ids.size()}, {"max_model_len", limits_.maxModelLen}, {"tokens", ids}};
  if (flag("return_token_strs", false)) {
    json strs = json::array();
    for (int32_t id : ids) strs.push_back(tokenizer_->idToToken(id));
    out["token_strs"] = strs;
  }
  return out;
}

std::variant<json, ApiError> RequestParser::detokenize(const std::string& text) const {
  auto parsedBody = parseJsonBody(text);
  if (auto* e = std::get_if<ApiError>(&parsedBody)) return *e;
  const json& body = std::get<json>(parsedBody);
  if (!body.contains("tokens") || !body["tokens"].is_array()) {
    return ApiError::invalidRequest("tokens: required array of token ids", "tokens");
  }
  std::vector<int32_t> ids;
  const json& tokens = body["tokens"];
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& t = tokens[i];
    // The message names the position, never the value: a value can be any size (docs/security.md).
    if (!t.is_number_integer() || (t.is_number_unsigned() && t.get<uint64_t>() >= uint64_t(limits_.vocab)) ||
        t.get<int64_t>() < 0 || t.get<int64_t>() >= limits_.vocab) {
      return ApiError::invalidRequest(
          "tokens[" + std::to_string(i) + "]: expected a token id of this model (an integer in [0, " +
              std::to_string(limits_.vocab) + ")), got " +
              (t.is_number_integer() ? std::to_string(t.get<int64_t>()) : std::string(t.type_name())),
          "tokens");
    }
    ids.push_back(int32_t(t.get<int64_t>()));
  }
  return json{{"prompt", tokenizer_->decode(ids)}};
}

}  // namespace pd::router
