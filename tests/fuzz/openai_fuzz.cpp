// The router's OpenAI request path: the body goes to the same RequestParser calls the HTTP
// handler makes (router_service.cpp) for /v1/completions, /v1/chat/completions, /tokenize,
// /detokenize and /v1/responses. Input: byte 0 picks the endpoint (mod 5: in that order, the
// Responses API last), the rest is the body. Every call must return
// an answer (a parsed request or an ApiError): an exception escaping is a request the server
// never answers, and is a finding.
#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>

#include "tests/fuzz/fuzz_parser.h"

namespace {

using namespace pd;

// As http_reply.cpp writes a body: invalid UTF-8 from the request is replaced, not thrown.
void dumpLikeTheServer(const nlohmann::json& j) {
  (void)j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void checkError(const router::ApiError& e) {
  PD_FUZZ_CHECK(e.status >= 400 && e.status < 600, "errors are 4xx/5xx");
  PD_FUZZ_CHECK(!e.message.empty(), "errors say what is wrong");
  dumpLikeTheServer(e.toJson());
}

void parseOne(const router::RequestParser& p, int which, const std::string& body) {
  switch (which) {
    case 0:
    case 1:
    case 4: {
      auto endpoint = which == 0   ? router::Endpoint::kCompletions
                      : which == 1 ? router::Endpoint::kChat
                                   : router::Endpoint::kResponses;
      auto r = p.parseGenerate(body, endpoint);
      if (auto* ok = std::get_if<router::ParsedGenerate>(&r)) {
        PD_FUZZ_CHECK(!ok->prompt.empty(), "a parsed prompt is not empty");
        PD_FUZZ_CHECK(ok->maxTokens >= 1, "max_tokens >= 1");
        PD_FUZZ_CHECK(static_cast<int64_t>(ok->prompt.size()) + ok->maxTokens <= 4096,
                      "prompt + max_tokens fits the context");
      } else {
        checkError(std::get<router::Rejection>(r).error);
      }
      break;
    }
    case 2: {
      auto r = p.tokenize(body);
      if (auto* e = std::get_if<router::ApiError>(&r))
        checkError(*e);
      else
        dumpLikeTheServer(std::get<nlohmann::json>(r));
      break;
    }
    case 3: {
      auto r = p.detokenize(body);
      if (auto* e = std::get_if<router::ApiError>(&r))
        checkError(*e);
      else
        dumpLikeTheServer(std::get<nlohmann::json>(r));
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  const int which = data[0] % 5;
  parseOne(fuzz::tinyRequestParser(), which, body);
  return 0;
}
