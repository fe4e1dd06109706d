// Tokenizer encode/decode (common/tokenizer) over every tokenizer in tokenizerDirs(): the
// committed tiny byte-level one, plus Llama 2 (SentencePiece-style, byte fallback), Llama 3
// and Qwen 3 (byte-level BPE with a pre-tokenizer regex) when run.sh passes them. Input: byte
// 0 picks the tokenizer, byte 1 the operation, the rest is text or little-endian int32 ids.
// Invariants: encoded ids are in the vocabulary; streaming detokenization equals decode().
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/tokenizer/detokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace pd;

const std::vector<std::shared_ptr<const tok::Tokenizer>>& tokenizers() {
  static auto* all = [] {
    auto* v = new std::vector<std::shared_ptr<const tok::Tokenizer>>();
    for (const auto& dir : fuzz::tokenizerDirs()) v->push_back(fuzz::loadTokenizerOrDie(dir));
    return v;
  }();
  return *all;
}

void checkStreaming(const std::shared_ptr<const tok::Tokenizer>& t, const std::vector<tok::TokenId>& ids,
                    bool skipSpecial) {
  tok::IncrementalDetokenizer d(t, skipSpecial);
  std::string streamed;
  for (auto id : ids) streamed += d.push(id);
  streamed += d.finish();
  PD_FUZZ_CHECK(streamed == t->decode(ids, {.skipSpecialTokens = skipSpecial}), "the streamed text equals decode()");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizers();  // load outside the timed inputs
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const auto& all = tokenizers();
  const auto& t = all[data[0] % all.size()];
  const uint8_t op = data[1];
  data += 2;
  size -= 2;
  const int64_t vocab = static_cast<int64_t>(t->vocabSize());
  if (op % 2 == 0) {
    std::string_view text(reinterpret_cast<const char*>(data), size);
    auto ids = t->encode(text, /*addSpecialTokens=*/(op & 2) != 0);
    if (!ids.ok()) return 0;
    for (auto id : *ids) PD_FUZZ_CHECK(id >= 0 && id < vocab, "encoded ids are in the vocabulary");
    (void)t->decode(*ids, {.skipSpecialTokens = (op & 4) != 0, .cleanUpTokenizationSpaces = (op & 8) != 0});
    checkStreaming(t, *ids, (op & 4) != 0);
  } else {
    // Ids a client sends (/detokenize, prompt ids): any int32, in or out of the vocabulary.
    std::vector<tok::TokenId> ids(size / 4);
    if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
    // Mostly in range, so the decoder's paths are reached; op bit 1 keeps the raw values.
    if ((op & 2) == 0 && vocab > 0) {
      for (auto& id : ids) id = static_cast<tok::TokenId>(static_cast<uint32_t>(id) % (vocab + 2));
    }
    for (auto id : ids) {
      if (id >= 0 && id < vocab) (void)t->idToToken(id);
    }
    (void)t->decode(ids, {.skipSpecialTokens = (op & 4) != 0, .cleanUpTokenizationSpaces = (op & 8) != 0});
    checkStreaming(t, ids, (op & 4) != 0);
  }
  return 0;
}
