// The router's RequestParser over the tiny tokenizer fixture, as the OpenAI-path fuzz targets
// (openai_fuzz, http_fuzz) drive it: built once per process, with the limits of a small model
// as router_service.cpp builds them. Aborts when the fixture does not load.
#pragma once

#include <memory>

#include "router/request_parser.h"
#include "tests/fuzz/fuzz_util.h"

namespace pd::fuzz {

inline const router::RequestParser& tinyRequestParser() {
  static const router::RequestParser* p = [] {
    auto tok = loadTokenizerOrDie(dataDir() + "/tiny_tokenizer");
    auto chat = tok::ChatTemplate::forTokenizer(*tok);
    PD_FUZZ_CHECK(chat.ok(), "the tiny tokenizer's chat template renders");
    router::ParserLimits limits{"small", 4096, static_cast<int>(tok->vocabSize()), 0};
    return new router::RequestParser(tok, std::make_unique<tok::ChatTemplate>(std::move(*chat)), limits);
  }();
  return *p;
}

}  // namespace pd::fuzz
