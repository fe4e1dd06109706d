#include "router/tool_calls.h"

#include <catch2/catch.hpp>

#include "router/openai_api.h"
#include "router/responses_api.h"

using namespace pd::router;
using nlohmann::json;

TEST_CASE("hermes: calls between <tool_call> tags, text before them is content") {
  auto out =
      parseToolCalls(ToolCallFormat::kHermes,
                     "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"
                     "\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
  CHECK(out.content == "Let me look.");
  REQUIRE(out.calls.size() == 2);
  CHECK(out.calls[0].name == "get_weather");
  CHECK(json::parse(out.calls[0].arguments) == json{{"city", "Oslo"}});
  CHECK(out.calls[0].id.starts_with("call_"));
  CHECK(out.calls[0].id.size() == 29);
  CHECK(out.calls[0].id != out.calls[1].id);
  CHECK(out.calls[1].arguments == "{}");
  // The last call may lack its closing tag; arguments may come as a JSON text.
  auto open =
      parseToolCalls(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 2}\"}");
  REQUIRE(open.calls.size() == 1);
  CHECK(json::parse(open.calls[0].arguments) == json{{"a", 2}});
  // Broken syntax stays content, whole.
  for (const char* text : {"<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>", "<tool_call>[1]</tool_call>",
                           "<tool_call>{\"arguments\": {}}</tool_call>", "no call at all"}) {
    INFO(text);
    auto bad = parseToolCalls(ToolCallFormat::kHermes, text);
    CHECK(bad.calls.empty());
    CHECK(bad.content == text);
  }
}

TEST_CASE("llama3_json: the whole answer is the call, with parameters") {
  auto out = parseToolCalls(ToolCallFormat::kLlama3Json,
                            " {\"name\": \"search\", \"parameters\": {\"q\": \"pdserve\"}}; {\"name\": \"g\", "
                            "\"parameters\": {}}");
  REQUIRE(out.calls.size() == 2);
  CHECK(out.content.empty());
  CHECK(out.calls[0].name == "search");
  CHECK(json::parse(out.calls[0].arguments) == json{{"q", "pdserve"}});
  auto tagged =
      parseToolCalls(ToolCallFormat::kLlama3Json, "<|python_tag|>{\"name\": \"f\", \"arguments\": {\"x\": 1}}");
  REQUIRE(tagged.calls.size() == 1);
  CHECK(parseToolCalls(ToolCallFormat::kLlama3Json, "The answer is {\"name\": 1}").calls.empty());
  CHECK(parseToolCalls(ToolCallFormat::kLlama3Json, "{\"name\": \"f\"} trailing").calls.empty());
  CHECK(parseToolCalls(ToolCallFormat::kLlama3Json, "{\"name\": \"f\"} trailing").content ==
        "{\"name\": \"f\"} trailing");
}

TEST_CASE("mistral: [TOOL_CALLS] with a JSON array, or name[ARGS]{...}") {
  auto array = parseToolCalls(ToolCallFormat::kMistral,
                              "ok [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"n\": 1}}, {\"name\": \"b\", "
                              "\"arguments\": {}}]");
  CHECK(array.content == "ok");
  REQUIRE(array.calls.size() == 2);
  CHECK(array.calls[1].name == "b");
  auto args =
      parseToolCalls(ToolCallFormat::kMistral, "[TOOL_CALLS]a[ARGS]{\"n\": [1, {\"m\": \"}\"}]}[TOOL_CALLS]b[ARGS]{}");
  REQUIRE(args.calls.size() == 2);
  CHECK(json::parse(args.calls[0].arguments) == json{{"n", {1, {{"m", "}"}}}}});
  CHECK(parseToolCalls(ToolCallFormat::kMistral, "[TOOL_CALLS][{\"name\": \"a\"").calls.empty());
}

TEST_CASE("nesting deeper than 64 levels is content, never a deep parse") {
  std::string deep = "<tool_call>{\"name\": \"f\", \"arguments\": " + std::string(100000, '[') + "</tool_call>";
  CHECK(parseToolCalls(ToolCallFormat::kHermes, deep).calls.empty());
}

TEST_CASE("the format is read off the template, or named") {
  CHECK(detectToolCallFormat("{% for t in tools %}<tool_call>{% endfor %}") == ToolCallFormat::kHermes);
  CHECK(detectToolCallFormat("[AVAILABLE_TOOLS] [TOOL_CALLS]") == ToolCallFormat::kMistral);
  CHECK(detectToolCallFormat("{{ '<|python_tag|>' }}") == ToolCallFormat::kLlama3Json);
  CHECK_FALSE(detectToolCallFormat("{{ bos_token }}"));
  CHECK(toolCallFormatFromName("llama3_json") == ToolCallFormat::kLlama3Json);
  CHECK_FALSE(toolCallFormatFromName("pythonic"));
}

TEST_CASE("streaming: content passes, a call comes out at the end as id/name then arguments") {
  ToolCallStreamer s(ToolCallFormat::kHermes);
  std::string content;
  for (const char* piece :
       {"Sure", ", <to", "ol", "_call>{\"name\": \"f\", ", "\"arguments\": {\"a\": 1}}</tool_call>"})
    content += s.push(piece).content;
  CHECK(content == "Sure, ");
  auto end = s.finish();
  REQUIRE(end.calls.size() == 2);
  CHECK(end.calls[0].index == 0);
  CHECK(end.calls[0].name == std::optional<std::string>("f"));
  CHECK(end.calls[0].id);
  CHECK(end.calls[1].arguments == "{\"a\":1}");
  CHECK(s.sawCalls());
  // A held prefix of the marker that turns out to be text is released.
  ToolCallStreamer t(ToolCallFormat::kHermes);
  CHECK(t.push("a <to").content == "a ");
  CHECK(t.push("p>").content == "<top>");
  CHECK(t.finish().calls.empty());
  // llama3_json: the first non-space character decides.
  ToolCallStreamer l(ToolCallFormat::kLlama3Json);
  CHECK(l.push("  ").content.empty());
  CHECK(l.push("Hi {").content == "  Hi {");
  ToolCallStreamer l2(ToolCallFormat::kLlama3Json, /*firstOnly=*/true);
  CHECK(l2.push("{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {}}").content.empty());
  CHECK(l2.finish().calls.size() == 2);  // one call: its head and its arguments
}

TEST_CASE("tools, tool_choice, parallel_tool_calls: read and refused by name") {
  const std::string msgs = R"("messages":[{"role":"user","content":"x"}])";
  const std::string tool = R"({"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}})";
  auto ok = parseGenerationRequest("{" + msgs + R"(,"tools":[)" + tool + R"(],"parallel_tool_calls":false})",
                                   Endpoint::kChat);
  REQUIRE(std::holds_alternative<GenerationRequest>(ok));
  const auto& t = std::get<GenerationRequest>(ok).tools;
  CHECK(t.choice == ToolChoice::kAuto);
  CHECK_FALSE(t.parallelToolCalls);
  CHECK(t.find("get_weather") != nullptr);
  auto named = parseGenerationRequest(
      "{" + msgs + R"(,"tools":[)" + tool + R"(],"tool_choice":{"type":"function","function":{"name":"get_weather"}}})",
      Endpoint::kChat);
  REQUIRE(std::holds_alternative<GenerationRequest>(named));
  CHECK(std::get<GenerationRequest>(named).tools.choice == ToolChoice::kNamed);
  auto err = [&](const std::string& extra) {
    auto r = parseGenerationRequest("{" + msgs + "," + extra + "}", Endpoint::kChat);
    REQUIRE(std::holds_alternative<ApiError>(r));
    return std::get<ApiError>(r);
  };
  CHECK(err(R"("tools":[{"type":"web_search"}])").message ==
        "tools[0].type: 'web_search' is not supported by pdserve (only \"function\")");
  CHECK(err(R"("tools":[{"type":"function","function":{"name":"a b"}}])").param == std::optional<std::string>("tools"));
  CHECK(err(R"("tools":[)" + tool + "," + tool + "]").message ==
        "tools[1].function.name: 'get_weather' is given twice");
  CHECK(err(R"("tools":[)" + tool + R"(],"tool_choice":{"type":"function","function":{"name":"nope"}})").message ==
        "tool_choice: function 'nope' is not one of the tools");
  CHECK(err(R"("tool_choice":"required")").message ==
        "tool_choice: needs tools (only \"none\" may be sent without them)");
  CHECK(err(R"("tools":[)" + tool + R"(],"tool_choice":"sometimes")").param ==
        std::optional<std::string>("tool_choice"));
  CHECK(err(R"("tools":[{"type":"function","function":{"name":"f","examples":[]}}])").message ==
        "tools[0].function.examples: not supported by pdserve");
}

TEST_CASE("tool calls in chat responses: whole and as stream deltas") {
  ResponseMeta meta{"chatcmpl-1", 1, "m"};
  ChoiceDelta whole;
  whole.finishReason = "tool_calls";
  whole.toolCalls = {{"call_1", "f", "{\"a\":1}"}};
  auto body = fullResponse(Endpoint::kChat, meta, {whole}, Usage{}, false);
  const json& msg = body["choices"][0]["message"];
  CHECK(msg["content"].is_null());
  CHECK(msg["tool_calls"][0] ==
        json{{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{\"a\":1}"}}}});
  CHECK(body["choices"][0]["finish_reason"] == "tool_calls");
  ChoiceDelta head;
  head.toolCallDeltas.push_back({0, "call_1", "f", ""});
  auto chunk = streamChunk(Endpoint::kChat, meta, head, false);
  CHECK(chunk["choices"][0]["delta"]["tool_calls"][0] ==
        json{{"index", 0}, {"id", "call_1"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", ""}}}});
  ChoiceDelta args;
  args.toolCallDeltas.push_back({0, std::nullopt, std::nullopt, "{\"a\""});
  const json want{{"index", 0}, {"function", {{"arguments", "{\"a\""}}}};
  CHECK(streamChunk(Endpoint::kChat, meta, args, false)["choices"][0]["delta"]["tool_calls"][0] == want);
}

TEST_CASE("responses: a body becomes the chat request it means") {
  auto r = parseResponsesRequest(R"({"model":"m","instructions":"Be brief.","max_output_tokens":9,"temperature":0,
      "input":[{"role":"user","content":[{"type":"input_text","text":"weather?"}]},
               {"type":"function_call","call_id":"c1","name":"w","arguments":"{\"city\":\"Oslo\"}"},
               {"type":"function_call_output","call_id":"c1","output":"sunny"}],
      "tools":[{"type":"function","name":"w","parameters":{"type":"object"}}],
      "tool_choice":{"type":"function","name":"w"},"stream":true,"store":false})");
  REQUIRE(std::holds_alternative<GenerationRequest>(r));
  const auto& g = std::get<GenerationRequest>(r);
  CHECK(g.endpoint == Endpoint::kChat);
  REQUIRE(g.messages.size() == 4);
  CHECK(g.messages[0].role == "system");
  CHECK(g.messages[0].content == "Be brief.");
  CHECK(g.messages[1].content == "weather?");
  CHECK(g.messages[2].role == "assistant");
  CHECK((*g.messages[2].toolCalls)[0]["function"]["arguments"] == json{{"city", "Oslo"}});
  CHECK(g.messages[3].role == "tool");
  CHECK(g.messages[3].toolCallId == std::optional<std::string>("c1"));
  CHECK(g.maxTokens == std::optional<int>(9));
  CHECK(g.temperature == 0.0f);
  CHECK(g.stream);
  CHECK(g.tools.choice == ToolChoice::kNamed);
  CHECK(g.tools.namedFunction == "w");
  REQUIRE(g.responses);
  CHECK((*g.responses)["instructions"] == "Be brief.");
  auto s = parseResponsesRequest(R"({"input":"hi"})");
  REQUIRE(std::holds_alternative<GenerationRequest>(s));
  CHECK(std::get<GenerationRequest>(s).messages[0].role == "user");
  auto err = [](const std::string& body) {
    auto e = parseResponsesRequest(body);
    REQUIRE(std::holds_alternative<ApiError>(e));
    return std::get<ApiError>(e);
  };
  CHECK(err(R"({"input":"hi","previous_response_id":"resp_1"})").param ==
        std::optional<std::string>("previous_response_id"));
  CHECK(err(R"({"input":"hi","store":true})").param == std::optional<std::string>("store"));
  CHECK(err(R"({"input":"hi","reasoning":{"effort":"low"}})").message == "reasoning: not supported by pdserve");
  CHECK(err(R"({"input":"hi","tools":[{"type":"web_search"}]})").param == std::optional<std::string>("tools"));
  CHECK(err(R"({"input":[{"type":"input_image"}]})").param == std::optional<std::string>("input"));
  // Chat's checks answer in the Responses field names.
  CHECK(err(R"({"input":"hi","max_output_tokens":-1})").param == std::optional<std::string>("max_output_tokens"));
  CHECK(err(R"({"input":"hi","max_output_tokens":-1})").message.starts_with("max_output_tokens: "));
}

TEST_CASE("responses: the Response object and the stream's event sequence") {
  ResponsesWriter w(json{{"instructions", nullptr}, {"tools", json::array()}}, "resp_1", 5, "m");
  std::string events = w.start();
  events += w.delta("Hel", {});
  events += w.delta("lo", {});
  events += w.delta("", {{0, "call_9", "f", ""}, {0, std::nullopt, std::nullopt, "{\"a\":1}"}});
  Usage u;
  u.promptTokens = 3;
  u.completionTokens = 4;
  events += w.finish("tool_calls", u);
  std::vector<std::string> types;
  std::vector<json> datas;
  for (size_t at = 0; (at = events.find("event: ", at)) != std::string::npos;) {
    const size_t nl = events.find('\n', at);
    types.push_back(events.substr(at + 7, nl - at - 7));
    const size_t end = events.find("\n\n", nl);
    datas.push_back(json::parse(events.substr(nl + 7, end - nl - 7)));
    at = end;
  }
  CHECK(types == std::vector<std::string>{
                     "response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"});
  for (size_t i = 0; i < datas.size(); ++i) {
    CHECK(datas[i]["sequence_number"] == int(i));
    CHECK(datas[i]["type"] == types[i]);
  }
  CHECK(datas[6]["text"] == "Hello");
  const json& done = datas.back()["response"];
  CHECK(done["status"] == "completed");
  CHECK(done["usage"]["input_tokens"] == 3);
  CHECK(done["usage"]["total_tokens"] == 7);
  REQUIRE(done["output"].size() == 2);
  CHECK(done["output"][0]["content"][0]["text"] == "Hello");
  CHECK(done["output"][1]["call_id"] == "call_9");
  CHECK(done["output"][1]["arguments"] == "{\"a\":1}");
  CHECK(datas[10]["output_index"] == 1);
  // Whole, cut by max_output_tokens.
  ResponsesWriter w2(json::object(), "resp_2", 5, "m");
  auto full = w2.full("abc", {}, "length", u);
  CHECK(full["status"] == "incomplete");
  CHECK(full["incomplete_details"]["reason"] == "max_output_tokens");
  CHECK(full["output"][0]["type"] == "message");
}

TEST_CASE("an OpenAI endpoint pdserve does not serve: a 404 in OpenAI's shape naming it; context: a 400") {
  const json e = ApiError::endpointNotServed("POST", "/v1/embeddings").toJson();
  CHECK(ApiError::endpointNotServed("POST", "/v1/embeddings").status == 404);
  CHECK(e["error"]["code"] == "not_served");
  CHECK(e["error"]["type"] == "invalid_request_error");
  CHECK(
      e["error"]["message"].get<std::string>().starts_with("POST /v1/embeddings: this OpenAI endpoint is not served"));
  const ApiError c = ApiError::contextLengthExceeded("too long", "messages");
  CHECK(c.status == 400);
  CHECK(c.code == std::optional<std::string>("context_length_exceeded"));
  CHECK(c.param == std::optional<std::string>("messages"));
}
