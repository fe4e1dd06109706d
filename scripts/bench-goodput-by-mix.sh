#!/usr/bin/env bash
# The goodput-by-mix benchmark (docs/performance.md "Goodput by trace mix"): the same
# two cores served four ways, on three trace mixes, with the same requests. Every worker runs
# the default engine.threads (0: all cores), as `pdserve up` does; the workers of a 1 + 1
# layout share the two cores.
#   adaptive      1 prefill + 1 decode worker, short-prompt threshold 256 moving with the
#                 pools' SLO headroom (router.routing.adaptive_threshold), SLO-sized prefill chunks
#                 and protect_itl routing: the default layout, adapting by itself;
#   colocated     1 decode worker and no prefill pool;
#   colocated_slo the same with SLO-sized prefill chunks;
#   disaggregated 1 prefill + 1 decode worker, the threshold fixed at 256, fixed chunks.
# Each mix replays its trace's lengths (x0.35, prompts <= 1,500 tokens, outputs <= 64) as
# Poisson arrivals at the mix's rate (near what 1 + 1 sustains) for 120 s (one burst decides a
# 40 s run: the layouts' order flipped between runs), and prints goodput (requests within
# both SLOs per second) and attainment per layout.
# Usage: scripts/bench-goodput-by-mix.sh [BUILD_DIR]
#   env: DURATION (every mix's) MIXES="conv code mooncake" SLO=ttft_ms=2000,itl_ms=100 RATE
#        (every mix's) LAYOUTS="adaptive colocated colocated_slo disaggregated"
#        THREADS=0 (engine.threads of every worker; 1 gives each worker of a 1 + 1 layout a
#        core of its own, and the colocated ones 2: the layouts of the 2 Dec tables)
#        KEEP=DIR keeps every run's bench report (DIR/MIX-LAYOUT.json) and the /metrics of
#        the router (DIR/MIX-LAYOUT.metrics) and of each worker (DIR/MIX-LAYOUT.WORKER.metrics)
#        scraped at the end, and each cluster's log (DIR/MIX-LAYOUT.log)
#        LOG_LEVEL=warn (logging.level: debug logs every engine step of the workers)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN="$BUILD/bin"
THREADS=${THREADS:-0}
MIXES=${MIXES:-"conv code mooncake"}
LAYOUTS=${LAYOUTS:-"adaptive colocated colocated_slo disaggregated"}
SLO=${SLO:-ttft_ms=2000,itl_ms=100}
WORK=${KEEP:-$(mktemp -d)}
mkdir -p "$WORK"
source scripts/lib/cluster.sh
PID=
trap 'pd_down; [ -n "${KEEP:-}" ] || rm -rf "$WORK"' EXIT

[ -f models/small/config.json ] || "$BIN/pdserve" make-model --preset small --out models/small > /dev/null

config() {  # $1: layout
  local prefill=1 threads=$THREADS threshold=256 adaptive=false colocated_threads=0
  [ "$THREADS" = 0 ] || colocated_threads=$((2 * THREADS))
  case $1 in
    adaptive) adaptive=true ;;
    colocated) prefill=0 threads=$colocated_threads ;;
    colocated_slo) prefill=0 threads=$colocated_threads adaptive=true ;;
    disaggregated) ;;
    *) echo "unknown layout $1" >&2; exit 2 ;;
  esac
  cat <<YAML
model: {path: models/small, preset: small, name: small, dtype: f32}
router:
  http: {host: 127.0.0.1, port: 8130}
  workers: {control_port: 9130}
  routing: {short_prompt_tokens: $threshold, adaptive_threshold: $adaptive}
  requests: {request_timeout_ms: 300000}
pools:
  prefill: {replicas: $prefill, slo: {ttft_ms: 2000, percentile: 99}}
  decode: {replicas: 1, slo: {itl_ms: 100, percentile: 99}}
engine: {backend: cpu, threads: $threads, block_size: 16, kv_cache_bytes: 268435456, max_batch_tokens: 1024,
         max_running_requests: 64, slo_sized_prefill_chunks: $adaptive}
kv_transfer: {transports: [tcp], listen_host: 127.0.0.1, timeout_ms: 60000, on_remote_prefill_failure: recompute}
logging: {level: ${LOG_LEVEL:-warn}}
YAML
}

echo "goodput by mix: engine.threads $THREADS, SLO $SLO; load average now: $(cut -d' ' -f1-3 /proc/loadavg)"
for mix in $MIXES; do
  TRACE=$(pd_mix_trace "$mix")
  case $mix in
    conv) MIX_RATE=${RATE:-3} ;;
    code) MIX_RATE=${RATE:-2} ;;
    *) MIX_RATE=${RATE:-0.6} ;;
  esac
  for layout in $LAYOUTS; do
    config "$layout" > "$WORK/$layout.yaml"
    pd_up "$WORK/$layout.yaml" "$WORK/$mix-$layout.log"
    "$BIN/pdserve" bench --url http://127.0.0.1:8130 --trace "$TRACE" --length-scale 0.35 --max-prompt-tokens 1500 \
      --max-output-tokens 64 --rate "$MIX_RATE" --duration "${DURATION:-120}" --slo "$SLO" --warmup 2 \
      --extra-body '{"return_token_ids": true}' --no-progress --out "$WORK/$mix-$layout" > /dev/null || true
    curl -s http://127.0.0.1:8130/metrics > "$WORK/$mix-$layout.metrics" || true
    for worker in decode-0 prefill-0; do
      url=$(pd_worker_metrics_url "$WORK/$mix-$layout.log" "$worker")
      [ -z "$url" ] || curl -s "$url" > "$WORK/$mix-$layout.$worker.metrics" || true
    done
    pd_down
  done
  python3 - "$WORK" "$mix" "$MIX_RATE" $LAYOUTS <<'PY'
import json, sys
work, mix, rate = sys.argv[1:4]
rows = {}
for layout in sys.argv[4:]:
    try:
        rows[layout] = json.load(open(f"{work}/{mix}-{layout}.json"))
    except OSError:
        rows[layout] = None
for layout, j in rows.items():
    if j is None:
        print(f"| {mix} @ {rate}/s | {layout} | no report |")
        continue
    p = j["pdserve"]
    print(f'| {mix} @ {rate}/s | {layout} | {j["request_goodput"]:.2f} req/s | {100 * p["slo_attainment"]:.1f}% '
          f'| {j["completed"]} done, {j["failed"]} failed | p99 TTFT {j["p99_ttft_ms"]:.0f} ms | p99 ITL {j["p99_itl_ms"]:.0f} ms |')
PY
done
