#!/usr/bin/env bash
# Style checks CI runs (docs/design.md §9, "Conventions"):
#   format   every C/C++/CUDA source the repository tracks is as .clang-format says
#            (clang-format 14, Debian's); prints the files that drift and how to fix them
#   subjects every commit subject since SINCE is at most 72 characters
# Usage: check_style.sh format|subjects SOURCE_DIR [SINCE]
set -uo pipefail
what=$1
cd "$2" || exit 2

if [ "$what" = format ]; then
  fmt=$(command -v clang-format-14 || command -v clang-format) ||
    { echo "FAIL: clang-format-14 is not installed (scripts/setup installs it)"; exit 1; }
  mapfile -t files < <(git ls-files '*.cpp' '*.cc' '*.h' '*.hpp' '*.cu' '*.cuh' | grep -v '^tests/npm/')
  [ "${#files[@]}" -gt 0 ] || { echo "FAIL: no sources found (not a git checkout?)"; exit 1; }
  drift=()
  for f in "${files[@]}"; do
    "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1 || drift+=("$f")
  done
  if [ "${#drift[@]}" -gt 0 ]; then
    printf 'not formatted: %s\n' "${drift[@]}"
    echo "FAIL: ${#drift[@]} of ${#files[@]} files drift from .clang-format;" \
         "fix with: $fmt -i ${drift[*]}"
    exit 1
  fi
  echo "format: ${#files[@]} files match .clang-format"
elif [ "$what" = subjects ]; then
  since=$3
  if ! git cat-file -e "$since^{commit}" 2>/dev/null; then
    echo "SKIP: $since is not in this clone's history (a shallow clone?): the subjects cannot be checked"
    exit 77
  fi
  long=$(git log --format='%h %s' "$since..HEAD" | awk '{s=$0; sub(/^[^ ]+ /, "", s); if (length(s) > 72) print}')
  if [ -n "$long" ]; then
    echo "$long"
    echo "FAIL: commit subjects over 72 characters (above)"
    exit 1
  fi
  echo "subjects: every subject since $since is at most 72 characters"
else
  echo "usage: check_style.sh format|subjects SOURCE_DIR [SINCE]"; exit 2
fi
