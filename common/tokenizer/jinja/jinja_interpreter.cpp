// The Jinja interpreter (jinja_interpreter.h): statements, expressions, filters, tests,
// methods and globals.
#include "common/tokenizer/jinja/jinja_interpreter.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <functional>
#include <unordered_set>
#include <vector>

#include "common/tokenizer/jinja/jinja_lexer.h"
#include "common/tokenizer/unicode.h"

namespace pd::tok::jinja {
namespace {

std::string pyStrip(const std::string& s, const Value* chars, bool left, bool right) {
  if (chars == nullptr || chars->kind == Value::Kind::kNone || chars->isUndefined()) {
    std::string_view v = s;
    if (left) v = trimStartJs(v);
    if (right) v = trimEndJs(v);
    return std::string(v);
  }
  auto set = codePoints(chars->s);
  auto cps = codePoints(s);
  size_t b = 0, e = cps.size();
  auto in = [&](const std::string& c) { return std::find(set.begin(), set.end(), c) != set.end(); };
  if (left)
    while (b < e && in(cps[b])) ++b;
  if (right)
    while (e > b && in(cps[e - 1])) --e;
  std::string out;
  for (size_t k = b; k < e; ++k) out += cps[k];
  return out;
}

// A macro call nests a whole interpreter's frames; a macro that calls itself without end
// must be a render error, not a stack overflow (found by tests/fuzz). Per thread: a template
// renders on one thread, and several threads may render at once.
constexpr int kMaxMacroDepth = 100;
thread_local int tMacroDepth = 0;

class MacroDepth {
 public:
  MacroDepth(int line, const std::string& name) {
    if (tMacroDepth >= kMaxMacroDepth) {
      fail(line, "macro '" + name + "': calls nested deeper than " + std::to_string(kMaxMacroDepth) +
                     " levels (unbounded recursion?)");
    }
    ++tMacroDepth;
  }
  ~MacroDepth() { --tMacroDepth; }
  MacroDepth(const MacroDepth&) = delete;
  MacroDepth& operator=(const MacroDepth&) = delete;
};

// Template integers are 64-bit, as the references' are in practice; an operation past that range
// is a render error, not undefined behaviour (found by tests/fuzz).
int64_t checkedInt(int line, const std::string& op, int64_t a, int64_t b) {
  int64_t r = 0;
  bool overflow = false;
  if (op == "+")
    overflow = __builtin_add_overflow(a, b, &r);
  else if (op == "-")
    overflow = __builtin_sub_overflow(a, b, &r);
  else if (op == "*")
    overflow = __builtin_mul_overflow(a, b, &r);
  if (overflow) {
    fail(line, "integer overflow: " + std::to_string(a) + " " + op + " " + std::to_string(b) + " is outside 64 bits");
  }
  return r;
}

// a ** b for b >= 0 by squaring: a loop of b multiplications would run for ever on 1 ** 10**18.
int64_t checkedPow(int line, int64_t a, int64_t b) {
  int64_t r = 1;
  for (;;) {
    if (b & 1) r = checkedInt(line, "*", r, a);
    b >>= 1;
    if (b == 0) return r;
    a = checkedInt(line, "*", a, a);
  }
}

// Whether `v` is, or holds anywhere inside it, the array or dict at `container`. A container
// put inside itself (ns.x = ns, xs.append(xs)) would be a cycle: repr and equality would never
// end and its shared pointers would never be freed (found by tests/fuzz). `seen` keeps the
// walk linear where values share parts.
bool holds(const Value& v, const void* container, std::unordered_set<const void*>& seen) {
  const void* self = v.kind == Value::Kind::kArray    ? static_cast<const void*>(v.arr.get())
                     : v.kind == Value::Kind::kObject ? static_cast<const void*>(v.obj.get())
                                                      : nullptr;
  if (self == nullptr || !seen.insert(self).second) return false;
  if (self == container) return true;
  if (v.kind == Value::Kind::kArray) {
    for (const Value& item : *v.arr)
      if (holds(item, container, seen)) return true;
  } else {
    for (const auto& [key, item] : v.obj->items)
      if (holds(item, container, seen)) return true;
  }
  return false;
}

void refuseCycle(int line, const Value& v, const void* container, const std::string& what) {
  std::unordered_set<const void*> seen;
  if (holds(v, container, seen)) fail(line, what + " would contain itself");
}

// What a template may build in one value: generous for any chat template, small enough that
// "x" * 10**15 or range(10**15) is an error naming the limit, not an allocation that never ends.
constexpr int64_t kMaxSequenceItems = int64_t{1} << 20;
constexpr int64_t kMaxStringBytes = int64_t{1} << 24;

class Interpreter {
 public:
  explicit Interpreter(std::string& out) : out_(out) {}

  void exec(const NodeP& n, const ScopeP& scope) {
    switch (n->kind) {
      case NK::kBlock:
        for (const auto& k : n->kids) exec(k, scope);
        return;
      case NK::kText:
        out_ += n->name;
        return;
      case NK::kOutput:
        out_ += toStr(eval(n->kids[0], scope));
        return;
      case NK::kIf:
        for (size_t k = 0; k + 1 < n->kids.size(); k += 2) {
          if (truthy(eval(n->kids[k], scope))) {
            exec(n->kids[k + 1], scope);
            return;
          }
        }
        return;
      case NK::kFor:
        execFor(n, scope);
        return;
      case NK::kSet:
        execSet(n, scope);
        return;
      case NK::kMacro:
        defineMacro(n, scope);
        return;
      case NK::kBreak:
        throw BreakSignal{};
      case NK::kContinue:
        throw ContinueSignal{};
      default:
        out_ += toStr(eval(n, scope));
        return;
    }
  }

 private:
  static std::vector<Value> iterate(const Value& v, int line) {
    switch (v.kind) {
      case Value::Kind::kArray:
        return *v.arr;
      case Value::Kind::kObject: {
        std::vector<Value> keys;
        for (auto& [k, _] : v.obj->items) keys.push_back(Value::str(k));
        return keys;
      }
      case Value::Kind::kString: {
        std::vector<Value> chars;
        for (auto& c : codePoints(v.s)) chars.push_back(Value::str(c));
        return chars;
      }
      case Value::Kind::kUndefined:
        return {};
      default:
        fail(line, std::string("cannot iterate over ") + kindName(v));
    }
  }

  void bindTargets(const std::vector<std::string>& names, const Value& item, Scope& s, int line) {
    if (names.size() == 1) {
      s.vars[names[0]] = item;
      return;
    }
    auto parts = iterate(item, line);
    if (parts.size() != names.size())
      fail(line,
           "cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(names.size()) + " names");
    for (size_t k = 0; k < names.size(); ++k) s.vars[names[k]] = parts[k];
  }

  void execFor(const NodeP& n, const ScopeP& scope) {
    Value iterable = eval(n->kids[0], scope);
    std::vector<Value> items = iterate(iterable, n->line);
    if (n->kids[1]) {  // {% for x in xs if cond %}: filter before loop variables are set
      std::vector<Value> kept;
      for (auto& it : items) {
        auto s = std::make_shared<Scope>();
        s->parent = scope;
        bindTargets(n->names, it, *s, n->line);
        if (truthy(eval(n->kids[1], s))) kept.push_back(it);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(n->kids[3], scope);
      return;
    }
    int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      auto s = std::make_shared<Scope>();
      s->parent = scope;
      bindTargets(n->names, items[static_cast<size_t>(k)], *s, n->line);
      Value loop = Value::object();
      loop.obj->set("index", Value::integer(k + 1));
      loop.obj->set("index0", Value::integer(k));
      loop.obj->set("revindex", Value::integer(len - k));
      loop.obj->set("revindex0", Value::integer(len - k - 1));
      loop.obj->set("first", Value::boolean(k == 0));
      loop.obj->set("last", Value::boolean(k == len - 1));
      loop.obj->set("length", Value::integer(len));
      loop.obj->set("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value());
      loop.obj->set("nextitem", k + 1 < len ? items[static_cast<size_t>(k + 1)] : Value());
      s->vars["loop"] = loop;
      try {
        exec(n->kids[2], s);
      } catch (const BreakSignal&) {
        break;
      } catch (const ContinueSignal&) {
        continue;
      }
    }
  }

  void execSet(const NodeP& n, const ScopeP& scope) {
    Value v;
    if (n->kids[0]) {
      v = eval(n->kids[0], scope);
    } else {
      std::string captured;
      Interpreter inner(captured);
      inner.exec(n->kids[1], scope);
      v = Value::str(captured);
    }
    if (n->names.size() == 2 && !n->negated) {  // ns.attr = value
      Value* target = scope->lookup(n->names[0]);
      if (!target || target->kind != Value::Kind::kObject || !target->isNamespace)
        fail(n->line, "cannot set attribute '" + n->names[1] + "' of '" + n->names[0] + "': it is not a namespace()");
      refuseCycle(n->line, v, target->obj.get(), "namespace '" + n->names[0] + "'");
      target->obj->set(n->names[1], v);
      return;
    }
    bindTargets(n->names, v, *scope, n->line);
  }

  void defineMacro(const NodeP& n, const ScopeP& scope) {
    NodeP def = n;
    // Weak: the scope owns the macro, so a strong reference back would leak both.
    std::weak_ptr<Scope> defScope = scope;
    scope->vars[n->name] = makeFunction(n->name, [def, defScope](std::vector<Value>& args, Kwargs& kwargs, int line) {
      MacroDepth depth(line, def->name);
      auto s = std::make_shared<Scope>();
      s->parent = defScope.lock();
      if (args.size() > def->kwargs.size())
        fail(line, "macro '" + def->name + "' takes " + std::to_string(def->kwargs.size()) + " arguments");
      for (size_t k = 0; k < def->kwargs.size(); ++k) {
        const auto& [pname, dflt] = def->kwargs[k];
        Value v;
        bool set = false;
        if (k < args.size()) {
          v = args[k];
          set = true;
        }
        for (auto& [kn, kv] : kwargs)
          if (kn == pname) v = kv, set = true;
        if (!set && dflt) {
          std::string unused;
          Interpreter tmp(unused);
          v = tmp.eval(dflt, s);
        }
        s->vars[pname] = v;
      }
      std::string out;
      Interpreter inner(out);
      inner.exec(def->kids[0], s);
      return Value::str(out);
    });
  }

 public:
  Value eval(const NodeP& n, const ScopeP& scope) {
    switch (n->kind) {
      case NK::kLiteral:
        return n->value;
      case NK::kName: {
        Value* v = scope->lookup(n->name);
        return v ? *v : Value();
      }
      case NK::kList:
      case NK::kTuple: {
        Value v = Value::array();
        v.isTuple = n->kind == NK::kTuple;
        for (auto& k : n->kids) v.arr->push_back(eval(k, scope));
        return v;
      }
      case NK::kDict: {
        Value v = Value::object();
        for (size_t k = 0; k + 1 < n->kids.size(); k += 2) {
          Value key = eval(n->kids[k], scope);
          if (!key.isString()) fail(n->line, "dict keys must be strings");
          v.obj->set(key.s, eval(n->kids[k + 1], scope));
        }
        return v;
      }
      case NK::kAttr:
        return getAttr(eval(n->kids[0], scope), n->name, n->line);
      case NK::kIndex:
        return getItem(eval(n->kids[0], scope), eval(n->kids[1], scope), n->line);
      case NK::kSlice:
        return slice(n, scope);
      case NK::kCall:
        return call(n, scope);
      case NK::kFilter:
        return filter(n, scope);
      case NK::kTest: {
        bool r = test(n, scope);
        return Value::boolean(n->negated ? !r : r);
      }
      case NK::kNot:
        return Value::boolean(!truthy(eval(n->kids[0], scope)));
      case NK::kNeg: {
        Value v = eval(n->kids[0], scope);
        if (v.kind == Value::Kind::kInt) return Value::integer(checkedInt(n->line, "-", 0, v.i));
        if (v.kind == Value::Kind::kFloat) return Value::real(-v.f);
        fail(n->line, std::string("cannot negate ") + kindName(v));
      }
      case NK::kAnd: {
        Value l = eval(n->kids[0], scope);
        return truthy(l) ? eval(n->kids[1], scope) : l;
      }
      case NK::kOr: {
        Value l = eval(n->kids[0], scope);
        return truthy(l) ? l : eval(n->kids[1], scope);
      }
      case NK::kTernary:
        return truthy(eval(n->kids[0], scope)) ? eval(n->kids[1], scope) : eval(n->kids[2], scope);
      case NK::kBinary:
        return binary(n, scope);
      default:
        fail(n->line, "statement used as an expression");
    }
  }

 private:
  Value getAttr(const Value& obj, const std::string& name, int line) {
    if (obj.kind == Value::Kind::kObject) {
      if (Value* v = obj.obj->find(name)) return *v;
      if (!obj.isNamespace) {
        Value m = method(obj, name, line);
        if (!m.isUndefined()) return m;
      }
      return Value();
    }
    if (obj.kind == Value::Kind::kString || obj.kind == Value::Kind::kArray) return method(obj, name, line);
    return Value();  // attribute of undefined/none/number: undefined, as the references do
  }

  static int64_t normIndex(int64_t idx, int64_t len) { return idx < 0 ? idx + len : idx; }

  Value getItem(const Value& obj, const Value& key, int line) {
    if (obj.kind == Value::Kind::kArray) {
      if (key.kind != Value::Kind::kInt) fail(line, "list indices must be integers");
      int64_t len = static_cast<int64_t>(obj.arr->size());
      int64_t i = normIndex(key.i, len);
      if (i < 0 || i >= len) return Value();
      return (*obj.arr)[static_cast<size_t>(i)];
    }
    if (obj.kind == Value::Kind::kString) {
      if (key.kind != Value::Kind::kInt) fail(line, "string indices must be integers");
      auto cps = codePoints(obj.s);
      int64_t len = static_cast<int64_t>(cps.size());
      int64_t i = normIndex(key.i, len);
      if (i < 0 || i >= len) return Value();
      return Value::str(cps[static_cast<size_t>(i)]);
    }
    if (obj.kind == Value::Kind::kObject) {
      if (!key.isString()) return Value();
      if (Value* v = obj.obj->find(key.s)) return *v;
      return Value();
    }
    return Value();
  }

  Value slice(const NodeP& n, const ScopeP& scope) {
    Value obj = eval(n->kids[0], scope);
    auto opt = [&](const NodeP& e, bool* has) -> int64_t {
      *has = false;
      if (!e) return 0;
      Value v = eval(e, scope);
      if (v.kind == Value::Kind::kNone) return 0;
      if (v.kind != Value::Kind::kInt) fail(n->line, "slice indices must be integers");
      *has = true;
      return v.i;
    };
    bool hasA, hasB, hasC;
    int64_t a = opt(n->kids[1], &hasA), b = opt(n->kids[2], &hasB), c = opt(n->kids[3], &hasC);
    if (!hasC) c = 1;
    if (c == 0) fail(n->line, "slice step cannot be zero");
    std::vector<Value> items;
    bool isStr = obj.kind == Value::Kind::kString;
    if (isStr) {
      for (auto& cp : codePoints(obj.s)) items.push_back(Value::str(cp));
    } else if (obj.kind == Value::Kind::kArray) {
      items = *obj.arr;
    } else {
      fail(n->line, std::string("cannot slice ") + kindName(obj));
    }
    int64_t len = static_cast<int64_t>(items.size());
    auto clamp = [&](int64_t v, bool has, int64_t dflt, int64_t lo, int64_t hi) {
      if (!has) return dflt;
      if (v < 0) v += len;
      return std::clamp(v, lo, hi);
    };
    std::vector<Value> out;
    if (c > 0) {
      int64_t s = clamp(a, hasA, 0, 0, len), e = clamp(b, hasB, len, 0, len);
      // A step past the end stops at the end: k + c could overflow for a huge step.
      for (int64_t k = s; k < e; k += std::min(c, e - k)) out.push_back(items[static_cast<size_t>(k)]);
    } else {
      int64_t s = clamp(a, hasA, len - 1, -1, len - 1), e = clamp(b, hasB, -1, -1, len - 1);
      for (int64_t k = s; k > e; k += std::max(c, e - k)) out.push_back(items[static_cast<size_t>(k)]);
    }
    if (isStr) {
      std::string r;
      for (auto& v : out) r += v.s;
      return Value::str(r);
    }
    return Value::array(out);
  }

  Value callArgs(const Value& fn, const NodeP& n, const ScopeP& scope, size_t firstArg) {
    std::vector<Value> args;
    for (size_t k = firstArg; k < n->kids.size(); ++k) args.push_back(eval(n->kids[k], scope));
    Kwargs kwargs;
    for (auto& [k, e] : n->kwargs) kwargs.emplace_back(k, eval(e, scope));
    return fn.fn->call(args, kwargs, n->line);
  }

  Value call(const NodeP& n, const ScopeP& scope) {
    Value fn = eval(n->kids[0], scope);
    if (fn.kind != Value::Kind::kFunction) {
      std::string what = n->kids[0]->kind == NK::kName   ? "'" + n->kids[0]->name + "'"
                         : n->kids[0]->kind == NK::kAttr ? "method '" + n->kids[0]->name + "'"
                                                         : "expression";
      fail(n->line, "unsupported or undefined function " + what + " (" + kindName(fn) + ")");
    }
    return callArgs(fn, n, scope, 1);
  }

  static const Value* arg(std::vector<Value>& args, Kwargs& kwargs, size_t pos, const char* name) {
    if (pos < args.size()) return &args[pos];
    for (auto& [k, v] : kwargs)
      if (k == name) return &v;
    return nullptr;
  }

  // Methods of strings, dicts and lists (Python's), bound to `self`.
  Value method(const Value& self, const std::string& name, int line) {
    Value me = self;
    auto fn = [&](std::function<Value(std::vector<Value>&, Kwargs&, int)> f) {
      return makeFunction(name, std::move(f));
    };
    if (self.kind == Value::Kind::kString) {
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        bool l = name != "rstrip", r = name != "lstrip";
        return fn([me, l, r](std::vector<Value>& a, Kwargs& k, int) {
          return Value::str(pyStrip(me.s, arg(a, k, 0, "chars"), l, r));
        });
      }
      if (name == "upper" || name == "lower") {
        bool up = name == "upper";
        return fn([me, up](std::vector<Value>&, Kwargs&, int) {
          std::string s = me.s;
          for (auto& c : s)
            c = static_cast<char>(up ? std::toupper(static_cast<unsigned char>(c))
                                     : std::tolower(static_cast<unsigned char>(c)));
          return Value::str(s);
        });
      }
      if (name == "title" || name == "capitalize") {
        bool title = name == "title";
        return fn([me, title](std::vector<Value>&, Kwargs&, int) {
          std::string s = me.s;
          bool start = true;
          for (size_t k = 0; k < s.size(); ++k) {
            unsigned char c = static_cast<unsigned char>(s[k]);
            if (title) {
              s[k] = static_cast<char>(start ? std::toupper(c) : std::tolower(c));
              start = !std::isalnum(c);
            } else {
              s[k] = static_cast<char>(k == 0 ? std::toupper(c) : std::tolower(c));
            }
          }
          return Value::str(s);
        });
      }
      if (name == "startswith" || name == "endswith") {
        bool starts = name == "startswith";
        return fn([me, starts, name](std::vector<Value>& a, Kwargs&, int ln) {
          if (a.empty()) fail(ln, name + "() needs an argument");
          std::vector<std::string> pats;
          if (a[0].isString())
            pats.push_back(a[0].s);
          else if (a[0].kind == Value::Kind::kArray)
            for (auto& p : *a[0].arr) pats.push_back(toStr(p));
          else
            fail(ln, name + "() argument must be a string or a tuple of strings");
          for (auto& p : pats) {
            if (p.size() <= me.s.size() && me.s.compare(starts ? 0 : me.s.size() - p.size(), p.size(), p) == 0)
              return Value::boolean(true);
          }
          return Value::boolean(false);
        });
      }
      if (name == "split" || name == "rsplit") {
        return fn([me](std::vector<Value>& a, Kwargs& k, int ln) {
          const Value* sep = arg(a, k, 0, "sep");
          const Value* maxv = arg(a, k, 1, "maxsplit");
          int64_t maxsplit = maxv && maxv->kind == Value::Kind::kInt ? maxv->i : -1;
          Value out = Value::array();
          if (!sep || sep->kind == Value::Kind::kNone) {
            std::string_view rest = trimStartJs(me.s);
            while (!rest.empty()) {
              if (maxsplit >= 0 && static_cast<int64_t>(out.arr->size()) >= maxsplit) {
                out.arr->push_back(Value::str(std::string(rest)));
                break;
              }
              size_t p = 0;
              while (p < rest.size()) {
                size_t q = p;
                if (isJsWhitespace(nextCodePoint(rest, q))) break;
                p = q;
              }
              out.arr->push_back(Value::str(std::string(rest.substr(0, p))));
              rest = trimStartJs(rest.substr(p));
            }
            return out;
          }
          if (!sep->isString() || sep->s.empty()) fail(ln, "split() separator must be a non-empty string");
          size_t prev = 0, pos;
          while ((pos = me.s.find(sep->s, prev)) != std::string::npos &&
                 (maxsplit < 0 || static_cast<int64_t>(out.arr->size()) < maxsplit)) {
            out.arr->push_back(Value::str(me.s.substr(prev, pos - prev)));
            prev = pos + sep->s.size();
          }
          out.arr->push_back(Value::str(me.s.substr(prev)));
          return out;
        });
      }
      if (name == "replace") {
        return fn([me](std::vector<Value>& a, Kwargs& k, int ln) {
          if (a.size() < 2 || !a[0].isString() || !a[1].isString()) fail(ln, "replace() needs two string arguments");
          const Value* cnt = arg(a, k, 2, "count");
          int64_t count = cnt && cnt->kind == Value::Kind::kInt ? cnt->i : -1;
          return Value::str(replaceStr(me.s, a[0].s, a[1].s, count));
        });
      }
      if (name == "find") {
        return fn([me](std::vector<Value>& a, Kwargs&, int ln) {
          if (a.empty() || !a[0].isString()) fail(ln, "find() needs a string argument");
          size_t p = me.s.find(a[0].s);
          if (p == std::string::npos) return Value::integer(-1);
          return Value::integer(static_cast<int64_t>(codePoints(me.s.substr(0, p)).size()));
        });
      }
      if (name == "join") {
        return fn([me](std::vector<Value>& a, Kwargs&, int ln) {
          if (a.empty()) fail(ln, "join() needs an argument");
          std::string out;
          bool first = true;
          for (auto& v : iterate(a[0], ln)) {
            if (!first) out += me.s;
            out += toStr(v);
            first = false;
          }
          return Value::str(out);
        });
      }
      if (name == "format") fail(line, "unsupported string method 'format'");
    } else if (self.kind == Value::Kind::kObject) {
      if (name == "get") {
        return fn([me](std::vector<Value>& a, Kwargs&, int ln) {
          if (a.empty()) fail(ln, "get() needs a key");
          if (a[0].isString())
            if (Value* v = me.obj->find(a[0].s)) return *v;
          return a.size() > 1 ? a[1] : Value::none();
        });
      }
      if (name == "items" || name == "keys" || name == "values") {
        int which = name == "items" ? 0 : (name == "keys" ? 1 : 2);
        return fn([me, which](std::vector<Value>&, Kwargs&, int) {
          Value out = Value::array();
          for (auto& [k, v] : me.obj->items) {
            if (which == 0) {
              Value pair = Value::array({Value::str(k), v});
              pair.isTuple = true;
              out.arr->push_back(pair);
            } else {
              out.arr->push_back(which == 1 ? Value::str(k) : v);
            }
          }
          return out;
        });
      }
    } else if (self.kind == Value::Kind::kArray) {
      if (name == "append") {
        return fn([me](std::vector<Value>& a, Kwargs&, int ln) {
          if (a.size() != 1) fail(ln, "append() takes one argument");
          refuseCycle(ln, a[0], me.arr.get(), "the list");
          me.arr->push_back(a[0]);
          return Value::none();
        });
      }
    }
    return Value();
  }

  static std::string replaceStr(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    if (from.empty()) {
      // Python inserts `to` between every character (and at both ends).
      std::string out = to;
      int64_t done = 1;
      for (auto& c : codePoints(s)) {
        out += c;
        if (count < 0 || done < count) out += to, ++done;
      }
      return out;
    }
    std::string out;
    size_t prev = 0, pos;
    int64_t done = 0;
    while ((count < 0 || done < count) && (pos = s.find(from, prev)) != std::string::npos) {
      out.append(s, prev, pos - prev);
      out += to;
      prev = pos + from.size();
      ++done;
    }
    out.append(s, prev, std::string::npos);
    return out;
  }

  Value binary(const NodeP& n, const ScopeP& scope) {
    const std::string& op = n->name;
    Value a = eval(n->kids[0], scope);
    Value b = eval(n->kids[1], scope);
    int line = n->line;
    if (op == "==") return Value::boolean(equals(a, b));
    if (op == "!=") return Value::boolean(!equals(a, b));
    if (op == "<") return Value::boolean(compare(a, b, line) < 0);
    if (op == ">") return Value::boolean(compare(a, b, line) > 0);
    if (op == "<=") return Value::boolean(compare(a, b, line) <= 0);
    if (op == ">=") return Value::boolean(compare(a, b, line) >= 0);
    if (op == "in" || op == "not in") {
      bool r = contains(b, a, line);
      return Value::boolean(op == "in" ? r : !r);
    }
    if (op == "~") return Value::str(toStr(a) + toStr(b));
    if (op == "+") {
      if (a.isString() && b.isString()) return Value::str(a.s + b.s);
      if (a.kind == Value::Kind::kArray && b.kind == Value::Kind::kArray) {
        Array r = *a.arr;
        r.insert(r.end(), b.arr->begin(), b.arr->end());
        return Value::array(r);
      }
    }
    if (op == "*" && a.isString() && b.kind == Value::Kind::kInt) {
      if (b.i > 0 && static_cast<int64_t>(a.s.size()) > kMaxStringBytes / b.i) {
        fail(line, "string repeated " + std::to_string(b.i) + " times would be over " +
                       std::to_string(kMaxStringBytes) + " bytes");
      }
      std::string r;
      for (int64_t k = 0; k < b.i; ++k) r += a.s;
      return Value::str(r);
    }
    if (!a.isNumber() || !b.isNumber()) {
      fail(line, "unsupported operand types for " + op + ": " + kindName(a) + " and " + kindName(b));
    }
    bool ints = a.kind == Value::Kind::kInt && b.kind == Value::Kind::kInt;
    if (op == "+") return ints ? Value::integer(checkedInt(line, op, a.i, b.i)) : Value::real(a.num() + b.num());
    if (op == "-") return ints ? Value::integer(checkedInt(line, op, a.i, b.i)) : Value::real(a.num() - b.num());
    if (op == "*") return ints ? Value::integer(checkedInt(line, op, a.i, b.i)) : Value::real(a.num() * b.num());
    if (op == "/") {
      if (b.num() == 0) fail(line, "division by zero");
      return Value::real(a.num() / b.num());
    }
    if (op == "//" || op == "%") {
      if (b.num() == 0) fail(line, "division by zero");
      if (ints) {
        if (a.i == INT64_MIN && b.i == -1) fail(line, "integer overflow: " + std::to_string(a.i) + " " + op + " -1");
        int64_t q = a.i / b.i, r = a.i % b.i;
        if (r != 0 && ((r < 0) != (b.i < 0))) --q, r += b.i;
        return Value::integer(op == "//" ? q : r);
      }
      double q = std::floor(a.num() / b.num());
      return Value::real(op == "//" ? q : a.num() - q * b.num());
    }
    if (op == "**") {
      if (ints && b.i >= 0) return Value::integer(checkedPow(line, a.i, b.i));
      return Value::real(std::pow(a.num(), b.num()));
    }
    fail(line, "unsupported operator '" + op + "'");
  }

  static bool contains(const Value& container, const Value& item, int line) {
    switch (container.kind) {
      case Value::Kind::kString:
        if (!item.isString()) fail(line, "'in <string>' needs a string on the left");
        return container.s.find(item.s) != std::string::npos;
      case Value::Kind::kArray:
        for (auto& v : *container.arr)
          if (equals(v, item)) return true;
        return false;
      case Value::Kind::kObject:
        return item.isString() && container.obj->find(item.s) != nullptr;
      case Value::Kind::kUndefined:
        return false;
      default:
        fail(line, std::string("'in' is not supported for ") + kindName(container));
    }
  }

  bool applyTest(const std::string& name, const Value& v, std::vector<Value>& args, int line) {
    if (name == "defined") return !v.isUndefined();
    if (name == "undefined") return v.isUndefined();
    if (name == "none") return v.kind == Value::Kind::kNone;
    if (name == "true") return v.kind == Value::Kind::kBool && v.b;
    if (name == "false") return v.kind == Value::Kind::kBool && !v.b;
    if (name == "boolean") return v.kind == Value::Kind::kBool;
    if (name == "string") return v.isString();
    if (name == "number") return v.isNumber();
    if (name == "integer") return v.kind == Value::Kind::kInt;
    if (name == "float") return v.kind == Value::Kind::kFloat;
    if (name == "mapping") return v.kind == Value::Kind::kObject;
    if (name == "sequence" || name == "iterable")
      return v.kind == Value::Kind::kArray || v.isString() || v.kind == Value::Kind::kObject;
    if (name == "callable") return v.kind == Value::Kind::kFunction;
    if (name == "lower" || name == "upper") {
      if (!v.isString()) return false;
      for (unsigned char c : v.s)
        if (name == "lower" ? std::isupper(c) : std::islower(c)) return false;
      return true;
    }
    if (name == "odd" || name == "even") {
      if (v.kind != Value::Kind::kInt) fail(line, "test '" + name + "' needs an integer");
      return (v.i % 2 != 0) == (name == "odd");
    }
    if (args.empty() &&
        (name == "divisibleby" || name == "eq" || name == "equalto" || name == "==" || name == "ne" || name == "lt" ||
         name == "gt" || name == "le" || name == "ge" || name == "in" || name == "sameas"))
      fail(line, "test '" + name + "' needs an argument");
    if (name == "divisibleby")
      return v.kind == Value::Kind::kInt && args[0].kind == Value::Kind::kInt && args[0].i != 0 && v.i % args[0].i == 0;
    if (name == "eq" || name == "equalto" || name == "sameas") return equals(v, args[0]);
    if (name == "ne") return !equals(v, args[0]);
    if (name == "lt") return compare(v, args[0], line) < 0;
    if (name == "gt") return compare(v, args[0], line) > 0;
    if (name == "le") return compare(v, args[0], line) <= 0;
    if (name == "ge") return compare(v, args[0], line) >= 0;
    if (name == "in") return contains(args[0], v, line);
    fail(line, "unsupported test '" + name + "'");
  }

  bool test(const NodeP& n, const ScopeP& scope) {
    Value v = eval(n->kids[0], scope);
    std::vector<Value> args;
    for (size_t k = 1; k < n->kids.size(); ++k) args.push_back(eval(n->kids[k], scope));
    return applyTest(n->name, v, args, n->line);
  }

  Value attributeOf(const Value& item, const std::string& path, int line) {
    Value cur = item;
    size_t prev = 0;
    for (;;) {
      size_t dot = path.find('.', prev);
      std::string part = path.substr(prev, dot == std::string::npos ? std::string::npos : dot - prev);
      bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      cur = numeric ? getItem(cur, Value::integer(std::stoll(part)), line) : getAttr(cur, part, line);
      if (dot == std::string::npos) return cur;
      prev = dot + 1;
    }
  }

  Value filter(const NodeP& n, const ScopeP& scope) {
    Value v = eval(n->kids[0], scope);
    std::vector<Value> args;
    for (size_t k = 1; k < n->kids.size(); ++k) args.push_back(eval(n->kids[k], scope));
    Kwargs kwargs;
    for (auto& [k, e] : n->kwargs) kwargs.emplace_back(k, eval(e, scope));
    return applyFilter(n->name, v, args, kwargs, n->line);
  }

  Value applyFilter(const std::string& name, const Value& v, std::vector<Value>& args, Kwargs& kwargs, int line) {
    if (name == "trim") return Value::str(pyStrip(toStr(v), arg(args, kwargs, 0, "chars"), true, true));
    if (name == "length" || name == "count") {
      if (v.isString()) return Value::integer(static_cast<int64_t>(codePoints(v.s).size()));
      if (v.kind == Value::Kind::kArray) return Value::integer(static_cast<int64_t>(v.arr->size()));
      if (v.kind == Value::Kind::kObject) return Value::integer(static_cast<int64_t>(v.obj->items.size()));
      if (v.isUndefined()) return Value::integer(0);
      fail(line, std::string("length of ") + kindName(v) + " is undefined");
    }
    if (name == "tojson") {
      const Value* ind = arg(args, kwargs, 0, "indent");
      int indent = ind && ind->kind == Value::Kind::kInt ? static_cast<int>(ind->i) : 0;
      std::string out;
      toJson(out, v, indent, 0);
      return Value::str(out);
    }
    if (name == "string") return Value::str(toStr(v));
    if (name == "safe" || name == "e" || name == "escape") {
      if (name != "safe") fail(line, "unsupported filter '" + name + "' (chat templates do not escape)");
      return v;
    }
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      Value m = method(Value::str(toStr(v)), name, line);
      std::vector<Value> none;
      Kwargs nk;
      return m.fn->call(none, nk, line);
    }
    if (name == "replace") {
      if (args.size() < 2) fail(line, "filter 'replace' needs two arguments");
      int64_t count = args.size() > 2 && args[2].kind == Value::Kind::kInt ? args[2].i : -1;
      return Value::str(replaceStr(toStr(v), toStr(args[0]), toStr(args[1]), count));
    }
    if (name == "default" || name == "d") {
      const Value* dflt = arg(args, kwargs, 0, "default_value");
      const Value* boolean = arg(args, kwargs, 1, "boolean");
      bool useBool = boolean && truthy(*boolean);
      if (v.isUndefined() || (useBool && !truthy(v))) return dflt ? *dflt : Value::str("");
      return v;
    }
    if (name == "first" || name == "last") {
      auto items = iterate(v, line);
      if (items.empty()) return Value();
      return name == "first" ? items.front() : items.back();
    }
    if (name == "join") {
      const Value* sep = arg(args, kwargs, 0, "d");
      const Value* attr = arg(args, kwargs, 1, "attribute");
      std::string out;
      bool first = true;
      for (auto& item : iterate(v, line)) {
        if (!first && sep) out += toStr(*sep);
        out += toStr(attr ? attributeOf(item, toStr(*attr), line) : item);
        first = false;
      }
      return Value::str(out);
    }
    if (name == "list") return Value::array(iterate(v, line));
    if (name == "reverse") {
      if (v.isString()) {
        auto cps = codePoints(v.s);
        std::string r;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) r += *it;
        return Value::str(r);
      }
      auto items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return Value::array(items);
    }
    if (name == "items") {
      if (v.kind != Value::Kind::kObject) fail(line, "filter 'items' needs a dict");
      Value m = method(v, "items", line);
      std::vector<Value> none;
      Kwargs nk;
      return m.fn->call(none, nk, line);
    }
    if (name == "int") {
      if (v.kind == Value::Kind::kInt) return v;
      if (v.kind == Value::Kind::kFloat) {
        // The cast of a float outside int64's range is undefined; 2**63 is exact as a double.
        if (!(v.f > -9223372036854775808.0 && v.f < 9223372036854775808.0)) {
          fail(line, "filter 'int': " + std::to_string(v.f) + " is outside 64-bit integers");
        }
        return Value::integer(static_cast<int64_t>(v.f));
      }
      if (v.isString()) {
        try {
          return Value::integer(std::stoll(v.s));
        } catch (...) {
          return Value::integer(0);
        }
      }
      return Value::integer(v.kind == Value::Kind::kBool ? v.b : 0);
    }
    if (name == "float") {
      if (v.isNumber()) return Value::real(v.num());
      if (v.isString()) {
        try {
          return Value::real(std::stod(v.s));
        } catch (...) {
          return Value::real(0);
        }
      }
      return Value::real(0);
    }
    if (name == "abs") {
      if (v.kind == Value::Kind::kInt) return Value::integer(v.i < 0 ? checkedInt(line, "-", 0, v.i) : v.i);
      if (v.kind == Value::Kind::kFloat) return Value::real(std::fabs(v.f));
      fail(line, "filter 'abs' needs a number");
    }
    if (name == "unique") {
      Value out = Value::array();
      for (auto& item : iterate(v, line)) {
        bool seen = false;
        for (auto& o : *out.arr) seen = seen || equals(o, item);
        if (!seen) out.arr->push_back(item);
      }
      return out;
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      bool attrMode = name == "selectattr" || name == "rejectattr";
      bool keep = name == "selectattr" || name == "select";
      size_t k = 0;
      std::string attr;
      if (attrMode) {
        if (args.empty()) fail(line, "filter '" + name + "' needs an attribute name");
        attr = toStr(args[k++]);
      }
      std::string testName = k < args.size() ? toStr(args[k++]) : "";
      std::vector<Value> testArgs(args.begin() + static_cast<std::ptrdiff_t>(std::min(k, args.size())), args.end());
      Value out = Value::array();
      for (auto& item : iterate(v, line)) {
        Value x = attrMode ? attributeOf(item, attr, line) : item;
        bool r = testName.empty() ? truthy(x) : applyTest(testName, x, testArgs, line);
        if (r == keep) out.arr->push_back(item);
      }
      return out;
    }
    if (name == "map") {
      const Value* attr = nullptr;
      for (auto& [k, val] : kwargs)
        if (k == "attribute") attr = &val;
      Value out = Value::array();
      for (auto& item : iterate(v, line)) {
        if (attr) {
          Value x = attributeOf(item, toStr(*attr), line);
          if (x.isUndefined()) {
            for (auto& [k, val] : kwargs)
              if (k == "default") x = val;
          }
          out.arr->push_back(x);
        } else {
          if (args.empty()) fail(line, "filter 'map' needs a filter name or attribute=");
          std::vector<Value> rest(args.begin() + 1, args.end());
          Kwargs nk;
          out.arr->push_back(applyFilter(toStr(args[0]), item, rest, nk, line));
        }
      }
      return out;
    }
    if (name == "dictsort") {
      if (v.kind != Value::Kind::kObject) fail(line, "filter 'dictsort' needs a dict");
      auto items = v.obj->items;
      std::stable_sort(items.begin(), items.end(), [](auto& x, auto& y) { return x.first < y.first; });
      Value out = Value::array();
      for (auto& [k, val] : items) {
        Value pair = Value::array({Value::str(k), val});
        pair.isTuple = true;
        out.arr->push_back(pair);
      }
      return out;
    }
    if (name == "indent") {
      const Value* w = arg(args, kwargs, 0, "width");
      const Value* first = arg(args, kwargs, 1, "first");
      std::string pad = w && w->isString() ? w->s : std::string(w ? static_cast<size_t>(w->i) : 4, ' ');
      std::string s = toStr(v), out;
      if (first && truthy(*first)) out += pad;
      for (size_t k = 0; k < s.size(); ++k) {
        out.push_back(s[k]);
        if (s[k] == '\n' && k + 1 < s.size() && s[k + 1] != '\n') out += pad;
      }
      return Value::str(out);
    }
    fail(line, "unsupported filter '" + name + "'");
  }

  std::string& out_;
};

}  // namespace

ScopeP makeGlobals(const nlohmann::ordered_json& context) {
  auto g = std::make_shared<Scope>();
  g->vars["raise_exception"] = makeFunction("raise_exception", [](std::vector<Value>& a, Kwargs&, int line) -> Value {
    fail(line, "template raised an exception: " + (a.empty() ? std::string("(no message)") : toStr(a[0])));
  });
  g->vars["range"] = makeFunction("range", [](std::vector<Value>& a, Kwargs&, int line) {
    int64_t start = 0, stop = 0, step = 1;
    for (auto& x : a)
      if (x.kind != Value::Kind::kInt) fail(line, "range() arguments must be integers");
    if (a.size() == 1)
      stop = a[0].i;
    else if (a.size() >= 2)
      start = a[0].i, stop = a[1].i;
    if (a.size() == 3) step = a[2].i;
    if (a.empty() || a.size() > 3 || step == 0) fail(line, "range() takes 1 to 3 integer arguments, step not 0");
    // The count, in unsigned arithmetic: stop - start may not fit in int64.
    uint64_t span = step > 0 ? (stop > start ? uint64_t(stop) - uint64_t(start) : 0)
                             : (start > stop ? uint64_t(start) - uint64_t(stop) : 0);
    uint64_t stride = step > 0 ? uint64_t(step) : uint64_t(0) - uint64_t(step);
    uint64_t count = span == 0 ? 0 : (span - 1) / stride + 1;
    if (count > uint64_t(kMaxSequenceItems)) {
      fail(line,
           "range() of " + std::to_string(count) + " items is over the limit of " + std::to_string(kMaxSequenceItems));
    }
    Value out = Value::array();
    // Unsigned steps wrap where the last one would pass int64's end; C++20 defines the casts.
    uint64_t k = uint64_t(start);
    for (uint64_t done = 0; done < count; ++done, k += uint64_t(step)) out.arr->push_back(Value::integer(int64_t(k)));
    return out;
  });
  g->vars["namespace"] = makeFunction("namespace", [](std::vector<Value>& a, Kwargs& kw, int line) {
    Value ns = Value::object();
    ns.isNamespace = true;
    for (auto& x : a) {
      if (x.kind != Value::Kind::kObject) fail(line, "namespace() positional argument must be a dict");
      for (auto& [k, v] : x.obj->items) ns.obj->set(k, v);
    }
    for (auto& [k, v] : kw) ns.obj->set(k, v);
    return ns;
  });
  g->vars["dict"] = makeFunction("dict", [](std::vector<Value>&, Kwargs& kw, int) {
    Value d = Value::object();
    for (auto& [k, v] : kw) d.obj->set(k, v);
    return d;
  });
  g->vars["strftime_now"] = makeFunction("strftime_now", [](std::vector<Value>& a, Kwargs&, int line) {
    if (a.empty() || !a[0].isString()) fail(line, "strftime_now() needs a format string");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    size_t len = std::strftime(buf, sizeof(buf), a[0].s.c_str(), &tm);
    return Value::str(std::string(buf, len));
  });
  if (context.is_object()) {
    for (auto it = context.begin(); it != context.end(); ++it) g->vars[it.key()] = fromJson(it.value());
  }
  return g;
}

void renderTree(const NodeP& root, const ScopeP& scope, std::string& out) {
  Interpreter interp(out);
  interp.exec(root, scope);
}

}  // namespace pd::tok::jinja
