#include "router/tool_calls.h"

#include <algorithm>
#include <random>
#include <set>

namespace pd::router {

using nlohmann::json;

namespace {

constexpr const char* kHermesOpen = "<tool_call>";
constexpr const char* kHermesClose = "</tool_call>";
constexpr const char* kPythonTag = "<|python_tag|>";
constexpr const char* kMistralCalls = "[TOOL_CALLS]";
constexpr const char* kMistralArgs = "[ARGS]";
constexpr size_t kMaxTools = 128;
constexpr int kMaxJsonDepth = 64;  // as the request bodies (router/json_body.h)

bool isSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && isSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && isSpace(s.back())) s.remove_suffix(1);
  return s;
}

// The end (one past) of the JSON object or array that starts at s[start], by bracket
// matching outside strings; npos when it is unfinished or nests deeper than kMaxJsonDepth
// (nlohmann's parser recurses: model output must not choose the depth of our stack).
size_t jsonValueEnd(std::string_view s, size_t start) {
  if (start >= s.size() || (s[start] != '{' && s[start] != '[')) return std::string_view::npos;
  int depth = 0;
  bool inString = false;
  for (size_t i = start; i < s.size(); ++i) {
    const char c = s[i];
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
      continue;
    }
    if (c == '"') {
      inString = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth) return std::string_view::npos;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

std::optional<json> parseJson(std::string_view s) {
  s = trim(s);
  if (s.empty() || jsonValueEnd(s, 0) != s.size()) return std::nullopt;
  json j = json::parse(s.begin(), s.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

std::string argumentsText(const json& args) { return args.dump(-1, ' ', false, json::error_handler_t::replace); }

// {"name": "f", "<argsKey>": {...}}; arguments may also come as a JSON object's text.
std::optional<ToolCall> callFromObject(const json& j) {
  if (!j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return std::nullopt;
  ToolCall c;
  c.name = name->get<std::string>();
  const json* args = nullptr;
  for (const char* key : {"arguments", "parameters"}) {
    auto it = j.find(key);
    if (it != j.end()) {
      args = &*it;
      break;
    }
  }
  if (args == nullptr) {
    c.arguments = "{}";
  } else if (args->is_object()) {
    c.arguments = argumentsText(*args);
  } else if (args->is_string()) {
    auto inner = parseJson(args->get_ref<const std::string&>());
    if (!inner || !inner->is_object()) return std::nullopt;
    c.arguments = argumentsText(*inner);
  } else {
    return std::nullopt;
  }
  c.id = newToolCallId();
  return c;
}

ParsedToolOutput asContent(std::string_view text) { return ParsedToolOutput{std::string(text), {}}; }

ParsedToolOutput parseHermes(std::string_view text) {
  const size_t first = text.find(kHermesOpen);
  if (first == std::string_view::npos) return asContent(text);
  ParsedToolOutput out;
  out.content = std::string(trim(text.substr(0, first)));
  size_t at = first;
  while (at != std::string_view::npos) {
    const size_t bodyStart = at + std::string_view(kHermesOpen).size();
    size_t close = text.find(kHermesClose, bodyStart);
    // The last call may lack its closing tag (the answer ended with the JSON).
    std::string_view body =
        text.substr(bodyStart, close == std::string_view::npos ? std::string_view::npos : close - bodyStart);
    auto j = parseJson(body);
    auto call = j ? callFromObject(*j) : std::nullopt;
    if (!call) return asContent(text);
    out.calls.push_back(std::move(*call));
    if (close == std::string_view::npos) break;
    const size_t after = close + std::string_view(kHermesClose).size();
    at = text.find(kHermesOpen, after);
    // Text between or after the calls: what a template would not write; kept as content.
    std::string_view between =
        trim(text.substr(after, at == std::string_view::npos ? std::string_view::npos : at - after));
    if (!between.empty()) out.content += (out.content.empty() ? "" : "\n") + std::string(between);
  }
  return out;
}

ParsedToolOutput parseLlama3(std::string_view text) {
  std::string_view rest = trim(text);
  if (rest.starts_with(kPythonTag)) rest = trim(rest.substr(std::string_view(kPythonTag).size()));
  if (rest.empty() || rest.front() != '{') return asContent(text);
  ParsedToolOutput out;
  while (!rest.empty()) {
    const size_t end = jsonValueEnd(rest, 0);
    if (end == std::string_view::npos) return asContent(text);
    auto j = parseJson(rest.substr(0, end));
    auto call = j ? callFromObject(*j) : std::nullopt;
    if (!call) return asContent(text);
    out.calls.push_back(std::move(*call));
    rest = trim(rest.substr(end));
    if (!rest.empty() && rest.front() == ';') rest = trim(rest.substr(1));
  }
  return out;
}

ParsedToolOutput parseMistral(std::string_view text) {
  const size_t first = text.find(kMistralCalls);
  if (first == std::string_view::npos) return asContent(text);
  ParsedToolOutput out;
  out.content = std::string(trim(text.substr(0, first)));
  std::string_view rest = trim(text.substr(first + std::string_view(kMistralCalls).size()));
  if (!rest.empty() && rest.front() == '[') {  // [TOOL_CALLS][{...}, {...}]
    auto j = parseJson(rest);
    if (!j || !j->is_array() || j->empty()) return asContent(text);
    for (const auto& item : *j) {
      auto call = callFromObject(item);
      if (!call) return asContent(text);
      out.calls.push_back(std::move(*call));
    }
    return out;
  }
  // [TOOL_CALLS]name[ARGS]{...} repeated.
  while (!rest.empty()) {
    const size_t args = rest.find(kMistralArgs);
    if (args == std::string_view::npos) return asContent(text);
    const std::string_view name = trim(rest.substr(0, args));
    std::string_view after = trim(rest.substr(args + std::string_view(kMistralArgs).size()));
    const size_t end = jsonValueEnd(after, 0);
    if (name.empty() || end == std::string_view::npos) return asContent(text);
    auto j = parseJson(after.substr(0, end));
    if (!j || !j->is_object()) return asContent(text);
    out.calls.push_back({newToolCallId(), std::string(name), argumentsText(*j)});
    rest = trim(after.substr(end));
    if (rest.starts_with(kMistralCalls)) rest = trim(rest.substr(std::string_view(kMistralCalls).size()));
  }
  if (out.calls.empty()) return asContent(text);  // a marker with no call after it
  return out;
}

bool validFunctionName(const std::string& n) {
  return !n.empty() && n.size() <= 64 && std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

std::optional<ToolFieldError> err(std::string message, std::string param) {
  return ToolFieldError{std::move(message), std::move(param)};
}

}  // namespace

std::optional<ToolCallFormat> toolCallFormatFromName(std::string_view name) {
  if (name == "hermes") return ToolCallFormat::kHermes;
  if (name == "llama3_json") return ToolCallFormat::kLlama3Json;
  if (name == "mistral") return ToolCallFormat::kMistral;
  return std::nullopt;
}

const char* toolCallFormatName(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kLlama3Json:
      return "llama3_json";
    case ToolCallFormat::kMistral:
      return "mistral";
  }
  return "hermes";
}

std::optional<ToolCallFormat> detectToolCallFormat(std::string_view src) {
  if (src.find(kHermesOpen) != std::string_view::npos) return ToolCallFormat::kHermes;
  if (src.find(kMistralCalls) != std::string_view::npos) return ToolCallFormat::kMistral;
  if (src.find(kPythonTag) != std::string_view::npos) return ToolCallFormat::kLlama3Json;
  return std::nullopt;
}

std::vector<std::string> toolCallMarkers(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes:
      return {kHermesOpen, kHermesClose};
    case ToolCallFormat::kLlama3Json:
      return {kPythonTag};
    case ToolCallFormat::kMistral:
      return {kMistralCalls, kMistralArgs};
  }
  return {};
}

const json* ToolRequest::find(const std::string& name) const {
  for (const auto& t : tools)
    if (t.contains("function") && t["function"].value("name", "") == name) return &t;
  return nullptr;
}

std::optional<ToolFieldError> readToolFields(const json& body, ToolRequest* out) {
  auto present = [&](const char* f) { return body.contains(f) && !body[f].is_null(); };
  if (present("tools")) {
    const json& tools = body["tools"];
    if (!tools.is_array()) return err("tools: expected an array", "tools");
    if (tools.size() > kMaxTools) {
      return err("tools: at most " + std::to_string(kMaxTools) + " tools, got " + std::to_string(tools.size()),
                 "tools");
    }
    std::set<std::string> names;
    for (size_t i = 0; i < tools.size(); ++i) {
      const std::string at = "tools[" + std::to_string(i) + "]";
      const json& t = tools[i];
      if (!t.is_object()) return err(at + ": expected an object", "tools");
      for (const auto& [key, value] : t.items()) {
        if (key != "type" && key != "function" && !value.is_null())
          return err(at + "." + key + ": not supported by pdserve", "tools");
      }
      if (!t.contains("type") || !t["type"].is_string())
        return err(at + ".type: required string (\"function\")", "tools");
      if (t["type"] != "function") {
        return err(at + ".type: '" + t["type"].get<std::string>().substr(0, 64) +
                       "' is not supported by pdserve (only \"function\")",
                   "tools");
      }
      if (!t.contains("function") || !t["function"].is_object()) return err(at + ".function: required object", "tools");
      const json& f = t["function"];
      for (const auto& [key, value] : f.items()) {
        if (key != "name" && key != "description" && key != "parameters" && key != "strict" && !value.is_null())
          return err(at + ".function." + key.substr(0, 64) + ": not supported by pdserve", "tools");
      }
      if (!f.contains("name") || !f["name"].is_string() || !validFunctionName(f["name"].get<std::string>()))
        return err(at + ".function.name: required, [A-Za-z0-9_-]{1,64}", "tools");
      if (f.contains("description") && !f["description"].is_null() && !f["description"].is_string())
        return err(at + ".function.description: expected a string", "tools");
      if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object())
        return err(at + ".function.parameters: expected a JSON schema object", "tools");
      if (f.contains("strict") && !f["strict"].is_null() && !f["strict"].is_boolean())
        return err(at + ".function.strict: expected a boolean", "tools");
      if (!names.insert(f["name"].get<std::string>()).second)
        return err(at + ".function.name: '" + f["name"].get<std::string>() + "' is given twice", "tools");
    }
    out->tools = tools;
    if (!tools.empty()) out->choice = ToolChoice::kAuto;
  }
  if (present("tool_choice")) {
    const json& c = body["tool_choice"];
    if (c.is_string()) {
      const std::string& s = c.get_ref<const std::string&>();
      if (s == "none")
        out->choice = ToolChoice::kNone;
      else if (s == "auto")
        out->choice = ToolChoice::kAuto;
      else if (s == "required")
        out->choice = ToolChoice::kRequired;
      else
        return err("tool_choice: '" + s.substr(0, 64) + "' is not one of none, auto, required", "tool_choice");
    } else if (c.is_object()) {
      if (!c.contains("type") || c["type"] != "function" || !c.contains("function") || !c["function"].is_object() ||
          !c["function"].contains("name") || !c["function"]["name"].is_string()) {
        return err("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice");
      }
      out->choice = ToolChoice::kNamed;
      out->namedFunction = c["function"]["name"].get<std::string>();
      if (out->find(out->namedFunction) == nullptr) {
        return err("tool_choice: function '" + out->namedFunction.substr(0, 64) + "' is not one of the tools",
                   "tool_choice");
      }
    } else {
      return err("tool_choice: expected a string or an object", "tool_choice");
    }
    if (out->choice != ToolChoice::kNone && out->tools.empty())
      return err("tool_choice: needs tools (only \"none\" may be sent without them)", "tool_choice");
  }
  if (present("parallel_tool_calls")) {
    if (!body["parallel_tool_calls"].is_boolean())
      return err("parallel_tool_calls: expected a boolean", "parallel_tool_calls");
    out->parallelToolCalls = body["parallel_tool_calls"].get<bool>();
  }
  return std::nullopt;
}

nlohmann::ordered_json orderedTools(const std::string& body, bool responsesShape) {
  using ojson = nlohmann::ordered_json;
  ojson parsed = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object() || !parsed.contains("tools") || !parsed["tools"].is_array()) return ojson::array();
  if (!responsesShape) return parsed["tools"];
  ojson out = ojson::array();
  for (const auto& t : parsed["tools"]) {
    ojson function = ojson::object();
    for (const auto& [key, v] : t.items())
      if (key != "type" && !v.is_null()) function[key] = v;
    out.push_back({{"type", "function"}, {"function", function}});
  }
  return out;
}

ParsedToolOutput parseToolCalls(ToolCallFormat f, std::string_view text) {
  switch (f) {
    case ToolCallFormat::kHermes:
      return parseHermes(text);
    case ToolCallFormat::kLlama3Json:
      return parseLlama3(text);
    case ToolCallFormat::kMistral:
      return parseMistral(text);
  }
  return asContent(text);
}

std::string newToolCallId() {
  static constexpr char kAlnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlnum[rng() % (sizeof(kAlnum) - 1)];
  return id;
}

void keepFirstCall(ParsedToolOutput* out) {
  if (out->calls.size() > 1) out->calls.resize(1);
}

ToolCallStreamer::Out ToolCallStreamer::push(std::string_view text) {
  Out out;
  if (inCalls_) {
    held_ += text;
    return out;
  }
  held_ += text;
  if (format_ == ToolCallFormat::kLlama3Json) {
    // The answer is a call when its first non-space character starts one.
    if (sawText_) {
      out.content = std::move(held_);
      held_.clear();
      return out;
    }
    std::string_view t = trim(held_);
    if (t.empty()) return out;
    if (t.front() == '{' || t.starts_with(kPythonTag)) {
      inCalls_ = true;
      return out;
    }
    if (std::string_view(kPythonTag).starts_with(t)) return out;  // may still become the tag
    sawText_ = true;
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  const std::string_view marker = format_ == ToolCallFormat::kHermes ? kHermesOpen : kMistralCalls;
  const size_t at = held_.find(marker);
  if (at != std::string::npos) {
    out.content = held_.substr(0, at);
    held_.erase(0, at);
    inCalls_ = true;
    return out;
  }
  // Hold back the longest tail that is a prefix of the marker.
  size_t keep = 0;
  for (size_t k = std::min(marker.size() - 1, held_.size()); k > 0; --k) {
    if (held_.compare(held_.size() - k, k, marker, 0, k) == 0) {
      keep = k;
      break;
    }
  }
  out.content = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

ToolCallStreamer::Out ToolCallStreamer::finish() {
  Out out;
  if (!inCalls_) {
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  ParsedToolOutput parsed = parseToolCalls(format_, held_);
  held_.clear();
  if (firstOnly_) keepFirstCall(&parsed);
  if (parsed.calls.empty()) {
    out.content = std::move(parsed.content);
    return out;
  }
  // Content the parser found after the marker (between calls) still reaches the client.
  out.content = std::move(parsed.content);
  for (auto& c : parsed.calls) {
    CallDelta head;
    head.index = callCount_;
    head.id = c.id;
    head.name = c.name;
    out.calls.push_back(std::move(head));
    CallDelta args;
    args.index = callCount_;
    args.arguments = c.arguments;
    out.calls.push_back(std::move(args));
    ++callCount_;
  }
  return out;
}

}  // namespace pd::router
