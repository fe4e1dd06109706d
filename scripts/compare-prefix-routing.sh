#!/usr/bin/env bash
# Replays the start of the Mooncake FAST'25 conversation trace (real prefix sharing: every
# request starts with the same system block, turns of one conversation share their history)
# against `pdserve up` (1 prefill + 1 decode worker, CPU, the small model), once per mode:
#   length  routing by length and load only (router.routing.prefix_aware_routing: false)
#   prefix  prefix-aware, the defaults (exact KV-event index where current, docs/kv_events.md)
#   approx  prefix-aware on the predicted index only (router.routing.exact_prefix_routing: false)
#   exact   the same as prefix, named for the approx/exact comparison
# Writes OUT/MODE.{json,csv,html,txt}, the router's route decisions, prefix-hit counters
# (predicted / exact / actual) per mode in OUT/MODE.routes.txt, a one-line hit-match summary
# per mode in OUT/MODE.hits.txt, and prints `pdserve bench compare` of the first two modes.
# usage: scripts/compare-prefix-routing.sh [OUT_DIR] [DURATION_S] [LENGTH_SCALE] [MODES]
#   MODES: space-separated, default "length prefix"; "approx exact" compares the two indexes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/compare-prefix-routing} duration=${2:-120} scale=${3:-0.04} modes=${4:-length prefix}
bin=build/bin
mkdir -p "$out"
metric() { awk -v s="$1" 'index($0, s) == 1 { v = $NF } END { print (v == "" ? 0 : v) }' "$2"; }
for mode in $modes; do
  aware=true exact=true
  case "$mode" in
    length) aware=false ;;
    approx) exact=false ;;
    prefix | exact) ;;
    *) echo "unknown mode '$mode' (length, prefix, approx, exact)" >&2; exit 2 ;;
  esac
  sed "s/short_prompt_tokens: .*/short_prompt_tokens: 64\n    prefix_aware_routing: $aware\n    exact_prefix_routing: $exact/; s/port: 8000/port: 18081/; s/control_port: 9000/control_port: 19081/; s|disk_path: kv-cache|disk_path: $out/$mode.kv-cache|" \
    deploy/configs/local.yaml > "$out/$mode.yaml"
  rm -rf "$out/$mode.kv-cache"  # the disk KV tier (docs/kv_cache.md): no blocks of an earlier run
  "$bin/pdserve" up --config "$out/$mode.yaml" > "$out/$mode.up.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do grep -q "pdserve is up" "$out/$mode.up.log" && break; sleep 1; done
  "$bin/pdserve" bench --url http://127.0.0.1:18081 \
    --trace data/traces/mooncake_fast25_conversation_trace.jsonl --spread-ticks \
    --duration "$duration" --length-scale "$scale" --max-output-tokens 32 \
    --warmup 4 --slo ttft_ms=2000,itl_ms=200 --extra-body '{"return_token_ids": true}' \
    --no-progress --out "$out/$mode" | tee "$out/$mode.txt"
  curl -s http://127.0.0.1:18081/metrics | grep -E "^pdserve_route_decisions_total|^pdserve_router_predicted|^pdserve_router_prefix_|^pdserve_router_kv_" \
    | tee "$out/$mode.routes.txt"
  r="$out/$mode.routes.txt"
  # Requests whose predicted hit equalled the worker's actual one, per index (the exact
  # index's counts only requests routed while it was current).
  for index in predicted exact; do
    m=$(metric "pdserve_router_prefix_predictions_total{index=\"$index\",outcome=\"match\"}" "$r")
    o=$(metric "pdserve_router_prefix_predictions_total{index=\"$index\",outcome=\"over\"}" "$r")
    u=$(metric "pdserve_router_prefix_predictions_total{index=\"$index\",outcome=\"under\"}" "$r")
    awk -v i="$index" -v m="$m" -v o="$o" -v u="$u" -v mode="$mode" 'BEGIN {
      n = m + o + u; printf "%s: %s index: %d requests, %d match (%.1f%%), %d over, %d under\n", mode, i, n, m, n ? 100 * m / n : 0, o, u }'
  done | tee "$out/$mode.hits.txt"
  printf "%s: hit tokens predicted %s, exact %s (actual on those requests %s), actual %s\n" "$mode" \
    "$(metric 'pdserve_router_prefix_hit_tokens_total{source="predicted"}' "$r")" \
    "$(metric 'pdserve_router_prefix_hit_tokens_total{source="exact"}' "$r")" \
    "$(metric 'pdserve_router_prefix_hit_tokens_total{source="actual_exact_indexed"}' "$r")" \
    "$(metric 'pdserve_router_prefix_hit_tokens_total{source="actual"}' "$r")" | tee -a "$out/$mode.hits.txt"
  kill -INT $up
  wait $up || true
done
set -- $modes
"$bin/pdserve" bench compare "$out/$1.json" "$out/$2.json" | tee "$out/compare.txt"
