// The Jinja value model's conversions and comparisons (jinja_value.h).
#include "common/tokenizer/jinja/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/tokenizer/unicode.h"

namespace pd::tok::jinja {

Value Value::object() {
  Value v;
  v.kind = Kind::kObject;
  v.obj = std::make_shared<Object>();
  return v;
}

Value makeFunction(std::string name, std::function<Value(std::vector<Value>&, Kwargs&, int)> f) {
  Value v;
  v.kind = Value::Kind::kFunction;
  v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(f)});
  return v;
}

const char* kindName(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "none";
    case Value::Kind::kBool:
      return "boolean";
    case Value::Kind::kInt:
      return "integer";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "string";
    case Value::Kind::kArray:
      return "list";
    case Value::Kind::kObject:
      return v.isNamespace ? "namespace" : "dict";
    case Value::Kind::kFunction:
      return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kFloat:
      return v.f != 0;
    case Value::Kind::kString:
      return !v.s.empty();
    case Value::Kind::kArray:
      return !v.arr->empty();
    case Value::Kind::kObject:
      return v.isNamespace || !v.obj->items.empty();
    case Value::Kind::kFunction:
      return true;
  }
  return false;
}

std::string formatFloat(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == std::floor(d) && std::fabs(d) < 1e16) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.1f", d);
    return buf;
  }
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {  // shortest representation that round-trips
    std::snprintf(buf, sizeof(buf), "%.*g", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  return buf;
}

void jsonString(std::string& out, const std::string& s) {
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

// json.dumps as transformers' tojson calls it: separators (", ", ": "), or ("," , ": ") with
// an indent; non-ASCII kept.
void toJson(std::string& out, const Value& v, int indent, int depth) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Value::Kind::kFloat:
      out += formatFloat(v.f);
      return;
    case Value::Kind::kString:
      jsonString(out, v.s);
      return;
    case Value::Kind::kFunction:
      out += "null";
      return;
    case Value::Kind::kArray:
    case Value::Kind::kObject: {
      bool isArr = v.kind == Value::Kind::kArray;
      size_t n = isArr ? v.arr->size() : v.obj->items.size();
      out.push_back(isArr ? '[' : '{');
      if (n == 0) {
        out.push_back(isArr ? ']' : '}');
        return;
      }
      std::string pad = indent > 0 ? "\n" + std::string(static_cast<size_t>(indent * (depth + 1)), ' ') : "";
      for (size_t k = 0; k < n; ++k) {
        if (k > 0) out += indent > 0 ? "," : ", ";
        out += pad;
        if (isArr) {
          toJson(out, (*v.arr)[k], indent, depth + 1);
        } else {
          jsonString(out, v.obj->items[k].first);
          out += ": ";
          toJson(out, v.obj->items[k].second, indent, depth + 1);
        }
      }
      if (indent > 0) out += "\n" + std::string(static_cast<size_t>(indent * depth), ' ');
      out.push_back(isArr ? ']' : '}');
      return;
    }
  }
}

// What {{ v }} prints (Python's str()).
std::string toStr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.b ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.i);
    case Value::Kind::kFloat:
      return formatFloat(v.f);
    case Value::Kind::kString:
      return v.s;
    case Value::Kind::kArray:
    case Value::Kind::kObject:
      return repr(v);
    case Value::Kind::kFunction:
      return "<function " + v.fn->name + ">";
  }
  return "";
}

std::string repr(const Value& v) {
  if (v.kind == Value::Kind::kString) {
    std::string out = "'";
    for (char c : v.s) {
      if (c == '\'' || c == '\\') out.push_back('\\');
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      out.push_back(c);
    }
    return out + "'";
  }
  if (v.kind == Value::Kind::kArray) {
    std::string out = v.isTuple ? "(" : "[";
    for (size_t k = 0; k < v.arr->size(); ++k) out += (k ? ", " : "") + repr((*v.arr)[k]);
    return out + (v.isTuple ? ")" : "]");
  }
  if (v.kind == Value::Kind::kObject) {
    std::string out = "{";
    for (size_t k = 0; k < v.obj->items.size(); ++k)
      out += (k ? ", " : "") + repr(Value::str(v.obj->items[k].first)) + ": " + repr(v.obj->items[k].second);
    return out + "}";
  }
  return toStr(v);
}

bool equals(const Value& a, const Value& b) {
  if (a.isNumber() && b.isNumber()) return a.num() == b.num();
  if ((a.kind == Value::Kind::kBool && b.isNumber()) || (b.kind == Value::Kind::kBool && a.isNumber()))
    return (a.kind == Value::Kind::kBool ? a.b : a.num()) == (b.kind == Value::Kind::kBool ? b.b : b.num());
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kBool:
      return a.b == b.b;
    case Value::Kind::kString:
      return a.s == b.s;
    case Value::Kind::kArray:
      if (a.arr->size() != b.arr->size()) return false;
      for (size_t k = 0; k < a.arr->size(); ++k)
        if (!equals((*a.arr)[k], (*b.arr)[k])) return false;
      return true;
    case Value::Kind::kObject:
      if (a.obj->items.size() != b.obj->items.size()) return false;
      for (auto& [k, v] : a.obj->items) {
        Value* o = b.obj->find(k);
        if (!o || !equals(v, *o)) return false;
      }
      return true;
    case Value::Kind::kFunction:
      return a.fn == b.fn;
    default:
      return false;
  }
}

int compare(const Value& a, const Value& b, int line) {
  if (a.isNumber() && b.isNumber()) return a.num() < b.num() ? -1 : (a.num() > b.num() ? 1 : 0);
  if (a.isString() && b.isString()) return a.s < b.s ? -1 : (a.s > b.s ? 1 : 0);
  fail(line, std::string("cannot compare ") + kindName(a) + " with " + kindName(b));
}

std::vector<std::string> codePoints(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t start = pos;
    nextCodePoint(s, pos);
    out.push_back(s.substr(start, pos - start));
  }
  return out;
}

Value fromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Value v = Value::array();
      for (const auto& e : j) v.arr->push_back(fromJson(e));
      return v;
    }
    case nlohmann::ordered_json::value_t::object: {
      Value v = Value::object();
      for (auto it = j.begin(); it != j.end(); ++it) v.obj->set(it.key(), fromJson(it.value()));
      return v;
    }
    default:
      return Value();
  }
}

}  // namespace pd::tok::jinja
