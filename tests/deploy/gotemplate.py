"""A small Go text/template engine with the Helm and sprig functions the pdserve chart uses.

Helm is not packaged for Debian 12, so the chart tests render the chart with this instead.
It follows Go's semantics where the chart depends on them:
  - `{{-` / `-}}` trim all adjacent white space (spaces, tabs, newlines);
  - pipelines pass the previous command's value as the last argument;
  - variables are scoped to the enclosing if/with/range/define, `=` assigns an outer one;
  - truth: false, 0, nil, "" and empty lists/maps are false;
  - eq/ne/lt/le/gt/ge refuse to compare values of different kinds (int against float is an
    error in Go, and a classic chart bug);
  - numbers read from values are float64 as in Helm (values pass through JSON), and print as
    Go's %v prints float64 (1000000 -> 1e+06);
  - a map key that does not exist is an error (like `helm template --strict`... stricter:
    Helm would print "<no value>"), so a typo in a values path cannot pass.
Unknown functions are errors at parse time, as in Go.

Method calls: a field or variable whose value is a Python callable is called with the
command's arguments (the renderer's `.Files.Get "path"`).

Not supported (the chart does not use them): `block`, `template` with pipelines other than a
field, `break`/`continue`, complex numbers.
"""

import base64
import copy
import hashlib
import json
import math
import posixpath
import re
import secrets
import string

import yaml


class TemplateError(Exception):
    pass


class Fail(TemplateError):
    """The template called `fail` or `required` failed: the chart refused the values."""


# ---- values: Go kinds ----------------------------------------------------------------------
def helmify(v):
    """Values as Helm sees them after its JSON round trip: every number a float64."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, dict):
        return {str(k): helmify(x) for k, x in v.items()}
    if isinstance(v, list):
        return [helmify(x) for x in v]
    return v


class Int(int):
    """An int64 produced by a template function (int, add, max, len)."""


def kind(v):
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "nil"
    return type(v).__name__


def go_float(f):
    """fmt's %v of a float64: strconv.FormatFloat(f, 'g', -1, 64), i.e. the shortest digits,
    in %e form when the exponent is < -4 or >= 6 (fmt.Println(1000000.0) prints 1e+06)."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "0"
    r = repr(abs(f))  # shortest round-trip digits, as strconv's shortest
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?(?:e([+-]\d+))?", r)
    ip, fp, ex = m.group(1), m.group(2) or "", int(m.group(3) or 0)
    digits = (ip + fp).lstrip("0")
    # decimal point position relative to the digit string
    lead_zeros = len(ip + fp) - len((ip + fp).lstrip("0"))
    dp = len(ip) + ex - lead_zeros
    digits = digits.rstrip("0") or "0"
    nd = len(digits)
    exp = dp - 1
    eprec = 6  # strconv: "if precision was the shortest possible, use precision 6"
    sign = "-" if f < 0 else ""
    if exp < -4 or exp >= eprec:
        mant = digits[0] + ("." + digits[1:] if nd > 1 else "")
        return f"{sign}{mant}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    if dp <= 0:
        return sign + "0." + "0" * (-dp) + digits
    if dp >= nd:
        return sign + digits + "0" * (dp - nd)
    return sign + digits[:dp] + "." + digits[dp:]


def go_str(v):
    """fmt's %v."""
    if v is None:
        return "<nil>"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return go_float(v)
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "[" + " ".join(go_str(x) for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{go_str(v[k])}" for k in sorted(v)) + "]"
    return str(v)


def truth(v):
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, dict)):
        return len(v) > 0
    return True


def to_yaml(v):
    def plain(x):  # JSON semantics: integral float64 values marshal as integers
        if isinstance(x, float) and x.is_integer() and abs(x) < 1e21:
            return int(x)
        if isinstance(x, Int):
            return int(x)
        if isinstance(x, dict):
            return {k: plain(y) for k, y in x.items()}
        if isinstance(x, list):
            return [plain(y) for y in x]
        return x
    if v is None:
        return "null"
    out = yaml.safe_dump(plain(v), default_flow_style=False, sort_keys=True, width=10 ** 9)
    if out.endswith("\n...\n"):
        out = out[:-5]
    return out.rstrip("\n")


def to_int(v):
    if v is None:
        return Int(0)
    if isinstance(v, bool):
        return Int(1 if v else 0)
    if isinstance(v, (int, float)):
        return Int(int(v))
    if isinstance(v, str):
        try:
            return Int(int(v, 0))
        except ValueError:
            try:
                return Int(int(float(v)))
            except ValueError:
                return Int(0)
    return Int(0)


def to_float(v):
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return 0.0
    return 0.0


def sprig_empty(v):
    return not truth(v)


def compare(op, a, b):
    ka, kb = kind(a), kind(b)
    if ka != kb:
        raise TemplateError(f"{op}: incompatible types for comparison: {ka} ({go_str(a)}) "
                            f"and {kb} ({go_str(b)})")
    if op in ("eq", "ne"):
        r = a == b
        return r if op == "eq" else not r
    if ka not in ("int", "float", "string"):
        raise TemplateError(f"{op}: invalid type for comparison: {ka}")
    return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op]


def go_printf(fmt, *args):
    out, ai, i = [], 0, 0
    while i < len(fmt):
        c = fmt[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        m = re.match(r"%([-+# 0]*)(\d*)(?:\.(\d+))?([svdqfgt%])", fmt[i:])
        if not m:
            raise TemplateError(f"printf: unsupported verb in {fmt!r}")
        verb = m.group(4)
        i += m.end()
        if verb == "%":
            out.append("%")
            continue
        if ai >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        a = args[ai]
        ai += 1
        if verb == "v" or verb == "t":
            out.append(go_str(a))
        elif verb == "s":
            out.append(a if isinstance(a, str) else f"%!s({kind(a)}={go_str(a)})")
        elif verb == "d":
            out.append(str(int(a)) if kind(a) == "int" else f"%!d({kind(a)}={go_str(a)})")
        elif verb == "q":
            out.append(json.dumps(a) if isinstance(a, str) else f"%!q({kind(a)}={go_str(a)})")
        else:
            out.append(("%" + m.group(1) + m.group(2) + ("." + m.group(3) if m.group(3) else "")
                        + verb) % to_float(a))
    return "".join(out)


def trunc(n, s):
    n = int(n)
    if n < 0:
        return s[n:] if -n < len(s) else s
    return s[:n]


def regex_go(pattern):
    return pattern  # the chart's patterns are in the common subset of RE2 and Python's re


def _append(lst, v):
    return list(lst or []) + [v]


def _set(d, k, v):
    d[k] = v
    return d


def _dict(*kv):
    if len(kv) % 2:
        raise TemplateError("dict: odd number of arguments")
    return {str(kv[i]): kv[i + 1] for i in range(0, len(kv), 2)}


def _default(d, *given):
    if not given or sprig_empty(given[0]):
        return d
    return given[0]


def _required(msg, v=None):
    if v is None or (isinstance(v, str) and v == ""):
        raise Fail(msg)
    return v


def _fail(msg):
    raise Fail(msg)


def _quote(*args):
    return " ".join(json.dumps(go_str(a)) for a in args if a is not None)


def _max(a, *rest):
    return Int(max([to_int(a)] + [to_int(x) for x in rest]))


def _min(a, *rest):
    return Int(min([to_int(a)] + [to_int(x) for x in rest]))


def _divf(a, *rest):
    r = to_float(a)
    for x in rest:
        r /= to_float(x)
    return r


def _join(sep, lst):
    return sep.join(go_str(x) for x in (lst or []))


SPRIG = {
    "quote": _quote,
    "squote": lambda *a: " ".join("'" + go_str(x) + "'" for x in a if x is not None),
    "default": _default,
    "empty": sprig_empty,
    "required": _required,
    "fail": _fail,
    "trunc": trunc,
    "trimSuffix": lambda suf, s: s[:-len(suf)] if suf and s.endswith(suf) else s,
    "trimPrefix": lambda pre, s: s[len(pre):] if pre and s.startswith(pre) else s,
    "trimAll": lambda cut, s: s.strip(cut),
    "trim": lambda s: s.strip(),
    "contains": lambda sub, s: sub in s,
    "hasPrefix": lambda pre, s: s.startswith(pre),
    "hasSuffix": lambda suf, s: s.endswith(suf),
    "replace": lambda old, new, s: s.replace(old, new),
    "regexReplaceAll": lambda pat, s, repl: re.sub(regex_go(pat), repl.replace("$", "\\"), s),
    "lower": lambda s: s.lower(),
    "upper": lambda s: s.upper(),
    "base": lambda s: posixpath.basename(s.rstrip("/")) if s.strip("/") else ("/" if s else "."),
    "int": to_int,
    "int64": to_int,
    "float64": to_float,
    "toString": go_str,
    "add": lambda *a: Int(sum(to_int(x) for x in a)),
    "sub": lambda a, b: Int(to_int(a) - to_int(b)),
    "mul": lambda *a: Int(math.prod(to_int(x) for x in a)),
    "max": _max,
    "min": _min,
    "divf": _divf,
    "mulf": lambda *a: math.prod(to_float(x) for x in a),
    "addf": lambda *a: sum(to_float(x) for x in a),
    "list": lambda *a: list(a),
    "dict": _dict,
    "set": _set,
    "unset": lambda d, k: (d.pop(k, None), d)[1],
    "hasKey": lambda d, k: k in d,
    "get": lambda d, k: d.get(k, "") if isinstance(d, dict) else "",
    "has": lambda needle, lst: needle in (lst or []),
    "append": _append,
    "deepCopy": copy.deepcopy,
    "keys": lambda *ds: [k for d in ds for k in d],
    "join": _join,
    "toYaml": to_yaml,
    "toJson": lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True),
    "indent": lambda n, s: (" " * int(n)) + s.replace("\n", "\n" + " " * int(n)),
    "nindent": lambda n, s: "\n" + (" " * int(n)) + s.replace("\n", "\n" + " " * int(n)),
    "sha256sum": lambda s: hashlib.sha256(s.encode()).hexdigest(),
    "b64enc": lambda s: base64.b64encode(go_str(s).encode()).decode(),
    "randAlphaNum": lambda n: "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(to_int(n))),
    # Helm's lookup needs a live cluster; `helm template` (what this renderer stands for)
    # gets an empty map, and so do we.
    "lookup": lambda api, kind, ns, name: {},
    "b64enc": lambda s: base64.b64encode(s.encode()).decode(),
    "printf": go_printf,
    "print": lambda *a: "".join(go_str(x) for x in a),
    "len": lambda v: Int(len(v or [])),
    # Go builtins
    "not": lambda v: not truth(v),
    "eq": lambda a, *bs: any(compare("eq", a, b) for b in bs),
    "ne": lambda a, b: compare("ne", a, b),
    "lt": lambda a, b: compare("lt", a, b),
    "le": lambda a, b: compare("le", a, b),
    "gt": lambda a, b: compare("gt", a, b),
    "ge": lambda a, b: compare("ge", a, b),
    "index": None,  # handled in eval (needs error context)
    "and": None,    # short-circuit, handled in eval
    "or": None,
    "include": None,  # needs the engine
    "tpl": None,
}


# ---- lexing and parsing --------------------------------------------------------------------
ACTION_RE = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<decl>:=)
  | (?P<assign>=)
  | (?P<pipe>\|)
  | (?P<lp>\()
  | (?P<rp>\))
  | (?P<comma>,)
  | (?P<var>\$\w*(?:\.\w+)*)
  | (?P<field>(?:\.\w+)+|\.)
  | (?P<ident>[A-Za-z_]\w*)
""", re.X)


def lex_action(text, where):
    toks, pos = [], 0
    while pos < len(text):
        m = TOKEN_RE.match(text, pos)
        if not m:
            raise TemplateError(f"{where}: cannot parse action near {text[pos:pos + 20]!r}")
        pos = m.end()
        k = m.lastgroup
        if k == "ws":
            continue
        toks.append((k, m.group(k)))
    return toks


class Node:
    def __init__(self, kind, **kw):
        self.kind = kind
        self.__dict__.update(kw)


class Parser:
    """Turns template text into a tree: text, action (pipeline), if/with/range with bodies."""

    def __init__(self, name, text, funcs):
        self.name, self.text, self.funcs = name, text, funcs
        self.defines = {}

    def line_of(self, pos):
        return self.text.count("\n", 0, pos) + 1

    def parse(self):
        items = []  # ("text", s) | ("act", body, pos)
        pos = 0
        for m in ACTION_RE.finditer(self.text):
            items.append(["text", self.text[pos:m.start()]])
            body = m.group(2)
            items.append(["act", body, m.start(), bool(m.group(1)), bool(m.group(3))])
            pos = m.end()
        items.append(["text", self.text[pos:]])
        # trim markers
        for i, it in enumerate(items):
            if it[0] == "act":
                if it[3] and i > 0:
                    items[i - 1][1] = items[i - 1][1].rstrip(" \t\r\n")
                if it[4] and i + 1 < len(items):
                    items[i + 1][1] = items[i + 1][1].lstrip(" \t\r\n")
        self.items = items
        self.i = 0
        root = self.parse_list(top=True)
        return root

    def parse_list(self, top=False):
        nodes = []
        while self.i < len(self.items):
            it = self.items[self.i]
            self.i += 1
            if it[0] == "text":
                if it[1]:
                    nodes.append(Node("text", text=it[1]))
                continue
            body, pos = it[1].strip(), it[2]
            where = f"{self.name}:{self.line_of(pos)}"
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise TemplateError(f"{where}: unclosed comment")
                continue
            word = body.split(None, 1)[0] if body else ""
            rest = body[len(word):].strip()
            if word in ("end", "else"):
                if top:
                    raise TemplateError(f"{where}: unexpected {{{{{word}}}}}")
                self.i -= 1
                return nodes
            if word in ("if", "with", "range"):
                nodes.append(self.parse_control(word, rest, where))
            elif word == "define":
                m = re.fullmatch(r'"([^"]+)"', rest)
                if not m:
                    raise TemplateError(f"{where}: bad define {rest!r}")
                body_nodes = self.parse_list()
                self.expect_end(where)
                self.defines[m.group(1)] = body_nodes
            elif word == "template":
                m = re.fullmatch(r'"([^"]+)"\s*(.*)', rest)
                if not m:
                    raise TemplateError(f"{where}: bad template {rest!r}")
                arg = self.parse_pipeline(lex_action(m.group(2), where), where) if m.group(2) else None
                nodes.append(Node("template", tname=m.group(1), arg=arg, where=where))
            elif word in ("block", "break", "continue"):
                raise TemplateError(f"{where}: {word} is not supported by this renderer")
            else:
                nodes.append(Node("action", pipe=self.parse_pipeline(lex_action(body, where), where),
                                  where=where))
        if not top:
            raise TemplateError(f"{self.name}: unexpected end of template (missing {{{{end}}}})")
        return nodes

    def expect_end(self, where):
        if self.i >= len(self.items):
            raise TemplateError(f"{where}: missing {{{{end}}}}")
        it = self.items[self.i]
        if it[1].strip() != "end":
            raise TemplateError(f"{where}: expected {{{{end}}}}, got {{{{{it[1].strip()}}}}}")
        self.i += 1

    def parse_control(self, word, rest, where):
        toks = lex_action(rest, where)
        decl = None
        if word == "range":
            # range $k, $v := pipe | range $v := pipe
            if len(toks) >= 4 and toks[0][0] == "var" and toks[1][0] == "comma" and toks[3][0] == "decl":
                decl = (toks[0][1], toks[2][1])
                toks = toks[4:]
            elif len(toks) >= 2 and toks[0][0] == "var" and toks[1][0] == "decl":
                decl = (None, toks[0][1])
                toks = toks[2:]
        pipe = self.parse_pipeline(toks, where)
        body = self.parse_list()
        else_nodes = None
        it = self.items[self.i] if self.i < len(self.items) else None
        if it is None:
            raise TemplateError(f"{where}: {word} without {{{{end}}}}")
        b = it[1].strip()
        if b == "else":
            self.i += 1
            else_nodes = self.parse_list()
            self.expect_end(where)
        elif b.startswith("else if ") or b.startswith("else with "):
            # else if X ... == else {{if X ...}} sharing one end
            self.i += 1
            sub_word, sub_rest = b[5:].split(None, 1)
            else_nodes = [self.parse_control_chained(sub_word, sub_rest, f"{self.name}:{self.line_of(it[2])}")]
        else:
            self.expect_end(where)
        return Node(word, pipe=pipe, body=body, else_nodes=else_nodes, decl=decl, where=where)

    def parse_control_chained(self, word, rest, where):
        return self.parse_control(word, rest, where)

    def parse_pipeline(self, toks, where):
        if not toks:
            raise TemplateError(f"{where}: empty pipeline")
        decl = None
        if len(toks) >= 2 and toks[0][0] == "var" and toks[1][0] in ("decl", "assign"):
            decl = (toks[0][1], toks[1][0])
            toks = toks[2:]
        cmds, cur, depth = [], [], 0
        for t in toks:
            if t[0] == "lp":
                depth += 1
            elif t[0] == "rp":
                depth -= 1
            if t[0] == "pipe" and depth == 0:
                cmds.append(cur)
                cur = []
            else:
                cur.append(t)
        cmds.append(cur)
        if depth != 0:
            raise TemplateError(f"{where}: unbalanced parentheses")
        parsed = [self.parse_command(c, where) for c in cmds]
        return Node("pipe", decl=decl, cmds=parsed, where=where)

    def parse_command(self, toks, where):
        if not toks:
            raise TemplateError(f"{where}: empty command in pipeline")
        args, i = [], 0
        while i < len(toks):
            k, v = toks[i]
            if k == "lp":
                depth, j = 1, i + 1
                while j < len(toks) and depth:
                    depth += {"lp": 1, "rp": -1}.get(toks[j][0], 0)
                    j += 1
                args.append(Node("sub", pipe=self.parse_pipeline(toks[i + 1:j - 1], where)))
                i = j
                continue
            if k == "ident":
                if v in ("true", "false"):
                    args.append(Node("lit", value=(v == "true")))
                elif v == "nil":
                    args.append(Node("lit", value=None))
                else:
                    if v not in self.funcs:
                        raise TemplateError(f'{where}: function "{v}" not defined')
                    args.append(Node("func", name=v))
            elif k == "str":
                args.append(Node("lit", value=json.loads(v)))
            elif k == "raw":
                args.append(Node("lit", value=v[1:-1]))
            elif k == "num":
                args.append(Node("lit", value=(float(v) if re.search(r"[.eE]", v) else Int(int(v)))))
            elif k == "field":
                args.append(Node("field", path=[p for p in v.split(".") if p]))
            elif k == "var":
                parts = v.split(".")
                args.append(Node("var", name=parts[0], path=parts[1:]))
            else:
                raise TemplateError(f"{where}: unexpected {v!r}")
            i += 1
        return args


# ---- execution -----------------------------------------------------------------------------
class Scope:
    def __init__(self, parent=None):
        self.vars, self.parent = {}, parent

    def get(self, name, where):
        s = self
        while s:
            if name in s.vars:
                return s.vars[name]
            s = s.parent
        raise TemplateError(f"{where}: undefined variable {name}")

    def assign(self, name, value, where):
        s = self
        while s:
            if name in s.vars:
                s.vars[name] = value
                return
            s = s.parent
        raise TemplateError(f"{where}: assignment to undeclared variable {name}")


class Engine:
    def __init__(self):
        self.defines = {}
        self.trees = {}
        self.funcs = dict(SPRIG)

    def add(self, name, text):
        p = Parser(name, text, self.funcs)
        tree = p.parse()
        for d, body in p.defines.items():
            self.defines[d] = body
        self.trees[name] = tree

    def render(self, name, dot):
        out = []
        scope = Scope()
        scope.vars["$"] = dot
        self.exec_list(self.trees[name], dot, scope, out)
        return "".join(out)

    def include(self, name, dot, where):
        if name not in self.defines:
            raise TemplateError(f'{where}: include: no template "{name}"')
        out = []
        scope = Scope()
        scope.vars["$"] = dot
        self.exec_list(self.defines[name], dot, scope, out)
        return "".join(out)

    def exec_list(self, nodes, dot, scope, out):
        for n in nodes:
            if n.kind == "text":
                out.append(n.text)
            elif n.kind == "action":
                v = self.eval_pipe(n.pipe, dot, scope)
                if n.pipe.decl is None:
                    out.append("" if v is None else go_str(v))
            elif n.kind == "template":
                arg = self.eval_pipe(n.arg, dot, scope) if n.arg else None
                out.append(self.include(n.tname, arg, n.where))
            elif n.kind in ("if", "with"):
                inner = Scope(scope)
                v = self.eval_pipe(n.pipe, dot, inner)
                if truth(v):
                    self.exec_list(n.body, v if n.kind == "with" else dot, inner, out)
                elif n.else_nodes is not None:
                    self.exec_list(n.else_nodes, dot, Scope(scope), out)
            elif n.kind == "range":
                inner = Scope(scope)
                v = self.eval_pipe(n.pipe, dot, inner)
                if isinstance(v, dict):
                    seq = [(k, v[k]) for k in sorted(v)]
                elif isinstance(v, list):
                    seq = list(enumerate(v))
                elif v is None:
                    seq = []
                elif isinstance(v, int):
                    seq = [(i, Int(i)) for i in range(v)]
                else:
                    raise TemplateError(f"{n.where}: range can't iterate over {go_str(v)}")
                if not seq and n.else_nodes is not None:
                    self.exec_list(n.else_nodes, dot, Scope(scope), out)
                for k, item in seq:
                    s = Scope(inner)
                    if n.decl:
                        if n.decl[0]:
                            s.vars[n.decl[0]] = Int(k) if isinstance(k, int) else k
                        s.vars[n.decl[1]] = item
                    self.exec_list(n.body, item, s, out)

    def eval_pipe(self, pipe, dot, scope):
        val, have = None, False
        for cmd in pipe.cmds:
            val = self.eval_cmd(cmd, dot, scope, pipe.where, val if have else _NOARG)
            have = True
        if pipe.decl:
            name, op = pipe.decl
            if op == "decl":
                scope.vars[name] = val
            else:
                scope.assign(name, val, pipe.where)
        return val

    def eval_cmd(self, cmd, dot, scope, where, piped):
        head = cmd[0]
        if head.kind == "func":
            name = head.name
            if name in ("and", "or"):
                args = cmd[1:]
                vals = []
                for a in args:
                    v = self.eval_arg(a, dot, scope, where)
                    vals.append(v)
                    if (name == "and") != truth(v):
                        return v
                if piped is not _NOARG:
                    return piped
                return vals[-1] if vals else None
            args = [self.eval_arg(a, dot, scope, where) for a in cmd[1:]]
            if piped is not _NOARG:
                args.append(piped)
            if name == "include":
                if len(args) != 2:
                    raise TemplateError(f"{where}: include takes a name and a value")
                return self.include(args[0], args[1], where)
            if name == "index":
                v = args[0]
                for k in args[1:]:
                    if isinstance(v, dict):
                        if k not in v:
                            raise TemplateError(f"{where}: index: no key {k!r}")
                        v = v[k]
                    elif isinstance(v, list):
                        v = v[int(k)]
                    else:
                        raise TemplateError(f"{where}: index of {kind(v)}")
                return v
            if name == "tpl":
                raise TemplateError(f"{where}: tpl is not supported by this renderer")
            try:
                return self.funcs[name](*args)
            except (Fail, TemplateError):
                raise
            except Exception as e:  # wrong arity or types: Go would fail the render too
                raise TemplateError(f"{where}: error calling {name}: {e}") from e
        if len(cmd) > 1 or piped is not _NOARG:
            method = self.eval_arg(head, dot, scope, where) if head.kind in ("field", "var") else None
            if callable(method):
                args = [self.eval_arg(a, dot, scope, where) for a in cmd[1:]]
                if piped is not _NOARG:
                    args.append(piped)
                try:
                    return method(*args)
                except (Fail, TemplateError):
                    raise
                except Exception as e:  # Go fails the render when a method returns an error
                    raise TemplateError(f"{where}: error calling {self.describe(head)}: {e}") from e
            raise TemplateError(f"{where}: can't give argument to non-function {self.describe(head)}")
        return self.eval_arg(head, dot, scope, where)

    @staticmethod
    def describe(n):
        if n.kind == "field":
            return "." + ".".join(n.path)
        if n.kind == "var":
            return ".".join([n.name] + n.path)
        return n.kind

    def eval_arg(self, a, dot, scope, where):
        if a.kind == "lit":
            return a.value
        if a.kind == "sub":
            return self.eval_pipe(a.pipe, dot, scope)
        if a.kind == "field":
            return self.walk(dot, a.path, where, "." + ".".join(a.path))
        if a.kind == "var":
            base = scope.get(a.name, where)
            return self.walk(base, a.path, where, ".".join([a.name] + a.path))
        if a.kind == "func":  # a niladic function used as an argument, e.g. `default dict`
            return self.eval_cmd([a], dot, scope, where, _NOARG)
        raise TemplateError(f"{where}: bad argument")

    @staticmethod
    def walk(v, path, where, text):
        for i, p in enumerate(path):
            if isinstance(v, dict):
                if p not in v:
                    raise TemplateError(f"{where}: {text}: map has no key {p!r} "
                                        f"(have: {', '.join(sorted(v)) or 'none'})")
                v = v[p]
            elif v is None:
                raise TemplateError(f"{where}: {text}: nil pointer evaluating .{p}")
            else:
                raise TemplateError(f"{where}: {text}: can't evaluate field {p} in {kind(v)}")
        return v


_NOARG = object()
