#!/usr/bin/env bash
# A GPU test is a ctest skip (exit 77, "SKIPPED: <reason>") without a device and a FAILURE
# under PD_REQUIRE_GPU=1; with a device it runs and passes either way (tests/test_skip.h).
# Usage: check_skip_semantics.sh GPU_TEST_BINARY
set -uo pipefail
bin=$1
case_name=$("$bin" --list-test-names-only | sed -n '1p')
[ -n "$case_name" ] || { echo "no test case in $bin"; exit 1; }
out=$("$bin" "$case_name" 2>&1); rc=$?
out_req=$(PD_REQUIRE_GPU=1 "$bin" "$case_name" 2>&1); rc_req=$?
if nvidia-smi -L >/dev/null 2>&1; then
  echo "device present: '$case_name' -> $rc, under PD_REQUIRE_GPU=1 -> $rc_req (both must be 0)"
  [ $rc = 0 ] && [ $rc_req = 0 ]; exit $?
fi
echo "no device: '$case_name' -> exit $rc; under PD_REQUIRE_GPU=1 -> exit $rc_req"
echo "$out" | grep -q "^SKIPPED: no CUDA device" || { echo "FAIL: no 'SKIPPED: no CUDA device' line:"; echo "$out"; exit 1; }
[ $rc = 77 ] || { echo "FAIL: a skip must exit 77, got $rc"; exit 1; }
[ $rc_req != 0 ] && [ $rc_req != 77 ] || { echo "FAIL: PD_REQUIRE_GPU=1 must turn the skip into a failure, got $rc_req"; echo "$out_req"; exit 1; }
echo "ok"
