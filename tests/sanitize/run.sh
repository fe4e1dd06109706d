#!/usr/bin/env bash
# The sanitizer run (docs/security.md): configures BUILD_DIR as a second tree of this
# checkout built with gcc and -fsanitize=<SANITIZERS> (PD_SANITIZE; default address,undefined),
# builds the unit tests, the e2e test and the programs the e2e clusters start, and runs their
# ctest cases there. Any sanitizer report fails the run: the test process aborts on the first
# finding (halt_on_error, -fno-sanitize-recover=all), and the cluster processes the e2e cases
# start write their reports to BUILD_DIR/sanitizer-logs, which must stay empty.
#   tests/sanitize/run.sh BUILD_DIR [SANITIZERS] [CTEST_REGEX]
# Env: SAN_JOBS (build and ctest parallelism, default 2); SAN_TARGETS (build only these
# targets, e.g. "test_router_api test_tokenizer", with a matching CTEST_REGEX; default: all).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 BUILD_DIR [address,undefined|thread] [CTEST_REGEX]" >&2
  exit 2
fi
BUILD_DIR=$(realpath -m "$1")
SAN=${2:-address,undefined}
# What runs: every unit test executable and test_e2e (the real programs on loopback). Not the
# multi-host bed, the chart and client checks or the benches: they test the same C++ code
# through scripts, at several times the cost, and run unsanitized in the main tree.
REGEX=${3:-^test_}
JOBS=${SAN_JOBS:-2}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$SRC} CCACHE_NOHASHDIR=1

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  mkdir -p "$BUILD_DIR"
  echo "sanitize: configuring $BUILD_DIR (-fsanitize=$SAN)"
  cmake -S "$SRC" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPD_SANITIZE="$SAN" \
    -DPD_BUILD_BENCHMARKS=OFF -DPD_WITH_CUDA=OFF >"$BUILD_DIR/configure.log" 2>&1 ||
    { cat "$BUILD_DIR/configure.log"; exit 1; }
fi
t0=$(date +%s)
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$JOBS" ${SAN_TARGETS:+--target $SAN_TARGETS} >"$BUILD_DIR/build.log" 2>&1 ||
  { tail -50 "$BUILD_DIR/build.log"; echo "sanitize: build failed (log: $BUILD_DIR/build.log)"; exit 1; }
t1=$(date +%s)
echo "sanitize: built in $((t1 - t0)) s"

LOGS=$BUILD_DIR/sanitizer-logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
# halt_on_error: the first report ends the process. log_path: reports of every process (the
# e2e clusters' too, whose stderr the tests do not read) land in $LOGS as <name>.<pid>.
# detect_leaks: LeakSanitizer runs at every exit (ASan only).
common="halt_on_error=1:abort_on_error=1:log_path=$LOGS/report:print_stacktrace=1"
export ASAN_OPTIONS="$common:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="$common"
export TSAN_OPTIONS="$common:second_deadlock_stack=1"
set +e
(cd "$BUILD_DIR" && ctest -R "$REGEX" -LE gpu --output-on-failure -j "$JOBS" --timeout 900 \
   >"$BUILD_DIR/ctest.log" 2>&1)
rc=$?
set -e
t2=$(date +%s)
grep -E 'tests passed|tests failed|Total Test time' "$BUILD_DIR/ctest.log" || true
echo "sanitize: ran in $((t2 - t1)) s"
reports=$(find "$LOGS" -type f | sort)
if [ -n "$reports" ]; then
  echo "sanitize: FAILED: sanitizer reports:"
  for f in $reports; do
    echo "== $f"
    head -40 "$f"
  done
  exit 1
fi
if [ $rc -ne 0 ]; then
  grep -E '\*\*\*Failed|\*\*\*Timeout|\(Failed\)|\(Timeout\)|Exception' "$BUILD_DIR/ctest.log" | head -40 || true
  # What failed, as Catch2 said it (file:line, the expression, its values, INFO messages):
  # CI shows only this output, not the log.
  grep -E -A10 ': FAILED:$' "$BUILD_DIR/ctest.log" | head -120 || true
  echo "sanitize: FAILED: ctest exit $rc (log: $BUILD_DIR/ctest.log)"
  exit 1
fi
echo "sanitize: clean ($SAN)"
