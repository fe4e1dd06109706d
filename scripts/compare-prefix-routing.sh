#!/usr/bin/env bash
# Replays the start of the Mooncake FAST'25 conversation trace (real prefix sharing: every
# request starts with the same system block, turns of one conversation share their history)
# against `pdserve up` (1 prefill + 1 decode worker, CPU, the small model) twice: routing by
# length and load only (router.prefix_aware_routing: false), then prefix-aware (the default).
# Writes OUT/{length,prefix}.{json,csv,html,txt}, the router's route decisions and the
# workers' prefix-cache hits per mode, and prints `pdserve bench compare`.
# usage: scripts/compare-prefix-routing.sh [OUT_DIR] [DURATION_S] [LENGTH_SCALE]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/compare-prefix-routing} duration=${2:-120} scale=${3:-0.04}
bin=build/bin
mkdir -p "$out"
for mode in length prefix; do
  aware=true
  [ "$mode" = length ] && aware=false
  sed "s/short_prompt_tokens: .*/short_prompt_tokens: 64\n  prefix_aware_routing: $aware/; s/port: 8000/port: 18081/; s/control_port: 9000/control_port: 19081/" \
    deploy/configs/local.yaml > "$out/$mode.yaml"
  "$bin/pdserve" up --config "$out/$mode.yaml" > "$out/$mode.up.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do grep -q "pdserve is up" "$out/$mode.up.log" && break; sleep 1; done
  "$bin/pdserve" bench --url http://127.0.0.1:18081 \
    --trace data/traces/mooncake_fast25_conversation_trace.jsonl --spread-ticks \
    --duration "$duration" --length-scale "$scale" --max-output-tokens 32 \
    --warmup 4 --slo ttft_ms=2000,itl_ms=200 --extra-body '{"return_token_ids": true}' \
    --no-progress --out "$out/$mode" | tee "$out/$mode.txt"
  curl -s http://127.0.0.1:18081/metrics | grep -E "^pdserve_route_decisions_total|^pdserve_router_predicted" \
    | tee "$out/$mode.routes.txt"
  kill -INT $up
  wait $up || true
done
"$bin/pdserve" bench compare "$out/length.json" "$out/prefix.json" | tee "$out/compare.txt"
