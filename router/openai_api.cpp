#include "router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <string_view>

#include "common/constraint/constraint.h"
#include "router/json_body.h"

namespace pd::router {

using nlohmann::json;

json ApiError::toJson() const {
  return json{{"error",
               {{"message", message},
                {"type", type},
                {"param", param ? json(*param) : json(nullptr)},
                {"code", code ? json(*code) : json(nullptr)}}}};
}

// Designated initializers keep each shape to its differences from the defaults (400,
// invalid_request_error, no param, code or Retry-After).
ApiError ApiError::invalidRequest(std::string message, std::optional<std::string> param) {
  return {.message = std::move(message), .param = std::move(param)};
}

ApiError ApiError::modelNotFound(const std::string& model) {
  return {.status = 404,
          .message = "The model `" + quoteForMessage(model) + "` does not exist.",
          .param = "model",
          .code = "model_not_found"};
}

ApiError ApiError::notFound(std::string message) {
  return {.status = 404, .message = std::move(message), .code = "not_found"};
}

ApiError ApiError::methodNotAllowed(std::string message) { return {.status = 405, .message = std::move(message)}; }

ApiError ApiError::endpointNotServed(const std::string& method, const std::string& path) {
  return {.status = 404,
          .message = method + " " + quoteForMessage(path) +
                     ": this OpenAI endpoint is not served by pdserve (it serves /v1/completions, "
                     "/v1/chat/completions, /v1/responses and /v1/models; docs/serving.md \"API fields\")",
          .code = "not_served"};
}

ApiError ApiError::contextLengthExceeded(std::string message, std::string param) {
  return {.message = std::move(message), .param = std::move(param), .code = "context_length_exceeded"};
}

ApiError ApiError::unauthorized(std::string message) {
  return {.status = 401, .type = "authentication_error", .message = std::move(message), .code = "invalid_api_key"};
}

ApiError ApiError::rateLimited(std::string message, std::string code, std::optional<std::string> param,
                               std::optional<int> retryAfterS) {
  return {.status = 429,
          .type = "rate_limit_exceeded",
          .message = std::move(message),
          .param = std::move(param),
          .code = std::move(code),
          .retryAfterS = retryAfterS};
}

ApiError ApiError::unavailable(std::string message) {
  return {.status = 503, .type = "service_unavailable", .message = std::move(message)};
}

ApiError ApiError::internal(std::string message) {
  return {.status = 500, .type = "internal_error", .message = std::move(message)};
}

namespace {

// Field readers: each returns an error naming the field, or nullopt on success. A JSON null
// counts as "not given", as in the OpenAI schemas where these fields are nullable.
using MaybeError = std::optional<ApiError>;

const char* typeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

MaybeError wrongType(const std::string& field, const char* want, const json& got) {
  return ApiError::invalidRequest(field + ": expected " + want + ", got " + typeName(got), field);
}

bool present(const json& body, const char* field) {
  auto it = body.find(field);
  return it != body.end() && !it->is_null();
}

MaybeError readNumber(const json& body, const char* field, double lo, double hi, float* out) {
  if (!present(body, field)) return std::nullopt;
  const json& v = body[field];
  if (!v.is_number()) return wrongType(field, "a number", v);
  double d = v.get<double>();
  if (!(d >= lo && d <= hi) || !std::isfinite(d)) {
    return ApiError::invalidRequest(
        std::string(field) + ": " + v.dump() + " is out of range [" + json(lo).dump() + ", " + json(hi).dump() + "]",
        field);
  }
  *out = static_cast<float>(d);
  return std::nullopt;
}

template <typename Int>
MaybeError readInt(const json& body, const char* field, int64_t lo, int64_t hi, Int* out) {
  if (!present(body, field)) return std::nullopt;
  const json& v = body[field];
  if (!v.is_number_integer()) return wrongType(field, "an integer", v);
  int64_t i = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
  if (i < lo || i > hi) {
    return ApiError::invalidRequest(std::string(field) + ": " + v.dump() + " is out of range [" + std::to_string(lo) +
                                        ", " + std::to_string(hi) + "]",
                                    field);
  }
  *out = static_cast<Int>(i);
  return std::nullopt;
}

MaybeError readBool(const json& body, const char* field, bool* out) {
  if (!present(body, field)) return std::nullopt;
  const json& v = body[field];
  if (!v.is_boolean()) return wrongType(field, "a boolean", v);
  *out = v.get<bool>();
  return std::nullopt;
}

MaybeError readTokenIds(const json& v, const std::string& field, std::vector<int32_t>* out) {
  out->clear();
  for (size_t i = 0; i < v.size(); ++i) {
    const json& t = v[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return ApiError::invalidRequest(field + "[" + std::to_string(i) + "]: expected a token id (integer >= 0)", field);
    }
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return std::nullopt;
}

MaybeError readPrompt(const json& body, GenerationRequest* r) {
  if (!present(body, "prompt")) return ApiError::invalidRequest("prompt: required", "prompt");
  const json& p = body["prompt"];
  if (p.is_string()) {
    r->promptText = p.get<std::string>();
    return std::nullopt;
  }
  if (!p.is_array()) return wrongType("prompt", "a string, an array of strings or token ids", p);
  if (p.empty()) return ApiError::invalidRequest("prompt: must not be empty", "prompt");
  if (p[0].is_number_integer()) {
    std::vector<int32_t> ids;
    if (auto e = readTokenIds(p, "prompt", &ids)) return e;
    r->promptIds = std::move(ids);
    return std::nullopt;
  }
  // A batch of prompts: accepted in its one-element form only.
  if (p.size() != 1) {
    return ApiError::invalidRequest(
        "prompt: a batch of " + std::to_string(p.size()) + " prompts is not supported; send one prompt per request",
        "prompt");
  }
  if (p[0].is_string()) {
    r->promptText = p[0].get<std::string>();
    return std::nullopt;
  }
  if (p[0].is_array()) {
    std::vector<int32_t> ids;
    if (auto e = readTokenIds(p[0], "prompt[0]", &ids)) return e;
    if (ids.empty()) return ApiError::invalidRequest("prompt[0]: must not be empty", "prompt");
    r->promptIds = std::move(ids);
    return std::nullopt;
  }
  return wrongType("prompt[0]", "a string or an array of token ids", p[0]);
}

// A bounded string field of a message: absent or null leaves *out unset.
MaybeError readBoundedString(const json& obj, const char* key, const std::string& at, size_t maxBytes,
                             std::optional<std::string>* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::nullopt;
  const std::string field = at + "." + key;
  if (!it->is_string())
    return ApiError::invalidRequest(field + ": expected a string, got " + typeName(*it), "messages");
  if (it->get_ref<const std::string&>().size() > maxBytes) {
    return ApiError::invalidRequest(field + ": at most " + std::to_string(maxBytes) + " bytes, got " +
                                        std::to_string(it->get_ref<const std::string&>().size()),
                                    "messages");
  }
  *out = it->get<std::string>();
  return std::nullopt;
}

// An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}].
MaybeError readToolCalls(const json& value, const std::string& at, const ApiLimits& limits, ChatMessage* cm) {
  const std::string field = at + ".tool_calls";
  if (!value.is_array())
    return ApiError::invalidRequest(field + ": expected an array, got " + typeName(value), "messages");
  if (value.empty()) return std::nullopt;  // some clients always send one: none
  if (cm->role != "assistant")
    return ApiError::invalidRequest(field + ": only assistant messages carry tool calls", "messages");
  json calls = json::array();
  for (size_t i = 0; i < value.size(); ++i) {
    const std::string callAt = field + "[" + std::to_string(i) + "]";
    const json& c = value[i];
    if (!c.is_object()) return wrongType(callAt, "an object", c);
    for (const auto& [key, v] : c.items()) {
      if (key != "id" && key != "type" && key != "function" && !v.is_null())
        return ApiError::invalidRequest(callAt + "." + quoteForMessage(key) + ": not supported by pdserve", "messages");
    }
    if (c.contains("type") && !c["type"].is_null() && c["type"] != "function")
      return ApiError::invalidRequest(callAt + ".type: only \"function\"", "messages");
    auto id = c.find("id");
    if (id == c.end() || !id->is_string() || id->get_ref<const std::string&>().size() > limits.maxNameBytes)
      return ApiError::invalidRequest(
          callAt + ".id: required string of at most " + std::to_string(limits.maxNameBytes) + " bytes", "messages");
    auto f = c.find("function");
    if (f == c.end() || !f->is_object() || !f->contains("name") || !(*f)["name"].is_string())
      return ApiError::invalidRequest(callAt + ".function.name: required string", "messages");
    for (const auto& [key, v] : f->items()) {
      if (key != "name" && key != "arguments" && !v.is_null())
        return ApiError::invalidRequest(callAt + ".function." + quoteForMessage(key) + ": not supported by pdserve",
                                        "messages");
    }
    json args = json::object();
    if (f->contains("arguments") && !(*f)["arguments"].is_null()) {
      const json& a = (*f)["arguments"];
      if (!a.is_string())
        return ApiError::invalidRequest(callAt + ".function.arguments: expected a string", "messages");
      json parsed = json::parse(a.get_ref<const std::string&>(), nullptr, false);
      args = parsed.is_object() ? parsed : a;
    }
    calls.push_back({{"id", *id}, {"type", "function"}, {"function", {{"name", (*f)["name"]}, {"arguments", args}}}});
  }
  cm->toolCalls = std::move(calls);
  return std::nullopt;
}

// The keys of a message besides role and content: name, tool_call_id (role tool) and
// tool_calls (role assistant), each passed to the chat template.
MaybeError readMessageExtras(const json& msg, const std::string& at, const ApiLimits& limits, ChatMessage* cm) {
  if (auto e = readBoundedString(msg, "name", at, limits.maxNameBytes, &cm->name)) return e;
  if (auto e = readBoundedString(msg, "tool_call_id", at, limits.maxNameBytes, &cm->toolCallId)) return e;
  for (const auto& [key, value] : msg.items()) {
    if (value.is_null() || key == "role" || key == "content" || key == "name" || key == "tool_call_id") continue;
    if (key == "tool_calls") {
      if (auto e = readToolCalls(value, at, limits, cm)) return e;
      continue;
    }
    return ApiError::invalidRequest(at + "." + quoteForMessage(key) + ": not supported by pdserve", "messages");
  }
  return std::nullopt;
}

MaybeError readMessages(const json& body, const ApiLimits& limits, GenerationRequest* r) {
  if (!present(body, "messages")) return ApiError::invalidRequest("messages: required", "messages");
  const json& m = body["messages"];
  if (!m.is_array()) return wrongType("messages", "an array", m);
  if (m.empty()) return ApiError::invalidRequest("messages: must not be empty", "messages");
  for (size_t i = 0; i < m.size(); ++i) {
    std::string at = "messages[" + std::to_string(i) + "]";
    const json& msg = m[i];
    if (!msg.is_object()) return wrongType(at, "an object", msg);
    if (!msg.contains("role") || !msg["role"].is_string()) {
      return ApiError::invalidRequest(at + ".role: required string", "messages");
    }
    ChatMessage cm;
    cm.role = msg["role"].get<std::string>();
    if (cm.role != "system" && cm.role != "developer" && cm.role != "user" && cm.role != "assistant" &&
        cm.role != "tool") {
      return ApiError::invalidRequest(
          at + ".role: '" + quoteForMessage(cm.role) + "' is not one of system, developer, user, assistant, tool",
          "messages");
    }
    auto content = msg.find("content");
    if (content == msg.end() || content->is_null()) {
      if (cm.role != "assistant") return ApiError::invalidRequest(at + ".content: required", "messages");
    } else if (content->is_string()) {
      cm.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        std::string partAt = at + ".content[" + std::to_string(k) + "]";
        // Each check names the path; json::value() would throw on a non-string "type".
        if (!part.is_object()) return wrongType(partAt, "an object", part);
        auto type = part.find("type");
        if (type == part.end() || !type->is_string()) {
          return ApiError::invalidRequest(partAt +
                                              ".type: expected a string (only \"text\" parts are supported), got " +
                                              (type == part.end() ? std::string("nothing") : typeName(*type)),
                                          partAt + ".type");
        }
        if (type->get_ref<const std::string&>() != "text") {
          return ApiError::invalidRequest(partAt + ".type: '" + quoteForMessage(type->get_ref<const std::string&>()) +
                                              "' is not supported; only \"text\" parts are",
                                          partAt + ".type");
        }
        auto text = part.find("text");
        if (text == part.end() || !text->is_string()) {
          return ApiError::invalidRequest(partAt + ".text: required string", partAt + ".text");
        }
        cm.content += text->get_ref<const std::string&>();
      }
    } else {
      return wrongType(at + ".content", "a string or an array of text parts", *content);
    }
    if (auto e = readMessageExtras(msg, at, limits, &cm)) return e;
    r->messages.push_back(std::move(cm));
  }
  return std::nullopt;
}

MaybeError readStop(const json& body, const ApiLimits& limits, GenerationRequest* r) {
  if (!present(body, "stop")) return std::nullopt;
  const json& s = body["stop"];
  auto add = [&](const json& v, const std::string& field) -> MaybeError {
    const std::string& text = v.get_ref<const std::string&>();
    if (text.size() > limits.maxStopBytes) {
      return ApiError::invalidRequest(field + ": a stop string may be at most " + std::to_string(limits.maxStopBytes) +
                                          " bytes, got " + std::to_string(text.size()),
                                      "stop");
    }
    if (!text.empty()) r->stop.push_back(text);
    return std::nullopt;
  };
  if (s.is_string()) return add(s, "stop");
  if (!s.is_array()) return wrongType("stop", "a string or an array of strings", s);
  if (static_cast<int>(s.size()) > limits.maxStop) {
    return ApiError::invalidRequest("stop: at most " + std::to_string(limits.maxStop) + " stop strings", "stop");
  }
  for (size_t i = 0; i < s.size(); ++i) {
    const std::string field = "stop[" + std::to_string(i) + "]";
    if (!s[i].is_string()) return wrongType(field, "a string", s[i]);
    if (auto e = add(s[i], field)) return e;
  }
  return std::nullopt;
}

// The fields each endpoint implements. Anything else that is not null is refused by name:
// a field pdserve does not implement must never be accepted and ignored (a wrong answer with a
// 200). docs/serving.md "API fields" lists them, and what the metadata fields mean here.
constexpr std::string_view kBothFields[] = {"model",
                                            "max_tokens",
                                            "max_completion_tokens",
                                            "temperature",
                                            "top_p",
                                            "top_k",
                                            "min_p",
                                            "seed",
                                            "ignore_eos",
                                            "stop",
                                            "stop_token_ids",
                                            "n",
                                            "stream",
                                            "stream_options",
                                            "presence_penalty",
                                            "frequency_penalty",
                                            "repetition_penalty",
                                            "logit_bias",
                                            "min_tokens",
                                            "response_format",
                                            "guided_json",
                                            "guided_regex",
                                            "guided_choice",
                                            "structured_outputs",
                                            "user",
                                            "metadata",
                                            "store",
                                            "service_tier",
                                            "return_token_ids",
                                            "split_special_tokens"};
constexpr std::string_view kCompletionsFields[] = {"prompt", "logprobs", "echo", "best_of"};
constexpr std::string_view kChatFields[] = {"messages", "add_generation_prompt", "logprobs",           "top_logprobs",
                                            "tools",    "tool_choice",           "parallel_tool_calls"};

bool listed(std::span<const std::string_view> fields, const std::string& name) {
  return std::find(fields.begin(), fields.end(), name) != fields.end();
}

MaybeError notSupported(const std::string& field, const std::string& why = "") {
  return ApiError::invalidRequest(field + ": not supported by pdserve" + why, field);
}

MaybeError refuseUnknownFields(const json& body, Endpoint endpoint) {
  if (!body.is_object()) return std::nullopt;  // parseJsonBody already refused it
  for (const auto& [name, value] : body.items()) {
    if (value.is_null() || listed(kBothFields, name)) continue;
    if (listed(endpoint == Endpoint::kCompletions ? std::span<const std::string_view>(kCompletionsFields)
                                                  : std::span<const std::string_view>(kChatFields),
               name)) {
      continue;
    }
    return notSupported(quoteForMessage(name));
  }
  return std::nullopt;
}

// Metadata that changes nothing pdserve does, accepted with the value that says so:
// `metadata` (an object; only ever stored with `store`), `store` false (nothing is stored),
// `service_tier` "auto" or "default" (there is one tier).
MaybeError readMetadataFields(const json& body, const ApiLimits& limits) {
  if (present(body, "metadata")) {
    const json& m = body["metadata"];
    if (!m.is_object()) return wrongType("metadata", "an object", m);
    if (m.size() > limits.maxMetadataPairs) {
      return ApiError::invalidRequest(
          "metadata: at most " + std::to_string(limits.maxMetadataPairs) + " pairs, got " + std::to_string(m.size()),
          "metadata");
    }
    for (const auto& [key, value] : m.items()) {
      if (key.size() > limits.maxMetadataKeyBytes) {
        return ApiError::invalidRequest("metadata: key '" + quoteForMessage(key) + "' is over " +
                                            std::to_string(limits.maxMetadataKeyBytes) + " bytes",
                                        "metadata");
      }
      const std::string field = "metadata." + quoteForMessage(key);
      if (!value.is_string())
        return ApiError::invalidRequest(field + ": expected a string, got " + typeName(value), "metadata");
      if (value.get_ref<const std::string&>().size() > limits.maxMetadataValueBytes) {
        return ApiError::invalidRequest(field + ": at most " + std::to_string(limits.maxMetadataValueBytes) + " bytes",
                                        "metadata");
      }
    }
  }
  bool store = false;
  if (auto e = readBool(body, "store", &store)) return e;
  if (store) return notSupported("store", " (completions are never stored; send false)");
  if (present(body, "service_tier")) {
    const json& t = body["service_tier"];
    if (!t.is_string()) return wrongType("service_tier", "a string", t);
    if (t != "auto" && t != "default") {
      return notSupported("service_tier", ": '" + quoteForMessage(t.get<std::string>()) +
                                              "' (only \"auto\" and \"default\": there is one tier)");
    }
  }
  return std::nullopt;
}

// Structured outputs (docs/serving.md "Structured outputs"): response_format json_object /
// json_schema, vLLM's guided_json / guided_regex / guided_choice and its newer
// structured_outputs {json | regex | choice | json_object}, at most one of them. The spec is
// compiled here once (common/constraint: the same compiler the engine runs), so a schema
// keyword or regex construct pdserve does not implement is a 400 naming it, never ignored.
MaybeError unknownKeys(const json& obj, std::initializer_list<std::string_view> known, const std::string& where) {
  for (const auto& [name, value] : obj.items()) {
    if (value.is_null()) continue;
    if (std::find(known.begin(), known.end(), name) == known.end())
      return notSupported(where + "." + quoteForMessage(name));
  }
  return std::nullopt;
}

// A schema given as an object or as its JSON text (vLLM takes both).
MaybeError schemaText(const json& v, const std::string& field, std::string* out) {
  if (v.is_object() || v.is_boolean()) {
    *out = v.dump();
    return std::nullopt;
  }
  if (v.is_string()) {
    *out = v.get<std::string>();
    return std::nullopt;
  }
  return wrongType(field, "a JSON schema object", v);
}

MaybeError choiceText(const json& v, const std::string& field, std::string* out) {
  if (!v.is_array() || v.empty()) return wrongType(field, "a non-empty array of strings", v);
  for (const auto& c : v)
    if (!c.is_string()) return wrongType(field, "a non-empty array of strings", v);
  *out = v.dump();
  return std::nullopt;
}

MaybeError readStructuredOutput(const json& body, GenerationRequest* r) {
  using constraint::SpecKind;
  std::string source;  // the field that set the spec, for errors and the one-of rule
  constraint::ConstraintSpec spec;
  auto set = [&](const std::string& field, SpecKind kind, std::string text) -> MaybeError {
    if (!source.empty()) {
      return ApiError::invalidRequest(
          field + ": only one structured-output field per request (" + source + " is already set)", field);
    }
    source = field;
    spec.kind = kind;
    spec.body = std::move(text);
    return std::nullopt;
  };
  if (present(body, "response_format")) {
    const json& f = body["response_format"];
    if (!f.is_object()) return wrongType("response_format", "an object", f);
    auto type = f.find("type");
    if (type == f.end() || !type->is_string()) {
      return ApiError::invalidRequest("response_format.type: required string", "response_format");
    }
    const std::string t = type->get<std::string>();
    if (t == "text" || t == "json_object") {
      if (auto e = unknownKeys(f, {"type"}, "response_format")) return e;
      if (t == "json_object")
        if (auto e = set("response_format.json_object", SpecKind::kJsonObject, "")) return e;
    } else if (t == "json_schema") {
      if (auto e = unknownKeys(f, {"type", "json_schema"}, "response_format")) return e;
      auto js = f.find("json_schema");
      if (js == f.end() || !js->is_object())
        return ApiError::invalidRequest("response_format.json_schema: required object", "response_format");
      if (auto e = unknownKeys(*js, {"name", "description", "schema", "strict"}, "response_format.json_schema"))
        return e;
      if (js->contains("name") && !(*js)["name"].is_string())
        return wrongType("response_format.json_schema.name", "a string", (*js)["name"]);
      if (js->contains("strict") && !(*js)["strict"].is_null() && !(*js)["strict"].is_boolean())
        return wrongType("response_format.json_schema.strict", "a boolean", (*js)["strict"]);
      // strict or not, the output follows the schema: the constraint is what pdserve does.
      std::string text = "{}";  // OpenAI: a schema-less json_schema is any JSON value
      if (js->contains("schema") && !(*js)["schema"].is_null())
        if (auto e = schemaText((*js)["schema"], "response_format.json_schema.schema", &text)) return e;
      if (auto e = set("response_format.json_schema.schema", SpecKind::kJsonSchema, text)) return e;
    } else {
      return ApiError::invalidRequest("response_format: type '" + quoteForMessage(t) +
                                          "' is not supported by pdserve (\"text\", \"json_object\", \"json_schema\")",
                                      "response_format");
    }
  }
  std::string text;
  if (present(body, "guided_json")) {
    if (auto e = schemaText(body["guided_json"], "guided_json", &text)) return e;
    if (auto e = set("guided_json", SpecKind::kJsonSchema, text)) return e;
  }
  if (present(body, "guided_regex")) {
    if (!body["guided_regex"].is_string()) return wrongType("guided_regex", "a string", body["guided_regex"]);
    if (auto e = set("guided_regex", SpecKind::kRegex, body["guided_regex"].get<std::string>())) return e;
  }
  if (present(body, "guided_choice")) {
    if (auto e = choiceText(body["guided_choice"], "guided_choice", &text)) return e;
    if (auto e = set("guided_choice", SpecKind::kChoice, text)) return e;
  }
  if (present(body, "structured_outputs")) {
    const json& so = body["structured_outputs"];
    if (!so.is_object()) return wrongType("structured_outputs", "an object", so);
    if (auto e = unknownKeys(so, {"json", "regex", "choice", "json_object"}, "structured_outputs")) return e;
    if (present(so, "json")) {
      if (auto e = schemaText(so["json"], "structured_outputs.json", &text)) return e;
      if (auto e = set("structured_outputs.json", SpecKind::kJsonSchema, text)) return e;
    }
    if (present(so, "regex")) {
      if (!so["regex"].is_string()) return wrongType("structured_outputs.regex", "a string", so["regex"]);
      if (auto e = set("structured_outputs.regex", SpecKind::kRegex, so["regex"].get<std::string>())) return e;
    }
    if (present(so, "choice")) {
      if (auto e = choiceText(so["choice"], "structured_outputs.choice", &text)) return e;
      if (auto e = set("structured_outputs.choice", SpecKind::kChoice, text)) return e;
    }
    if (present(so, "json_object")) {
      if (!so["json_object"].is_boolean())
        return wrongType("structured_outputs.json_object", "a boolean", so["json_object"]);
      if (so["json_object"].get<bool>())
        if (auto e = set("structured_outputs.json_object", SpecKind::kJsonObject, "")) return e;
    }
  }
  r->constraint = std::move(spec);
  r->constraintSource = source;
  return std::nullopt;
}

// A schema's properties are generated in the order the client wrote them (as OpenAI does),
// but `json` keeps object keys sorted: the schema is taken again from the body parsed with
// its order kept. Then the spec is compiled once, so what pdserve does not implement is
// refused here, by name.
MaybeError finishStructuredOutput(const std::string& bodyText, GenerationRequest* r) {
  if (!r->constraint.active()) return std::nullopt;
  const std::string& source = r->constraintSource;
  // Only the fields whose value is the schema itself; a spec built from other fields (tool
  // calls) carries its own text.
  const bool schemaField =
      source == "response_format.json_schema.schema" || source == "guided_json" || source == "structured_outputs.json";
  if (r->constraint.kind == constraint::SpecKind::kJsonSchema && schemaField) {
    const auto ordered = nlohmann::ordered_json::parse(bodyText, nullptr, false);
    const nlohmann::ordered_json* v = &ordered;
    const std::string& path = source;
    for (size_t at = 0; v && at <= path.size();) {
      const size_t dot = std::min(path.find('.', at), path.size());
      const std::string key = path.substr(at, dot - at);
      v = v->is_object() && v->contains(key) ? &(*v)[key] : nullptr;
      at = dot + 1;
    }
    if (v && (v->is_object() || v->is_boolean())) r->constraint.body = v->dump();
  }
  // json_object has no body to check (and its automaton is the largest to build: ~3 ms).
  if (r->constraint.kind == constraint::SpecKind::kJsonObject) return std::nullopt;
  Status st = constraint::validateSpec(r->constraint);
  if (!st.isOk()) return ApiError::invalidRequest(source + ": " + st.message(), source.substr(0, source.find('.')));
  return std::nullopt;
}

// logit_bias: {"<token id>": bias in [-100, 100]}; the ids are checked against the
// vocabulary by the parser (RequestParser), which knows it.
MaybeError readLogitBias(const json& body, const ApiLimits& limits, GenerationRequest* r) {
  if (!present(body, "logit_bias")) return std::nullopt;
  const json& b = body["logit_bias"];
  if (!b.is_object()) return wrongType("logit_bias", "an object of token id -> bias", b);
  if (int64_t(b.size()) > limits.maxLogitBias) {
    return ApiError::invalidRequest(
        "logit_bias: at most " + std::to_string(limits.maxLogitBias) + " entries, got " + std::to_string(b.size()),
        "logit_bias");
  }
  for (const auto& [key, value] : b.items()) {
    // Decimal digits only, as the key of a token id (no sign, no spaces, no leading zero, so
    // one id has one key and no two entries add up; at most 9 digits).
    const bool id = !key.empty() && key.size() <= 9 && (key.size() == 1 || key[0] != '0') &&
                    std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!id) {
      return ApiError::invalidRequest("logit_bias: key '" + quoteForMessage(key) + "' is not a token id", "logit_bias");
    }
    if (!value.is_number()) return wrongType("logit_bias[" + key + "]", "a number", value);
    const double bias = value.get<double>();
    if (!(bias >= -100.0 && bias <= 100.0)) {
      return ApiError::invalidRequest("logit_bias[" + key + "]: " + value.dump() + " is out of range [-100, 100]",
                                      "logit_bias");
    }
    r->logitBias.emplace_back(std::stoi(key), float(bias));
  }
  return std::nullopt;
}

MaybeError readFields(const json& body, Endpoint endpoint, const ApiLimits& limits, GenerationRequest* r) {
  if (auto e = refuseUnknownFields(body, endpoint)) return e;
  if (auto e = readMetadataFields(body, limits)) return e;
  if (auto e = readStructuredOutput(body, r)) return e;
  if (present(body, "model")) {
    if (!body["model"].is_string()) return wrongType("model", "a string", body["model"]);
    r->model = body["model"].get<std::string>();
  }
  if (endpoint == Endpoint::kCompletions) {
    if (auto e = readPrompt(body, r)) return e;
  } else {
    if (auto e = readMessages(body, limits, r)) return e;
    if (auto e = readBool(body, "add_generation_prompt", &r->addGenerationPrompt)) return e;
    if (auto e = readToolFields(body, &r->tools)) return ApiError::invalidRequest(e->message, e->param);
  }

  constexpr int64_t kMaxTokensCap = 1 << 24;
  int maxTokens = 0;
  bool haveMax = false;
  for (const char* field : {"max_completion_tokens", "max_tokens"}) {
    if (haveMax || !present(body, field)) continue;
    if (auto e = readInt(body, field, 0, kMaxTokensCap, &maxTokens)) return e;
    haveMax = true;
  }
  if (haveMax) r->maxTokens = maxTokens;

  if (auto e = readNumber(body, "temperature", 0.0, 2.0, &r->temperature)) return e;
  if (auto e = readNumber(body, "top_p", 0.0, 1.0, &r->topP)) return e;
  if (present(body, "top_p") && r->topP <= 0.0f) {
    return ApiError::invalidRequest("top_p: must be greater than 0", "top_p");
  }
  if (auto e = readInt(body, "top_k", -1, 1 << 20, &r->topK)) return e;
  if (auto e = readNumber(body, "min_p", 0.0, 1.0, &r->minP)) return e;
  if (present(body, "seed")) {
    const json& s = body["seed"];
    if (!s.is_number_integer()) return wrongType("seed", "an integer", s);
    r->seed = s.is_number_unsigned() ? s.get<uint64_t>() : static_cast<uint64_t>(s.get<int64_t>());
  }
  if (auto e = readBool(body, "ignore_eos", &r->ignoreEos)) return e;
  if (auto e = readStop(body, limits, r)) return e;
  if (present(body, "stop_token_ids")) {
    const json& s = body["stop_token_ids"];
    if (!s.is_array()) return wrongType("stop_token_ids", "an array of token ids", s);
    if (int64_t(s.size()) > limits.maxStopTokenIds) {
      return ApiError::invalidRequest(
          "stop_token_ids: at most " + std::to_string(limits.maxStopTokenIds) + " ids, got " + std::to_string(s.size()),
          "stop_token_ids");
    }
    // The ids are checked against the vocabulary by the parser (RequestParser), which knows it.
    if (auto e = readTokenIds(s, "stop_token_ids", &r->stopTokenIds)) return e;
  }
  if (auto e = readNumber(body, "presence_penalty", -2.0, 2.0, &r->presencePenalty)) return e;
  if (auto e = readNumber(body, "frequency_penalty", -2.0, 2.0, &r->frequencyPenalty)) return e;
  if (auto e = readNumber(body, "repetition_penalty", 0.0, 2.0, &r->repetitionPenalty)) return e;
  if (present(body, "repetition_penalty") && r->repetitionPenalty <= 0.0f) {
    return ApiError::invalidRequest("repetition_penalty: must be greater than 0", "repetition_penalty");
  }
  if (auto e = readLogitBias(body, limits, r)) return e;
  if (auto e = readInt(body, "min_tokens", 0, kMaxTokensCap, &r->minTokens)) return e;
  if (auto e = readInt(body, "n", 1, limits.maxN, &r->n)) return e;
  if (endpoint == Endpoint::kCompletions && present(body, "best_of")) {
    // Best-of-n ranking is not implemented; best_of == n (every candidate returned) is what
    // pdserve does anyway.
    int bestOf = 1;
    if (auto e = readInt(body, "best_of", 1, limits.maxN, &bestOf)) return e;
    if (bestOf != r->n) {
      return ApiError::invalidRequest("best_of: " + std::to_string(bestOf) +
                                          " is not supported by pdserve (only best_of equal to n, " +
                                          std::to_string(r->n) + ": candidates are not ranked)",
                                      "best_of");
    }
  }
  if (auto e = readBool(body, "stream", &r->stream)) return e;
  if (present(body, "stream_options")) {
    const json& so = body["stream_options"];
    if (!so.is_object()) return wrongType("stream_options", "an object", so);
    if (!r->stream) {
      return ApiError::invalidRequest("stream_options: only allowed when stream is true", "stream_options");
    }
    // vLLM: include_usage defaults to true when the object is present.
    r->includeUsage = true;
    for (const auto& [name, value] : so.items()) {
      if (name != "include_usage" && !value.is_null()) {
        return notSupported("stream_options." + quoteForMessage(name));
      }
    }
    if (auto e = readBool(so, "include_usage", &r->includeUsage)) {
      e->message = "stream_options." + e->message;
      e->param = "stream_options.include_usage";
      return e;
    }
  }
  if (endpoint == Endpoint::kCompletions) {
    if (present(body, "logprobs")) {
      if (auto e = readInt(body, "logprobs", 0, limits.maxLogprobs, &r->topLogprobs)) return e;
      r->logprobs = true;
    }
    if (auto e = readBool(body, "echo", &r->echo)) return e;
  } else {
    if (auto e = readBool(body, "logprobs", &r->logprobs)) return e;
    if (auto e = readInt(body, "top_logprobs", 0, limits.maxLogprobs, &r->topLogprobs)) return e;
    if (present(body, "top_logprobs") && !r->logprobs) {
      return ApiError::invalidRequest("top_logprobs: requires logprobs to be true", "top_logprobs");
    }
  }
  if (present(body, "user")) {
    if (!body["user"].is_string()) return wrongType("user", "a string", body["user"]);
    r->user = body["user"].get<std::string>();
    if (r->user.size() > limits.maxUserBytes) {
      return ApiError::invalidRequest(
          "user: at most " + std::to_string(limits.maxUserBytes) + " bytes, got " + std::to_string(r->user.size()),
          "user");
    }
  }
  if (auto e = readBool(body, "return_token_ids", &r->returnTokenIds)) return e;
  if (auto e = readBool(body, "split_special_tokens", &r->splitSpecialTokens)) return e;
  if (r->maxTokens && *r->maxTokens == 0 && !r->echo) {
    return ApiError::invalidRequest("max_tokens: must be at least 1", "max_tokens");
  }
  return std::nullopt;
}

json logprobsJson(Endpoint endpoint, const std::vector<TokenLogprob>& lps, size_t textOffset) {
  if (endpoint == Endpoint::kChat) {
    json content = json::array();
    for (const auto& lp : lps) {
      auto bytesOf = [](const std::string& s) {
        json b = json::array();
        for (unsigned char c : s) b.push_back(int(c));
        return b;
      };
      json top = json::array();
      for (const auto& [tok, p] : lp.top) top.push_back({{"token", tok}, {"logprob", p}, {"bytes", bytesOf(tok)}});
      content.push_back(
          {{"token", lp.token}, {"logprob", lp.logprob}, {"bytes", bytesOf(lp.token)}, {"top_logprobs", top}});
    }
    return json{{"content", content}, {"refusal", nullptr}};
  }
  json tokens = json::array(), tokenLogprobs = json::array(), top = json::array(), offsets = json::array();
  size_t offset = textOffset;
  for (const auto& lp : lps) {
    tokens.push_back(lp.token);
    tokenLogprobs.push_back(lp.logprob);
    json alternatives = json::object();
    for (size_t k = 0; k < lp.top.size(); ++k) {
      const auto& [tok, p] = lp.top[k];
      if (alternatives.contains(tok) && k < lp.topIds.size()) {
        alternatives["token_id:" + std::to_string(lp.topIds[k])] = p;
      } else {
        alternatives[tok] = p;
      }
    }
    top.push_back(alternatives);
    offsets.push_back(offset);
    offset += lp.token.size();
  }
  return json{{"tokens", tokens}, {"token_logprobs", tokenLogprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json finishJson(const std::optional<std::string>& reason) { return reason ? json(*reason) : json(nullptr); }

}  // namespace

ParseResult parseGenerationRequest(const std::string& body, Endpoint endpoint, const ApiLimits& limits) {
  auto body_ = parseJsonBody(body);
  if (auto* e = std::get_if<ApiError>(&body_)) return *e;
  const json& parsed = std::get<json>(body_);
  GenerationRequest r;
  r.endpoint = endpoint;
  if (auto e = readFields(parsed, endpoint, limits, &r)) return *e;
  if (auto e = finishStructuredOutput(body, &r)) return *e;
  return r;
}

json Usage::toJson() const {
  json j{{"prompt_tokens", promptTokens},
         {"completion_tokens", completionTokens},
         {"total_tokens", promptTokens + completionTokens}};
  if (cachedTokens) j["prompt_tokens_details"] = {{"cached_tokens", *cachedTokens}};
  if (pdserveTiming) j["pdserve_timing"] = *pdserveTiming;
  return j;
}

json streamChunk(Endpoint endpoint, const ResponseMeta& meta, const ChoiceDelta& d, bool wantLogprobs) {
  json choice{{"index", d.index}};
  if (endpoint == Endpoint::kChat) {
    json delta = json::object();
    if (d.first) delta["role"] = "assistant";
    if (d.first || !d.text.empty()) delta["content"] = d.text;
    if (!d.toolCallDeltas.empty()) {
      json calls = json::array();
      for (const auto& c : d.toolCallDeltas) {
        json call{{"index", c.index}};
        if (c.id) call["id"] = *c.id, call["type"] = "function";
        json function = json::object();
        if (c.name) function["name"] = *c.name;
        function["arguments"] = c.arguments;
        call["function"] = function;
        calls.push_back(std::move(call));
      }
      delta["tool_calls"] = calls;
    }
    choice["delta"] = delta;
  } else {
    choice["text"] = d.text;
  }
  choice["logprobs"] = wantLogprobs && !d.logprobs.empty() ? logprobsJson(endpoint, d.logprobs, 0) : json(nullptr);
  choice["finish_reason"] = finishJson(d.finishReason);
  if (d.tokenIds) choice["token_ids"] = *d.tokenIds;
  return json{{"id", meta.id},
              {"object", endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", json::array({choice})}};
}

json usageChunk(Endpoint endpoint, const ResponseMeta& meta, const Usage& usage) {
  return json{{"id", meta.id},
              {"object", endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", json::array()},
              {"usage", usage.toJson()}};
}

json fullResponse(Endpoint endpoint, const ResponseMeta& meta, const std::vector<ChoiceDelta>& choices,
                  const Usage& usage, bool wantLogprobs) {
  json out = json::array();
  for (const auto& c : choices) {
    json choice{{"index", c.index}};
    if (endpoint == Endpoint::kChat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
      if (!c.toolCalls.empty()) {
        json calls = json::array();
        for (const auto& t : c.toolCalls)
          calls.push_back(
              {{"id", t.id}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
        choice["message"]["tool_calls"] = calls;
        if (c.text.empty()) choice["message"]["content"] = nullptr;  // as OpenAI answers a call
      }
    } else {
      choice["text"] = c.text;
    }
    choice["logprobs"] = wantLogprobs ? logprobsJson(endpoint, c.logprobs, 0) : json(nullptr);
    choice["finish_reason"] = finishJson(c.finishReason);
    if (c.tokenIds) choice["token_ids"] = *c.tokenIds;
    out.push_back(choice);
  }
  return json{
      {"id", meta.id},           {"object", endpoint == Endpoint::kChat ? "chat.completion" : "text_completion"},
      {"created", meta.created}, {"model", meta.model},
      {"choices", out},          {"usage", usage.toJson()}};
}

std::string sseEvent(const json& j) {
  // Token text can end inside a UTF-8 sequence (logprob tokens): replace, never throw.
  return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

}  // namespace pd::router
