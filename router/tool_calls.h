// Tool calling as data: the request's tools and tool_choice, and the model's tool-call syntax
// parsed back into OpenAI tool calls, whole (non-streamed) or as a stream of deltas.
//
// Three syntaxes (docs/serving.md "Tool calls"), one per model family:
//   hermes       Hermes / Qwen:  text <tool_call>{"name": .., "arguments": {..}}</tool_call> ...
//   llama3_json  Llama 3.x:      [<|python_tag|>]{"name": .., "parameters": {..}} [; {..}]
//                                (the whole answer is the call; anything else is content)
//   mistral      Mistral:        text [TOOL_CALLS][{"name": .., "arguments": {..}}, ..]
//                                or   text [TOOL_CALLS]name[ARGS]{..}[TOOL_CALLS]name[ARGS]{..}
// Text that does not parse as a call stays content, as vLLM's parsers return it: a model that
// writes broken syntax answers with text, never with a half-made call.
//
// No I/O, no exceptions out of any function (the parsers run on model output, which can be
// anything). Threads: the functions are pure; a ToolCallStreamer belongs to one choice.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace pd::router {

enum class ToolCallFormat { kHermes, kLlama3Json, kMistral };

// "hermes" | "llama3_json" | "mistral"; nullopt for any other name.
std::optional<ToolCallFormat> toolCallFormatFromName(std::string_view name);
const char* toolCallFormatName(ToolCallFormat f);
// The syntax a chat template writes tool calls in, read off its source: "<tool_call>" means
// hermes, "[TOOL_CALLS]" mistral, "<|python_tag|>" llama3_json; nullopt when it shows none.
std::optional<ToolCallFormat> detectToolCallFormat(std::string_view templateSource);
// The special tokens of the syntax: the detokenizer drops special tokens, so the stream puts
// these back into the text the parser reads (empty for llama3_json's optional python tag
// only when the tokenizer lacks it).
std::vector<std::string> toolCallMarkers(ToolCallFormat f);

// What a request asked for.
enum class ToolChoice { kNone, kAuto, kRequired, kNamed };
struct ToolRequest {
  // The request's tools as given (type "function" each), for the chat template; empty: none.
  nlohmann::json tools = nlohmann::json::array();
  // The same in the body's key order (set by the request parser): what the template renders
  // (transformers' tojson keeps the order) and the order of a forced call's properties.
  nlohmann::ordered_json ordered = nlohmann::ordered_json::array();
  ToolChoice choice = ToolChoice::kNone;  // default: auto with tools, none without
  std::string namedFunction;              // kNamed
  bool parallelToolCalls = true;
  bool active() const { return !tools.empty() && choice != ToolChoice::kNone; }
  // The tool named `name` ({"type":"function","function":{...}}), or nullptr.
  const nlohmann::json* find(const std::string& name) const;
};

struct ToolFieldError {
  std::string message;
  std::string param;
};
// Reads tools, tool_choice and parallel_tool_calls of a chat body (nulls: not given).
// Refused by name: a tool type other than "function", a function key we do not know, a
// name that is not [A-Za-z0-9_-]{1,64}, two tools of one name, more than 128 tools, a
// tool_choice naming no tool, a tool_choice other than none without tools.
std::optional<ToolFieldError> readToolFields(const nlohmann::json& body, ToolRequest* out);
// The tools of a body that readToolFields accepted, in the body's key order; `responsesShape`:
// a Responses body's flat {type, name, ...} tools, turned into chat's {type, function}.
nlohmann::ordered_json orderedTools(const std::string& body, bool responsesShape);

struct ToolCall {
  std::string id;  // "call_<24 alphanumerics>"
  std::string name;
  std::string arguments;  // a JSON object's text, as OpenAI sends it
};

struct ParsedToolOutput {
  std::string content;  // text outside the calls (trimmed when calls were found)
  std::vector<ToolCall> calls;
};

// Parses a whole answer. Calls without an id get a fresh one.
ParsedToolOutput parseToolCalls(ToolCallFormat f, std::string_view text);

// A fresh "call_..." id (random).
std::string newToolCallId();

// One choice's output as it streams: content passes through at once, except text that may be
// the start of the syntax's marker (held until it is known not to be); from the marker on,
// the text is held and parsed at the end (finish()), when the calls come out, each as one
// delta with its id and name and one with its arguments.
class ToolCallStreamer {
 public:
  // firstOnly: parallel_tool_calls false, only the first call comes out.
  explicit ToolCallStreamer(ToolCallFormat f, bool firstOnly = false) : format_(f), firstOnly_(firstOnly) {}

  struct CallDelta {
    int index = 0;
    std::optional<std::string> id;    // the first delta of a call
    std::optional<std::string> name;  // the first delta of a call
    std::string arguments;            // the later deltas
  };
  struct Out {
    std::string content;
    std::vector<CallDelta> calls;
  };
  Out push(std::string_view text);
  // The end of the answer: held text parsed, the calls (or the text, when it is no call).
  Out finish();
  bool sawCalls() const { return callCount_ > 0; }

 private:
  ToolCallFormat format_;
  bool firstOnly_ = false;
  std::string held_;
  bool inCalls_ = false;
  bool sawText_ = false;  // llama3_json: a non-space character decided the answer is content
  int callCount_ = 0;
};

// Keeps only the first call (parallel_tool_calls false).
void keepFirstCall(ParsedToolOutput* out);

}  // namespace pd::router
