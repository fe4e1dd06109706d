#!/usr/bin/env bash
# deploy/prometheus/pdserve-rules.yaml (also the chart's PrometheusRule): `promtool check
# rules`, then `promtool test rules` on rules_test.yaml and rules_slow_test.yaml (each alert
# fires on a synthetic burn and stays silent within its SLO), then the same tests against copies of the rules broken in
# known ways, each of which they must catch. Needs Debian's prometheus package (scripts/setup);
# without promtool the test SKIPs (77).
# usage: check_rules.sh SOURCE_DIR
set -euo pipefail
src=$1
command -v promtool >/dev/null || { echo "SKIPPED: promtool not installed (scripts/setup installs prometheus)"; exit "$([ "${PD_REQUIRE_TOOLS:-}" = 1 ] && echo 1 || echo 77)"; }
rules=$src/deploy/prometheus/pdserve-rules.yaml
promtool check rules "$rules"
tests=(rules_test.yaml rules_slow_test.yaml)
(cd "$src/tests/prometheus" && promtool test rules "${tests[@]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/deploy/prometheus" "$tmp/tests/prometheus"
for t in "${tests[@]}"; do cp "$src/tests/prometheus/$t" "$tmp/tests/prometheus/"; done
missed=0
# desc % text in the rules % its replacement
while IFS='%' read -r desc old new; do
  [ -n "$desc" ] || continue
  grep -qF -- "$old" "$rules" || { echo "SELF-TEST BROKEN: $desc: '$old' not in the rules"; missed=$((missed + 1)); continue; }
  python3 - "$rules" "$tmp/deploy/prometheus/pdserve-rules.yaml" "$old" "$new" <<'PY'
import sys
src, dst, old, new = sys.argv[1:]
open(dst, "w").write(open(src).read().replace(old, new, 1))
PY
  if (cd "$tmp/tests/prometheus" && promtool test rules "${tests[@]}") >/dev/null 2>&1; then
    echo "MISSED: $desc"; missed=$((missed + 1))
  else
    echo "caught: $desc"
  fi
done <<'BREAKS'
fast burn factor 10x too high%(14.4 * pdserve:slo_error_budget:ratio)%(144 * pdserve:slo_error_budget:ratio)
slow burn at 2x the budget's pace%(1 * pdserve:slo_error_budget:ratio)%(2 * pdserve:slo_error_budget:ratio)
fast burn without its short window%            and pdserve:slo_error_ratio:rate5m > on (namespace, slo) group_left () (14.4 * pdserve:slo_error_budget:ratio))%)
budget from the wrong percentile%(pdserve_slo_percentile{pool="prefill"}) / 100, "slo", "ttft"%(pdserve_slo_percentile{pool="decode"}) / 100, "slo", "ttft"
attainment of all observations%rate(pdserve_slo_good_observations_total[5m])%rate(pdserve_slo_observations_total[5m])
no-worker alert ignores a pool the router wants empty%            and on (namespace, pool) max by (namespace, pool) (pdserve_desired_replicas) > 0%
transfer failures counted as successes%pdserve_remote_prefill_total{outcome=~"failed|recomputed"}%pdserve_remote_prefill_total{outcome="ok"}
shedding threshold 10x too high%expr: pdserve:shed:ratio_rate5m > 0.01%expr: pdserve:shed:ratio_rate5m > 0.1
BREAKS
[ "$missed" -eq 0 ] || { echo "rules self-test: $missed break(s) missed"; exit 1; }
echo "prometheus rules: ok"
