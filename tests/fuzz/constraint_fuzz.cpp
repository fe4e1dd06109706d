// The constraint compiler and token matcher (common/constraint) on arbitrary specs and texts.
// Input: byte 0 picks the kind (json_object, json_schema, regex, choice); the rest is the
// spec's body, a 0x00 byte, then a text to walk. Invariants:
//   - compiling never crashes; a refusal has a message;
//   - walk() equals stepping byte by byte, and a dead state stays dead;
//   - a text a JSON kind accepts parses as JSON (an object for json_object); a text a choice
//     accepts is one of the choices;
//   - on a small vocabulary (every byte, and pieces of the text), the trie mask of each state
//     along the text equals walking every token's bytes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/constraint/constraint.h"

#define CONSTRAINT_CHECK(cond, what)                                         \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s)\n", what, #cond); \
      std::abort();                                                          \
    }                                                                        \
  } while (0)

using namespace pd::constraint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const SpecKind kinds[] = {SpecKind::kJsonObject, SpecKind::kJsonSchema, SpecKind::kRegex, SpecKind::kChoice};
  const SpecKind kind = kinds[data[0] % 4];
  std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t sep = rest.find('\0');
  const std::string body = rest.substr(0, sep);
  const std::string text = sep == std::string::npos ? "" : rest.substr(sep + 1);
  ConstraintSpec spec{kind, body, "", ""};
  auto g = compileGrammar(spec);
  if (!g.ok()) {
    CONSTRAINT_CHECK(!g.status().message().empty(), "a refusal says why");
    return 0;
  }
  const Grammar& gr = **g;
  State s = gr.start();
  std::vector<State> states{s};
  for (unsigned char c : text) {
    const State n = gr.step(s, c);
    if (s == kDeadState) CONSTRAINT_CHECK(n == kDeadState, "a dead state stays dead");
    s = n;
    states.push_back(s);
  }
  CONSTRAINT_CHECK(gr.walk(gr.start(), text) == s, "walk equals stepping");
  if (s != kDeadState && gr.accepting(s)) {
    if (kind == SpecKind::kJsonObject || kind == SpecKind::kJsonSchema) {
      auto v = nlohmann::json::parse(text, nullptr, false);
      CONSTRAINT_CHECK(!v.is_discarded(), "an accepted JSON text parses");
      if (kind == SpecKind::kJsonObject) CONSTRAINT_CHECK(v.is_object(), "json_object accepts objects");
    } else if (kind == SpecKind::kChoice) {
      auto c = nlohmann::json::parse(body);
      bool found = false;
      for (const auto& x : c) found = found || x.get<std::string>() == text;
      CONSTRAINT_CHECK(found, "an accepted choice is one of the choices");
    }
  }
  // A small vocabulary: the 256 bytes, then pieces of the text.
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, char(b)));
  for (size_t i = 0; i + 1 < text.size() && bytes.size() < 320; i += 3) bytes.push_back(text.substr(i, 2 + i % 5));
  bytes.push_back("");  // never usable
  std::vector<bool> usable(bytes.size(), true);
  auto vocab = std::make_shared<const TokenVocabulary>(bytes, usable);
  TokenMatcher m(*g, vocab);
  for (size_t i = 0; i < states.size() && i < 16; ++i) {
    const TokenMask& mask = m.allowed(states[i]);
    int count = 0;
    for (int id = 0; id < vocab->size(); ++id) {
      const bool brute =
          vocab->usable(id) && states[i] != kDeadState && gr.walk(states[i], vocab->bytes(id)) != kDeadState;
      CONSTRAINT_CHECK(mask.test(id) == brute, "the trie mask equals the brute-force walk");
      count += brute;
    }
    CONSTRAINT_CHECK(mask.count == count, "the mask counts its bits");
  }
  return 0;
}
