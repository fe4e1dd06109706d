#!/usr/bin/env python3
"""A real Prometheus (Debian's prometheus package) scrapes a `pdserve up` cluster through the
file_sd targets file `pdserve up` writes, with the labels the chart's ServiceMonitors give the
series (namespace, service), and evaluates what an SRE deploys:

  1. at rest (a short warm-up, then no load): the prefill ScaledObject's triggers, as the chart
     renders them with its defaults, ask for no more than the one prefill worker there is, and
     the prefill pool's TTFT burn-rate alert is not pending;
  2. under a prefill overload driven by `pdserve bench` (long prompts, far past one prefill
     worker's rate; admission sheds as it does by default): within OVERLOAD_DEADLINE_S the
     prefill trigger asks KEDA for more replicas (KEDA's formulas: AverageValue
     desired = ceil(value / threshold); Value desired = ceil(current * value / threshold)) and
     PdserveSLOBudgetBurnFast{pool="prefill",slo="ttft"} is pending (or firing);
  3. then every dashboard query (pdserve's names and vLLM's), every trigger query as rendered
     and every rule expression returns data.

`promtool check metrics` runs on every process's /metrics as well. --record FILE writes the
overload timeline as a Markdown table (docs/performance.md). Exit 77 (ctest SKIP) without
prometheus/promtool, with the reason.

usage: prometheus_e2e.py --build BUILD_DIR --source SOURCE_DIR [--record FILE]
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import yaml

OVERLOAD_DEADLINE_S = 60  # the prefill trigger crosses, and the alert is pending, within this
NAMESPACE = "llm"  # the chart render's (tests/deploy/render_chart.py)
RELEASE = "pdserve"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Prom:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr):
        body = http_get(self.base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
        r = json.loads(body)
        if r.get("status") != "success":
            raise RuntimeError(f"query {expr!r}: {r}")
        return r["data"]["result"]

    def scalar(self, expr):
        res = self.query(expr)
        if not res:
            return None
        return float(res[0]["value"][1])


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def rendered_triggers(source, values):
    """The chart's ScaledObjects, rendered (tests/deploy/render_chart.py's renderer) with `values`."""
    sys.path.insert(0, os.path.join(source, "tests", "deploy"))
    import render_chart  # noqa: E402
    assert render_chart.NAMESPACE == NAMESPACE and render_chart.RELEASE == RELEASE
    _, manifests, _ = render_chart.Renderer(source).render(values)
    out = {}
    for name, text in manifests.items():
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "ScaledObject":
                role = "prefill" if doc["metadata"]["name"].endswith("-prefill") else "decode"
                out[role] = doc["spec"]["triggers"]
    return out


def keda_desired(trigger, value, current):
    th = float(trigger["metadata"]["threshold"])
    if trigger["metricType"] == "AverageValue":
        return math.ceil(value / th)
    return math.ceil(current * value / th)


def dashboard_queries(source):
    with open(os.path.join(source, "deploy", "grafana", "pdserve.json")) as f:
        dash = json.load(f)
    out = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            for prefix in ("pdserve_", "vllm:"):
                if prefix == "vllm:" and "${metric_prefix}" not in t["expr"]:
                    continue
                e = (t["expr"].replace("${metric_prefix}", prefix).replace("$__rate_interval", "5m")
                     .replace("$namespace", NAMESPACE).replace("$cluster", ".*"))
                out.append((panel["title"], e))
    return out


def rule_expressions(source):
    with open(os.path.join(source, "deploy", "prometheus", "pdserve-rules.yaml")) as f:
        rules = yaml.safe_load(f)
    out = []
    for g in rules["groups"]:
        for r in g["rules"]:
            out.append((r.get("record") or r.get("alert"), "record" in r, r["expr"]))
    return out


def series_names(expr):
    """Metric and recording-rule names an expression reads (for alerts, which are empty until
    they fire: each name they read must have data)."""
    expr = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)', " ", expr)
    return {m for m in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if m.startswith(("pdserve", "process_"))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--record", help="write the overload timeline as a Markdown table here")
    ap.add_argument("--hold", type=int, default=0,
                    help="keep sampling this many seconds after both crossed (a longer --record)")
    args = ap.parse_args()
    for tool in ("prometheus", "promtool"):
        if not shutil.which(tool):
            print(f"SKIPPED: {tool} not installed (scripts/setup installs Debian's prometheus package)")
            return 1 if os.environ.get("PD_REQUIRE_TOOLS") == "1" else 77
    args.build, args.source = os.path.abspath(args.build), os.path.abspath(args.source)
    bindir = os.path.join(args.build, "bin")
    work = os.path.join(args.build, "test_prometheus_e2e")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # The cluster: 1 prefill + 1 decode worker, the chart's SLO defaults (TTFT p99 1 s), the
    # prefill pool allowed to grow to 4 (the router's recommendation may say so), fixed in size
    # (--no-autoscale: KEDA would act on the recommendation, not `pdserve up`).
    model = os.path.join(work, "small")
    subprocess.run([os.path.join(bindir, "pdserve"), "make-model", "--preset", "small", "--out", model],
                   check=True, stdout=subprocess.DEVNULL)
    http_port, control_port, prom_port = free_port(), free_port(), free_port()
    with open(os.path.join(work, "cluster.yaml"), "w") as f:
        f.write(f"""model: {{path: {model}, name: small}}
router:
  workers: {{control_port: {control_port}}}
  routing: {{short_prompt_tokens: 64}}
  autoscaler: {{tick_ms: 1000, window_ms: 20000, min_samples: 5}}
metrics: {{vllm_compatible_names: true}}
pools:
  prefill: {{replicas: 1, min_replicas: 1, max_replicas: 4, slo: {{ttft_ms: 1000, percentile: 99}}}}
  decode: {{replicas: 1, min_replicas: 1, max_replicas: 2, slo: {{itl_ms: 500, percentile: 90}}}}
engine: {{threads: 1, kv_cache_bytes: 134217728}}
kv_transfer: {{transports: [tcp]}}
logging: {{level: warn}}
""")
    targets = os.path.join(work, "targets.json")
    procs = []

    def stop_all():
        for p, sig in reversed(procs):
            if p.poll() is None:
                p.send_signal(sig)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    try:
        up_log = open(os.path.join(work, "up.log"), "w")
        up = subprocess.Popen([os.path.join(bindir, "pdserve"), "up", "--config", os.path.join(work, "cluster.yaml"),
                               "--port", str(http_port), "--no-autoscale", "--prometheus-targets", targets],
                              stdout=up_log, stderr=subprocess.STDOUT)
        procs.append((up, signal.SIGINT))
        deadline = time.time() + 120
        while time.time() < deadline:
            if up.poll() is not None:
                fail("pdserve up exited:\n" + open(os.path.join(work, "up.log")).read())
            if "pdserve is up" in open(os.path.join(work, "up.log")).read() and os.path.exists(targets):
                break
            time.sleep(0.5)
        else:
            fail("the cluster did not start in 120 s")
        groups = json.load(open(targets))
        processes = sorted(g["labels"]["pdserve_process"] for g in groups)
        if processes != ["decode-0", "prefill-0", "router"]:
            fail(f"file_sd targets: {processes}")

        # promtool check metrics on every process's /metrics (the default configuration but
        # vLLM's names on: both sets must be clean).
        for g in groups:
            text = http_get(f"http://{g['targets'][0]}/metrics")
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            # vLLM's own names hold a ':' (vllm:...), which promtool's lint reserves for recording
            # rules: the one complaint allowed, and only for them (they are off by default).
            problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                        if ln.strip() and not re.fullmatch(r"vllm:\w+ metric names should not contain ':'", ln)]
            if problems:
                fail(f"promtool check metrics on {g['labels']['pdserve_process']}: " + "\n".join(problems))
            for want in ("pdserve_build_info{", "process_cpu_seconds_total", "process_resident_memory_bytes",
                         "process_open_fds", "process_start_time_seconds"):
                if want not in text:
                    fail(f"{g['labels']['pdserve_process']}'s /metrics has no {want}")

        # Prometheus, labelling the series as the chart's ServiceMonitors do.
        rules = os.path.join(args.source, "deploy", "prometheus", "pdserve-rules.yaml")
        relabel = [{"target_label": "namespace", "replacement": NAMESPACE}]
        for proc, svc in (("router", "router"), ("prefill-.*", "prefill"), ("decode-.*", "decode")):
            relabel.append({"source_labels": ["pdserve_process"], "regex": proc, "target_label": "service",
                            "replacement": f"{RELEASE}-{svc}"})
        prom_cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                    "rule_files": [rules],
                    "scrape_configs": [{"job_name": "pdserve",
                                        "file_sd_configs": [{"files": [targets], "refresh_interval": "1s"}],
                                        "relabel_configs": relabel}]}
        with open(os.path.join(work, "prometheus.yml"), "w") as f:
            yaml.safe_dump(prom_cfg, f)
        r = subprocess.run(["promtool", "check", "config", os.path.join(work, "prometheus.yml")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"promtool check config: {r.stdout}{r.stderr}")
        prom = subprocess.Popen(["prometheus", f"--config.file={work}/prometheus.yml",
                                 f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address=127.0.0.1:{prom_port}",
                                 "--storage.tsdb.retention.time=1h"],
                                stdout=open(os.path.join(work, "prometheus.log"), "w"), stderr=subprocess.STDOUT)
        procs.append((prom, signal.SIGTERM))
        p = Prom(prom_port)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if p.scalar('count(up{job="pdserve"} == 1)') == 3:
                    break
            except OSError:
                pass
            if prom.poll() is not None:
                fail("prometheus exited:\n" + open(os.path.join(work, "prometheus.log")).read())
            time.sleep(0.5)
        else:
            fail("Prometheus did not scrape the 3 targets within 60 s")

        # The chart's triggers with its defaults (the pools' SLOs as this cluster's).
        triggers = rendered_triggers(args.source, {
            "modelVolume": {"pvc": {"claimName": "models"}},
            "config": {"pools": {"prefill": {"min_replicas": 1, "max_replicas": 4,
                                             "slo": {"ttft_ms": 1000, "percentile": 99}},
                                 "decode": {"min_replicas": 1, "max_replicas": 2,
                                            "slo": {"itl_ms": 500, "percentile": 90}}}},
            "autoscaling": {"prefill": {"enabled": True}, "decode": {"enabled": True}}})
        names = [t["name"] for t in triggers["prefill"]]
        if "router-recommendation" not in names or "ttft" not in names:
            fail(f"the chart's default prefill triggers are {names}")

        bench = os.path.join(bindir, "pdserve")
        url = f"http://127.0.0.1:{http_port}"
        common = ["--url", url, "--vocab-size", "256", "--no-progress", "--seed", "1"]
        # Warm-up: a few short (colocated) and long (disaggregated) requests, so every series exists.
        subprocess.run([bench, "bench", *common, "--prompt-len", "uniform:16:300", "--output-len", "8",
                        "--num-requests", "8", "--concurrency", "1", "--out", os.path.join(work, "warmup")],
                       check=True, stdout=subprocess.DEVNULL)
        time.sleep(4)  # idle: a few scrapes and rule evaluations of the cluster at rest

        def sample():
            row = {"t": None}
            for t in triggers["prefill"]:
                v = p.scalar(t["metadata"]["query"])
                row[t["name"]] = v
                row[t["name"] + ":desired"] = keda_desired(t, v, 1) if v is not None else None
            row["slo_observed"] = p.scalar(f'pdserve_slo_observed_seconds{{namespace="{NAMESPACE}",pool="prefill"}}')
            row["burn5m"] = p.scalar(f'pdserve:slo_error_ratio:rate5m{{namespace="{NAMESPACE}",pool="prefill",slo="ttft"}}'
                                     f' / on (namespace, slo) group_left () pdserve:slo_error_budget:ratio')
            alerts = p.query(f'ALERTS{{alertname="PdserveSLOBudgetBurnFast",pool="prefill",slo="ttft"}}')
            row["alert"] = alerts[0]["metric"]["alertstate"] if alerts else "inactive"
            row["shed"] = p.scalar(f'sum(pdserve_request_errors_total{{namespace="{NAMESPACE}",pool="prefill",'
                                   f'type="overloaded"}}) or vector(0)')
            return row

        rest = sample()
        print("at rest:", rest, flush=True)
        if any((rest[t["name"] + ":desired"] or 0) > 1 for t in triggers["prefill"]):
            fail(f"at rest a prefill trigger asks for more than 1 replica: {rest}")
        if rest["alert"] != "inactive":
            fail(f"at rest the prefill TTFT burn-rate alert is {rest['alert']}")

        # The overload: prompts of ~1500 tokens at 4/s, far past one prefill worker's rate here.
        overload = subprocess.Popen([bench, "bench", *common, "--prompt-len", "uniform:1200:1800", "--output-len", "4",
                                     "--rate", "4", "--duration", str(OVERLOAD_DEADLINE_S + args.hold + 10),
                                     "--out", os.path.join(work, "overload")],
                                    stdout=open(os.path.join(work, "overload.log"), "w"), stderr=subprocess.STDOUT)
        procs.append((overload, signal.SIGINT))
        start = time.time()
        timeline = []
        crossed_at = pending_at = None
        while time.time() - start < OVERLOAD_DEADLINE_S + args.hold:
            time.sleep(2)
            row = sample()
            row["t"] = round(time.time() - start)
            timeline.append(row)
            print(row, flush=True)
            if crossed_at is None and (row["router-recommendation:desired"] or 0) > 1:
                crossed_at = row["t"]
            if pending_at is None and row["alert"] in ("pending", "firing"):
                pending_at = row["t"]
            if crossed_at is not None and pending_at is not None and row["t"] >= pending_at + args.hold:
                break
        if overload.poll() is None:
            overload.send_signal(signal.SIGINT)
            overload.wait(timeout=30)
        if crossed_at is None:
            fail(f"the prefill trigger did not ask for more than 1 replica within {OVERLOAD_DEADLINE_S} s")
        if pending_at is None:
            fail(f"the prefill TTFT burn-rate alert did not go pending within {OVERLOAD_DEADLINE_S} s")
        print(f"overload: the router-recommendation trigger crossed at {crossed_at} s, "
              f"the TTFT burn-rate alert was pending at {pending_at} s", flush=True)

        # Every query returns data, now that every route, shed and transfer has happened.
        empty = []
        for title, expr in dashboard_queries(args.source):
            if not p.query(expr):
                empty.append(f"dashboard {title!r}: {expr}")
        queries = 0
        for role, ts in triggers.items():
            for t in ts:
                queries += 1
                if not p.query(t["metadata"]["query"]):
                    empty.append(f"trigger {role}/{t['name']}: {t['metadata']['query']}")
        for name, is_record, expr in rule_expressions(args.source):
            if is_record:
                if not p.query(expr):
                    empty.append(f"recording rule {name}: {expr}")
                if not p.query(name):
                    empty.append(f"recorded series {name}")
            else:
                for n in series_names(expr):
                    if not p.query(n):
                        empty.append(f"alert {name} reads {n}, which has no data")
        if empty:
            fail("queries without data:\n  " + "\n  ".join(empty))
        print(f"prometheus e2e: {len(dashboard_queries(args.source))} dashboard queries, {queries} trigger "
              f"queries, {len(rule_expressions(args.source))} rules returned data", flush=True)

        if args.record:
            with open(args.record, "w") as f:
                cols = ["t", "router-recommendation", "router-recommendation:desired", "ttft", "ttft:desired",
                        "queued-prefill-tokens", "slo_observed", "burn5m", "shed", "alert"]
                f.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
                for row in [dict(rest, t="rest")] + timeline:
                    cells = []
                    for c in cols:
                        v = row.get(c)
                        cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
                    f.write("| " + " | ".join(cells) + " |\n")
        return 0
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
