#!/usr/bin/env bash
# The mixed-load benchmark (docs/performance.md "Mixed load"): S short streams
# decode while L long prompts arrive; run against two local clusters on this machine:
#   disaggregated: 1 prefill + 1 decode worker, one engine thread each, TCP KV;
#   colocated:     1 decode worker with two engine threads, no prefill pool, with SLO-sized
#                  prefill chunks (the default) and, for the same-run comparison, without
#                  (engine.slo_sized_prefill_chunks: false: max_batch_tokens chunks).
# Usage: scripts/bench-mixed.sh [BUILD_DIR] [-- extra `pdserve bench mixed` options]
# Needs the small model (models/small; `pdserve up` makes it on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
BIN="$BUILD/bin"
WORK=$(mktemp -d)
source scripts/lib/cluster.sh
PID=
trap 'pd_down; rm -rf "$WORK"' EXIT

config() {  # $1: prefill replicas, $2: engine threads, $3: SLO-sized prefill chunks (true/false)
  cat <<YAML
model: {path: models/small, preset: small, name: small, dtype: f32}
router:
  http: {host: 127.0.0.1, port: 8100}
  workers: {control_port: 9100}
  routing: {short_prompt_tokens: 256}
  requests: {request_timeout_ms: 120000}
pools:
  prefill: {replicas: $1, slo: {ttft_ms: 2000, percentile: 90}}
  decode: {replicas: 1, slo: {itl_ms: 100, percentile: 90}}
engine: {backend: cpu, threads: $2, block_size: 16, kv_cache_bytes: 268435456, max_batch_tokens: 1024, max_running_requests: 32, slo_sized_prefill_chunks: $3}
kv_transfer: {transports: [tcp], listen_host: 127.0.0.1, timeout_ms: 10000, on_remote_prefill_failure: recompute}
logging: {level: warn}
YAML
}

run() {  # $1: label, $2: prefill replicas, $3: threads, $4: SLO-sized prefill chunks
  config "$2" "$3" "$4" > "$WORK/$1.yaml"
  pd_up "$WORK/$1.yaml" "$WORK/$1.log"
  "$BIN/pdserve" bench mixed --url http://127.0.0.1:8100 --label "$1" "${EXTRA[@]}" || RC=1
  pd_down
}

RC=0
run "disaggregated (1 prefill + 1 decode, 1 thread each)" 1 1 true
run "colocated (1 decode worker, 2 threads)" 0 2 true
run "colocated, fixed 1,024-token chunks" 0 2 false
exit $RC
