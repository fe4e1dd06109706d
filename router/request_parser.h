// The parse stage of a request (docs/design.md §6): an OpenAI request body -> a validated internal
// request with its prompt tokenized once, or the OpenAI error to answer with. Also the bodies
// of /tokenize and /detokenize, which share the prompt rules.
//
// Threads: immutable after construction; every method may be called from any thread at once
// (the tokenizer and chat template are immutable, tokenizer.h, chat_template.h). No I/O.
//
// Tool calls (router/tool_calls.h): the tools go to the chat template as its `tools`
// variable, a history's tool calls and tool results as the messages' keys; with
// tool_choice required or a named function the request carries the constraint that makes
// its output that call (req.constraint, constraintSource "tool_choice": the syntax's text
// around a JSON value of the tool's parameters).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/constraint/spec.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "router/openai_api.h"

namespace pd::router {

// A generation request that passed every check: ready to route.
struct ParsedGenerate {
  GenerationRequest req;
  std::vector<int32_t> prompt;  // not empty, shorter than the context
  std::string promptText;       // the rendered prompt (echo)
  int maxTokens = 1;            // >= 1; prompt + maxTokens fits the context
  // echo with max_tokens 0: the workers still run one step (their requests need
  // max_tokens >= 1), and its token is not part of the answer (no text, no usage).
  bool discardOutput = false;
  // Chat with tools (tool_choice not none): the syntax its answer is parsed in, and the
  // special tokens of that syntax the stream keeps in the text (the detokenizer drops
  // special tokens).
  std::optional<ToolCallFormat> toolFormat;
  std::vector<std::pair<int32_t, std::string>> markerTokens;
};

// Why a request was refused, and the pdserve_request_errors label it counts under (empty:
// not counted; empty prompts and oversized max_tokens never were, and still are not).
struct Rejection {
  ApiError error;
  std::string errorMetric;
};

struct ParserLimits {
  std::string modelName;
  int64_t maxModelLen = 0;
  int vocab = 0;
  int64_t maxPromptTokens = 0;  // router.max_prompt_tokens; <= 0: the context length
  // router.requests.tool_call_parser; nullopt (auto): read off the chat template, hermes when
  // it shows no syntax (docs/serving.md "Tool calls").
  std::optional<ToolCallFormat> toolCallParser;
};

class RequestParser {
 public:
  RequestParser(std::shared_ptr<const tok::Tokenizer> tokenizer, std::unique_ptr<tok::ChatTemplate> chat,
                ParserLimits limits);

  std::variant<ParsedGenerate, Rejection> parseGenerate(const std::string& body, Endpoint endpoint) const;
  // /tokenize and /detokenize: the response body or a 400/404.
  std::variant<nlohmann::json, ApiError> tokenize(const std::string& body) const;
  std::variant<nlohmann::json, ApiError> detokenize(const std::string& body) const;

  const std::shared_ptr<const tok::Tokenizer>& tokenizer() const { return tokenizer_; }
  const ParserLimits& limits() const { return limits_; }
  ToolCallFormat toolCallFormat() const { return toolFormat_; }

 private:
  // Tokenizes the prompt of a parsed request; errors are 400s naming the field.
  std::variant<std::vector<int32_t>, ApiError> promptIds(const GenerationRequest& req, std::string* text) const;
  // A completions prompt or /tokenize text; splitSpecialTokens: its special-token text stays plain.
  Result<std::vector<int32_t>> encodePrompt(const std::string& text, bool addSpecialTokens,
                                            bool splitSpecialTokens) const;

  std::shared_ptr<const tok::Tokenizer> tokenizer_;
  std::unique_ptr<tok::ChatTemplate> chat_;
  ParserLimits limits_;
  ToolCallFormat toolFormat_ = ToolCallFormat::kHermes;
  std::vector<std::pair<int32_t, std::string>> markerTokens_;
};

}  // namespace pd::router
