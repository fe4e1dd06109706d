#!/usr/bin/env bash
# Replays the Azure 2023 conversation trace against `pdserve up` (1 prefill + 1 decode worker,
# CPU, the small model) twice: every request colocated, then disaggregated with the default
# threshold of deploy/configs/local.yaml. Writes OUT/{colocated,disaggregated}.{json,csv,html}
# and prints `pdserve bench compare`. docs/performance.md records a run of it.
# usage: scripts/compare-routes.sh [OUT_DIR] [DURATION_S] [TIME_SCALE]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/compare-routes} duration=${2:-180} scale=${3:-7}
bin=build/bin
mkdir -p "$out"
for mode in colocated disaggregated; do
  threshold=64
  [ "$mode" = colocated ] && threshold=1000000
  sed "s/short_prompt_tokens: .*/short_prompt_tokens: $threshold/; s/port: 8000/port: 18080/; s/control_port: 9000/control_port: 19080/; s|disk_path: kv-cache|disk_path: $out/$mode.kv-cache|" \
    deploy/configs/local.yaml > "$out/$mode.yaml"
  rm -rf "$out/$mode.kv-cache"  # the disk KV tier (docs/kv_cache.md): no blocks of an earlier run
  "$bin/pdserve" up --config "$out/$mode.yaml" > "$out/$mode.up.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do grep -q "pdserve is up" "$out/$mode.up.log" && break; sleep 1; done
  "$bin/pdserve" bench --url http://127.0.0.1:18080 --trace data/traces/azure_llm_2023_conv.csv \
    --time-scale "$scale" --duration "$duration" --max-prompt-tokens 1024 --max-output-tokens 64 \
    --warmup 4 --slo ttft_ms=1500,itl_ms=200 --extra-body '{"return_token_ids": true}' \
    --no-progress --out "$out/$mode" | tee "$out/$mode.txt"
  kill -INT $up
  wait $up || true
done
"$bin/pdserve" bench compare "$out/colocated.json" "$out/disaggregated.json" | tee "$out/compare.txt"
