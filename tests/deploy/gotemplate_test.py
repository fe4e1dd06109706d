#!/usr/bin/python3
"""Checks gotemplate.py against Go text/template / Helm behaviour the chart relies on.
Each expected string is what Go (with sprig, as in Helm) produces for the same input."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gotemplate import Engine, Fail, TemplateError, helmify  # noqa: E402

CASES = [
    # (template, data (helmified: numbers become float64), expected output)
    ('{{ .Files.Get "a" | nindent 2 }}', {"Files": {"Get": lambda p: "x:\n  " + p}}, "\n  x:\n    a"),
    ("a  {{- 3 }}  b", {}, "a3  b"),
    ("{{ 3 -}}  \n b", {}, "3b"),
    ("x\n{{- /* gone */}}\ny", {}, "x\ny"),
    ("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}", {}, "2"),
    ("{{ $x := 1 }}{{ if true }}{{ $x := 5 }}{{ end }}{{ $x }}", {}, "1"),
    ("{{ .n }} {{ .big }} {{ .f }} {{ .small }}", {"n": 8000, "big": 1000000, "f": 0.9, "small": 0.00001},
     "8000 1e+06 0.9 1e-05"),
    ("{{ range $k, $v := . }}{{ $k }}={{ $v }};{{ end }}", {"b": 1, "a": 2}, "a=2;b=1;"),
    ("{{ range $i, $v := .l }}{{ $i }}:{{ $v }} {{ end }}", {"l": ["p", "q"]}, "0:p 1:q "),
    ('{{ with "" }}x{{ else }}y{{ end }}', {}, "y"),
    ("{{ with .m }}{{ .k }}{{ end }}", {"m": {"k": "v"}}, "v"),
    ("{{ and 1 0 2 }} {{ or 0 \"\" \"z\" }} {{ not .e }}", {"e": []}, "0 z true"),
    ('{{ "a" | printf "%s-%s" "b" }}', {}, "b-a"),
    ("{{ toYaml . | nindent 2 }}", {"b": [1, 2], "a": "x"}, "\n  a: x\n  b:\n  - 1\n  - 2"),
    ('{{ default "d" "" }} {{ default "d" .z }} {{ default "d" .f }} {{ .s | default "d" }}',
     {"z": 0, "f": False, "s": "set"}, "d d d set"),
    ('{{ define "x" }}[{{ .a }}|{{ $.a }}]{{ end }}{{ include "x" (dict "a" 1) }}', {}, "[1|1]"),
    ("{{ int 3.9 }} {{ add 1 2 }} {{ divf 1 4 }} {{ max 1 5 3 }} {{ divf .p 100 }}", {"p": 90},
     "3 3 0.25 5 0.9"),
    ("{{ quote .port }} {{ .port | toString }} {{ printf \"%s:%v\" \"h\" .port }}", {"port": 9000},
     '"9000" 9000 h:9000'),
    ("{{ if eq .a 1 }}one{{ else if eq .a 2 }}two{{ else }}many{{ end }}", {"a": "x"}, None),
    ("{{ if eq .a \"1\" }}one{{ else if eq .a \"2\" }}two{{ else }}many{{ end }}", {"a": "2"}, "two"),
    ('{{ trunc 3 "abcdef" }} {{ trimSuffix "-" "ab-" }} {{ trimAll "-." "-a.b-" }} {{ base "/m/x" }}', {},
     "abc ab a.b x"),
    ('{{ regexReplaceAll "[^a-z]" "a/B-c" "-" }} {{ hasPrefix "/m/" "/m/x" }} {{ has 2 (list 1 2) }}', {},
     "a---c true true"),
    ('{{ $d := dict "a" 1 }}{{ $_ := set $d "b" 2 }}{{ toYaml $d }}', {}, "a: 1\nb: 2"),
    ('{{ get .m "x" }}|{{ get .m "k" }}', {"m": {"k": "v"}}, "|v"),
]

ERRORS = [
    # (template, data, text the error must contain)
    ("{{ gt .f 0 }}", {"f": 1.5}, "incompatible types for comparison"),
    ("{{ eq .a 1 }}", {"a": "x"}, "incompatible types for comparison"),
    ("{{ nosuch 1 }}", {}, 'function "nosuch" not defined'),
    ("{{ .a.b }}", {"a": {}}, "map has no key 'b'"),
    ("{{ if true }}x", {}, "missing {{end}}"),
    ('{{ include "none" . }}', {}, 'no template "none"'),
    ('{{ fail "stop here" }}', {}, "stop here"),
    ('{{ required "need x" .x }}', {"x": ""}, "need x"),
]


def render(text, data):
    e = Engine()
    e.add("t", text)
    return e.render("t", helmify(data))


def main():
    bad = 0
    for text, data, want in CASES:
        try:
            got = render(text, data)
        except TemplateError as ex:
            got = f"<error: {ex}>"
        if want is None:  # expected to fail: eq of a string and an int
            if not got.startswith("<error"):
                print(f"FAIL {text!r}: rendered {got!r}, Go refuses it")
                bad += 1
            continue
        if got != want:
            print(f"FAIL {text!r}: got {got!r}, want {want!r}")
            bad += 1
    for text, data, want in ERRORS:
        try:
            got = render(text, data)
            print(f"FAIL {text!r}: rendered {got!r}, want an error containing {want!r}")
            bad += 1
        except (TemplateError, Fail) as ex:
            if want not in str(ex):
                print(f"FAIL {text!r}: error {ex}, want {want!r}")
                bad += 1
    total = len(CASES) + len(ERRORS)
    print(f"{total - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
