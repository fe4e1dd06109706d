# Shared by the benchmark scripts (source it after setting BIN): start `pdserve up` and wait
# until it says so, stop it, and the trace of each named mix. The cluster's pid is in PID,
# empty when none runs, so a script's EXIT trap can stop what is left.

# pd_up CONFIG LOG [pdserve up flags...]: exits the script, printing the log, when the
# cluster dies or has not come up within 60 s.
pd_up() {
  local config=$1 log=$2
  shift 2
  "$BIN/pdserve" up --config "$config" "$@" > "$log" 2>&1 &
  PID=$!
  for _ in $(seq 1 300); do
    grep -q "pdserve is up" "$log" && return 0
    kill -0 "$PID" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.2
  done
  echo "pdserve up ($config) did not start within 60 s"; cat "$log"; exit 1
}

pd_down() {
  [ -n "$PID" ] && { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true; }
  PID=
}

# pd_worker_metrics_url LOG ID: the /metrics URL of worker ID, from the cluster's log.
pd_worker_metrics_url() {
  sed -n "s/^worker metrics: $2 \(http[^ ]*\)$/\1/p" "$1" | head -1
}

# pd_mix_trace MIX: the trace file of conv, code or mooncake.
pd_mix_trace() {
  case $1 in
    conv) echo data/traces/azure_llm_2023_conv.csv ;;
    code) echo data/traces/azure_llm_2023_code.csv ;;
    mooncake) echo data/traces/mooncake_fast25_conversation_trace.jsonl ;;
    *) echo "unknown mix $1 (conv, code, mooncake)" >&2; return 2 ;;
  esac
}
