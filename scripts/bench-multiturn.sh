#!/usr/bin/env bash
# The multi-turn Mooncake replay (docs/kv_cache.md, "Multi-turn"; docs/bench.md, "Multi-turn
# replay") on a local cluster of this machine -- a router, 1 prefill and 2 decode workers of the
# small model on loopback, started by hand so that one worker can be killed and restarted
# under its own id -- once per configuration, with the same requests:
#   off    prefix caching off                      (scripts/multiturn/off.yaml)
#   cache  per-worker prefix caching               (scripts/multiturn/cache.yaml)
#   tiers  + the host and disk tiers               (scripts/multiturn/tiers.yaml)
#   pulls  + peer pulls (scripts/multiturn/pulls.yaml): between the decode workers, and a
#          prefill worker pulling a disaggregated next turn's history from its decode worker
#   PATH   any other config of the same shape
# Prints one table: per configuration the fleet prefix hit rate (usage cached_tokens over
# prompt tokens), the hit rate by tier (pdserve_kv_tier_hit_blocks_total; a pulled block is
# attached from the target's region, so it counts there too) and by pull (the tokens
# PULL_BYTES_METRIC's bytes hold, at the region's bytes a block), the pulls by outcome
# (PULLS_METRIC: done / fell_back / refused), TTFT p50/p90/p99, goodput within the SLOs, mean
# and p50/p90 pull latency (PULL_SECONDS_METRIC histogram) when present, and the hit rate one
# unbounded cache would get on the same requests.
#
# usage: scripts/bench-multiturn.sh [OUT_DIR] [CONFIGS] [TRACE_S] [TIME_SCALE]
#   CONFIGS   space-separated names or paths (default "off cache tiers")
#   TRACE_S   seconds of the trace replayed (default 900), TIME_SCALE its speed-up (default
#             0.25: 900 s of trace in 225 s)
# Environment: SAMPLE (conversations kept, one in SAMPLE; default 10), LENGTH_SCALE (prompt
# lengths; default 1/32: a 512-token trace block becomes one 16-token KV block), MAX_OUTPUT
# (default 32), SLO (default ttft_ms=2000,itl_ms=200),
# RESTART=WORKER (kill WORKER with SIGKILL halfway and start it again under its id; its hit
# rate before and after is printed), PULLS_METRIC, PULL_BYTES_METRIC, PULL_SECONDS_METRIC.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/bench-multiturn} configs=${2:-off cache tiers} trace_s=${3:-900} time_scale=${4:-0.25}
sample=${SAMPLE:-10} length_scale=${LENGTH_SCALE:-0.03125} max_output=${MAX_OUTPUT:-32}
slo=${SLO:-ttft_ms=2000,itl_ms=200} restart=${RESTART:-}
pulls_metric=${PULLS_METRIC:-pdserve_kv_pulls_total}
pull_bytes=${PULL_BYTES_METRIC:-pdserve_kv_pull_bytes_total}
pull_seconds=${PULL_SECONDS_METRIC:-pdserve_kv_pull_seconds}
bin=build/bin
model=${MODEL:-build/test_models/e2e_small}
port=${BASE_PORT:-18700}
http=$port control=$((port + 1))
workers="prefill-0 decode-0 decode-1"
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f "$model/config.json" ] || "$bin/pdserve" make-model --preset small --out "$model" > /dev/null

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2> /dev/null || true; done
  pids=()
}
trap cleanup EXIT

metrics_port() { # WORKER
  case $1 in prefill-0) echo $((port + 2)) ;; decode-0) echo $((port + 5)) ;; decode-1) echo $((port + 6)) ;; esac
}
declare -A worker_pid worker_cmd
start_worker() { # WORKER CONFIG NAME
  local w=$1 cfg=$2 name=$3 program=pdserve-decode extra=()
  # The prefill worker's control port, and its kvtransfer tcp port one above it.
  if [ "$w" = prefill-0 ]; then program=pdserve-prefill extra=(--port $((port + 3))); fi
  worker_cmd[$w]="$bin/$program --config $cfg --id $w --router 127.0.0.1:$control --metrics-port $(metrics_port "$w") ${extra[*]}"
  ${worker_cmd[$w]} >> "$out/$name.$w.log" 2>&1 &
  worker_pid[$w]=$!
  pids+=($!)
}
wait_ready() { # NAME: every worker healthy at the router
  for _ in $(seq 600); do
    local m
    m=$(curl -sf "http://127.0.0.1:$http/metrics" || true)
    local up
    up=$(printf '%s\n' "$m" | awk '/^pdserve_worker_healthy\{/ && $NF == 1 { n++ } END { print n + 0 }')
    [ "$up" -ge 3 ] && return 0
    sleep 0.2
  done
  echo "$1: the cluster did not come up; logs in $out/$1.*.log" >&2
  exit 1
}
snapshot() { # NAME TAG: every worker's /metrics
  for w in $workers; do curl -sf "http://127.0.0.1:$(metrics_port "$w")/metrics" > "$out/$1.$2.$w.prom" || true; done
}

for config in $configs; do
  if [ -f "$config" ]; then src=$config name=$(basename "$config" .yaml); else src=scripts/multiturn/$config.yaml name=$config; fi
  [ -f "$src" ] || { echo "no config '$config' (off, cache, tiers, pulls, or a YAML path)" >&2; exit 2; }
  rm -rf "$out/$name.kv-cache" "$out/$name".*.log "$out/$name".*.prom
  sed "/^#/!{s|@MODEL@|$PWD/$model|; s|@DISK@|$out/$name.kv-cache|}" "$src" > "$out/$name.yaml"
  cfg=$out/$name.yaml
  "$bin/pdserve-router" --config "$cfg" --port $http --control-port $control >> "$out/$name.router.log" 2>&1 &
  pids+=($!)
  for w in $workers; do start_worker "$w" "$cfg" "$name"; done
  wait_ready "$name"
  snapshot "$name" before
  if [ -n "$restart" ]; then
    (
      sleep "$(awk -v t="$trace_s" -v s="$time_scale" 'BEGIN { print t * s / 2 }')"
      curl -sf "http://127.0.0.1:$(metrics_port "$restart")/metrics" > "$out/$name.killed.$restart.prom" || true
      kill -KILL "${worker_pid[$restart]}"
      echo "restart: $restart killed at $(date -u +%T)" >> "$out/$name.restart.log"
    ) &
    killer=$!
  fi
  "$bin/pdserve" bench --url "http://127.0.0.1:$http" \
    --trace data/traces/mooncake_fast25_conversation_trace.jsonl --multi-turn --spread-ticks \
    --sample-conversations "$sample" --length-scale "$length_scale" --max-output-tokens "$max_output" \
    --time-scale "$time_scale" --duration "$(awk -v t="$trace_s" -v s="$time_scale" 'BEGIN { print t * s }')" \
    --slo "$slo" --no-progress --out "$out/$name" > "$out/$name.txt" &
  bench=$!
  if [ -n "$restart" ]; then
    wait "$killer"
    wait "${worker_pid[$restart]}" 2> /dev/null || true
    start_worker "$restart" "$cfg" "$name"
    echo "restart: $restart started again at $(date -u +%T)" >> "$out/$name.restart.log"
  fi
  wait "$bench" || echo "$name: pdserve bench exited $?" >&2
  snapshot "$name" after
  curl -sf "http://127.0.0.1:$http/metrics" > "$out/$name.router.prom" || true
  cat "$out/$name.txt"
  cleanup
done

python3 - "$out" "$restart" "$pulls_metric" "$pull_bytes" "$pull_seconds" "$workers" $configs << 'EOF'
import json, os, re, sys
out, restart, pulls_metric, pull_bytes, pull_seconds, workers = sys.argv[1:7]
workers = workers.split()
names = [os.path.basename(c)[:-5] if c.endswith(".yaml") else c for c in sys.argv[7:]]

def series(path):
    vals = {}
    if os.path.exists(path):
        for line in open(path):
            if line.startswith("#") or not line.strip():
                continue
            key, _, v = line.rpartition(" ")
            try:
                vals[key] = float(v)
            except ValueError:
                pass
    return vals

def total(name, prefix, label=None):
    """Sum over workers of the growth of series starting with `prefix` (and holding `label`)."""
    s = 0.0
    for w in workers:
        a, b = series(f"{out}/{name}.before.{w}.prom"), series(f"{out}/{name}.after.{w}.prom")
        k = series(f"{out}/{name}.killed.{w}.prom")
        for key, v in b.items():
            if not (key == prefix or key.startswith(prefix + "{")) or (label and label not in key):
                continue
            if k:  # restarted: its counters began again at 0
                s += k.get(key, 0) - a.get(key, 0) + v
            else:
                s += v - a.get(key, 0)
    return s

rows = []
for n in names:
    res = json.load(open(f"{out}/{n}.json"))
    turns = json.load(open(f"{out}/{n}.turns.json"))
    bs, prompt = turns["block_size"], max(1, turns["prompt_tokens"])
    tier = {t: 100 * total(n, "pdserve_kv_tier_hit_blocks_total", f'tier="{t}"') * bs / prompt
            for t in ("region", "host", "disk")}
    # One block's bytes: the region's bytes over its named blocks (the same on every worker).
    block_bytes = 0.0
    for w in workers:
        after = series(f"{out}/{n}.after.{w}.prom")
        pick = lambda name: next((v for key, v in after.items() if key.startswith(name + "{") and 'tier="region"' in key), 0)
        b, k = pick("pdserve_kv_tier_bytes"), pick("pdserve_kv_tier_blocks")
        if b and k:
            block_bytes = b / k
            break
    pulled_bytes = total(n, pull_bytes)
    pulled = pulled_bytes / block_bytes if block_bytes else 0
    outcomes = " / ".join("%.0f" % total(n, pulls_metric, f'outcome="{o}"') for o in ("done", "fell_back", "refused"))
    psum, pcount = total(n, pull_seconds + "_sum"), total(n, pull_seconds + "_count")
    # The pull latency's p50 and p90 from the histogram's buckets (the bucket's upper bound).
    buckets = {}
    for w in workers:
        a, b = series(f"{out}/{n}.before.{w}.prom"), series(f"{out}/{n}.after.{w}.prom")
        for key, v in b.items():
            m = re.match(re.escape(pull_seconds) + r'_bucket\{.*le="([^"]+)"', key)
            if m:
                buckets[m.group(1)] = buckets.get(m.group(1), 0) + v - a.get(key, 0)
    def quantile(q):
        if not pcount:
            return "-"
        for le, c in sorted(((float(k), c) for k, c in buckets.items())):
            if c >= q * pcount:
                return "<=%g" % (1000 * le) if le != float("inf") else ">5000"
        return "-"
    routes = series(f"{out}/{n}.router.prom")
    rows.append([n, res["completed"], res["failed"],
                 f'{100 * turns["cached_tokens"] / prompt:.1f}%',
                 " / ".join(f"{tier[t]:.1f}" for t in tier),
                 f"{100 * pulled * bs / prompt:.1f}%" if pulled else "-", outcomes if pcount or total(n, pulls_metric) else "-",
                 " / ".join(f'{res[k] or 0:.0f}' for k in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms")),
                 f'{res["request_goodput"]:.2f}' if res["request_goodput"] is not None else "-",
                 f"{1000 * psum / pcount:.1f} ({quantile(0.5)} / {quantile(0.9)})" if pcount else "-",
                 f'{100 * turns["ideal_cached_tokens"] / prompt:.1f}%',
                 f'{turns["next_turns"]}: {100 * turns["next_turn_cached_tokens"] / max(1, turns["next_turn_history_tokens"]):.0f}%',
                 " / ".join("%.0f" % routes.get('pdserve_route_decisions_total{reason="%s",route="%s"}' % rr, 0)
                            for rr in (("short_prompt", "colocated"), ("cached_prefix", "colocated"),
                                       ("pull", "colocated"), ("long_prompt", "disaggregated"),
                                       ("prefill_pull", "disaggregated")))])
head = ["config", "done", "failed", "fleet hit", "region/host/disk hit %", "pull hit",
        "pulls: done / fell_back / refused", "TTFT p50/p90/p99 ms", "goodput req/s", "pull ms: mean (p50 / p90)",
        "ceiling (1 cache)", "next turns: history hit",
        "routes: short / cached_prefix / pull / disaggregated / prefill_pull"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
if restart:
    for n in names:
        a = series(f"{out}/{n}.before.{restart}.prom")
        k = series(f"{out}/{n}.killed.{restart}.prom")
        b = series(f"{out}/{n}.after.{restart}.prom")
        q, h = "pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_hits_total"
        def find(d, name):
            return next((v for key, v in d.items() if key == name or key.startswith(name + "{")), 0.0)
        before_q, before_h = find(k, q) - find(a, q), find(k, h) - find(a, h)
        after_q, after_h = find(b, q), find(b, h)
        print(f"{n}: {restart} hit rate before the kill {100 * before_h / max(1, before_q):.1f}% "
              f"({before_h:.0f} of {before_q:.0f} tokens), after the restart {100 * after_h / max(1, after_q):.1f}% "
              f"({after_h:.0f} of {after_q:.0f})")
EOF
