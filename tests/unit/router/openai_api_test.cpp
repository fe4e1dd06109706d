#include "router/openai_api.h"

#include <algorithm>

#include <catch2/catch.hpp>

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
      "user":"u1"})");
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

  CHECK(parseErr(R"({"prompt":"x","max_tokens":"ten"})").message == "max_tokens: expected an integer, got a string");
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

TEST_CASE("penalties, logit_bias, min_tokens and best_of are read with their ranges") {
  auto r = parseOk(R"({"prompt":"x","presence_penalty":-2,"frequency_penalty":1.5,
      "repetition_penalty":1.2,"logit_bias":{"7":100,"12":-5.5},"min_tokens":3,"best_of":2,"n":2})");
  CHECK(r.presencePenalty == -2.0f);
  CHECK(r.frequencyPenalty == 1.5f);
  CHECK(r.repetitionPenalty == Approx(1.2f));
  auto bias = r.logitBias;
  std::sort(bias.begin(), bias.end());
  CHECK(bias == std::vector<std::pair<int32_t, float>>{{7, 100.0f}, {12, -5.5f}});
  CHECK(r.minTokens == 3);
  // Defaults: off.
  auto d = parseOk(R"({"prompt":"x"})");
  CHECK(d.presencePenalty == 0.0f);
  CHECK(d.frequencyPenalty == 0.0f);
  CHECK(d.repetitionPenalty == 1.0f);
  CHECK(d.logitBias.empty());
  CHECK(d.minTokens == 0);
  CHECK(parseOk(R"({"prompt":"x","best_of":1})").n == 1);

  auto param = [](const std::string& body, Endpoint ep = Endpoint::kCompletions) {
    return parseErr(body, ep).param.value_or("");
  };
  CHECK(parseErr(R"({"prompt":"x","presence_penalty":2.5})").message ==
        "presence_penalty: 2.5 is out of range [-2.0, 2.0]");
  CHECK(param(R"({"prompt":"x","frequency_penalty":-3})") == "frequency_penalty");
  CHECK(param(R"({"prompt":"x","frequency_penalty":"1"})") == "frequency_penalty");
  CHECK(parseErr(R"({"prompt":"x","repetition_penalty":0})").message == "repetition_penalty: must be greater than 0");
  CHECK(param(R"({"prompt":"x","repetition_penalty":2.01})") == "repetition_penalty");
  CHECK(parseErr(R"({"prompt":"x","logit_bias":{"5":101}})").message ==
        "logit_bias[5]: 101 is out of range [-100, 100]");
  CHECK(parseErr(R"({"prompt":"x","logit_bias":{"-5":1}})").message == "logit_bias: key '-5' is not a token id");
  CHECK(param(R"({"prompt":"x","logit_bias":{"abc":1}})") == "logit_bias");
  CHECK(parseErr(R"({"prompt":"x","logit_bias":{"07":1}})").message == "logit_bias: key '07' is not a token id");
  CHECK(parseOk(R"({"prompt":"x","logit_bias":{"0":1}})").logitBias.size() == 1);
  CHECK(param(R"({"prompt":"x","logit_bias":[1]})") == "logit_bias");
  CHECK(param(R"({"prompt":"x","logit_bias":{"1":"a"}})") == "logit_bias[1]");
  json many = {{"prompt", "x"}, {"logit_bias", json::object()}};
  for (int i = 0; i < 1025; ++i) many["logit_bias"][std::to_string(i)] = 1;
  CHECK(parseErr(many.dump()).message == "logit_bias: at most 1024 entries, got 1025");
  CHECK(param(R"({"prompt":"x","min_tokens":-1})") == "min_tokens");
  CHECK(parseErr(R"({"prompt":"x","best_of":3,"n":2})").message ==
        "best_of: 3 is not supported by pdserve (only best_of equal to n, 2: candidates are not ranked)");
  CHECK(param(R"({"prompt":"x","best_of":2})") == "best_of");
}

TEST_CASE("every field pdserve does not implement is a 400 naming it") {
  // tools / tool_choice / parallel_tool_calls are chat fields (tool_calls_test.cpp); on
  // completions they are refused like any other field.
  for (const char* field :
       {"functions", "function_call", "suffix", "audio", "modalities", "prediction", "reasoning_effort",
        "use_beam_search", "skip_special_tokens", "guided_grammar", "some_vendor_extra"}) {
    INFO(field);
    json body{{"prompt", "x"}, {field, json::array({1})}};
    auto e = parseErr(body.dump());
    CHECK(e.status == 400);
    CHECK(e.param == std::optional<std::string>(field));
    CHECK(e.message == std::string(field) + ": not supported by pdserve");
    json chat{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}, {field, "auto"}};
    CHECK(parseErr(chat.dump(), Endpoint::kChat).param == std::optional<std::string>(field));
  }
  for (const char* field : {"tools", "tool_choice", "parallel_tool_calls"})
    CHECK(parseErr(json{{"prompt", "x"}, {field, "auto"}}.dump()).param == std::optional<std::string>(field));
  // Each endpoint's own fields only.
  const std::string msgs = R"("messages":[{"role":"user","content":"x"}])";
  CHECK(parseErr("{" + msgs + R"(,"echo":true})", Endpoint::kChat).param == std::optional<std::string>("echo"));
  CHECK(parseErr("{" + msgs + R"(,"best_of":1})", Endpoint::kChat).param == std::optional<std::string>("best_of"));
  CHECK(parseErr(R"({"prompt":"x","messages":[]})").param == std::optional<std::string>("messages"));
  CHECK(parseErr(R"({"prompt":"x","top_logprobs":2})").param == std::optional<std::string>("top_logprobs"));
  // null is "not given", as in OpenAI's schemas.
  parseOk(R"({"prompt":"x","tools":null,"suffix":null,"response_format":null})");
  // response_format: text, json_object, json_schema (structured outputs).
  parseOk("{" + msgs + R"(,"response_format":{"type":"text"}})", Endpoint::kChat);
  CHECK_FALSE(parseOk("{" + msgs + R"(,"response_format":{"type":"text"}})", Endpoint::kChat).constraint.active());
  CHECK(parseErr(R"({"prompt":"x","response_format":"text"})").param == std::optional<std::string>("response_format"));
  CHECK(parseErr(R"({"prompt":"x","response_format":{"type":"xml"}})").param ==
        std::optional<std::string>("response_format"));
}

TEST_CASE("openai: structured-output fields become one constraint, refusals name the keyword") {
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  using pd::constraint::SpecKind;
  auto obj = parseOk("{" + msgs + R"(,"response_format":{"type":"json_object"}})", Endpoint::kChat);
  CHECK(obj.constraint.kind == SpecKind::kJsonObject);
  auto sch = parseOk("{" + msgs + R"(,"response_format":{"type":"json_schema","json_schema":{"name":"w","strict":true,
      "schema":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}}}})",
                     Endpoint::kChat);
  CHECK(sch.constraint.kind == SpecKind::kJsonSchema);
  CHECK(nlohmann::json::parse(sch.constraint.body)["required"][0] == "a");
  // Properties keep the client's order (they are generated in it), where json sorts keys.
  auto order = parseOk(
      R"({"prompt":"x","guided_json":{"type":"object","properties":{"zeta":{"type":"null"},"alpha":{"type":"null"}}}})");
  CHECK(order.constraint.body.find("zeta") < order.constraint.body.find("alpha"));
  order = parseOk(
      R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"properties":{"zeta":{},"alpha":{}}}}}})");
  CHECK(order.constraint.body.find("zeta") < order.constraint.body.find("alpha"));
  auto onCompletions = parseOk(
      R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"w","schema":{"type":"string"}}}})");
  CHECK(onCompletions.constraint.kind == SpecKind::kJsonSchema);
  CHECK(parseOk(R"({"prompt":"x","guided_regex":"[a-z]+"})").constraint.kind == SpecKind::kRegex);
  auto choice = parseOk(R"({"prompt":"x","guided_choice":["yes","no"]})");
  CHECK(choice.constraint.kind == SpecKind::kChoice);
  CHECK(choice.constraint.body == R"(["yes","no"])");
  CHECK(parseOk(R"({"prompt":"x","guided_json":{"type":"boolean"}})").constraint.kind == SpecKind::kJsonSchema);
  CHECK(parseOk(R"({"prompt":"x","structured_outputs":{"json":"{\"type\":\"null\"}"}})").constraint.kind ==
        SpecKind::kJsonSchema);
  CHECK(parseOk(R"({"prompt":"x","structured_outputs":{"choice":["a"]}})").constraint.kind == SpecKind::kChoice);
  CHECK(parseOk(R"({"prompt":"x","structured_outputs":{"regex":"a|b"}})").constraint.kind == SpecKind::kRegex);
  CHECK(parseOk(R"({"prompt":"x","structured_outputs":{"json_object":true}})").constraint.kind ==
        SpecKind::kJsonObject);

  // Refusals: each names the field and, for a schema or regex, the keyword or construct.
  auto e = parseErr("{" + msgs + R"(,"response_format":{"type":"json_schema","json_schema":{"name":"w",
      "schema":{"type":"object","properties":{"d":{"type":"string","format":"date-time"}}}}}})",
                    Endpoint::kChat);
  CHECK(e.param == std::optional<std::string>("response_format"));
  CHECK_THAT(e.message, Catch::Contains("keyword 'format' is not supported"));
  CHECK_THAT(e.message, Catch::Contains("#/properties/d"));
  e = parseErr(R"({"prompt":"x","guided_regex":"(a)\\1"})");
  CHECK(e.param == std::optional<std::string>("guided_regex"));
  CHECK_THAT(e.message, Catch::Contains("backreference"));
  e = parseErr(R"({"prompt":"x","structured_outputs":{"grammar":"root ::= \"a\""}})");
  CHECK(e.param == std::optional<std::string>("structured_outputs.grammar"));
  e = parseErr(R"({"prompt":"x","guided_grammar":"root ::= \"a\""})");
  CHECK(e.param == std::optional<std::string>("guided_grammar"));
  e = parseErr(R"({"prompt":"x","guided_choice":["a"],"guided_regex":"a"})");
  CHECK_THAT(e.message, Catch::Contains("only one structured-output field"));
  e = parseErr(
      "{" + msgs + R"(,"response_format":{"type":"json_schema","json_schema":{"name":"w","schema":{},"x":1}}})",
      Endpoint::kChat);
  CHECK(e.param == std::optional<std::string>("response_format.json_schema.x"));
  e = parseErr("{" + msgs + R"(,"response_format":{"type":"json_schema"}})", Endpoint::kChat);
  CHECK(e.param == std::optional<std::string>("response_format"));
  e = parseErr(R"({"prompt":"x","guided_choice":[1]})");
  CHECK(e.param == std::optional<std::string>("guided_choice"));
}

TEST_CASE("openai: refusals continue") {
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  // stream_options: include_usage only.
  CHECK(parseErr(R"({"prompt":"x","stream":true,"stream_options":{"continuous_usage_stats":true}})").param ==
        std::optional<std::string>("stream_options.continuous_usage_stats"));
  // Metadata: accepted with the values that change nothing.
  auto m = parseOk(R"({"prompt":"x","user":"u","metadata":{"k":"v"},"store":false,"service_tier":"auto"})");
  CHECK(m.user == "u");
  parseOk(R"({"prompt":"x","service_tier":"default"})");
  CHECK(parseErr(R"({"prompt":"x","store":true})").param == std::optional<std::string>("store"));
  CHECK(parseErr(R"({"prompt":"x","service_tier":"flex"})").param == std::optional<std::string>("service_tier"));
  CHECK(parseErr(R"({"prompt":"x","metadata":"k"})").param == std::optional<std::string>("metadata"));
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
  CHECK(parseErr(R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", Endpoint::kChat).message ==
        "top_logprobs: requires logprobs to be true");
}

TEST_CASE("error objects carry all four keys") {
  ApiError e = ApiError::invalidRequest("n: out of range", "n");
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
  CHECK_FALSE(usage["usage"].contains("prompt_tokens_details"));  // no worker figure: left out
  Usage cached{3, 2};
  cached.cachedTokens = 2;
  CHECK(usageChunk(Endpoint::kCompletions, meta, cached)["usage"]["prompt_tokens_details"]["cached_tokens"] == 2);

  ChoiceDelta whole{
      0, "Hello", {{"Hel", -0.5f, {{"Hel", -0.5f}, {"He", -1.5f}}}, {"lo", -0.25f, {}}}, std::string("stop"), false};
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
  CHECK(sseEvent(streamChunk(Endpoint::kCompletions, meta, partial, false)).find("\xef\xbf\xbd") != std::string::npos);
}

TEST_CASE("completions logprobs: alternatives that decode to the same text are all returned") {
  // Lone bytes of UTF-8 sequences all decode to U+FFFD: keyed by text they used to collapse
  // (logprobs: 20 returned 12 entries on a byte-level vocabulary).
  TokenLogprob lp;
  lp.token = "a";
  lp.logprob = -0.5f;
  lp.top = {{"a", -0.5f}, {"\xEF\xBF\xBD", -1.0f}, {"\xEF\xBF\xBD", -2.0f}, {"b", -3.0f}};
  lp.topIds = {97, 200, 201, 98};
  ChoiceDelta c;
  c.text = "a";
  c.logprobs = {lp};
  ResponseMeta meta{"cmpl-1", 1, "m"};
  json full = fullResponse(Endpoint::kCompletions, meta, {c}, Usage{1, 1}, true);
  const json& top = full["choices"][0]["logprobs"]["top_logprobs"][0];
  CHECK(top.size() == 4);
  CHECK(top["\xEF\xBF\xBD"] == -1.0f);
  CHECK(top["token_id:201"] == -2.0f);
  // Chat lists them: every entry is there with its own text.
  json chat = fullResponse(Endpoint::kChat, meta, {c}, Usage{1, 1}, true);
  CHECK(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size() == 4);
}

TEST_CASE("every request field is bounded and type-checked (docs/security.md \"Request fields\")") {
  // stop_token_ids: at most 64 ids (the vocabulary check is RequestParser's).
  json ids = json::array();
  for (int i = 0; i < 64; ++i) ids.push_back(i);
  CHECK(parseOk(json{{"prompt", "x"}, {"stop_token_ids", ids}}.dump()).stopTokenIds.size() == 64);
  ids.push_back(64);
  auto e = parseErr(json{{"prompt", "x"}, {"stop_token_ids", ids}}.dump());
  CHECK(e.param == std::optional<std::string>("stop_token_ids"));
  CHECK(e.message == "stop_token_ids: at most 64 ids, got 65");
  CHECK(parseErr(R"({"prompt":"x","stop_token_ids":[1,"2"]})").message ==
        "stop_token_ids[1]: expected a token id (integer >= 0)");
  CHECK(parseErr(R"({"prompt":"x","stop_token_ids":7})").param == std::optional<std::string>("stop_token_ids"));

  // stop strings: at most 1024 bytes each.
  CHECK(parseOk(json{{"prompt", "x"}, {"stop", std::string(1024, 's')}}.dump()).stop.size() == 1);
  CHECK(parseErr(json{{"prompt", "x"}, {"stop", json::array({"ok", std::string(1025, 's')})}}.dump()).message ==
        "stop[1]: a stop string may be at most 1024 bytes, got 1025");

  // user: a string of at most 256 bytes.
  CHECK(parseErr(json{{"prompt", "x"}, {"user", std::string(257, 'u')}}.dump()).param ==
        std::optional<std::string>("user"));

  // metadata: OpenAI's rules (16 pairs, 64-byte keys, string values of at most 512 bytes).
  CHECK(parseErr(R"({"prompt":"x","metadata":{"k":1}})").message == "metadata.k: expected a string, got an integer");
  json many = json::object();
  for (int i = 0; i < 17; ++i) many["k" + std::to_string(i)] = "v";
  CHECK(parseErr(json{{"prompt", "x"}, {"metadata", many}}.dump()).message == "metadata: at most 16 pairs, got 17");
  CHECK(parseErr(json{{"prompt", "x"}, {"metadata", {{std::string(65, 'k'), "v"}}}}.dump()).param ==
        std::optional<std::string>("metadata"));
  CHECK(parseErr(json{{"prompt", "x"}, {"metadata", {{"k", std::string(513, 'v')}}}}.dump()).param ==
        std::optional<std::string>("metadata"));
  parseOk(R"({"prompt":"x","metadata":{"team":"a","run":"7"}})");
}

TEST_CASE("chat messages: name is a bounded string, tool calls are refused by name") {
  auto chat = [](const std::string& body) { return parseGenerationRequest(body, Endpoint::kChat); };
  auto chatErr = [&](const std::string& body) {
    auto r = chat(body);
    REQUIRE(std::holds_alternative<ApiError>(r));
    return std::get<ApiError>(r);
  };
  auto r = chat(R"({"messages":[{"role":"user","content":"hi","name":"alice"}]})");
  REQUIRE(std::holds_alternative<GenerationRequest>(r));
  CHECK(std::get<GenerationRequest>(r).messages[0].name == std::optional<std::string>("alice"));
  CHECK(chatErr(R"({"messages":[{"role":"user","content":"hi","name":5}]})").message ==
        "messages[0].name: expected a string, got an integer");
  CHECK(
      chatErr(json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}, {"name", std::string(257, 'n')}}})}}
                  .dump())
          .message == "messages[0].name: at most 256 bytes, got 257");
  // Tool calls in the history pass to the template, their arguments as the object they encode.
  auto withCalls = chat(R"({"messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"id":"c1",
      "type":"function","function":{"name":"f","arguments":"{\"x\": 1}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"2"}]})");
  REQUIRE(std::holds_alternative<GenerationRequest>(withCalls));
  const auto& calls = std::get<GenerationRequest>(withCalls).messages[1].toolCalls;
  REQUIRE(calls);
  CHECK((*calls)[0]["function"]["arguments"] == json{{"x", 1}});
  CHECK((*calls)[0]["id"] == "c1");
  CHECK(chatErr(R"({"messages":[{"role":"user","content":"hi","tool_calls":[{"id":"c1",
      "type":"function","function":{"name":"f","arguments":"{}"}}]}]})")
            .message == "messages[0].tool_calls: only assistant messages carry tool calls");
  CHECK(chatErr(R"({"messages":[{"role":"assistant","tool_calls":[{"type":"function","function":{"name":"f"}}]}]})")
            .message == "messages[0].tool_calls[0].id: required string of at most 256 bytes");
  CHECK(chatErr(R"({"messages":[{"role":"assistant","tool_calls":"call f"}]})").message ==
        "messages[0].tool_calls: expected an array, got a string");
  // An empty tool_calls (some clients always send one) and nulls mean none.
  CHECK(std::holds_alternative<GenerationRequest>(
      chat(R"({"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo","tool_calls":[],
      "refusal":null}]})")));
  CHECK(chatErr(R"({"messages":[{"role":"assistant","content":"x","function_call":{"name":"f"}}]})").message ==
        "messages[0].function_call: not supported by pdserve");
  CHECK(chatErr(R"({"messages":[{"role":"tool","content":"x","tool_call_id":[1]}]})").message ==
        "messages[0].tool_call_id: expected a string, got an array");
}
