#!/usr/bin/env bash
# The planner's validation on this machine: `pdserve plan`'s simulated TTFT / ITL percentiles
# against `pdserve bench` on `pdserve up` in the same layout, with the same requests.
# Per trace mix:
# 1. calibrates the CPU backend (one engine thread, as each worker below) just before its
#    runs: this machine's pace drifts by up to 10% over minutes;
# 2. the measured run: a 1 prefill + 1 decode cluster (small model, tcp KV) serves the
#    trace's first RATE x DURATION requests (its lengths) as Poisson arrivals at RATE (bench
#    seed 0). The rate is the mix's own, below what the prefill worker sustains (Mooncake's
#    prompts are long: 0.6 req/s; the Azure mixes 1.5 req/s): a queue that grows for the
#    whole run is no steady state to compare percentiles in (RATE=X sets every mix's). A
#    count rather than a duration: 60 s of seed 0 holds 76 arrivals at 1.5 req/s and of seed
#    1 114, runs of different loads;
# 3. the traced run, for the simulator's step spread: the same cluster with its workers'
#    step traces on (logging.step_trace_dir) serves the same requests at the same rate, at
#    other Poisson arrival times (seed 1);
# 4. `pdserve plan --layout 1p1d` simulates the measured run's requests with the traced
#    run's steps (--step-trace: each step takes its modelled time times a ratio drawn from
#    how the traced run's steps of its kind and size compared with the cost model). SPREAD=0
#    simulates with the cost model alone and skips the traced run;
# 5. prints both rows and their ratio for p50 / p90 / p99; then the traced run against its
#    own simulation (in sample: what the simulator makes of the steps it was given), and how
#    much faster or slower the measured run's steps ran than the traced run's
#    (scripts/step-pace.py: this VM's pace moves between runs); last, how many of the 4
#    p50 / p90 cells per mix are within 10% of measured (the criterion of docs/plan.md).
# usage: scripts/validate-plan.sh [BUILD_DIR]   (env: RATE DURATION=60 MIXES="conv code mooncake"
#   SPREAD=1; SHEDDING=1: both runs with router.admission.overload_shedding on and the simulation with the
#   router's admission control, to compare what each sheds (off by default: the 10% criterion
#   compares latencies of the same requests); KEEP=DIR: keep the files there (per mix and
#   run: the calibration MIX.cal.json, the step traces MIX.RUN.steps/, the cluster's log, the
#   bench's JSON / CSV (MIX.* for the measured run, MIX.traced.* for the other), the simulated
#   requests' CSV MIX.sim.csv; scripts/step-overlap.py reads the step traces); RESIMULATE=1 with KEEP=DIR: serve nothing,
#   simulate and compare the runs kept in DIR again (with the same RATE, DURATION, SHEDDING
#   and SPREAD), e.g. after a change to the simulator; LOG_LEVEL=warn)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN="$BUILD/bin"
DURATION=${DURATION:-60}
MIXES=${MIXES:-"conv code mooncake"}
if [ "${SHEDDING:-0}" = 1 ]; then
  SHEDDING_KEY=true SHEDDING_FLAGS=()
else
  SHEDDING_KEY=false SHEDDING_FLAGS=(--no-overload-shedding)
fi
if [ "${RESIMULATE:-0}" = 1 ] && [ -z "${KEEP:-}" ]; then
  echo "validate-plan.sh: RESIMULATE=1 needs KEEP=DIR, the directory of a kept run" >&2
  exit 2
fi
WORK=${KEEP:-$(mktemp -d)}
mkdir -p "$WORK"
source scripts/lib/cluster.sh
PID=
trap 'pd_down; [ -n "${KEEP:-}" ] || rm -rf "$WORK"' EXIT


# cluster_yaml TRACE_DIR: the cluster's config, its workers' step traces in TRACE_DIR.
cluster_yaml() {
  cat <<YAML
model: {path: models/small, preset: small, name: small, dtype: f32}
router:
  http: {host: 127.0.0.1, port: 8120}
  workers: {control_port: 9120}
  routing: {short_prompt_tokens: 256}
  requests: {request_timeout_ms: 300000}
  admission: {overload_shedding: $SHEDDING_KEY}
pools:
  prefill: {replicas: 1, slo: {ttft_ms: 2000, percentile: 99}}
  decode: {replicas: 1, slo: {itl_ms: 100, percentile: 99}}
engine: {backend: cpu, threads: 1, block_size: 16, kv_cache_bytes: 268435456, max_batch_tokens: 1024, max_running_requests: 64}
kv_transfer: {transports: [tcp], listen_host: 127.0.0.1, timeout_ms: 60000, on_remote_prefill_failure: recompute}
logging: {level: ${LOG_LEVEL:-warn}, step_trace_dir: "$1"}
YAML
}

# serve RUN OUT BENCH_FLAGS...: one run of mix $mix, its workers' step traces in
# $WORK/$mix.RUN.steps/, the bench's files $OUT.json / .csv.
serve() {
  local run=$1 out=$2
  shift 2
  mkdir -p "$WORK/$mix.$run.steps"
  cluster_yaml "$WORK/$mix.$run.steps" > "$WORK/$mix.$run.yaml"
  pd_up "$WORK/$mix.$run.yaml" "$WORK/$mix.$run.up.log"
  "$BIN/pdserve" bench --url http://127.0.0.1:8120 "${LENGTHS[@]}" --rate "$MIX_RATE" "$@" \
    --warmup 2 --extra-body '{"return_token_ids": true}' --no-progress --out "$out" > /dev/null
  pd_down
}

# simulate OUT SIM_FLAGS...: the 1p1d layout on mix $mix's calibration, its summary line in OUT.
simulate() {
  local out=$1
  shift
  "$BIN/pdserve" plan --calibration "$WORK/$mix.cal.json" --model models/small --kv-cache-bytes 268435456 \
    --max-batch-tokens 1024 --max-running-requests 64 --kv-link-gbps 20 --slo ttft_ms=2000,itl_ms=100 \
    "${LENGTHS[@]}" --layout 1p1d --threshold 256 --rate "$MIX_RATE" "${SPREAD_FLAGS[@]}" "${SHEDDING_FLAGS[@]}" "$@" \
    2> /dev/null > "$out.out"
  grep "^simulated" "$out.out" > "$out"
}

# compare BENCH_JSON SIM LABEL [CELLS]: measured and simulated rows; with CELLS, each
# p50 / p90 cell's verdict appended there (the criterion of docs/plan.md: within 10% of measured).
compare() {
  python3 - "$@" <<'PY'
import json, re, sys
j = json.load(open(sys.argv[1]))
sim = open(sys.argv[2]).read()
label = sys.argv[3]
nums = [float(x) for x in re.findall(r"(\d+\.\d+)", sim)]
s_ttft, s_itl = nums[0:3], nums[3:6]
m_ttft = [j["median_ttft_ms"], j["p90_ttft_ms"], j["p99_ttft_ms"]]
m_itl = [j["median_itl_ms"], j["p90_itl_ms"], j["p99_itl_ms"]]
def row(name, m, s):
    r = " ".join(f"{a:8.1f} {b:8.1f} ({b / a if a else float('nan'):4.2f}x)" for a, b in zip(m, s))
    print(f"| {label} | {name} | {r} |")
row("TTFT p50 / p90 / p99 ms (measured, simulated)", m_ttft, s_ttft)
row("ITL p50 / p90 / p99 ms (measured, simulated)", m_itl, s_itl)
print(f"|   | completed {j['completed']}, failed {j['failed']} measured; {sim.split('|')[-1].strip()} simulated |")
if len(sys.argv) > 4:
    with open(sys.argv[4], "a") as cells:
        for name, m, s in (("TTFT", m_ttft, s_ttft), ("ITL", m_itl, s_itl)):
            for pct, a, b in zip(("p50", "p90"), m, s):
                print(f"{label} {name} {pct} {'within' if a and abs(b / a - 1) <= 0.10 else 'outside'}", file=cells)
PY
}

: > "$WORK/cells"
for mix in $MIXES; do
  TRACE=$(pd_mix_trace "$mix")
  [ "$mix" = mooncake ] && MIX_RATE=${RATE:-0.6} || MIX_RATE=${RATE:-1.5}
  LENGTHS=(--trace "$TRACE" --length-scale 0.35 --max-prompt-tokens 1500 --max-output-tokens 64)
  REQUESTS=$(python3 -c "print(round($MIX_RATE * $DURATION))")
  if [ "${RESIMULATE:-0}" != 1 ]; then
    "$BIN/pdserve" plan --calibrate --model models/small --threads 1 --out "$WORK/$mix.cal.json" | tail -1
    serve measured "$WORK/$mix" --num-requests "$REQUESTS" --seed 0
    [ "${SPREAD:-1}" = 0 ] || serve traced "$WORK/$mix.traced" --num-requests "$REQUESTS" --seed 1
  fi
  SPREAD_FLAGS=()
  [ "${SPREAD:-1}" = 0 ] || SPREAD_FLAGS=(--step-trace "$(ls "$WORK/$mix.traced.steps"/*.steps.csv | paste -sd, -)")
  simulate "$WORK/$mix.sim" --num-requests "$REQUESTS" --seed 0 --requests-csv "$WORK/$mix.sim.csv"
  compare "$WORK/$mix.json" "$WORK/$mix.sim" "$mix" "$WORK/cells"
  if [ "${SPREAD:-1}" != 0 ]; then
    # In sample: the traced run itself, simulated with its own steps (what the simulator
    # makes of steps it was given; the row above is the prediction).
    simulate "$WORK/$mix.traced.sim" --num-requests "$REQUESTS" --seed 1
    compare "$WORK/$mix.traced.json" "$WORK/$mix.traced.sim" "$mix, traced run (in sample)"
    echo "|   | host pace, measured run over traced run, shape for shape: $(python3 scripts/step-pace.py \
      "$WORK/$mix.traced.steps" "$WORK/$mix.measured.steps") |"
  fi
done
echo "p50 / p90 cells within 10% of measured: $(grep -c ' within$' "$WORK/cells") of $(wc -l < "$WORK/cells")" \
  "(outside: $(grep ' outside$' "$WORK/cells" | sed 's/ outside$//' | paste -sd, - | sed 's/,/, /g'))"
