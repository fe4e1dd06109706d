// The Responses API (POST /v1/responses) as a translation layer over the chat pipeline
// (docs/serving.md "Responses API"): a Responses body becomes the chat request it means (one
// request pipeline: parsing, the chat template, routing, streaming), and the chat output
// becomes a Response object or the Responses stream events.
//
// Request: input (a string, or message / function_call / function_call_output items),
// instructions, max_output_tokens, temperature, top_p, text.format, tools of type function,
// tool_choice, parallel_tool_calls, stream, metadata, user, service_tier, truncation
// "disabled", store false. Refused by name: store true and previous_response_id (nothing is
// stored), and every other field.
//
// Stream: response.created, response.in_progress, then per output item
// response.output_item.added; a message's response.content_part.added,
// response.output_text.delta..., response.output_text.done, response.content_part.done; a
// function call's response.function_call_arguments.delta / .done; response.output_item.done;
// last response.completed (response.incomplete when max_output_tokens ended it). Each SSE
// event carries `event: <type>` and a sequence_number.
//
// No I/O; parsing never throws. A ResponsesWriter belongs to one request (its strand).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "router/openai_api.h"
#include "router/tool_calls.h"

namespace pd::router {

// A Responses body as the chat request it means; GenerationRequest::responses holds what the
// Response object echoes. Errors name the Responses field (max_output_tokens, input, ...).
ParseResult parseResponsesRequest(const std::string& body, const ApiLimits& limits = {});

class ResponsesWriter {
 public:
  // `echo`: GenerationRequest::responses.
  ResponsesWriter(nlohmann::json echo, std::string id, int64_t createdAt, std::string model);

  // Streaming: response.created and response.in_progress.
  std::string start();
  // Streaming: events for new text and tool-call deltas (ToolCallStreamer's).
  std::string delta(const std::string& text, const std::vector<ToolCallStreamer::CallDelta>& calls);
  // Streaming: closes what is open and ends with response.completed / .incomplete.
  std::string finish(const std::string& finishReason, const Usage& usage);
  // Streaming: a failure (the `error` event, then response.failed).
  std::string failed(const ApiError& e);
  // Not streaming: the Response object of a whole answer.
  nlohmann::json full(const std::string& text, const std::vector<ToolCall>& calls, const std::string& finishReason,
                      const Usage& usage);

 private:
  std::string event(const std::string& type, nlohmann::json body);
  nlohmann::json responseObject(const std::string& status) const;
  nlohmann::json messageItem(const std::string& status) const;
  std::string closeMessage();
  std::string closeCall();
  static nlohmann::json usageJson(const Usage& usage);

  nlohmann::json echo_;
  std::string id_;
  int64_t createdAt_;
  std::string model_;
  int sequence_ = 0;
  nlohmann::json output_ = nlohmann::json::array();  // finished items
  // The open item: a message (msgOpen_) or a function call (callOpen_).
  bool msgOpen_ = false;
  std::string msgId_, text_;
  bool callOpen_ = false;
  nlohmann::json call_;
};

}  // namespace pd::router
