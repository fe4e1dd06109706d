#include <catch2/catch.hpp>

#include "router/openai_api.h"

using namespace pd::router;
using nlohmann::json;

namespace {

GenerationRequest parseOk(const std::string& body, Endpoint ep = Endpoint::kCompletions) {
  auto r = parseGenerationRequest(body, ep);
  if (auto* e = std::get_if<ApiError>(&r)) FAIL("unexpected error: " << e->message);
  return std::get<GenerationRequest>(r);
}

ApiError parseErr(const std::string& body, Endpoint ep = Endpoint::kCompletions) {
  auto r = parseGenerationRequest(body, ep);
  REQUIRE(std::holds_alternative<ApiError>(r));
  return std::get<ApiError>(r);
}

}  // namespace

TEST_CASE("completions: every prompt form and the sampling fields") {
  auto r = parseOk(R"({"model":"m","prompt":"hello","max_tokens":7,"temperature":0,
      "top_p":0.9,"top_k":5,"min_p":0.1,"seed":42,"ignore_eos":true,"stop":["\n\n","END"],
      "n":2,"stream":true,"stream_options":{"include_usage":true},"logprobs":3,"echo":true,
      "user":"u1","some_vendor_extra":{"x":1}})");
  CHECK(r.model == "m");
  CHECK(r.promptText == std::optional<std::string>("hello"));
  CHECK(r.maxTokens == std::optional<int>(7));
  CHECK(r.temperature == 0.0f);
  CHECK(r.topP == Approx(0.9f));
  CHECK(r.topK == 5);
  CHECK(r.minP == Approx(0.1f));
  CHECK(r.seed == std::optional<uint64_t>(42));
  CHECK(r.ignoreEos);
  CHECK(r.stop == std::vector<std::string>{"\n\n", "END"});
  CHECK(r.n == 2);
  CHECK(r.stream);
  CHECK(r.includeUsage);
  CHECK(r.logprobs);
  CHECK(r.topLogprobs == 3);
  CHECK(r.echo);
  CHECK(r.user == "u1");

  CHECK(parseOk(R"({"prompt":[1,2,3]})").promptIds == std::vector<int32_t>{1, 2, 3});
  CHECK(parseOk(R"({"prompt":[[4,5]]})").promptIds == std::vector<int32_t>{4, 5});
  CHECK(parseOk(R"({"prompt":["one"]})").promptText == std::optional<std::string>("one"));
  CHECK(parseOk(R"({"prompt":"x","stop":"###"})").stop == std::vector<std::string>{"###"});
  // stream_options without include_usage: vLLM's default is true.
  CHECK(parseOk(R"({"prompt":"x","stream":true,"stream_options":{}})").includeUsage);
  CHECK_FALSE(parseOk(R"({"prompt":"x"})").maxTokens.has_value());
}

TEST_CASE("completions: invalid fields are a 400 naming the field") {
  auto e = parseErr(R"({"prompt":"x","temperature":3})");
  CHECK(e.status == 400);
  CHECK(e.param == std::optional<std::string>("temperature"));
  CHECK(e.message == "temperature: 3 is out of range [0.0, 2.0]");

  CHECK(parseErr(R"({"prompt":"x","max_tokens":"ten"})").message ==
        "max_tokens: expected an integer, got a string");
  CHECK(parseErr(R"({"prompt":"x","n":9})").param == std::optional<std::string>("n"));
  CHECK(parseErr(R"({"prompt":"x","logprobs":21})").param == std::optional<std::string>("logprobs"));
  CHECK(parseErr(R"({"prompt":[1,-2]})").message == "prompt[1]: expected a token id (integer >= 0)");
  CHECK(parseErr(R"({"prompt":["a","b"]})").message ==
        "prompt: a batch of 2 prompts is not supported; send one prompt per request");
  CHECK(parseErr(R"({"max_tokens":3})").message == "prompt: required");
  CHECK(parseErr(R"({"prompt":"x","stream_options":{"include_usage":true}})").message ==
        "stream_options: only allowed when stream is true");
  CHECK(parseErr(R"({"prompt":"x","stop":[1]})").message == "stop[0]: expected a string, got an integer");
  CHECK(parseErr(R"({"prompt":"x","max_tokens":0})").message == "max_tokens: must be at least 1");
  CHECK(parseErr(R"({"prompt":"x","top_p":0})").param == std::optional<std::string>("top_p"));
  CHECK(parseErr("{not json").message == "request body is not valid JSON");
  CHECK(parseErr("[1,2]").message == "request body must be a JSON object");
}

TEST_CASE("chat: messages, content parts and logprob fields") {
  auto r = parseOk(R"({"model":"m","messages":[{"role":"system","content":"be brief"},
      {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]},
      {"role":"assistant","content":null}],"max_completion_tokens":5,"max_tokens":99,
      "logprobs":true,"top_logprobs":2})",
                   Endpoint::kChat);
  REQUIRE(r.messages.size() == 3);
  CHECK(r.messages[0].role == "system");
  CHECK(r.messages[1].content == "hi there");
  CHECK(r.messages[2].content.empty());
  CHECK(r.maxTokens == std::optional<int>(5));  // max_completion_tokens wins
  CHECK(r.logprobs);
  CHECK(r.topLogprobs == 2);

  CHECK(parseErr(R"({"messages":[{"role":"robot","content":"x"}]})", Endpoint::kChat).message ==
        "messages[0].role: 'robot' is not one of system, developer, user, assistant, tool");
  CHECK(parseErr(R"({"messages":[]})", Endpoint::kChat).message == "messages: must not be empty");
  CHECK(parseErr(R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", Endpoint::kChat)
            .message == "top_logprobs: requires logprobs to be true");
}

TEST_CASE("error objects carry all four keys") {
  ApiError e = badRequest("n: out of range", "n");
  json j = e.toJson();
  CHECK(j["error"]["message"] == "n: out of range");
  CHECK(j["error"]["type"] == "invalid_request_error");
  CHECK(j["error"]["param"] == "n");
  CHECK(j["error"]["code"].is_null());
}

TEST_CASE("stream chunks, usage chunk and full responses have OpenAI's shapes") {
  ResponseMeta meta{"chatcmpl-1", 1694268190, "m"};
  ChoiceDelta first{0, "", {}, std::nullopt, true};
  CHECK(sseEvent(streamChunk(Endpoint::kChat, meta, first, false)) ==
        "data: {\"choices\":[{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},\"finish_reason\":null,"
        "\"index\":0,\"logprobs\":null}],\"created\":1694268190,\"id\":\"chatcmpl-1\",\"model\":\"m\","
        "\"object\":\"chat.completion.chunk\"}\n\n");
  ChoiceDelta last{0, "", {}, std::string("length"), false};
  json lastJ = streamChunk(Endpoint::kChat, meta, last, false);
  CHECK(lastJ["choices"][0]["delta"] == json::object());
  CHECK(lastJ["choices"][0]["finish_reason"] == "length");

  json usage = usageChunk(Endpoint::kCompletions, meta, Usage{3, 2});
  CHECK(usage["choices"] == json::array());
  CHECK(usage["object"] == "text_completion");
  CHECK(usage["usage"]["total_tokens"] == 5);

  ChoiceDelta whole{0, "Hello", {{"Hel", -0.5f, {{"Hel", -0.5f}, {"He", -1.5f}}}, {"lo", -0.25f, {}}},
                    std::string("stop"), false};
  json full = fullResponse(Endpoint::kCompletions, meta, {whole}, Usage{4, 2}, true);
  CHECK(full["choices"][0]["text"] == "Hello");
  CHECK(full["choices"][0]["logprobs"]["tokens"] == json::array({"Hel", "lo"}));
  CHECK(full["choices"][0]["logprobs"]["text_offset"] == json::array({0, 3}));
  CHECK(full["choices"][0]["logprobs"]["top_logprobs"][0]["He"] == Approx(-1.5));
  json chat = fullResponse(Endpoint::kChat, meta, {whole}, Usage{4, 2}, true);
  CHECK(chat["object"] == "chat.completion");
  CHECK(chat["choices"][0]["message"]["content"] == "Hello");
  CHECK(chat["choices"][0]["logprobs"]["content"][1]["bytes"] == json::array({108, 111}));

  // A token that ends inside a UTF-8 sequence never breaks the stream.
  ChoiceDelta partial{0, "\xe4\xbd", {}, std::nullopt, false};
  CHECK(sseEvent(streamChunk(Endpoint::kCompletions, meta, partial, false)).find("\xef\xbf\xbd") !=
        std::string::npos);
}
