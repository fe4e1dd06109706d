#!/usr/bin/env python3
"""The dependency rules of docs/architecture.md, checked on #include lines.

Every source and header under the product's directories is read; an include of a project
header from a module its layer may not use is reported with file and line. Exit 1 on any.
(cmake/PdLayering.cmake checks the same rules on the link graph.)
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
PROJECT_DIRS = ["common/", "kernels/", "kvtransfer/", "worker/", "prefill_worker/", "decode_worker/", "flex_worker/",
                "router/", "tools/"]
ROLES = ["prefill_worker/", "decode_worker/"]
# module prefix -> include prefixes it must never use (longest prefix wins)
FORBIDDEN = {
    "common/base/": [d for d in PROJECT_DIRS if d != "common/"] + ["common/config/", "common/proto/", "common/net/",
                                                                    "common/metrics/", "common/tokenizer/", "common/engine/"],
    "kernels/": [d for d in PROJECT_DIRS if d != "kernels/"],
    "common/": ["kvtransfer/", "worker/", "flex_worker/", "router/", "tools/"] + ROLES,
    "kvtransfer/": ["common/engine/", "worker/", "flex_worker/", "router/", "tools/"] + ROLES,
    "worker/": ["flex_worker/", "router/", "tools/"] + ROLES,
    "prefill_worker/": ["decode_worker/", "flex_worker/", "router/", "tools/"],
    "decode_worker/": ["prefill_worker/", "flex_worker/", "router/", "tools/"],
    # pdserve-worker: both roles, switched at run time; above them, below nothing but tools/.
    "flex_worker/": ["router/", "tools/"],
    "router/": ["common/engine/", "kvtransfer/", "worker/", "flex_worker/", "tools/"] + ROLES,
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def module_of(rel: str):
    best = None
    for prefix in FORBIDDEN:
        if rel.startswith(prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def main() -> int:
    problems = []
    files = 0
    for path in sorted(ROOT.rglob("*")):
        if path.suffix not in {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"} or not path.is_file():
            continue
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("build", "tests/")):
            continue
        module = module_of(rel)
        if module is None:
            continue
        files += 1
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            for bad in FORBIDDEN[module]:
                if target.startswith(bad):
                    problems.append(f"{rel}:{n}: includes {target}: {module} may not use {bad}")
    for p in problems:
        print(p)
    print(f"layering: {files} files checked, {len(problems)} forbidden include(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
