#!/usr/bin/env bash
# pdserve bench against a real local cluster (`pdserve up`) for a few seconds: every request
# sent is accounted for, TTFT <= e2e, ITL gaps = output tokens - 1 (`pdserve bench check`),
# and the JSON, CSV and HTML reports are written. Short and long prompts, so both routes run.
# return_token_ids lets the client count the tokens of events whose text is held back (a
# byte-level model often ends a step inside a UTF-8 sequence).
# Shedding is off: this checks the bench's accounting, and on a busy CI machine the router's
# TTFT prediction can pass its 1 s default target and answer 429 (the overload fault case and
# tests/e2e/cluster_test.cpp test shedding).
# usage: bench_e2e.sh BIN_DIR WORK_DIR
set -euo pipefail
bin=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port) control=$(free_port)
"$bin/pdserve" make-model --preset small --out "$work/small" >/dev/null
cat > "$work/cluster.yaml" <<YAML
model: {path: $work/small, name: small}
router: {workers: {control_port: $control}, routing: {short_prompt_tokens: 64},
         admission: {overload_shedding: false}}
pools: {prefill: {replicas: 1}, decode: {replicas: 1}}
engine: {threads: 2, kv_cache_bytes: 67108864}
kv_transfer: {transports: [tcp]}
logging: {level: warn}
YAML
"$bin/pdserve" up --config "$work/cluster.yaml" --port "$port" > "$work/up.log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  grep -q "pdserve is up" "$work/up.log" && break
  kill -0 $up 2>/dev/null || { cat "$work/up.log"; exit 1; }
  sleep 1
done
grep -q "pdserve is up" "$work/up.log" || { echo "cluster did not start"; cat "$work/up.log"; exit 1; }

"$bin/pdserve" bench --url "http://127.0.0.1:$port" --prompt-len uniform:16:200 \
  --output-len uniform:4:24 --num-requests 24 --rate 8 --concurrency 6 --vocab-size 256 \
  --slo ttft_ms=2000,itl_ms=500 --extra-body '{"return_token_ids": true}' --no-progress \
  --metrics-url "http://127.0.0.1:$port/metrics" --metrics-interval-ms 200 \
  --out "$work/e2e" | tee "$work/bench.out"
"$bin/pdserve" bench check "$work/e2e.json"
grep -q -- "TTFT split, disaggregated (server, ms)" "$work/bench.out"
python3 - "$work/e2e.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 24 and r["failed"] == 0, (r["completed"], r["failed"])
assert all(t > 0 for t in r["ttfts"]), "every request has a TTFT"
# pdserve's TTFT split (usage.pdserve_timing), per route: every request carried one.
split = r["pdserve"]["ttft_split"]
assert set(split) == {"colocated", "disaggregated"}, split.keys()
assert sum(split[route]["ttft"]["count"] for route in split) == 24, split
for phase in ("prefill_compute", "kv_transfer"):
    s = split["disaggregated"][phase]
    assert s["p50_ms"] > 0 and s["p99_ms"] >= s["p90_ms"] >= s["p50_ms"], (phase, s)
assert "kv_transfer" not in split["colocated"], split["colocated"]
# The metrics timeline (--metrics-url): the router was scraped during the run, and its pool
# gauges are series (1 prefill + 1 decode worker; a worker late with its load report on a busy
# machine may read 0 for a moment, so only the peak is checked).
tl = r["pdserve"]["timeline"]
assert tl["scrapes"] >= 3 and tl["failed_scrapes"] == 0, (tl["scrapes"], tl["failed_scrapes"], tl["gaps"])
series = {s["key"]: s["points"] for s in tl["series"]}
for pool in ("prefill", "decode"):
    pts = series['pdserve_pool_workers{pool="%s"}' % pool]
    assert len(pts) >= 3 and max(v for _, v in pts) == 1, (pool, pts)
assert "pdserve_short_prompt_tokens" in series, sorted(series)
print("bench e2e: 24 requests, mean TTFT %.1f ms, mean ITL %.1f ms" % (r["mean_ttft_ms"], r["mean_itl_ms"]))
PY
grep -q "<svg" "$work/e2e.html"
grep -q "Replicas per pool" "$work/e2e.html"
test "$(wc -l < "$work/e2e.csv")" -eq 25
# Both routes were taken: the router counted each decision.
metrics=$(curl -s "http://127.0.0.1:$port/metrics")
for want in '{reason="long_prompt",route="disaggregated"}' '{reason="short_prompt",route="colocated"}'; do
  grep -qF "pdserve_route_decisions_total$want" <<<"$metrics" || {
    echo "bench e2e: no route decision $want; the router counted:"
    grep pdserve_route_decisions_total <<<"$metrics"; exit 1; }
done
# The autoscaler saw the run: within a tick (5 s) the decode pool's observed ITL percentile is
# the run's, and the recommendation for this fixed-size pool is its one replica.
for _ in $(seq 70); do
  metrics=$(curl -s "http://127.0.0.1:$port/metrics")
  observed=$(sed -n 's/^pdserve_slo_observed_seconds{pool="decode"} //p' <<<"$metrics")
  python3 -c "import sys; sys.exit(0 if float('${observed:-0}') > 0 else 1)" && break
  sleep 0.1
done
grep -E '^pdserve_slo_observed_seconds\{pool="decode"\}' <<<"$metrics"
python3 -c "import sys; sys.exit(0 if float('${observed:-0}') > 0 else 1)" ||
  { echo "bench e2e: the autoscaler never observed the decode pool's ITL"; exit 1; }
grep -qx 'pdserve_desired_replicas{pool="decode"} 1' <<<"$metrics" ||
  { echo "bench e2e: no decode recommendation of 1 replica"; grep desired_replicas <<<"$metrics"; exit 1; }
# Multi-turn replay (docs/bench.md): the first 40 kept rows of the Mooncake conversation trace
# hold 5 next turns, whose prompts carry the previous answers' ids; some of every next turn's
# history is served from a cache, and every request is accounted for.
"$bin/pdserve" bench --url "http://127.0.0.1:$port" \
  --trace "$(dirname "$0")/../../data/traces/mooncake_fast25_conversation_trace.jsonl" --multi-turn \
  --sample-conversations 10 --length-scale 0.03125 --max-output-tokens 8 --num-requests 40 \
  --time-scale 0.05 --spread-ticks --no-progress --out "$work/turns" | tee "$work/turns.out"
grep -q "Fleet prefix hit rate:" "$work/turns.out"
python3 - "$work/turns.json" "$work/turns.turns.json" <<'PY'
import json, sys
r, t = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert r["completed"] == 40 and r["failed"] == 0, (r["completed"], r["failed"])
assert t["requests"] == 40 and t["requests_with_cached_tokens"] == 40, t
assert t["next_turns"] == 5, t
assert 0 < t["next_turn_cached_tokens"] <= t["next_turn_history_tokens"], t
assert 0 < t["cached_tokens"] < t["prompt_tokens"] and 0 < t["ideal_cached_tokens"] < t["prompt_tokens"], t
print("bench e2e: multi-turn: %d next turns, %d of %d history tokens cached" %
      (t["next_turns"], t["next_turn_cached_tokens"], t["next_turn_history_tokens"]))
PY
echo "bench e2e: ok"
