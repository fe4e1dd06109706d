#!/usr/bin/env python3
"""Check the relative links in README.md and docs/**/*.md.

Usage: scripts/check-doc-links.py [ROOT]

For every relative Markdown link or image ([text](target), ![alt](target), [ref]: target) the
target file must exist inside ROOT (default: the repository root, the parent of this script's
folder). For a link with an #anchor into a Markdown file (or a bare #anchor within the same
file) a heading with that GitHub-style slug must exist. Links inside code fences and code spans
are ignored, as are absolute URLs (http:, https:, mailto:). Prints each broken link as
FILE:LINE: message and exits 1 if there is any, 0 otherwise. Standard library only.
"""
import os
import re
import sys
import urllib.parse

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def strip_code_spans(line):
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def slugify(text):
    """GitHub's heading anchor: rendered text, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images -> their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "")
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def scan(path):
    """Return (anchors, links) of one Markdown file; links are (line number, target)."""
    anchors, links, counts = set(), [], {}
    fence = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = FENCE.match(line)
            if m:
                marker = m.group(1)
                if fence is None:
                    fence = marker[0] * len(marker)
                elif marker.startswith(fence):
                    fence = None
                continue
            if fence is not None:
                continue
            for a in HTML_ANCHOR.findall(line):
                anchors.add(a)
            h = HEADING.match(line)
            if h:
                slug = slugify(h.group(2))
                n = counts.get(slug, 0)
                counts[slug] = n + 1
                anchors.add(slug if n == 0 else "%s-%d" % (slug, n))
            text = strip_code_spans(line)
            for target in INLINE_LINK.findall(text):
                links.append((number, target))
            r = REF_DEF.match(text)
            if r:
                links.append((number, r.group(1)))
    return anchors, links


def markdown_files(root):
    files = []
    readme = os.path.join(root, "README.md")
    if os.path.isfile(readme):
        files.append(readme)
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "docs")):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".md"):
                files.append(os.path.join(dirpath, name))
    return files


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1] in ("-h", "--help")):
        print(__doc__.strip())
        return 2
    root = os.path.abspath(argv[1] if len(argv) == 2 else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    cache = {}

    def anchors_of(path):
        if path not in cache:
            cache[path] = scan(path)[0]
        return cache[path]

    broken = 0
    checked = 0
    for md in markdown_files(root):
        _, links = scan(md)
        rel_md = os.path.relpath(md, root)
        for number, target in links:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue  # absolute URL (http:, https:, mailto:, ...)
            checked += 1
            path_part, _, anchor = target.partition("#")
            path_part = urllib.parse.unquote(path_part)
            anchor = urllib.parse.unquote(anchor)
            if path_part:
                dest = os.path.normpath(os.path.join(os.path.dirname(md), path_part))
            else:
                dest = md
            problem = None
            if os.path.relpath(dest, root).startswith(".."):
                problem = "points outside the repository"
            elif not os.path.exists(dest):
                problem = "no such file"
            elif anchor and dest.endswith(".md") and os.path.isfile(dest):
                if anchor not in anchors_of(dest):
                    problem = "no heading with anchor #%s in %s" % (
                        anchor, os.path.relpath(dest, root))
            if problem:
                broken += 1
                print("%s:%d: %s: %s" % (rel_md, number, target, problem))
    print("%d relative links checked, %d broken" % (checked, broken), file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
