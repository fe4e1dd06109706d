#!/usr/bin/env bash
# kernels/check-gpu.sh on a machine without a GPU: it parses, exits 2 at once with the reason,
# builds nothing and leaves its summary under $OUT. With a GPU this is a skip (exit 77): the
# script itself is then the check, run by hand or by the device tool (it takes minutes).
# Usage: check_gpu_script_test.sh SOURCE_DIR
set -uo pipefail
src=$1
script="$src/kernels/check-gpu.sh"
bash -n "$script" || { echo "FAIL: bash -n $script"; exit 1; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIPPED: a GPU is present: run kernels/check-gpu.sh itself"; exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
log=$(BUILD_DIR="$out/build" OUT="$out/results" timeout 30 bash "$script" 2>&1); rc=$?
echo "$log"
[ "$rc" = 2 ] || { echo "FAIL: without a GPU the script must exit 2, got $rc"; exit 1; }
echo "$log" | grep -q "no GPU visible" || { echo "FAIL: no 'no GPU visible' reason"; exit 1; }
grep -q "^device *SKIP .*no GPU visible" "$out/results/results.txt" ||
  { echo "FAIL: results.txt under \$OUT lacks the device SKIP line"; cat "$out/results/results.txt"; exit 1; }
[ ! -e "$out/build" ] || { echo "FAIL: it started a build without a GPU"; exit 1; }
echo "ok"
