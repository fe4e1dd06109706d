#include "router/responses_api.h"

#include <random>

#include "router/json_body.h"

namespace pd::router {

using nlohmann::json;

namespace {

// Fields a Responses body may carry (anything else not null is refused by name).
constexpr std::string_view kFields[] = {"model",
                                        "input",
                                        "instructions",
                                        "max_output_tokens",
                                        "temperature",
                                        "top_p",
                                        "text",
                                        "tools",
                                        "tool_choice",
                                        "parallel_tool_calls",
                                        "stream",
                                        "metadata",
                                        "user",
                                        "service_tier",
                                        "truncation",
                                        "store",
                                        "previous_response_id"};

ApiError bad(std::string message, std::string param) {
  return ApiError::invalidRequest(std::move(message), std::move(param));
}

std::string randomSuffix() {
  static constexpr char kHex[] = "0123456789abcdef";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string s;
  for (int i = 0; i < 24; ++i) s += kHex[rng() % 16];
  return s;
}

// A message item's content: a string, or input_text / output_text parts.
std::optional<ApiError> contentText(const json& content, const std::string& at, std::string* out) {
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return bad(at + ".content: expected a string or an array of text parts", "input");
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    const std::string partAt = at + ".content[" + std::to_string(k) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      return bad(partAt + ".type: required string", "input");
    const std::string type = part["type"].get<std::string>();
    if (type != "input_text" && type != "output_text" && type != "text") {
      return bad(partAt + ".type: '" + quoteForMessage(type) +
                     "' is not supported by pdserve (only input_text and output_text parts)",
                 "input");
    }
    if (!part.contains("text") || !part["text"].is_string()) return bad(partAt + ".text: required string", "input");
    *out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

// input -> chat messages; consecutive function_call items become one assistant message.
std::optional<ApiError> inputMessages(const json& input, json* messages) {
  if (input.is_string()) {
    messages->push_back({{"role", "user"}, {"content", input}});
    return std::nullopt;
  }
  if (!input.is_array()) return bad("input: expected a string or an array of items", "input");
  for (size_t i = 0; i < input.size(); ++i) {
    const std::string at = "input[" + std::to_string(i) + "]";
    const json& item = input[i];
    if (!item.is_object()) return bad(at + ": expected an object", "input");
    const std::string type =
        item.contains("type") && item["type"].is_string() ? item["type"].get<std::string>() : std::string("message");
    if (type == "message") {
      for (const auto& [key, v] : item.items()) {
        if (key != "type" && key != "role" && key != "content" && key != "id" && key != "status" && !v.is_null())
          return bad(at + "." + quoteForMessage(key) + ": not supported by pdserve", "input");
      }
      if (!item.contains("role") || !item["role"].is_string()) return bad(at + ".role: required string", "input");
      const std::string role = item["role"].get<std::string>();
      if (role != "user" && role != "system" && role != "developer" && role != "assistant")
        return bad(at + ".role: '" + quoteForMessage(role) + "' is not one of user, system, developer, assistant",
                   "input");
      std::string text;
      if (!item.contains("content")) return bad(at + ".content: required", "input");
      if (auto e = contentText(item["content"], at, &text)) return e;
      messages->push_back({{"role", role}, {"content", text}});
    } else if (type == "function_call") {
      for (const char* key : {"call_id", "name", "arguments"}) {
        if (!item.contains(key) || !item[key].is_string()) return bad(at + "." + key + ": required string", "input");
      }
      json call{{"id", item["call_id"]},
                {"type", "function"},
                {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
      if (!messages->empty() && messages->back()["role"] == "assistant" && messages->back().contains("tool_calls")) {
        messages->back()["tool_calls"].push_back(std::move(call));
      } else {
        messages->push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({call})}});
      }
    } else if (type == "function_call_output") {
      if (!item.contains("call_id") || !item["call_id"].is_string())
        return bad(at + ".call_id: required string", "input");
      std::string output;
      if (!item.contains("output")) return bad(at + ".output: required", "input");
      if (auto e = contentText(item["output"], at + ".output", &output)) return e;
      messages->push_back({{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", output}});
    } else {
      return bad(at + ".type: '" + quoteForMessage(type) +
                     "' is not supported by pdserve (only message, function_call, function_call_output)",
                 "input");
    }
  }
  if (messages->empty()) return bad("input: must not be empty", "input");
  return std::nullopt;
}

// Responses tools ({type, name, description, parameters, strict}) -> chat tools.
std::optional<ApiError> chatTools(const json& tools, json* out) {
  if (!tools.is_array()) return bad("tools: expected an array", "tools");
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string at = "tools[" + std::to_string(i) + "]";
    const json& t = tools[i];
    if (!t.is_object() || !t.contains("type") || !t["type"].is_string())
      return bad(at + ".type: required string", "tools");
    if (t["type"] != "function") {
      return bad(at + ".type: '" + quoteForMessage(t["type"].get<std::string>()) +
                     "' is not supported by pdserve (only \"function\")",
                 "tools");
    }
    json function = json::object();
    for (const auto& [key, v] : t.items()) {
      if (key == "type" || v.is_null()) continue;
      if (key != "name" && key != "description" && key != "parameters" && key != "strict")
        return bad(at + "." + quoteForMessage(key) + ": not supported by pdserve", "tools");
      function[key] = v;
    }
    out->push_back({{"type", "function"}, {"function", function}});
  }
  return std::nullopt;
}

// The chat error's field names as the Responses body spells them.
ApiError renamed(ApiError e) {
  static const std::pair<const char*, const char*> kNames[] = {{"max_completion_tokens", "max_output_tokens"},
                                                               {"max_tokens", "max_output_tokens"},
                                                               {"messages", "input"},
                                                               {"response_format", "text.format"}};
  for (const auto& [chat, responses] : kNames) {
    if (e.message.starts_with(chat)) e.message = responses + e.message.substr(std::string_view(chat).size());
    if (e.param && e.param->starts_with(chat)) *e.param = responses + e.param->substr(std::string_view(chat).size());
  }
  return e;
}

}  // namespace

ParseResult parseResponsesRequest(const std::string& text, const ApiLimits& limits) {
  auto parsedBody = parseJsonBody(text);
  if (auto* e = std::get_if<ApiError>(&parsedBody)) return *e;
  const json& body = std::get<json>(parsedBody);
  if (!body.is_object()) return bad("the body must be a JSON object", "input");
  auto present = [&](const char* f) { return body.contains(f) && !body[f].is_null(); };
  for (const auto& [name, value] : body.items()) {
    if (value.is_null()) continue;
    if (std::find(std::begin(kFields), std::end(kFields), name) == std::end(kFields))
      return bad(quoteForMessage(name) + ": not supported by pdserve", quoteForMessage(name));
  }
  if (present("previous_response_id")) {
    return bad(
        "previous_response_id: not supported by pdserve (responses are not stored; send the whole "
        "conversation as input)",
        "previous_response_id");
  }
  if (present("store") && (!body["store"].is_boolean() || body["store"].get<bool>())) {
    return bad("store: not supported by pdserve (responses are not stored; send false or leave it out)", "store");
  }
  if (present("truncation") && body["truncation"] != "disabled")
    return bad("truncation: only \"disabled\" is supported by pdserve", "truncation");

  json chat = json::object();
  json messages = json::array();
  if (present("instructions")) {
    if (!body["instructions"].is_string()) return bad("instructions: expected a string", "instructions");
    messages.push_back({{"role", "system"}, {"content", body["instructions"]}});
  }
  if (!present("input")) return bad("input: required", "input");
  if (auto e = inputMessages(body["input"], &messages)) return *e;
  chat["messages"] = messages;
  for (const char* f :
       {"model", "temperature", "top_p", "stream", "metadata", "user", "service_tier", "parallel_tool_calls"})
    if (present(f)) chat[f] = body[f];
  if (present("max_output_tokens")) chat["max_completion_tokens"] = body["max_output_tokens"];
  if (present("text")) {
    const json& t = body["text"];
    if (!t.is_object()) return bad("text: expected an object", "text");
    for (const auto& [key, v] : t.items()) {
      if (key != "format" && !v.is_null())
        return bad("text." + quoteForMessage(key) + ": not supported by pdserve", "text");
    }
    if (t.contains("format") && !t["format"].is_null()) {
      const json& f = t["format"];
      if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
        return bad("text.format.type: required string", "text.format");
      if (f["type"] == "json_schema") {
        // Responses flattens what chat nests under json_schema.
        json schema = json::object();
        for (const auto& [key, v] : f.items())
          if (key != "type") schema[key] = v;
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", schema}};
      } else {
        chat["response_format"] = f;
      }
    }
  }
  if (present("tools")) {
    json tools = json::array();
    if (auto e = chatTools(body["tools"], &tools)) return *e;
    chat["tools"] = tools;
  }
  if (present("tool_choice")) {
    const json& c = body["tool_choice"];
    if (c.is_object() && c.contains("type") && c["type"] == "function" && c.contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", c["name"]}}}};
    } else {
      chat["tool_choice"] = c;
    }
  }
  std::string chatText = chat.dump();
  if (chat.contains("response_format") && chat["response_format"]["type"] == "json_schema") {
    // The schema's own key order is the order its properties are generated in; `json` sorted it.
    auto ordered = nlohmann::ordered_json::parse(text, nullptr, false);
    auto ochat = nlohmann::ordered_json::parse(chatText);
    if (ordered.is_object() && ordered["text"]["format"].contains("schema"))
      ochat["response_format"]["json_schema"]["schema"] = ordered["text"]["format"]["schema"];
    chatText = ochat.dump();
  }
  auto parsed = parseGenerationRequest(chatText, Endpoint::kChat, limits);
  if (auto* e = std::get_if<ApiError>(&parsed)) return renamed(*e);
  auto& r = std::get<GenerationRequest>(parsed);
  json echo = json::object();
  for (const char* f : {"instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
                        "parallel_tool_calls", "text", "metadata", "user"})
    echo[f] = present(f) ? body[f] : json(nullptr);
  if (echo["temperature"].is_null()) echo["temperature"] = 1.0;
  if (echo["top_p"].is_null()) echo["top_p"] = 1.0;
  if (echo["tools"].is_null()) echo["tools"] = json::array();
  if (echo["tool_choice"].is_null()) echo["tool_choice"] = "auto";
  if (echo["parallel_tool_calls"].is_null()) echo["parallel_tool_calls"] = true;
  if (echo["text"].is_null()) echo["text"] = {{"format", {{"type", "text"}}}};
  if (echo["metadata"].is_null()) echo["metadata"] = json::object();
  r.responses = std::move(echo);
  return parsed;
}

// ---- the Response object and its stream ----------------------------------------------------

ResponsesWriter::ResponsesWriter(json echo, std::string id, int64_t createdAt, std::string model)
    : echo_(std::move(echo)), id_(std::move(id)), createdAt_(createdAt), model_(std::move(model)) {}

json ResponsesWriter::usageJson(const Usage& u) {
  return {{"input_tokens", u.promptTokens},
          {"input_tokens_details", {{"cached_tokens", 0}}},
          {"output_tokens", u.completionTokens},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", u.promptTokens + u.completionTokens}};
}

json ResponsesWriter::responseObject(const std::string& status) const {
  json r{{"id", id_},
         {"object", "response"},
         {"created_at", createdAt_},
         {"status", status},
         {"error", nullptr},
         {"incomplete_details", nullptr},
         {"model", model_},
         {"output", output_},
         {"previous_response_id", nullptr},
         {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
         {"store", false},
         {"truncation", "disabled"},
         {"usage", nullptr}};
  for (const auto& [key, v] : echo_.items()) r[key] = v;
  return r;
}

json ResponsesWriter::messageItem(const std::string& status) const {
  json content = json::array();
  if (status == "completed" || !text_.empty())
    content.push_back({{"type", "output_text"}, {"text", text_}, {"annotations", json::array()}});
  return {{"id", msgId_}, {"type", "message"}, {"status", status}, {"role", "assistant"}, {"content", content}};
}

std::string ResponsesWriter::event(const std::string& type, json body) {
  body["type"] = type;
  body["sequence_number"] = sequence_++;
  return "event: " + type + "\ndata: " + body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

std::string ResponsesWriter::start() {
  std::string out = event("response.created", {{"response", responseObject("in_progress")}});
  out += event("response.in_progress", {{"response", responseObject("in_progress")}});
  return out;
}

std::string ResponsesWriter::closeMessage() {
  if (!msgOpen_) return "";
  msgOpen_ = false;
  const int index = int(output_.size());
  json part{{"type", "output_text"}, {"text", text_}, {"annotations", json::array()}};
  std::string out = event("response.output_text.done",
                          {{"item_id", msgId_}, {"output_index", index}, {"content_index", 0}, {"text", text_}});
  out += event("response.content_part.done",
               {{"item_id", msgId_}, {"output_index", index}, {"content_index", 0}, {"part", part}});
  json item = messageItem("completed");
  out += event("response.output_item.done", {{"output_index", index}, {"item", item}});
  output_.push_back(std::move(item));
  return out;
}

std::string ResponsesWriter::closeCall() {
  if (!callOpen_) return "";
  callOpen_ = false;
  const int index = int(output_.size());
  std::string out = event("response.function_call_arguments.done",
                          {{"item_id", call_["id"]}, {"output_index", index}, {"arguments", call_["arguments"]}});
  call_["status"] = "completed";
  out += event("response.output_item.done", {{"output_index", index}, {"item", call_}});
  output_.push_back(call_);
  return out;
}

std::string ResponsesWriter::delta(const std::string& text, const std::vector<ToolCallStreamer::CallDelta>& calls) {
  std::string out;
  if (!text.empty()) {
    out += closeCall();
    if (!msgOpen_) {
      msgOpen_ = true;
      msgId_ = "msg_" + randomSuffix();
      text_.clear();
      const int index = int(output_.size());
      out += event("response.output_item.added", {{"output_index", index}, {"item", messageItem("in_progress")}});
      out += event("response.content_part.added",
                   {{"item_id", msgId_},
                    {"output_index", index},
                    {"content_index", 0},
                    {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}}});
    }
    text_ += text;
    out += event("response.output_text.delta", {{"item_id", msgId_},
                                                {"output_index", int(output_.size())},
                                                {"content_index", 0},
                                                {"delta", text},
                                                {"logprobs", json::array()}});
  }
  for (const auto& c : calls) {
    if (c.id) {  // a new call
      out += closeMessage();
      out += closeCall();
      callOpen_ = true;
      call_ = {{"id", "fc_" + randomSuffix()}, {"type", "function_call"}, {"status", "in_progress"}, {"call_id", *c.id},
               {"name", c.name.value_or("")},  {"arguments", ""}};
      out += event("response.output_item.added", {{"output_index", int(output_.size())}, {"item", call_}});
    }
    if (!c.arguments.empty() && callOpen_) {
      call_["arguments"] = call_["arguments"].get<std::string>() + c.arguments;
      out += event("response.function_call_arguments.delta",
                   {{"item_id", call_["id"]}, {"output_index", int(output_.size())}, {"delta", c.arguments}});
    }
  }
  return out;
}

std::string ResponsesWriter::finish(const std::string& finishReason, const Usage& usage) {
  std::string out = closeMessage();
  out += closeCall();
  const bool incomplete = finishReason == "length";
  json r = responseObject(incomplete ? "incomplete" : "completed");
  if (incomplete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  r["usage"] = usageJson(usage);
  out += event(incomplete ? "response.incomplete" : "response.completed", {{"response", r}});
  return out;
}

std::string ResponsesWriter::failed(const ApiError& e) {
  std::string out = event("error", {{"code", e.code ? json(*e.code) : json(e.type)},
                                    {"message", e.message},
                                    {"param", e.param ? json(*e.param) : json(nullptr)}});
  json r = responseObject("failed");
  r["error"] = {{"code", e.code ? *e.code : e.type}, {"message", e.message}};
  out += event("response.failed", {{"response", r}});
  return out;
}

json ResponsesWriter::full(const std::string& text, const std::vector<ToolCall>& calls, const std::string& finishReason,
                           const Usage& usage) {
  output_ = json::array();
  if (!text.empty() || calls.empty()) {
    msgId_ = "msg_" + randomSuffix();
    text_ = text;
    output_.push_back(messageItem("completed"));
  }
  for (const auto& c : calls) {
    output_.push_back({{"id", "fc_" + randomSuffix()},
                       {"type", "function_call"},
                       {"status", "completed"},
                       {"call_id", c.id},
                       {"name", c.name},
                       {"arguments", c.arguments}});
  }
  const bool incomplete = finishReason == "length";
  json r = responseObject(incomplete ? "incomplete" : "completed");
  if (incomplete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  r["usage"] = usageJson(usage);
  return r;
}

}  // namespace pd::router
