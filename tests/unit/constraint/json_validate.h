// A JSON-schema validator for the subset common/constraint implements (type, properties,
// required, additionalProperties, items, minItems/maxItems, minLength/maxLength, enum, const,
// anyOf/oneOf, $ref into #/$defs or #/definitions): the tests' independent check that a
// constrained output is a value of its schema. Test-only.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace pd::testing {

inline size_t utf8Length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

inline bool validatesAgainst(const nlohmann::json& v, const nlohmann::json& s, const nlohmann::json& root,
                             std::string* why) {
  using nlohmann::json;
  auto no = [&](const std::string& m) {
    *why = m + ": " + v.dump();
    return false;
  };
  if (s.is_boolean()) return s.get<bool>() || no("false schema");
  if (s.contains("$ref")) {
    std::string r = s["$ref"];
    std::string section = r.rfind("#/$defs/", 0) == 0 ? "$defs" : "definitions";
    std::string name = r.substr(r.find('/', 2) + 1);
    return validatesAgainst(v, root[section][name], root, why);
  }
  if (s.contains("const") && v != s["const"]) return no("const");
  if (s.contains("enum")) {
    bool found = false;
    for (const auto& e : s["enum"]) found = found || e == v;
    if (!found) return no("enum");
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    if (!s.contains(key)) continue;
    int matches = 0;
    for (const auto& sub : s[key]) {
      std::string ignore;
      matches += validatesAgainst(v, sub, root, &ignore);
    }
    if (matches == 0) return no(key);
  }
  if (s.contains("type")) {
    auto is = [&](const std::string& t) {
      if (t == "object") return v.is_object();
      if (t == "array") return v.is_array();
      if (t == "string") return v.is_string();
      if (t == "integer")
        return v.is_number_integer() || (v.is_number_float() && v.get<double>() == int64_t(v.get<double>()));
      if (t == "number") return v.is_number();
      if (t == "boolean") return v.is_boolean();
      if (t == "null") return v.is_null();
      return false;
    };
    bool ok = false;
    if (s["type"].is_string()) ok = is(s["type"]);
    for (const auto& t : s["type"].is_array() ? s["type"] : json::array()) ok = ok || is(t);
    if (!ok) return no("type");
  }
  if (v.is_object()) {
    if (s.contains("required"))
      for (const auto& k : s["required"])
        if (!v.contains(k.get<std::string>())) return no("required " + k.get<std::string>());
    const bool closed = s.contains("additionalProperties") && s["additionalProperties"] == false;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (s.contains("properties") && s["properties"].contains(it.key())) {
        if (!validatesAgainst(it.value(), s["properties"][it.key()], root, why)) return false;
      } else if (closed) {
        return no("additional property " + it.key());
      }
    }
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return no("minItems");
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return no("maxItems");
    if (s.contains("items"))
      for (const auto& e : v)
        if (!validatesAgainst(e, s["items"], root, why)) return false;
  }
  if (v.is_string()) {
    const size_t n = utf8Length(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return no("minLength");
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return no("maxLength");
  }
  return true;
}

}  // namespace pd::testing
