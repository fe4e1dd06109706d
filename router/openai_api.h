// The OpenAI HTTP surface of the router, as plain data: request parsing and validation, and
// the JSON of responses, stream chunks and errors (shapes: ../shared/reference/
// openai-api-metrics-deploy.md §1, as vLLM and the official SDKs use them).
//
// No I/O here: the HTTP server feeds bodies in and writes what these functions return.
// Parsing never throws; every problem becomes an ApiError naming the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/constraint/spec.h"
#include "router/tool_calls.h"

namespace pd::router {

// An OpenAI error object plus its HTTP status.
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";  // OpenAI's string type
  std::string message;
  std::optional<std::string> param;  // the offending field, when there is one
  std::optional<std::string> code;   // "model_not_found", "context_length_exceeded"
  std::optional<int> retryAfterS;    // 429/503: the Retry-After header (default 1)

  nlohmann::json toJson() const;  // {"error":{"message","type","param","code"}}

  // One constructor per shape the router answers with.
  // 400 invalid_request_error, naming the offending field when there is one.
  static ApiError invalidRequest(std::string message, std::optional<std::string> param = std::nullopt);
  // 404 for a model this server does not serve, as OpenAI and vLLM word it.
  static ApiError modelNotFound(const std::string& model);
  // 404, code not_found: no such route.
  static ApiError notFound(std::string message);
  // 405: the route takes another method.
  static ApiError methodNotAllowed(std::string message);
  // 404, code not_served: an OpenAI endpoint pdserve does not serve (embeddings, audio,
  // images, ...): an OpenAI-shaped error the SDKs raise as NotFoundError, naming the path.
  static ApiError endpointNotServed(const std::string& method, const std::string& path);
  // 400, code context_length_exceeded: the prompt (`param`) does not fit the model (OpenAI and
  // vLLM answer 400, which the SDKs raise as BadRequestError).
  static ApiError contextLengthExceeded(std::string message, std::string param);
  // 401 authentication_error, code invalid_api_key.
  static ApiError unauthorized(std::string message);
  // 429 rate_limit_exceeded with `code` (rate_limit_exceeded, overloaded, admission_refused);
  // retryAfterS: the Retry-After header (unset: 1).
  static ApiError rateLimited(std::string message, std::string code, std::optional<std::string> param = std::nullopt,
                              std::optional<int> retryAfterS = std::nullopt);
  // 503 service_unavailable: retry (Retry-After 1).
  static ApiError unavailable(std::string message);
  // 500 internal_error.
  static ApiError internal(std::string message);
};

// kResponses: POST /v1/responses, parsed into a chat request (router/responses_api.h).
enum class Endpoint { kCompletions, kChat, kResponses };

struct ChatMessage {
  std::string role;     // system | developer | user | assistant | tool
  std::string content;  // text parts joined
  // Passed to the chat template as the message's keys of the same name, when given.
  std::optional<std::string> name;        // at most ApiLimits::maxNameBytes
  std::optional<std::string> toolCallId;  // "tool_call_id", role tool; at most maxNameBytes
  // role assistant: its calls, [{id, type: "function", function: {name, arguments}}], where
  // arguments is the JSON object itself when the text parses as one (templates write it with
  // tojson, as transformers' apply_chat_template is given it), else the text.
  std::optional<nlohmann::json> toolCalls;
};

// One validated generation request, before tokenization. Field names follow the API.
struct GenerationRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  // Completions: exactly one of promptText / promptIds is set. Chat: messages.
  std::optional<std::string> promptText;
  std::optional<std::vector<int32_t>> promptIds;
  std::vector<ChatMessage> messages;
  bool addGenerationPrompt = true;

  std::optional<int> maxTokens;  // absent: completions 16; chat: what remains of the context
  float temperature = 1.0f;
  float topP = 1.0f;
  int topK = 0;  // 0 or -1: disabled
  float minP = 0.0f;
  std::optional<uint64_t> seed;
  bool ignoreEos = false;
  std::vector<std::string> stop;
  std::vector<int32_t> stopTokenIds;
  // Logits processors (engine/logits_processors.h has the definitions).
  float presencePenalty = 0.0f;                      // [-2, 2]
  float frequencyPenalty = 0.0f;                     // [-2, 2]
  float repetitionPenalty = 1.0f;                    // (0, 2]
  std::vector<std::pair<int32_t, float>> logitBias;  // ids checked against the vocabulary later
  int minTokens = 0;                                 // <= max_tokens (checked once max_tokens is known)
  int n = 1;
  bool stream = false;
  bool includeUsage = false;
  // Completions: logprobs = N (0..20). Chat: logprobs bool + top_logprobs N.
  bool logprobs = false;
  int topLogprobs = 0;
  bool echo = false;
  std::string user;
  bool returnTokenIds = false;  // vLLM's extension: each choice carries its token_ids
  // transformers' split_special_tokens: special-token text in the prompt or in message
  // contents is encoded as plain text. pdserve defaults to true (transformers to false), so
  // client text never becomes a control token; false lets it through (docs/serving.md).
  bool splitSpecialTokens = true;
  // Chat: tools, tool_choice, parallel_tool_calls (router/tool_calls.h).
  ToolRequest tools;
  // Set when the request came as a Responses body (router/responses_api.h): the fields the
  // Response object echoes. The request itself is the chat request it means.
  std::optional<nlohmann::json> responses;
  // Structured output (response_format json_object / json_schema, guided_*, structured_outputs),
  // validated at parse time; kind kNone when the text is free. Carried to every worker.
  constraint::ConstraintSpec constraint;
  std::string constraintSource;  // the field that set it ("response_format", "guided_regex", ...)
};

// Limits the router enforces while parsing.
struct ApiLimits {
  int maxN = 4;
  int maxLogprobs = 20;
  int maxStop = 16;
  int maxLogitBias = 1024;  // = pd::engine::kMaxLogitBias
  // docs/security.md "Request fields": every field is bounded. A model has a handful of
  // end-of-turn ids, and vLLM checks each generated token against every stop id, so a few
  // dozen is generous; 10^6 ids made a 3 MB body and a 2.5x slower request.
  int maxStopTokenIds = 64;
  size_t maxStopBytes = 1024;  // one stop string; stop sequences are short phrases
  size_t maxNameBytes = 256;   // a message's name / tool_call_id (OpenAI: 64 characters)
  size_t maxUserBytes = 256;   // user: an end-user id
  // metadata, as OpenAI documents it: up to 16 pairs, keys up to 64 characters, string values
  // up to 512.
  size_t maxMetadataPairs = 16;
  size_t maxMetadataKeyBytes = 64;
  size_t maxMetadataValueBytes = 512;
};

using ParseResult = std::variant<GenerationRequest, ApiError>;

// Parses and validates a request body for the endpoint. Each endpoint has an allow-list of
// the fields pdserve implements (docs/serving.md "API fields"): any other field that is not
// null is a 400 naming it ("<field>: not supported by pdserve"), never silently ignored; known
// fields with a wrong type or range are a 400 naming the field.
ParseResult parseGenerationRequest(const std::string& body, Endpoint endpoint, const ApiLimits& limits = {});

// ---- Responses ---------------------------------------------------------------------------

struct TokenLogprob {
  std::string token;  // text of the token
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;  // alternatives, best first
  // The alternatives' token ids, parallel to `top` (empty: unknown). Completions key their
  // alternatives by text, and different tokens can share one (every lone byte of a UTF-8
  // sequence decodes to U+FFFD): a repeated text is keyed "token_id:<id>" instead, vLLM's
  // return_tokens_as_token_ids form, so all N alternatives are returned.
  std::vector<int32_t> topIds;
};

struct Usage {
  int promptTokens = 0;
  int completionTokens = 0;
  // OpenAI's usage.prompt_tokens_details.cached_tokens: prompt tokens the worker served from
  // its prefix cache, in any tier (docs/kv_cache.md); unset: the field is left out.
  std::optional<int> cachedTokens;
  // pdserve's extension: the request's TTFT split (router/ttft_split.h), as "pdserve_timing".
  std::optional<nlohmann::json> pdserveTiming;
  nlohmann::json toJson() const;
};

// The part of one choice produced since the last chunk (or the whole choice, non-streaming).
struct ChoiceDelta {
  int index = 0;
  std::string text;
  std::vector<TokenLogprob> logprobs;            // one per token in `text`, when requested
  std::optional<std::string> finishReason;       // "stop" | "length" | "abort" | "error"
  bool first = false;                            // chat: carries delta.role
  std::optional<std::vector<int32_t>> tokenIds;  // return_token_ids: the ids behind `text`
  // Chat with tools: streamed, the calls' deltas in this chunk; whole, the calls.
  std::vector<ToolCallStreamer::CallDelta> toolCallDeltas;
  std::vector<ToolCall> toolCalls;
};

struct ResponseMeta {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
};

// A streamed chunk's JSON (object "text_completion" or "chat.completion.chunk").
nlohmann::json streamChunk(Endpoint endpoint, const ResponseMeta& meta, const ChoiceDelta& delta, bool wantLogprobs);
// The usage-only chunk sent before [DONE] when stream_options.include_usage is set.
nlohmann::json usageChunk(Endpoint endpoint, const ResponseMeta& meta, const Usage& usage);
// A whole non-streamed response; `choices` hold each choice's full text and logprobs.
nlohmann::json fullResponse(Endpoint endpoint, const ResponseMeta& meta, const std::vector<ChoiceDelta>& choices,
                            const Usage& usage, bool wantLogprobs);

// "data: <compact json>\n\n"
std::string sseEvent(const nlohmann::json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace pd::router
