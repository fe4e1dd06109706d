#!/usr/bin/env bash
# The overload benchmark (docs/performance.md "Overload"): a 1 prefill + 1 decode
# cluster on this machine; first its capacity (closed loop over the Azure conversation
# trace's lengths, CONCURRENCY streams, CAPACITY_S seconds: completed requests/s), then the
# same trace's lengths at 3x that rate (Poisson) for OVERLOAD_S seconds, once with the
# router's overload shedding on and once off. Prints the p99 TTFT/ITL of admitted requests,
# the share shed and the time to the first 429 for both.
# Usage: scripts/bench-overload.sh [BUILD_DIR]   (env: CAPACITY_S=30 OVERLOAD_S=60 FACTOR=3)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN="$BUILD/bin"
CAPACITY_S=${CAPACITY_S:-30}
OVERLOAD_S=${OVERLOAD_S:-60}
FACTOR=${FACTOR:-3}
CONCURRENCY=${CONCURRENCY:-4}
TRACE=data/traces/azure_llm_2023_conv.csv
WORK=$(mktemp -d)
source scripts/lib/cluster.sh
PID=
trap 'pd_down; rm -rf "$WORK"' EXIT

config() {  # $1: overload_shedding true|false
  cat <<YAML
model: {path: models/small, preset: small, name: small, dtype: f32}
router:
  http: {host: 127.0.0.1, port: 8110}
  workers: {control_port: 9110}
  routing: {short_prompt_tokens: 256}
  requests: {request_timeout_ms: 300000}
  admission: {overload_shedding: $1}
pools:
  prefill: {replicas: 1, slo: {ttft_ms: 2000, percentile: 99}}
  decode: {replicas: 1, slo: {itl_ms: 100, percentile: 99}}
engine: {backend: cpu, threads: 1, block_size: 16, kv_cache_bytes: 268435456, max_batch_tokens: 1024, max_running_requests: 64}
kv_transfer: {transports: [tcp], listen_host: 127.0.0.1, timeout_ms: 60000, on_remote_prefill_failure: recompute}
logging: {level: warn}
YAML
}

up() {  # $1: label, $2: shedding
  config "$2" > "$WORK/$1.yaml"
  pd_up "$WORK/$1.yaml" "$WORK/$1.log"
}

# A fixed length scale (not --max-prompt-tokens alone, which scales by the longest selected
# prompt): both runs then send the same length distribution. return_token_ids: every chunk
# says how many tokens it carries, so the ITL is per token, as the SLO is. Without it a token
# whose text the detokenizer holds back (a partial UTF-8 character: ~1 in 5 tokens of the
# random-weight model) arrives as an empty-text chunk the bench cannot count, and its gap is
# merged into the next one (docs/bench.md, "What is measured").
COMMON=(--url http://127.0.0.1:8110 --trace "$TRACE" --length-scale 0.35 --max-prompt-tokens 1500 --max-output-tokens 64
        --slo ttft_ms=2000,itl_ms=100 --warmup 2 --extra-body '{"return_token_ids": true}')

up capacity true
"$BIN/pdserve" bench "${COMMON[@]}" --concurrency "$CONCURRENCY" --duration "$CAPACITY_S" --out "$WORK/capacity" > /dev/null
pd_down
CAPACITY=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['request_throughput'])" "$WORK/capacity.json")
RATE=$(python3 -c "print(round($CAPACITY * $FACTOR, 3))")
echo "capacity: $CAPACITY req/s (closed loop, $CONCURRENCY streams); overload rate: $RATE req/s for $OVERLOAD_S s"

for shedding in true false; do
  up "shedding-$shedding" "$shedding"
  "$BIN/pdserve" bench "${COMMON[@]}" --rate "$RATE" --duration "$OVERLOAD_S" --out "$WORK/overload-$shedding" > /dev/null || true
  # The router's own view of the same run: its histograms carry the SLO targets as bounds.
  curl -s http://127.0.0.1:8110/metrics > "$WORK/router-$shedding.prom" || true
  # The decode worker's own steps: which of them pass the ITL target, and the loop's time
  # between them (pdserve_engine_step_seconds, pdserve_engine_step_gap_seconds).
  curl -s "$(pd_worker_metrics_url "$WORK/shedding-$shedding.log" decode-0)" > "$WORK/decode-$shedding.prom" || true
  pd_down
done
python3 - "$WORK" <<'PY'
import json, sys
import re
def buckets(prom, name, kind=None):
    """The cumulative buckets of histogram `name`, by upper bound, summed over its series (those
    with kind=`kind` only, if given)."""
    out = {}
    for m in re.finditer(name + r'_bucket\{([^}]*)\} (\S+)', prom):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if kind is not None and labels.get("kind") != kind: continue
        le = labels["le"] if labels["le"] == "+Inf" else float(labels["le"])
        out[le] = out.get(le, 0) + float(m.group(2))
    return out
def within(prom, name, bound):
    """Share of the observations of histogram `name` at or under `bound` (all series)."""
    b = buckets(prom, name)
    return f"{100 * b.get(bound, 0) / b['+Inf']:.1f}%" if b.get("+Inf") else "-"
print("| shedding | sent | admitted | shed | first 429 (s) | p99 TTFT admitted (ms) | p99 ITL (ms) | other errors | goodput (req/s) "
      "| router: TTFT <= 2 s | router: gaps <= 100 ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for s in ("true", "false"):
    j = json.load(open(f"{sys.argv[1]}/overload-{s}.json"))
    try: prom = open(f"{sys.argv[1]}/router-{s}.prom").read()
    except OSError: prom = ""
    p = j["pdserve"]
    sent = j["completed"] + j["failed"]
    shed = p["shed_requests"]
    other = j["failed"] - shed
    first = "-" if p["first_shed_s"] is None else f'{p["first_shed_s"]:.1f}'
    print(f'| {"on" if s == "true" else "off"} | {sent} | {j["completed"]} | {shed} ({100*shed/max(sent,1):.0f}%) | {first} '
          f'| {j["p99_ttft_ms"]:.0f} | {j["p99_itl_ms"]:.0f} | {other} | {j.get("request_goodput", 0):.2f} '
          f'| {within(prom, "pdserve_time_to_first_token_seconds", 2.0)} '
          f'| {within(prom, "pdserve_inter_token_latency_seconds", 0.1)} |')

print()
print("decode-0's own steps (its /metrics): how many of each kind, the share past the 100 ms target, and the loop's gap between steps")
print("| shedding | decode steps | past 100 ms | mixed steps | past 100 ms | gaps <= 1 ms | gaps > 10 ms |")
print("|---|---|---|---|---|---|---|")
for s in ("true", "false"):
    try: prom = open(f"{sys.argv[1]}/decode-{s}.prom").read()
    except OSError: prom = ""
    row = [f'{"on" if s == "true" else "off"}']
    for kind in ("decode", "mixed"):
        b = buckets(prom, "pdserve_engine_step_seconds", kind)
        n = b.get("+Inf", 0)
        row += [f"{n:.0f}", f"{100 * (n - b.get(0.1, 0)) / n:.2f}%" if n else "-"]
    g = buckets(prom, "pdserve_engine_step_gap_seconds")
    n = g.get("+Inf", 0)
    row += [f"{100 * g.get(0.001, 0) / n:.1f}%" if n else "-", f"{100 * (n - g.get(0.01, 0)) / n:.2f}%" if n else "-"]
    print("| " + " | ".join(row) + " |")
PY
