#!/usr/bin/env python3
"""The layering rules of cmake/layers.txt, checked on #include lines.

Usage: check_includes.py TABLE ROOT

Every source and header under a module's folders in ROOT is read; an #include "..." of a
header of a module that the file's module may not use (transitively, as the table says) is
reported with file and line. Exit 1 on any. cmake/PdLayering.cmake checks the same table on
the link graph.
"""
import pathlib
import sys

SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}


def read_table(path: pathlib.Path):
    """module -> (path prefixes, modules it names)"""
    modules = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cols = line.split()
        if len(cols) != 4:
            sys.exit(f"{path}:{n}: expected 4 columns, got {len(cols)}")
        name, paths, _targets, uses = cols
        modules[name] = ([p.rstrip("/") + "/" for p in paths.split(",")],
                         [] if uses == "-" else uses.split(","))
    return modules


def allowed_modules(modules, name):
    allowed, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m in allowed:
            continue
        if m not in modules:
            sys.exit(f"layering: module {name} may use '{m}', which is no module")
        allowed.add(m)
        todo.extend(modules[m][1])
    return allowed


def module_of(modules, path: str):
    """The module whose longest path prefix starts `path`, or None."""
    best, best_len = None, 0
    for name, (prefixes, _) in modules.items():
        for p in prefixes:
            if path.startswith(p) and len(p) > best_len:
                best, best_len = name, len(p)
    return best


def include_target(line: str):
    s = line.strip()
    if not s.startswith("#"):
        return None
    s = s[1:].lstrip()
    if not s.startswith("include"):
        return None
    s = s[len("include"):].strip()
    if not s.startswith('"'):
        return None
    end = s.find('"', 1)
    return s[1:end] if end > 0 else None


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    modules = read_table(pathlib.Path(sys.argv[1]))
    root = pathlib.Path(sys.argv[2]).resolve()
    allowed = {m: allowed_modules(modules, m) for m in modules}
    problems, files = [], 0
    for path in sorted(root.rglob("*")):
        if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("build", "tests/")):
            continue
        module = module_of(modules, rel)
        if module is None:
            continue
        files += 1
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            target = include_target(line)
            if target is None:
                continue
            used = module_of(modules, target)
            if used is not None and used not in allowed[module]:
                problems.append(f"{rel}:{n}: includes {target}: {module} may not use {used}")
    for p in problems:
        print(p)
    print(f"layering: {files} files checked, {len(problems)} forbidden include(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
