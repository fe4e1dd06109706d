#!/usr/bin/env bash
# The shifting-mix experiment (docs/performance.md "Shifting mix"): a phased bench
# run whose mix shifts from short prompts to long ones half-way and back, against `pdserve up`
# with pools that may scale (prefill 1..2, decode 1..2; a core each is what this 2-core
# machine has, so 4 workers oversubscribe it), once with the local actuator following the
# autoscaler and once with `pdserve up --no-autoscale` (the same pools fixed at 1 + 1). The
# bench scrapes the router's /metrics into a timeline, so each HTML report shows replicas per
# pool (registered and desired), the routing threshold and TTFT / ITL against the SLO over
# time with the phase boundaries. Prints SLO attainment and goodput of both runs, per phase.
# Usage: scripts/bench-shifting-mix.sh [BUILD_DIR] [OUT_DIR]
#   env: PHASE_S=40 SHORT_RATE=4 LONG_RATE=0.5 SHORT_PROMPT=uniform:16:128 LONG_PROMPT=uniform:800:1600
#        OUTPUT=uniform:16:64 SLO=ttft_ms=2000,itl_ms=100 SEED=0
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-shifting-mix-$(date -u +%Y%m%d-%H%M%S)}
BIN="$BUILD/bin"
PHASE_S=${PHASE_S:-40}
SHORT_RATE=${SHORT_RATE:-4}
LONG_RATE=${LONG_RATE:-0.5}
SHORT_PROMPT=${SHORT_PROMPT:-uniform:16:128}
LONG_PROMPT=${LONG_PROMPT:-uniform:800:1600}
OUTPUT=${OUTPUT:-uniform:16:64}
SLO=${SLO:-ttft_ms=2000,itl_ms=100}
SEED=${SEED:-0}
PORT=${PORT:-8120}
CONTROL=${CONTROL:-9120}
mkdir -p "$OUT"
WORK=$(mktemp -d)
source scripts/lib/cluster.sh
PID=
trap 'pd_down; rm -rf "$WORK"' EXIT

[ -f models/small/config.json ] || "$BIN/pdserve" make-model --preset small --out models/small > /dev/null

# Shortened autoscaler clocks so a phase of ~40 s shows a decision each way: a 1 s tick, a
# 10 s window with 10 samples, 3 s between scale-ups, 10 s before a scale-down and 10 s idle.
# The adaptive threshold is on, so its moves show in the report too. Shedding is off: the
# experiment measures what scaling does with the load, not how much of it is refused.
cat > "$WORK/cluster.yaml" <<YAML
model: {path: models/small, preset: small, name: small, dtype: f32}
router:
  http: {host: 127.0.0.1, port: $PORT}
  workers: {control_port: $CONTROL}
  routing: {short_prompt_tokens: 256, adaptive_threshold: true}
  requests: {request_timeout_ms: 300000}
  admission: {overload_shedding: false}
  autoscaler: {tick_ms: 1000, window_ms: 10000, min_samples: 10, scale_up_cooldown_ms: 3000,
               scale_down_cooldown_ms: 10000, idle_after_ms: 10000}
pools:
  prefill: {replicas: 1, min_replicas: 1, max_replicas: 2, slo: {ttft_ms: 2000, percentile: 99}}
  decode: {replicas: 1, min_replicas: 1, max_replicas: 2, slo: {itl_ms: 100, percentile: 99}}
engine: {backend: cpu, threads: 1, block_size: 16, kv_cache_bytes: 268435456, max_batch_tokens: 1024, max_running_requests: 64}
kv_transfer: {transports: [tcp], listen_host: 127.0.0.1, timeout_ms: 60000, on_remote_prefill_failure: recompute}
logging: {level: warn}
YAML

up() {  # $1: label, $2...: extra pdserve up flags
  local label=$1
  shift
  pd_up "$WORK/cluster.yaml" "$OUT/$label-up.log" "$@"
}

PHASES=(--phase "prompt-len=$SHORT_PROMPT,rate=$SHORT_RATE,duration=$PHASE_S"
        --phase "prompt-len=$LONG_PROMPT,rate=$LONG_RATE,duration=$PHASE_S"
        --phase "prompt-len=$SHORT_PROMPT,rate=$SHORT_RATE,duration=$PHASE_S")
# return_token_ids: every chunk says how many tokens it carries, so the ITL is per token
# (docs/bench.md, "What is measured").
COMMON=(--url "http://127.0.0.1:$PORT" --output-len "$OUTPUT" "${PHASES[@]}" --slo "$SLO" --seed "$SEED"
        --warmup 2 --extra-body '{"return_token_ids": true}' --no-progress
        --metrics-url "http://127.0.0.1:$PORT/metrics" --metrics-interval-ms 1000)

echo "shifting mix: ${PHASE_S} s each of short ($SHORT_PROMPT at $SHORT_RATE/s), long ($LONG_PROMPT at $LONG_RATE/s)," \
     "short; output $OUTPUT; SLO $SLO; load average now: $(cut -d' ' -f1-3 /proc/loadavg)"
for mode in scaling fixed; do
  if [ "$mode" = scaling ]; then up "$mode"; else up "$mode" --no-autoscale; fi
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  "$BIN/pdserve" bench "${COMMON[@]}" --out "$OUT/$mode" > "$OUT/$mode.txt" || true
  # The cluster's own load is about 2; much more means something else shared the cores.
  echo "$mode: load average before $before, after $(cut -d' ' -f1-3 /proc/loadavg)"
  pd_down
done

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def pct(v): return "-" if v is None else f"{100*v:.1f}%"
def num(v, f="{:.2f}"): return "-" if v is None else f.format(v)
runs = {m: json.load(open(f"{out}/{m}.json")) for m in ("scaling", "fixed")}
print("| run | phase | requests | good | SLO attainment | goodput (req/s) | p99 TTFT (ms) | p99 ITL (ms) | max workers P/D |")
print("|---|---|---|---|---|---|---|---|---|")
for m, j in runs.items():
    p = j["pdserve"]
    tl = p.get("timeline", {"series": []})
    def peak(pool, lo=None, hi=None):
        for s in tl["series"]:
            if s["name"] == "pdserve_pool_workers" and s["labels"].get("pool") == pool:
                vals = [v for t, v in s["points"] if v is not None and (lo is None or lo <= t < hi)]
                return "-" if not vals else f"{max(vals):.0f}"
        return "-"
    sent = j["completed"] + j["failed"]
    print(f'| {m} | all | {sent} | {p["good_requests"]} | {pct(p["slo_attainment"])} | {num(j["request_goodput"])} '
          f'| {num(j["p99_ttft_ms"], "{:.0f}")} | {num(j["p99_itl_ms"], "{:.0f}")} | {peak("prefill")}/{peak("decode")} |')
    for k, ph in enumerate(p.get("phases", []), 1):
        print(f'| {m} | {k}: {ph["prompt_len"]} @ {ph["rate"]}/s | {ph["requests"]} | {ph["good_requests"]} '
              f'| {pct(ph["slo_attainment"])} | {num(ph["request_goodput"])} | {num(ph["p99_ttft_ms"], "{:.0f}")} '
              f'| {num(ph["p99_itl_ms"], "{:.0f}")} | {peak("prefill", ph["start_s"], ph["end_s"])}/{peak("decode", ph["start_s"], ph["end_s"])} |')
    print(f'|  | timeline | {tl.get("scrapes", 0)} scrapes, {tl.get("failed_scrapes", 0)} failed | | | | | | |')
PY
echo "reports: $OUT/scaling.html $OUT/fixed.html (JSON, CSV and the clusters' logs beside them)"
