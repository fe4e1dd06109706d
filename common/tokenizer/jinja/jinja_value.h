// Internal to the Jinja interpreter (common/tokenizer/jinja.h has the contract): the value
// model (Python-like values: none, bool, int, float, string, list, dict, function), the
// conversions and comparisons every stage shares, and the error every stage raises.
// Errors travel as a JinjaError exception from deep in the recursive parser and evaluator up
// to JinjaTemplate::parse()/render() (jinja.cpp), which turn them into a Status. Nothing throws
// across the public API, threads or callbacks.
// Values are plain data: copying one shares its list / dict / function (as Python does).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace pd::tok::jinja {

struct JinjaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(int line, const std::string& msg) {
  throw JinjaError("jinja: line " + std::to_string(line) + ": " + msg);
}

// ---- Values ---------------------------------------------------------------------------------

struct Value;
using Array = std::vector<Value>;
struct Object;
struct Callable;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kFunction };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<Array> arr;
  std::shared_ptr<Object> obj;
  std::shared_ptr<Callable> fn;
  bool isNamespace = false;
  bool isTuple = false;

  static Value none() {
    Value v;
    v.kind = Kind::kNone;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.kind = Kind::kBool;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.kind = Kind::kInt;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.kind = Kind::kFloat;
    v.f = x;
    return v;
  }
  static Value str(std::string x) {
    Value v;
    v.kind = Kind::kString;
    v.s = std::move(x);
    return v;
  }
  static Value array(Array a = {}) {
    Value v;
    v.kind = Kind::kArray;
    v.arr = std::make_shared<Array>(std::move(a));
    return v;
  }
  static Value object();
  bool isUndefined() const { return kind == Kind::kUndefined; }
  bool isString() const { return kind == Kind::kString; }
  bool isNumber() const { return kind == Kind::kInt || kind == Kind::kFloat; }
  double num() const { return kind == Kind::kInt ? static_cast<double>(i) : f; }
};

struct Object {
  std::vector<std::pair<std::string, Value>> items;
  Value* find(const std::string& k) {
    for (auto& [key, v] : items)
      if (key == k) return &v;
    return nullptr;
  }
  void set(const std::string& k, Value v) {
    if (Value* p = find(k))
      *p = std::move(v);
    else
      items.emplace_back(k, std::move(v));
  }
};

using Kwargs = std::vector<std::pair<std::string, Value>>;
struct Callable {
  std::string name;
  std::function<Value(std::vector<Value>&, Kwargs&, int line)> call;
};

Value makeFunction(std::string name, std::function<Value(std::vector<Value>&, Kwargs&, int)> f);
const char* kindName(const Value& v);
// Python truthiness.
bool truthy(const Value& v);
std::string formatFloat(double d);
void jsonString(std::string& out, const std::string& s);
// json.dumps as transformers' tojson calls it (see jinja_value.cpp).
void toJson(std::string& out, const Value& v, int indent, int depth);
// What {{ v }} prints (Python's str()).
std::string toStr(const Value& v);
// Python's repr().
std::string repr(const Value& v);
bool equals(const Value& a, const Value& b);
// <0, 0, >0; fails (naming `line`) for values Python cannot order.
int compare(const Value& a, const Value& b, int line);
// A UTF-8 string's code points, one string each.
std::vector<std::string> codePoints(const std::string& s);
Value fromJson(const nlohmann::ordered_json& j);

}  // namespace pd::tok::jinja
