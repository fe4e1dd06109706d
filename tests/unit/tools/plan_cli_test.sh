#!/usr/bin/env bash
# `pdserve plan` from the command line, on a tiny model and its own calibration: one layout
# (--layout) at --rate for --duration simulates as many requests as `pdserve bench --rate
# --duration` sends (the Poisson arrivals cover the whole duration, not the span of the
# trace rows that --duration selects: on the Azure code trace that span is shorter), and
# --requests-csv writes one row per simulated request.
#   plan_cli_test.sh PDSERVE_BIN SOURCE_DIR
set -euo pipefail
BIN=$1
SRC=$2
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$BIN" make-model --preset tiny --out "$WORK/tiny" > /dev/null
"$BIN" plan --calibrate --model "$WORK/tiny" --threads 1 --out "$WORK/cal.json" > /dev/null
PLAN=("$BIN" plan --calibration "$WORK/cal.json" --model "$WORK/tiny" --kv-cache-bytes 67108864
  --trace "$SRC/data/traces/azure_llm_2023_code.csv" --length-scale 0.35 --max-prompt-tokens 1500
  --max-output-tokens 64 --duration 60 --layout 1p1d --threshold 256 --rate 1.5 --slo ttft_ms=2000,itl_ms=100)
line=$("${PLAN[@]}" --requests-csv "$WORK/requests.csv" 2> /dev/null | grep "^simulated")
echo "$line"
requests=$(sed -n 's|.* [0-9]*/\([0-9]*\) finished.*|\1|p' <<< "$line")
# Poisson at 1.5/s for 60 s: 90 expected; the fixed seed's draw lies well inside [65, 115].
if [ -z "$requests" ] || [ "$requests" -lt 65 ] || [ "$requests" -gt 115 ]; then
  echo "FAIL: expected ~90 simulated requests (1.5/s for 60 s), got '${requests}'"
  exit 1
fi
rows=$(($(wc -l < "$WORK/requests.csv") - 1))
disaggregated=$(grep -c ",disaggregated,1," "$WORK/requests.csv" || true)
said=$(sed -n 's|.*, \([0-9]*\) disaggregated$|\1|p' <<< "$line")
if [ "$rows" != "$requests" ] || [ "$disaggregated" != "$said" ]; then
  echo "FAIL: --requests-csv has $rows rows ($disaggregated disaggregated), the summary says $requests ($said)"
  exit 1
fi
echo "ok: $requests requests simulated, each in --requests-csv"

# A decode worker whose one-stream steps took 50 ms (the tiny model's modelled step is well
# under 1 ms): the simulated ITL follows the trace.
{
  echo "time_s,role,seconds,gap_seconds,decode_rows,decode_context_tokens,prompt_chunks,prompt_tokens,prompt_context_tokens"
  for i in $(seq 1 30); do echo "1.0,decode,0.050,0,1,$((300 + i)),0,0,0"; done
} > "$WORK/decode-0.steps.csv"
traced=$("${PLAN[@]}" --step-trace "$WORK/decode-0.steps.csv" 2> /dev/null)
itl=$(grep "^simulated" <<< "$traced" | sed -n 's|.*ITL p50/p90/p99 *\([0-9.]*\) .*|\1|p')
if ! grep -q "decode worker, decode-only steps *30 rows" <<< "$traced" || ! awk -v x="$itl" 'BEGIN { exit !(x > 20) }'; then
  echo "FAIL: with a trace of 50 ms decode steps, expected its 30 rows and an ITL p50 far above 1 ms:"
  echo "$traced"
  exit 1
fi
if "${PLAN[@]}" --step-trace "$WORK/none.steps.csv" > /dev/null 2> "$WORK/err" || ! grep -q "cannot read $WORK/none.steps.csv" "$WORK/err"; then
  echo "FAIL: a missing --step-trace file is not named:"; cat "$WORK/err"; exit 1
fi
echo "ok: --step-trace: ITL p50 $itl ms (one-stream steps traced at 50 ms); a missing trace is named"

# --autoscale: the pools start at the minimum and report the devices they held; a minimum
# larger than the layout, or of another kind, is refused by name.
scaled=$("${PLAN[@]/1p1d/2p2d}" --autoscale 1p1d --startup-s 5 2> /dev/null)
if ! grep -q "^devices: .* at most; autoscaled from 1p1d: [0-9]* workers started, [0-9]* drained" <<< "$scaled"; then
  echo "FAIL: --autoscale prints no devices line:"; echo "$scaled"; exit 1
fi
if "${PLAN[@]}" --autoscale 2p2d > /dev/null 2> "$WORK/err" || ! grep -q "the minimum must be a layout of the same kind no larger than --layout 1p1d" "$WORK/err"; then
  echo "FAIL: a minimum larger than the layout is not refused:"; cat "$WORK/err"; exit 1
fi
echo "ok: --autoscale: $(grep '^devices' <<< "$scaled")"
