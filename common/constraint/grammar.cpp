// The compiler: spec -> expression tree -> byte NFA (Thompson) -> DFA built lazily by subset
// construction, one state per set of NFA states reached. constraint.h has the contract;
// docs/design.md "Constraint module" the why.
#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/constraint/constraint.h"
#include "common/constraint/grammar_impl.h"

namespace pd::constraint {
namespace {

using ojson = nlohmann::ordered_json;

// ---- Expression tree -------------------------------------------------------------------------

struct Node;
using NodeP = std::shared_ptr<const Node>;

struct Prop {
  NodeP key;  // `"name": ` as bytes
  NodeP value;
  bool required = false;
};

// A regular expression over bytes. Nodes may be shared: emission re-traverses them, so a
// shared node becomes distinct NFA states at each use.
struct Node {
  enum class Kind { kBytes, kSeq, kAlt, kRepeat, kProps, kList } kind = Kind::kSeq;
  std::vector<std::pair<uint8_t, uint8_t>> ranges;  // kBytes: one byte in any range
  std::vector<NodeP> kids;                          // kSeq, kAlt, kRepeat (one), kList (item, separator)
  int min = 0, max = -1;                            // kRepeat; max -1: unbounded
  std::vector<Prop> props;                          // kProps: properties in order, ", " between
};

NodeP bytesNode(std::vector<std::pair<uint8_t, uint8_t>> r) {
  auto n = std::make_shared<Node>();
  n->kind = Node::Kind::kBytes;
  n->ranges = std::move(r);
  return n;
}
NodeP seq(std::vector<NodeP> kids) {
  if (kids.size() == 1) return kids[0];
  auto n = std::make_shared<Node>();
  n->kind = Node::Kind::kSeq;
  n->kids = std::move(kids);
  return n;
}
NodeP alt(std::vector<NodeP> kids) {
  if (kids.size() == 1) return kids[0];
  auto n = std::make_shared<Node>();
  n->kind = Node::Kind::kAlt;
  n->kids = std::move(kids);
  return n;
}
NodeP repeat(NodeP kid, int min, int max) {
  auto n = std::make_shared<Node>();
  n->kind = Node::Kind::kRepeat;
  n->kids = {std::move(kid)};
  n->min = min;
  n->max = max;
  return n;
}
// Zero or more `item`s with `sep` between them; emitted with one copy of each (a loop), where
// a repeat of `item (sep item)*` would copy the item twice per nesting level.
NodeP list(NodeP item, NodeP sep) {
  auto n = std::make_shared<Node>();
  n->kind = Node::Kind::kList;
  n->kids = {std::move(item), std::move(sep)};
  return n;
}
NodeP lit(std::string_view s) {
  std::vector<NodeP> k;
  for (unsigned char c : s) k.push_back(bytesNode({{c, c}}));
  return seq(std::move(k));
}

// ---- Code point sets as UTF-8 --------------------------------------------------------------

using CpRanges = std::vector<std::pair<uint32_t, uint32_t>>;  // sorted, disjoint, inclusive
constexpr uint32_t kMaxCp = 0x10FFFF;

CpRanges normalize(CpRanges r) {
  std::sort(r.begin(), r.end());
  CpRanges out;
  for (auto [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1)
      out.back().second = std::max(out.back().second, hi);
    else
      out.push_back({lo, hi});
  }
  return out;
}

CpRanges negate(const CpRanges& in) {
  CpRanges r = normalize(in), out;
  uint32_t next = 0;
  for (auto [lo, hi] : r) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCp) out.push_back({next, kMaxCp});
  return out;
}

std::string encodeUtf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// Splits [lo, hi] into pieces whose UTF-8 encodings are each a sequence of byte ranges.
void utf8Pieces(uint32_t lo, uint32_t hi, std::vector<NodeP>* out) {
  if (lo > hi) return;
  // No surrogates: they are not scalar values.
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) utf8Pieces(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8Pieces(0xE000, hi, out);
    return;
  }
  for (uint32_t b : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= b && hi > b) {
      utf8Pieces(lo, b, out);
      utf8Pieces(b + 1, hi, out);
      return;
    }
  }
  if (hi < 0x80) {
    out->push_back(bytesNode({{uint8_t(lo), uint8_t(hi)}}));
    return;
  }
  const int n = hi < 0x800 ? 2 : hi < 0x10000 ? 3 : 4;
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8Pieces(lo, lo | m, out);
        utf8Pieces((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8Pieces(lo, (hi & ~m) - 1, out);
        utf8Pieces(hi & ~m, hi, out);
        return;
      }
    }
  }
  const std::string a = encodeUtf8(lo), b = encodeUtf8(hi);
  std::vector<NodeP> k;
  for (size_t i = 0; i < a.size(); ++i) k.push_back(bytesNode({{uint8_t(a[i]), uint8_t(b[i])}}));
  out->push_back(seq(std::move(k)));
}

NodeP cpSet(const CpRanges& r) {
  std::vector<NodeP> pieces;
  // Merge the one-byte pieces into one node.
  std::vector<std::pair<uint8_t, uint8_t>> ascii;
  for (auto [lo, hi] : normalize(r)) {
    if (lo < 0x80) {
      ascii.push_back({uint8_t(lo), uint8_t(std::min<uint32_t>(hi, 0x7F))});
      if (hi < 0x80) continue;
      lo = 0x80;
    }
    utf8Pieces(lo, hi, &pieces);
  }
  if (!ascii.empty()) pieces.insert(pieces.begin(), bytesNode(std::move(ascii)));
  if (pieces.empty()) return bytesNode({});  // matches nothing
  return alt(std::move(pieces));
}

// ---- JSON pieces in the canonical layout ---------------------------------------------------

constexpr int kMaxIntDigits = 16;   // integer part of a number
constexpr int kMaxFracDigits = 16;  // fraction
constexpr int kMaxExpDigits = 2;    // 1e99 at most: every JSON parser reads it as a double

NodeP digits(int min, int max) { return repeat(bytesNode({{'0', '9'}}), min, max); }
NodeP jsonInteger() {
  return seq({repeat(lit("-"), 0, 1), alt({lit("0"), seq({bytesNode({{'1', '9'}}), digits(0, kMaxIntDigits - 1)})})});
}
NodeP jsonNumber() {
  return seq({jsonInteger(), repeat(seq({lit("."), digits(1, kMaxFracDigits)}), 0, 1),
              repeat(seq({bytesNode({{'e', 'e'}, {'E', 'E'}}), repeat(bytesNode({{'+', '+'}, {'-', '-'}}), 0, 1),
                          digits(1, kMaxExpDigits)}),
                     0, 1)});
}
// ---- numeric bounds (minimum / maximum) -------------------------------------------------
//
// Bounds become digit automata: a range of non-negative integers [a, b] in canonical form
// (no leading zeros) is split by length, and a range of equal-length digit strings by its
// first digit (the usual range-to-regex construction; O(digits^2) nodes).

constexpr int64_t kMaxMagnitude = 9999999999999999;  // kMaxIntDigits nines

NodeP anyDigits(size_t n) { return repeat(bytesNode({{'0', '9'}}), int(n), int(n)); }
// Digit strings of equal length, lo <= x <= hi (leading zeros allowed: a tail).
NodeP sameLengthRange(const std::string& lo, const std::string& hi) {
  // Every tail: one node (the recursion below would otherwise branch twice per digit).
  if (lo.find_first_not_of('0') == std::string::npos && hi.find_first_not_of('9') == std::string::npos)
    return anyDigits(lo.size());
  if (lo.size() == 1) return bytesNode({{uint8_t(lo[0]), uint8_t(hi[0])}});
  const std::string lr = lo.substr(1), hr = hi.substr(1);
  if (lo[0] == hi[0]) return seq({lit(lo.substr(0, 1)), sameLengthRange(lr, hr)});
  std::vector<NodeP> k{seq({lit(lo.substr(0, 1)), sameLengthRange(lr, std::string(lr.size(), '9'))})};
  if (hi[0] - lo[0] > 1)
    k.push_back(seq({bytesNode({{uint8_t(lo[0] + 1), uint8_t(hi[0] - 1)}}), anyDigits(lr.size())}));
  k.push_back(seq({lit(hi.substr(0, 1)), sameLengthRange(std::string(hr.size(), '0'), hr)}));
  return alt(std::move(k));
}
int64_t pow10(size_t n) {
  int64_t v = 1;
  while (n-- > 0) v *= 10;
  return v;
}
// Canonical decimal text of the integers lo..hi, 0 <= lo <= hi; nullptr when empty.
NodeP magnitudeRange(int64_t lo, int64_t hi) {
  if (lo > hi) return nullptr;
  const std::string a = std::to_string(lo), b = std::to_string(hi);
  if (a.size() == b.size()) return sameLengthRange(a, b);
  std::vector<NodeP> k{sameLengthRange(a, std::string(a.size(), '9'))};
  for (size_t len = a.size() + 1; len < b.size(); ++len)
    k.push_back(seq({bytesNode({{'1', '9'}}), anyDigits(len - 1)}));
  k.push_back(sameLengthRange(std::to_string(pow10(b.size() - 1)), b));
  return alt(std::move(k));
}
NodeP altOf(std::vector<NodeP> k) {
  std::erase(k, nullptr);
  if (k.empty()) return bytesNode({});  // matches nothing
  return k.size() == 1 ? k[0] : alt(std::move(k));
}
NodeP negated(NodeP magnitude) { return magnitude ? seq({lit("-"), magnitude}) : nullptr; }
NodeP then(NodeP a, NodeP b) { return a ? seq({a, b}) : nullptr; }

// Integers lo..hi.
NodeP integerRange(int64_t lo, int64_t hi) {
  return altOf({hi >= 0 ? magnitudeRange(std::max<int64_t>(lo, 0), hi) : nullptr,
                lo < 0 ? negated(magnitudeRange(std::max<int64_t>(1, -hi), -lo)) : nullptr});
}
// Numbers lo <= x <= hi for whole-number bounds, without an exponent: "I" or "I.F" lies in
// [I, I+1) and "-I.F" in (-I-1, -I], so the integer part's range follows from the bounds.
NodeP numberRange(int64_t lo, int64_t hi) {
  NodeP fraction = seq({lit("."), digits(1, kMaxFracDigits)});
  NodeP optionalFraction = repeat(fraction, 0, 1);
  return altOf({then(magnitudeRange(std::max<int64_t>(lo, 0), hi - 1), optionalFraction),
                hi >= std::max<int64_t>(lo, 0) ? lit(std::to_string(hi)) : nullptr,
                negated(then(magnitudeRange(std::max<int64_t>(0, -hi), -lo - 1), fraction)),
                negated(magnitudeRange(std::max<int64_t>(1, -hi), -lo))});
}

// One character of a JSON string's content: an unescaped scalar value or an escape.
// bmpOnly: no characters past U+FFFF. JSON Schema counts a string's length in code points,
// JavaScript (zod, ajv's default) in UTF-16 units, where such a character counts twice; a
// string under maxLength without them has the same length either way.
NodeP jsonChar(bool bmpOnly = false) {
  CpRanges plain = bmpOnly ? negate({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}, {0x10000, 0x10FFFF}})
                           : negate({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
  NodeP hex = bytesNode({{'0', '9'}, {'a', 'f'}, {'A', 'F'}});
  NodeP esc =
      seq({lit("\\"),
           alt({bytesNode(
                    {{'"', '"'}, {'\\', '\\'}, {'/', '/'}, {'b', 'b'}, {'f', 'f'}, {'n', 'n'}, {'r', 'r'}, {'t', 't'}}),
                seq({lit("u"), repeat(hex, 4, 4)})})});
  return alt({cpSet(plain), esc});
}
NodeP jsonString(int minLen = 0, int maxLen = -1) {
  return seq({lit("\""), repeat(jsonChar(/*bmpOnly=*/maxLen >= 0), minLen, maxLen), lit("\"")});
}
NodeP jsonScalar() { return alt({jsonString(), jsonNumber(), lit("true"), lit("false"), lit("null")}); }

NodeP anyValue(int depth);
NodeP anyObject(int depth) {  // depth: levels of nesting still allowed inside
  return seq({lit("{"), list(seq({jsonString(), lit(": "), anyValue(depth)}), lit(", ")), lit("}")});
}
NodeP anyArray(int depth) { return seq({lit("["), list(anyValue(depth), lit(", ")), lit("]")}); }
NodeP anyValue(int depth) {
  if (depth <= 0) return jsonScalar();
  return alt({jsonScalar(), anyObject(depth - 1), anyArray(depth - 1)});
}

// A JSON value as canonical text (enum / const): the layout the grammar generates.
std::string canonical(const ojson& v) {
  if (v.is_object()) {
    std::string s = "{";
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) s += ", ";
      first = false;
      s += ojson(it.key()).dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
      s += ": ";
      s += canonical(it.value());
    }
    return s + "}";
  }
  if (v.is_array()) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) s += ", ";
      s += canonical(v[i]);
    }
    return s + "]";
  }
  return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
}

// ---- JSON schema -> tree -----------------------------------------------------------------------

struct SchemaError {
  Status status;
};

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  throw SchemaError{invalidArgument("json_schema: " + what + " (at #" + where + ")")};
}
[[noreturn]] void unsupported(const std::string& where, const std::string& keyword) {
  throw SchemaError{unimplemented("json_schema: keyword '" + keyword + "' is not supported (at #" + where + ")")};
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const ojson& root) : root_(root) {}

  NodeP compile(const ojson& s, const std::string& at, int depth) {
    if (depth > 32) refuse(at, "schemas nest deeper than 32 levels");
    if (s.is_boolean()) {
      if (!s.get<bool>()) refuse(at, "the schema false accepts no value");
      return anyValue(kMaxJsonObjectDepth);
    }
    if (!s.is_object()) refuse(at, "a schema must be an object or a boolean");
    static const std::set<std::string> kAnnotations = {"title",    "description", "default",  "examples",
                                                       "$schema",  "$id",         "$comment", "deprecated",
                                                       "readOnly", "writeOnly",   "$defs",    "definitions"};
    static const std::set<std::string> kKnown = {"type",
                                                 "properties",
                                                 "required",
                                                 "additionalProperties",
                                                 "items",
                                                 "minItems",
                                                 "maxItems",
                                                 "enum",
                                                 "const",
                                                 "anyOf",
                                                 "oneOf",
                                                 "$ref",
                                                 "minLength",
                                                 "maxLength",
                                                 "minimum",
                                                 "maximum",
                                                 "exclusiveMinimum",
                                                 "exclusiveMaximum"};
    for (auto it = s.begin(); it != s.end(); ++it)
      if (!kAnnotations.count(it.key()) && !kKnown.count(it.key())) unsupported(at, it.key());

    if (s.contains("$ref")) {
      if (s.size() > 1) {
        for (auto it = s.begin(); it != s.end(); ++it)
          if (it.key() != "$ref" && !kAnnotations.count(it.key())) refuse(at, "'$ref' beside '" + it.key() + "'");
      }
      return ref(s["$ref"], at, depth);
    }
    if (s.contains("const")) return lit(canonical(s["const"]));
    if (s.contains("enum")) {
      const ojson& e = s["enum"];
      if (!e.is_array() || e.empty()) refuse(at + "/enum", "'enum' must be a non-empty array");
      std::vector<NodeP> k;
      for (const auto& v : e) k.push_back(lit(canonical(v)));
      return alt(std::move(k));
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      const ojson& a = s[key];
      if (!a.is_array() || a.empty()) refuse(at + "/" + key, std::string("'") + key + "' must be a non-empty array");
      std::vector<NodeP> k;
      for (size_t i = 0; i < a.size(); ++i)
        k.push_back(compile(a[i], at + "/" + key + "/" + std::to_string(i), depth + 1));
      return alt(std::move(k));
    }
    if (!s.contains("type")) {
      // Only annotations (or only keywords of one type without "type"): infer the obvious.
      if (s.contains("properties")) return object(s, at, depth);
      if (s.contains("items")) return array(s, at, depth);
      return anyValue(kMaxJsonObjectDepth);
    }
    const ojson& t = s["type"];
    if (t.is_string()) return typed(t.get<std::string>(), s, at, depth);
    if (!t.is_array() || t.empty()) refuse(at + "/type", "'type' must be a string or a non-empty array of strings");
    std::vector<NodeP> k;
    for (const auto& one : t) {
      if (!one.is_string()) refuse(at + "/type", "'type' must be a string or a non-empty array of strings");
      k.push_back(typed(one.get<std::string>(), s, at, depth));
    }
    return alt(std::move(k));
  }

 private:
  int count(const ojson& s, const char* key, const std::string& at, int dflt) {
    if (!s.contains(key)) return dflt;
    const ojson& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      refuse(at + "/" + key, std::string("'") + key + "' must be a non-negative integer");
    if (v.get<int64_t>() > kMaxRepeat)
      refuse(at + "/" + key, std::string("'") + key + "' over " + std::to_string(kMaxRepeat) + " is not supported");
    return int(v.get<int64_t>());
  }

  // minimum / maximum / exclusiveMinimum / exclusiveMaximum as inclusive whole-number bounds,
  // clamped to the magnitudes the grammar writes (kMaxIntDigits). An integer's bounds round
  // inwards; a number's must be whole numbers (a fractional bound is refused by name), and
  // its exclusive bounds are refused (they would need "any fraction but .0").
  std::pair<int64_t, int64_t> bounds(const ojson& s, const std::string& at, bool integer) {
    int64_t lo = -kMaxMagnitude, hi = kMaxMagnitude;
    for (const char* key : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      if (!s.contains(key)) continue;
      const ojson& v = s[key];
      if (!v.is_number()) refuse(at + "/" + key, std::string("'") + key + "' must be a number");
      const double d = std::clamp(v.get<double>(), -double(kMaxMagnitude), double(kMaxMagnitude));
      const bool exclusive = key[0] == 'e', lower = std::string(key).find("inimum") != std::string::npos;
      if (!integer && (exclusive || d != std::floor(d)))
        unsupported(at, std::string(key) + (exclusive ? "" : " (a fractional bound)") + " on a number");
      const int64_t bound = int64_t(lower ? std::ceil(d) : std::floor(d));
      if (lower)
        lo = std::max(lo, exclusive && double(bound) == d ? bound + 1 : bound);
      else
        hi = std::min(hi, exclusive && double(bound) == d ? bound - 1 : bound);
    }
    return {lo, hi};
  }

  void onlyFor(const ojson& s, const std::string& at, const std::string& type,
               std::initializer_list<const char*> keys) {
    for (const char* k : keys)
      if (s.contains(k)) refuse(at, std::string("'") + k + "' does not apply to type '" + type + "'");
  }

  NodeP typed(const std::string& type, const ojson& s, const std::string& at, int depth) {
    if (type == "object") {
      onlyFor(s, at, type, {"items", "minItems", "maxItems", "minLength", "maxLength"});
      return object(s, at, depth);
    }
    if (type == "array") {
      onlyFor(s, at, type, {"properties", "required", "additionalProperties", "minLength", "maxLength"});
      return array(s, at, depth);
    }
    onlyFor(s, at, type, {"properties", "required", "additionalProperties", "items", "minItems", "maxItems"});
    if (type != "integer" && type != "number")
      onlyFor(s, at, type, {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"});
    if (type == "string") {
      const int min = count(s, "minLength", at, 0), max = count(s, "maxLength", at, -1);
      if (max >= 0 && max < min) refuse(at, "'maxLength' is below 'minLength'");
      return jsonString(min, max);
    }
    if (s.contains("minLength") || s.contains("maxLength")) refuse(at, "'minLength'/'maxLength' apply to strings");
    if (type == "integer" || type == "number") {
      auto [lo, hi] = bounds(s, at, type == "integer");
      if (lo > hi) refuse(at, "the bounds admit no " + type);
      if (lo == -kMaxMagnitude && hi == kMaxMagnitude) return type == "integer" ? jsonInteger() : jsonNumber();
      return type == "integer" ? integerRange(lo, hi) : numberRange(lo, hi);
    }
    if (type == "boolean") return alt({lit("true"), lit("false")});
    if (type == "null") return lit("null");
    refuse(at + "/type", "unknown type '" + type + "'");
  }

  NodeP object(const ojson& s, const std::string& at, int depth) {
    bool closed = false;
    if (s.contains("additionalProperties")) {
      const ojson& a = s["additionalProperties"];
      if (!a.is_boolean()) unsupported(at, "additionalProperties (a schema)");
      closed = !a.get<bool>();
    }
    std::set<std::string> required;
    if (s.contains("required")) {
      const ojson& r = s["required"];
      if (!r.is_array()) refuse(at + "/required", "'required' must be an array of strings");
      for (const auto& k : r) {
        if (!k.is_string()) refuse(at + "/required", "'required' must be an array of strings");
        required.insert(k.get<std::string>());
      }
    }
    if (!s.contains("properties")) {
      if (!required.empty()) refuse(at, "'required' names properties that 'properties' does not define");
      // Free-form: any object (or the empty one when closed).
      return closed ? lit("{}") : anyObject(kMaxJsonObjectDepth - 1);
    }
    const ojson& p = s["properties"];
    if (!p.is_object()) refuse(at + "/properties", "'properties' must be an object");
    auto n = std::make_shared<Node>();
    n->kind = Node::Kind::kProps;
    for (auto it = p.begin(); it != p.end(); ++it) {
      Prop prop;
      prop.key = lit(ojson(it.key()).dump(-1, ' ', false, nlohmann::json::error_handler_t::strict) + ": ");
      prop.value = compile(it.value(), at + "/properties/" + it.key(), depth + 1);
      prop.required = required.erase(it.key()) > 0;
      n->props.push_back(std::move(prop));
    }
    if (!required.empty()) refuse(at + "/required", "'" + *required.begin() + "' is required but not in 'properties'");
    // Without additionalProperties: false the generated objects hold only the listed
    // properties, which every such schema accepts.
    return seq({lit("{"), n, lit("}")});
  }

  NodeP array(const ojson& s, const std::string& at, int depth) {
    const int min = count(s, "minItems", at, 0), max = count(s, "maxItems", at, -1);
    if (max >= 0 && max < min) refuse(at, "'maxItems' is below 'minItems'");
    NodeP item =
        s.contains("items") ? compile(s["items"], at + "/items", depth + 1) : anyValue(kMaxJsonObjectDepth - 1);
    if (max == 0) return lit("[]");
    if (min == 0 && max < 0) return seq({lit("["), list(item, lit(", ")), lit("]")});
    // [ item (", " item){min-1, max-1} ] or [] when min == 0.
    NodeP rest = repeat(seq({lit(", "), item}), std::max(min - 1, 0), max < 0 ? -1 : max - 1);
    NodeP some = seq({lit("["), item, rest, lit("]")});
    return min == 0 ? alt({lit("[]"), some}) : some;
  }

  NodeP ref(const ojson& r, const std::string& at, int depth) {
    if (!r.is_string()) refuse(at + "/$ref", "'$ref' must be a string");
    const std::string path = r.get<std::string>();
    const ojson* target = nullptr;
    for (const char* base : {"#/$defs/", "#/definitions/"}) {
      const std::string b = base;
      if (path.rfind(b, 0) != 0) continue;
      const std::string name = path.substr(b.size());
      const std::string section = b.substr(2, b.size() - 3);
      if (root_.contains(section) && root_[section].is_object() && root_[section].contains(name))
        target = &root_[section][name];
    }
    if (path == "#") unsupported(at, "$ref (recursive)");
    if (!target) refuse(at + "/$ref", "'" + path + "' does not name an entry of #/$defs or #/definitions");
    if (visiting_.count(path)) unsupported(at, "$ref (recursive)");
    visiting_.insert(path);
    NodeP n = compile(*target, path.substr(1), depth + 1);
    visiting_.erase(path);
    return n;
  }

  const ojson& root_;
  std::set<std::string> visiting_;
};

// ---- Regex -> tree -------------------------------------------------------------------------------

class RegexCompiler {
 public:
  explicit RegexCompiler(std::string_view p) : p_(p) {}

  NodeP compile() {
    if (!p_.empty() && p_[0] == '^') ++i_;
    NodeP n = alternation();
    if (i_ < p_.size()) fail("unbalanced ')'");
    return n;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw SchemaError{invalidArgument("regex: " + what + " at offset " + std::to_string(i_))};
  }
  [[noreturn]] void unsupported(const std::string& what) const {
    throw SchemaError{unimplemented("regex: " + what + " is not supported (at offset " + std::to_string(i_) + ")")};
  }
  bool more() const { return i_ < p_.size(); }
  char peek() const { return p_[i_]; }

  NodeP alternation() {
    std::vector<NodeP> k{concat()};
    while (more() && peek() == '|') {
      ++i_;
      k.push_back(concat());
    }
    return alt(std::move(k));
  }

  NodeP concat() {
    std::vector<NodeP> k;
    while (more() && peek() != '|' && peek() != ')') {
      if (peek() == '$') {
        ++i_;
        if (more() && peek() != '|' && peek() != ')') unsupported("'$' before the end of the pattern");
        continue;
      }
      if (peek() == '^') unsupported("'^' after the start of the pattern");
      NodeP a = atom();
      k.push_back(quantified(a));
    }
    return seq(std::move(k));
  }

  int number() {
    size_t start = i_;
    int64_t v = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > 1000000) fail("repeat count too large");
      ++i_;
    }
    if (i_ == start) return -1;
    return int(v);
  }

  NodeP quantified(NodeP a) {
    while (more()) {
      char c = peek();
      int min, max;
      if (c == '*') {
        min = 0, max = -1, ++i_;
      } else if (c == '+') {
        min = 1, max = -1, ++i_;
      } else if (c == '?') {
        min = 0, max = 1, ++i_;
      } else if (c == '{') {
        size_t save = i_;
        ++i_;
        min = number();
        if (min < 0) {  // a literal '{'
          i_ = save;
          return a;
        }
        max = min;
        if (more() && peek() == ',') {
          ++i_;
          max = number();
        }
        if (!more() || peek() != '}') fail("unterminated '{m,n}'");
        ++i_;
        if (max >= 0 && max < min) fail("'{m,n}' with n < m");
        if (min > kMaxRepeat || max > kMaxRepeat) fail("repeat counts over " + std::to_string(kMaxRepeat));
      } else {
        return a;
      }
      if (more() && peek() == '?') ++i_;  // lazy: the same language
      if (more() && peek() == '+') unsupported("a possessive quantifier");
      a = repeat(a, min, max);
    }
    return a;
  }

  uint32_t utf8At() {
    const unsigned char c = uint8_t(p_[i_]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i_ + n > p_.size()) fail("invalid UTF-8");
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) {
      const unsigned char d = uint8_t(p_[i_ + k]);
      if ((d >> 6) != 2) fail("invalid UTF-8");
      cp = (cp << 6) | (d & 0x3F);
    }
    i_ += n;
    return cp;
  }

  static CpRanges classOf(char c) {
    static const CpRanges kDigit{{'0', '9'}}, kWord{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}},
        kSpace{{'\t', '\r'}, {' ', ' '}};
    switch (c) {
      case 'd':
        return kDigit;
      case 'w':
        return kWord;
      case 's':
        return kSpace;
      case 'D':
        return negate(kDigit);
      case 'W':
        return negate(kWord);
      case 'S':
        return negate(kSpace);
      default:
        return {};
    }
  }

  uint32_t hexDigits(int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; ++k) {
      if (!more()) fail("truncated escape");
      char c = peek();
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) fail("bad hex digit in an escape");
      v = v * 16 + uint32_t(d);
      ++i_;
    }
    return v;
  }

  // After a backslash: a class (into *cls) or one code point (returned).
  std::optional<uint32_t> escape(CpRanges* cls) {
    if (!more()) fail("trailing backslash");
    const char c = peek();
    ++i_;
    if (std::string_view("dwsDWS").find(c) != std::string_view::npos) {
      *cls = classOf(c);
      return std::nullopt;
    }
    switch (c) {
      case 'n':
        return '\n';
      case 't':
        return '\t';
      case 'r':
        return '\r';
      case 'f':
        return '\f';
      case 'v':
        return '\v';
      case '0':
        return 0;
      case 'x':
        return hexDigits(2);
      case 'u':
        return hexDigits(4);
      case 'b':
        unsupported("'\\b' (word boundary)");
      case 'B':
        unsupported("'\\B'");
      case 'A':
        unsupported("'\\A'");
      case 'z':
      case 'Z':
        unsupported("'\\z'");
      case 'p':
      case 'P':
        unsupported("a Unicode property class ('\\p')");
      default:
        break;
    }
    if (c >= '1' && c <= '9') unsupported("a backreference");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) unsupported(std::string("the escape '\\") + c + "'");
    --i_;
    return utf8At();
  }

  NodeP charClass() {
    ++i_;  // '['
    bool neg = false;
    if (more() && peek() == '^') {
      neg = true;
      ++i_;
    }
    CpRanges r;
    bool first = true;
    while (true) {
      if (!more()) fail("unterminated '['");
      if (peek() == ']' && !first) break;
      first = false;
      if (peek() == '[' && i_ + 1 < p_.size() && p_[i_ + 1] == ':') unsupported("a POSIX class ('[:name:]')");
      uint32_t lo;
      if (peek() == '\\') {
        ++i_;
        CpRanges cls;
        auto cp = escape(&cls);
        if (!cp) {
          r.insert(r.end(), cls.begin(), cls.end());
          continue;
        }
        lo = *cp;
      } else {
        lo = utf8At();
      }
      uint32_t hi = lo;
      if (more() && peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        if (peek() == '\\') {
          ++i_;
          CpRanges cls;
          auto cp = escape(&cls);
          if (!cp) fail("a class escape as a range end");
          hi = *cp;
        } else {
          hi = utf8At();
        }
        if (hi < lo) fail("a range out of order in '[...]'");
      }
      r.push_back({lo, hi});
    }
    ++i_;  // ']'
    return cpSet(neg ? negate(r) : r);
  }

  NodeP atom() {
    const char c = peek();
    if (c == '(') {
      ++i_;
      if (more() && peek() == '?') {
        ++i_;
        if (more() && peek() == ':') {
          ++i_;
        } else if (more() && (peek() == 'P' || peek() == '<') &&
                   !(peek() == '<' && i_ + 1 < p_.size() && (p_[i_ + 1] == '=' || p_[i_ + 1] == '!'))) {
          if (peek() == 'P') ++i_;
          if (!more() || peek() != '<') fail("bad group name");
          while (more() && peek() != '>') ++i_;
          if (!more()) fail("unterminated group name");
          ++i_;
        } else if (more() && (peek() == '=' || peek() == '!' || peek() == '<')) {
          unsupported("a lookaround ('(?=', '(?!', '(?<=', '(?<!')");
        } else {
          unsupported("an inline flag or special group ('(?...')");
        }
      }
      NodeP n = alternation();
      if (!more() || peek() != ')') fail("missing ')'");
      ++i_;
      return n;
    }
    if (c == '[') return charClass();
    if (c == '.') {
      ++i_;
      return cpSet(negate({{'\n', '\n'}}));
    }
    if (c == '*' || c == '+' || c == '?') fail("a quantifier with nothing to repeat");
    if (c == '\\') {
      ++i_;
      CpRanges cls;
      auto cp = escape(&cls);
      return cp ? cpSet({{*cp, *cp}}) : cpSet(cls);
    }
    uint32_t cp = utf8At();
    return lit(encodeUtf8(cp));
  }

  std::string_view p_;
  size_t i_ = 0;
};

// ---- Tree -> NFA ---------------------------------------------------------------------------

struct Frag {
  int start, end;
};

class NfaBuilder {
 public:
  explicit NfaBuilder(NfaData* nfa) : nfa_(nfa) {}

  int newState() {
    if (nfa_->states.size() >= kMaxNfaStates)
      throw SchemaError{resourceExhausted("the constraint is too large (over " + std::to_string(kMaxNfaStates) +
                                          " automaton states): lower maxItems/maxLength or simplify the schema")};
    nfa_->states.emplace_back();
    return int(nfa_->states.size() - 1);
  }
  void eps(int from, int to) { nfa_->states[size_t(from)].eps.push_back(to); }

  Frag emit(const Node& n) {
    switch (n.kind) {
      case Node::Kind::kBytes: {
        Frag f{newState(), newState()};
        for (auto [lo, hi] : n.ranges) nfa_->states[size_t(f.start)].edges.push_back({lo, hi, f.end});
        return f;
      }
      case Node::Kind::kSeq: {
        int s = newState(), cur = s;
        for (const auto& k : n.kids) {
          Frag f = emit(*k);
          eps(cur, f.start);
          cur = f.end;
        }
        return {s, cur};
      }
      case Node::Kind::kAlt: {
        Frag f{newState(), newState()};
        for (const auto& k : n.kids) {
          Frag g = emit(*k);
          eps(f.start, g.start);
          eps(g.end, f.end);
        }
        return f;
      }
      case Node::Kind::kRepeat: {
        int s = newState(), cur = s;
        for (int i = 0; i < n.min; ++i) {
          Frag g = emit(*n.kids[0]);
          eps(cur, g.start);
          cur = g.end;
        }
        int end = newState();
        eps(cur, end);
        if (n.max < 0) {
          Frag g = emit(*n.kids[0]);
          eps(cur, g.start);
          eps(g.end, cur);
        } else {
          for (int i = n.min; i < n.max; ++i) {
            Frag g = emit(*n.kids[0]);
            eps(cur, g.start);
            cur = g.end;
            eps(cur, end);
          }
        }
        return {s, end};
      }
      case Node::Kind::kList: {
        Frag f{newState(), newState()};
        Frag item = emit(*n.kids[0]), sep = emit(*n.kids[1]);
        eps(f.start, f.end);
        eps(f.start, item.start);
        eps(item.end, f.end);
        eps(item.end, sep.start);
        eps(sep.end, item.start);
        return f;
      }
      case Node::Kind::kProps: {
        // States at[i][e]: before property i, e = whether one was written (a ", " is due).
        const size_t np = n.props.size();
        std::vector<std::array<int, 2>> at(np + 1);
        for (auto& a : at) a = {newState(), newState()};
        int end = newState();
        eps(at[np][0], end);
        eps(at[np][1], end);
        for (size_t i = 0; i < np; ++i) {
          const Prop& p = n.props[i];
          Frag key = emit(*p.key), value = emit(*p.value);
          eps(key.end, value.start);
          eps(value.end, at[i + 1][1]);
          eps(at[i][0], key.start);
          Frag comma = emit(*lit(", "));
          eps(at[i][1], comma.start);
          eps(comma.end, key.start);
          if (!p.required) {
            eps(at[i][0], at[i + 1][0]);
            eps(at[i][1], at[i + 1][1]);
          }
        }
        return {at[0][0], end};
      }
    }
    return {newState(), newState()};
  }

 private:
  NfaData* nfa_;
};

NodeP specTree(const ConstraintSpec& spec) {
  if (spec.body.size() > kMaxSpecBytes)
    throw SchemaError{invalidArgument("the constraint is over " + std::to_string(kMaxSpecBytes) + " bytes")};
  NodeP value;
  switch (spec.kind) {
    case SpecKind::kNone:
      throw SchemaError{invalidArgument("no constraint to compile")};
    case SpecKind::kJsonObject:
      value = anyObject(kMaxJsonObjectDepth - 1);
      break;
    case SpecKind::kJsonSchema: {
      ojson schema = ojson::parse(spec.body, nullptr, false);
      if (schema.is_discarded()) throw SchemaError{invalidArgument("json_schema: the schema is not valid JSON")};
      value = SchemaCompiler(schema).compile(schema, "", 0);
      break;
    }
    case SpecKind::kRegex:
      value = RegexCompiler(spec.body).compile();
      break;
    case SpecKind::kChoice: {
      ojson c = ojson::parse(spec.body, nullptr, false);
      if (c.is_discarded() || !c.is_array() || c.empty())
        throw SchemaError{invalidArgument("choice: must be a non-empty array of strings")};
      std::vector<NodeP> k;
      for (const auto& s : c) {
        if (!s.is_string()) throw SchemaError{invalidArgument("choice: must be a non-empty array of strings")};
        k.push_back(lit(s.get<std::string>()));
      }
      value = alt(std::move(k));
      break;
    }
  }
  if (!value) throw SchemaError{invalidArgument("unknown constraint kind " + std::to_string(int(spec.kind)))};
  return seq({lit(spec.prefix), value, lit(spec.suffix)});
}

}  // namespace

// ---- Grammar -------------------------------------------------------------------------------

Grammar::Grammar() : impl_(std::make_unique<Impl>()) {}
Grammar::~Grammar() = default;

State Grammar::step(State s, uint8_t byte) const {
  if (s == kDeadState) return kDeadState;
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->step(s, byte);
}

State Grammar::walk(State s, std::string_view bytes) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (unsigned char c : bytes) {
    if (s == kDeadState) return s;
    s = impl_->step(s, c);
  }
  return s;
}

bool Grammar::accepting(State s) const {
  if (s == kDeadState) return false;
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->dfa[size_t(s)].accepting;
}

bool Grammar::hasNext(State s) const {
  if (s == kDeadState) return false;
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->dfa[size_t(s)].hasNext;
}

size_t Grammar::numDfaStates() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->dfa.size();
}

int Grammar::Impl::addDfaState(std::vector<int> set) {
  auto [it, inserted] = index.try_emplace(set, int(dfa.size()));
  if (!inserted) return it->second;
  DfaState d;
  for (int q : set) {
    if (q == nfa.accept) d.accepting = true;
    if (!nfa.states[size_t(q)].edges.empty()) d.hasNext = true;
  }
  d.set = std::move(set);
  dfa.push_back(std::move(d));
  next.resize(dfa.size() * 256, kUnknown);
  return it->second;
}

std::vector<int> Grammar::Impl::closure(std::vector<int> seeds) const {
  std::vector<char> seen(nfa.states.size(), 0);
  std::vector<int> stack, out;
  for (int q : seeds)
    if (!seen[size_t(q)]) seen[size_t(q)] = 1, stack.push_back(q);
  while (!stack.empty()) {
    int q = stack.back();
    stack.pop_back();
    // Keep only states that read a byte or accept: the others are pass-through.
    const auto& st = nfa.states[size_t(q)];
    if (!st.edges.empty() || q == nfa.accept) out.push_back(q);
    for (int e : st.eps)
      if (!seen[size_t(e)]) seen[size_t(e)] = 1, stack.push_back(e);
  }
  std::sort(out.begin(), out.end());
  return out;
}

State Grammar::Impl::computeStep(State s, uint8_t byte) {
  std::vector<int> seeds;
  for (int q : dfa[size_t(s)].set)
    for (const auto& e : nfa.states[size_t(q)].edges)
      if (byte >= e.lo && byte <= e.hi) seeds.push_back(e.to);
  State t = kDeadState;
  if (!seeds.empty()) {
    std::vector<int> set = closure(std::move(seeds));
    if (!set.empty()) t = addDfaState(std::move(set));
  }
  next[size_t(s) * 256 + byte] = t;
  return t;
}

Result<std::shared_ptr<const Grammar>> compileGrammar(const ConstraintSpec& spec) {
  try {
    NodeP tree = specTree(spec);
    std::shared_ptr<Grammar> g(new Grammar());
    NfaBuilder b(&g->impl_->nfa);
    Frag f = b.emit(*tree);
    g->impl_->nfa.accept = f.end;
    std::vector<int> start = g->impl_->closure({f.start});
    g->impl_->addDfaState(std::move(start));  // state 0
    return std::shared_ptr<const Grammar>(std::move(g));
  } catch (const SchemaError& e) {
    return e.status;
  } catch (const std::exception& e) {
    return invalidArgument(std::string("constraint: ") + e.what());
  }
}

Status validateSpec(const ConstraintSpec& spec) {
  auto g = compileGrammar(spec);
  return g.ok() ? Status::ok() : g.status();
}

}  // namespace pd::constraint
