// The Jinja parser (jinja_parser.h): recursive descent over the lexer's tokens, with Jinja's
// operator precedence.
#include "common/tokenizer/jinja/jinja_parser.h"

#include <algorithm>

namespace pd::tok::jinja {
namespace {

// Recursive descent nests C++ frames per bracket, unary operator, `not`, `else` and block
// level; a bound keeps a pathological template an error instead of a stack overflow (found by
// tests/fuzz). Real chat templates nest a few levels; each bracket counts twice here.
constexpr int kMaxNesting = 256;

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  // One level of nesting while it lives; fails the parse past kMaxNesting.
  class Nest {
   public:
    Nest(Parser& p, int line) : p_(p) {
      if (++p_.depth_ > kMaxNesting) {
        fail(line,
             "template nested deeper than " + std::to_string(kMaxNesting) + " levels (brackets, operators or blocks)");
      }
    }
    ~Nest() { --p_.depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Parser& p_;
  };

  NodeP parseTemplate() {
    auto block = parseBlock({});
    if (peek().type != Tok::kEnd) fail(peek().line, "unexpected '" + peek().text + "'");
    return block;
  }

 private:
  const Token& peek(size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[p_ < t_.size() - 1 ? p_++ : p_]; }
  bool isOp(const char* op, size_t k = 0) const { return peek(k).type == Tok::kOp && peek(k).text == op; }
  bool isName(const char* nm, size_t k = 0) const { return peek(k).type == Tok::kName && peek(k).text == nm; }
  void expectOp(const char* op) {
    if (!isOp(op)) fail(peek().line, std::string("expected '") + op + "', found '" + describe(peek()) + "'");
    ++p_;
  }
  void expectName(const char* nm) {
    if (!isName(nm)) fail(peek().line, std::string("expected '") + nm + "', found '" + describe(peek()) + "'");
    ++p_;
  }
  void expect(Tok type, const char* what) {
    if (peek().type != type) fail(peek().line, std::string("expected ") + what + ", found '" + describe(peek()) + "'");
    ++p_;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kCloseStmt:
        return "%}";
      case Tok::kCloseExpr:
        return "}}";
      case Tok::kEnd:
        return "end of template";
      default:
        return t.text;
    }
  }
  std::string identifier() {
    if (peek().type != Tok::kName) fail(peek().line, "expected a name, found '" + describe(peek()) + "'");
    return next().text;
  }

  // Parses statements until a {% tag %} whose name is in `stops` (left unconsumed after
  // "{%"), or the end.
  NodeP parseBlock(const std::vector<std::string>& stops) {
    Nest nest(*this, peek().line);
    auto block = mk(NK::kBlock, peek().line);
    for (;;) {
      const Token& tk = peek();
      if (tk.type == Tok::kEnd) {
        if (!stops.empty()) fail(tk.line, "missing {% " + stops.back() + " %}");
        return block;
      }
      if (tk.type == Tok::kText) {
        auto n = mk(NK::kText, tk.line);
        n->name = tk.text;
        block->kids.push_back(n);
        ++p_;
      } else if (tk.type == Tok::kOpenExpr) {
        ++p_;
        auto n = mk(NK::kOutput, tk.line);
        n->kids.push_back(parseExpr());
        expect(Tok::kCloseExpr, "'}}'");
        block->kids.push_back(n);
      } else if (tk.type == Tok::kOpenStmt) {
        const Token& nameTok = peek(1);
        if (nameTok.type == Tok::kName && std::find(stops.begin(), stops.end(), nameTok.text) != stops.end()) {
          ++p_;  // leave the tag name for the caller
          return block;
        }
        ++p_;
        block->kids.push_back(parseStatement());
      } else {
        fail(tk.line, "unexpected '" + describe(tk) + "'");
      }
    }
  }

  NodeP parseStatement() {
    int line = peek().line;
    std::string tag = identifier();
    if (tag == "if") return parseIf(line);
    if (tag == "for") return parseFor(line);
    if (tag == "set") return parseSet(line);
    if (tag == "macro") return parseMacro(line);
    if (tag == "generation") {  // marks assistant text for training masks: renders its body
      expect(Tok::kCloseStmt, "'%}'");
      NodeP body = parseBlock({"endgeneration"});
      identifier();
      expect(Tok::kCloseStmt, "'%}'");
      return body;
    }
    if (tag == "break" || tag == "continue") {
      expect(Tok::kCloseStmt, "'%}'");
      return mk(tag == "break" ? NK::kBreak : NK::kContinue, line);
    }
    fail(line, "unsupported tag '" + tag + "' (supported: if, for, set, macro, generation, break, continue)");
  }

  NodeP parseIf(int line) {
    auto n = mk(NK::kIf, line);
    n->kids.push_back(parseExpr());
    expect(Tok::kCloseStmt, "'%}'");
    n->kids.push_back(parseBlock({"elif", "else", "endif"}));
    for (;;) {
      std::string tag = identifier();
      if (tag == "elif") {
        n->kids.push_back(parseExpr());
        expect(Tok::kCloseStmt, "'%}'");
        n->kids.push_back(parseBlock({"elif", "else", "endif"}));
      } else if (tag == "else") {
        expect(Tok::kCloseStmt, "'%}'");
        n->kids.push_back(mk(NK::kLiteral, line));  // condition placeholder: always true
        n->kids.back()->value = Value::boolean(true);
        n->kids.push_back(parseBlock({"endif"}));
      } else {  // endif
        expect(Tok::kCloseStmt, "'%}'");
        return n;
      }
    }
  }

  NodeP parseFor(int line) {
    auto n = mk(NK::kFor, line);
    n->names.push_back(identifier());
    while (isOp(",")) {
      ++p_;
      n->names.push_back(identifier());
    }
    expectName("in");
    NodeP iter = parseTernaryNoIf();
    NodeP cond;
    if (isName("if")) {
      ++p_;
      cond = parseExpr();
    }
    if (isName("recursive")) fail(peek().line, "unsupported: recursive for loops");
    expect(Tok::kCloseStmt, "'%}'");
    NodeP body = parseBlock({"else", "endfor"});
    NodeP elseBody = mk(NK::kBlock, line);
    if (identifier() == "else") {
      expect(Tok::kCloseStmt, "'%}'");
      elseBody = parseBlock({"endfor"});
      identifier();
    }
    expect(Tok::kCloseStmt, "'%}'");
    n->kids = {iter, cond ? cond : NodeP(), body, elseBody};
    return n;
  }

  NodeP parseSet(int line) {
    auto n = mk(NK::kSet, line);
    n->names.push_back(identifier());
    if (isOp(".")) {
      ++p_;
      n->names.push_back(identifier());  // namespace attribute
    } else {
      while (isOp(",")) {
        ++p_;
        n->names.push_back(identifier());
        n->negated = true;  // marks tuple unpacking
      }
    }
    if (isOp("=")) {
      ++p_;
      n->kids.push_back(parseExpr());
      expect(Tok::kCloseStmt, "'%}'");
      return n;
    }
    expect(Tok::kCloseStmt, "'%}'");  // block set
    auto body = parseBlock({"endset"});
    identifier();
    expect(Tok::kCloseStmt, "'%}'");
    n->kids.push_back(nullptr);
    n->kids.push_back(body);
    return n;
  }

  NodeP parseMacro(int line) {
    auto n = mk(NK::kMacro, line);
    n->name = identifier();
    expectOp("(");
    while (!isOp(")")) {
      std::string param = identifier();
      NodeP dflt;
      if (isOp("=")) {
        ++p_;
        dflt = parseExpr();
      }
      n->kwargs.emplace_back(param, dflt);
      if (!isOp(")")) expectOp(",");
    }
    expectOp(")");
    expect(Tok::kCloseStmt, "'%}'");
    n->kids.push_back(parseBlock({"endmacro"}));
    identifier();
    expect(Tok::kCloseStmt, "'%}'");
    return n;
  }

  // ---- expressions ----
  NodeP parseExpr() {
    Nest nest(*this, peek().line);
    NodeP e = parseTernaryNoIf();
    if (isName("if")) {
      int line = peek().line;
      ++p_;
      NodeP cond = parseOr();
      NodeP otherwise;
      if (isName("else")) {
        ++p_;
        otherwise = parseExpr();
      } else {
        otherwise = mk(NK::kLiteral, line);  // undefined
      }
      auto t = mk(NK::kTernary, line);
      t->kids = {cond, e, otherwise};
      return t;
    }
    return e;
  }
  NodeP parseTernaryNoIf() { return parseOr(); }

  NodeP parseOr() {
    NodeP l = parseAnd();
    while (isName("or")) {
      int line = next().line;
      auto n = mk(NK::kOr, line);
      n->kids = {l, parseAnd()};
      l = n;
    }
    return l;
  }
  NodeP parseAnd() {
    NodeP l = parseNot();
    while (isName("and")) {
      int line = next().line;
      auto n = mk(NK::kAnd, line);
      n->kids = {l, parseNot()};
      l = n;
    }
    return l;
  }
  NodeP parseNot() {
    Nest nest(*this, peek().line);
    if (isName("not")) {
      int line = next().line;
      auto n = mk(NK::kNot, line);
      n->kids = {parseNot()};
      return n;
    }
    return parseCompare();
  }
  NodeP parseCompare() {
    NodeP l = parseMath1();
    for (;;) {
      int line = peek().line;
      std::string op;
      if (peek().type == Tok::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                      peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (isName("in")) {
        ++p_;
        op = "in";
      } else if (isName("not") && isName("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        return l;
      }
      auto n = mk(NK::kBinary, line);
      n->name = op;
      n->kids = {l, parseMath1()};
      l = n;
    }
  }
  NodeP parseMath1() {
    NodeP l = parseConcat();
    while (isOp("+") || isOp("-")) {
      auto n = mk(NK::kBinary, peek().line);
      n->name = next().text;
      n->kids = {l, parseConcat()};
      l = n;
    }
    return l;
  }
  NodeP parseConcat() {
    NodeP l = parseMath2();
    while (isOp("~")) {
      auto n = mk(NK::kBinary, peek().line);
      n->name = next().text;
      n->kids = {l, parseMath2()};
      l = n;
    }
    return l;
  }
  NodeP parseMath2() {
    NodeP l = parsePow();
    while (isOp("*") || isOp("/") || isOp("//") || isOp("%")) {
      auto n = mk(NK::kBinary, peek().line);
      n->name = next().text;
      n->kids = {l, parsePow()};
      l = n;
    }
    return l;
  }
  NodeP parsePow() {
    NodeP l = parseUnary();
    while (isOp("**")) {
      auto n = mk(NK::kBinary, peek().line);
      n->name = next().text;
      n->kids = {l, parseUnary()};
      l = n;
    }
    return l;
  }
  NodeP parseUnary() {
    Nest nest(*this, peek().line);
    if (isOp("-") || isOp("+")) {
      int line = peek().line;
      bool neg = next().text == "-";
      NodeP e = parseUnary();
      if (!neg) return e;
      auto n = mk(NK::kNeg, line);
      n->kids = {e};
      return n;
    }
    NodeP e = parsePostfix(parsePrimary());
    return parseFilters(e);
  }

  void parseArgs(std::vector<NodeP>& args, std::vector<std::pair<std::string, NodeP>>& kwargs) {
    expectOp("(");
    while (!isOp(")")) {
      if (peek().type == Tok::kName && isOp("=", 1)) {
        std::string k = next().text;
        ++p_;
        kwargs.emplace_back(k, parseExpr());
      } else {
        if (isOp("*")) fail(peek().line, "unsupported: *args in calls");
        args.push_back(parseExpr());
      }
      if (!isOp(")")) expectOp(",");
    }
    expectOp(")");
  }

  NodeP parseFilters(NodeP e) {
    for (;;) {
      if (isOp("|")) {
        int line = next().line;
        auto f = mk(NK::kFilter, line);
        f->name = identifier();
        f->kids.push_back(e);
        if (isOp("(")) {
          std::vector<NodeP> args;
          parseArgs(args, f->kwargs);
          for (auto& a : args) f->kids.push_back(a);
        }
        e = f;
      } else if (isName("is")) {
        int line = next().line;
        auto t = mk(NK::kTest, line);
        if (isName("not")) {
          ++p_;
          t->negated = true;
        }
        t->name = identifier();
        t->kids.push_back(e);
        if (isOp("(")) {
          std::vector<NodeP> args;
          parseArgs(args, t->kwargs);
          for (auto& a : args) t->kids.push_back(a);
        } else if (peek().type == Tok::kString || peek().type == Tok::kInt || peek().type == Tok::kFloat ||
                   (peek().type == Tok::kName && !isName("and") && !isName("or") && !isName("else") && !isName("if") &&
                    !isName("in") && !isName("not") && !isName("is"))) {
          t->kids.push_back(parsePostfix(parsePrimary()));
        }
        e = t;
      } else {
        return e;
      }
    }
  }

  NodeP parsePostfix(NodeP e) {
    for (;;) {
      if (isOp(".")) {
        int line = next().line;
        auto n = mk(NK::kAttr, line);
        if (peek().type == Tok::kInt) {
          n->kind = NK::kIndex;
          auto lit = mk(NK::kLiteral, line);
          lit->value = Value::integer(std::stoll(next().text));
          n->kids = {e, lit};
        } else {
          n->name = identifier();
          n->kids = {e};
        }
        e = n;
      } else if (isOp("[")) {
        int line = next().line;
        NodeP a, b, c;
        bool slice = false;
        if (!isOp(":")) a = parseExpr();
        if (isOp(":")) {
          slice = true;
          ++p_;
          if (!isOp(":") && !isOp("]")) b = parseExpr();
          if (isOp(":")) {
            ++p_;
            if (!isOp("]")) c = parseExpr();
          }
        }
        expectOp("]");
        auto n = mk(slice ? NK::kSlice : NK::kIndex, line);
        n->kids = {e, a, b, c};
        if (!slice) n->kids = {e, a};
        e = n;
      } else if (isOp("(")) {
        auto n = mk(NK::kCall, peek().line);
        std::vector<NodeP> args;
        parseArgs(args, n->kwargs);
        n->kids.push_back(e);
        for (auto& a : args) n->kids.push_back(a);
        e = n;
      } else {
        return e;
      }
    }
  }

  NodeP parsePrimary() {
    const Token& tk = peek();
    int line = tk.line;
    if (tk.type == Tok::kString) {
      auto n = mk(NK::kLiteral, line);
      std::string s = next().text;
      while (peek().type == Tok::kString) s += next().text;  // adjacent literals concatenate
      n->value = Value::str(s);
      return n;
    }
    if (tk.type == Tok::kInt) {
      auto n = mk(NK::kLiteral, line);
      n->value = Value::integer(std::stoll(next().text));
      return n;
    }
    if (tk.type == Tok::kFloat) {
      auto n = mk(NK::kLiteral, line);
      n->value = Value::real(std::stod(next().text));
      return n;
    }
    if (tk.type == Tok::kName) {
      std::string nm = next().text;
      auto n = mk(NK::kLiteral, line);
      if (nm == "true" || nm == "True") {
        n->value = Value::boolean(true);
        return n;
      }
      if (nm == "false" || nm == "False") {
        n->value = Value::boolean(false);
        return n;
      }
      if (nm == "none" || nm == "None") {
        n->value = Value::none();
        return n;
      }
      n->kind = NK::kName;
      n->name = nm;
      return n;
    }
    if (isOp("(")) {
      ++p_;
      if (isOp(")")) {
        ++p_;
        return mk(NK::kTuple, line);
      }
      NodeP e = parseExpr();
      if (isOp(",")) {
        auto t = mk(NK::kTuple, line);
        t->kids.push_back(e);
        while (isOp(",")) {
          ++p_;
          if (isOp(")")) break;
          t->kids.push_back(parseExpr());
        }
        e = t;
      }
      expectOp(")");
      return e;
    }
    if (isOp("[")) {
      ++p_;
      auto n = mk(NK::kList, line);
      while (!isOp("]")) {
        n->kids.push_back(parseExpr());
        if (!isOp("]")) expectOp(",");
      }
      expectOp("]");
      return n;
    }
    if (isOp("{")) {
      ++p_;
      auto n = mk(NK::kDict, line);
      while (!isOp("}")) {
        n->kids.push_back(parseExpr());
        expectOp(":");
        n->kids.push_back(parseExpr());
        if (!isOp("}")) expectOp(",");
      }
      expectOp("}");
      return n;
    }
    fail(line, "expected an expression, found '" + describe(tk) + "'");
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  int depth_ = 0;
};

}  // namespace

NodeP parseTokens(std::vector<Token> tokens) {
  Parser parser(std::move(tokens));
  return parser.parseTemplate();
}

}  // namespace pd::tok::jinja
