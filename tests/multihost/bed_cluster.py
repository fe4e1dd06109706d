"""A pdserve cluster on the bed (netbed.py), started the way the Helm chart starts it.

The chart is rendered with the project's renderer (tests/deploy/render_chart.py, a Go-template
emulation of Helm): its ConfigMap gives the one cluster.yaml every process reads, and each
Deployment gives its container's command line and UCX environment. The chart's cluster Secret
(docs/security.md) becomes a 0600 file in the work directory, and cluster.secret_file points at it, as
the pod's /etc/pdserve-secret mount does. The downward API's
$(POD_NAME) and $(POD_IP) become the bed host's name and address; the control Service's DNS
name (--router <release>-router-control.<ns>.svc:PORT) resolves, through each namespace's
/etc/hosts, to the router host(s).
"""
import base64
import json
import os
import re
import subprocess
import sys
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "deploy"))
import render_chart  # noqa: E402

import netbed  # noqa: E402


def deep_merge(a, b):
    return render_chart.merge(a, b)


def render(values):
    """(cluster_yaml_text, {role: (args, env)}, cluster secret bytes or None) from the chart."""
    renderer = render_chart.Renderer(ROOT)
    _, manifests, _ = renderer.render(values)
    cfg, workloads, secret = None, {}, None
    for name, text in manifests.items():
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            if doc["kind"] in ("ConfigMap", "Secret") and "cluster.yaml" in str(doc.get("data", doc.get("stringData"))):
                cfg = (doc.get("data") or doc.get("stringData"))["cluster.yaml"]
            if doc["kind"] == "Secret" and doc["metadata"]["name"].endswith("-cluster-secret"):
                secret = base64.b64decode(next(iter(doc["data"].values())))
            if doc["kind"] == "Deployment":
                c = doc["spec"]["template"]["spec"]["containers"][0]
                role = doc["metadata"]["labels"]["pdserve.io/role"]
                env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
                workloads[role] = (c["command"] + c.get("args", []), env)
    assert cfg is not None, "the chart rendered no cluster.yaml"
    return cfg, workloads, secret


def write_secret(path, data):
    """A secret file as the processes require it: mode 0600."""
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def expand(argv, pod_name, pod_ip):
    return [a.replace("$(POD_NAME)", pod_name).replace("$(POD_IP)", pod_ip) for a in argv]


class Cluster:
    """Router(s), prefill and decode workers, each on its own bed host, plus a client host."""

    def __init__(self, build_dir, model_dir, work_dir, values_over, routers=1, prefill=2, decode=2, extra_hosts=()):
        self.build_dir, self.work_dir = build_dir, work_dir
        os.makedirs(work_dir, exist_ok=True)
        base = yaml.safe_load(open(os.path.join(ROOT, "deploy", "k8s", "examples", "cpu-kind.yaml")))
        mount = os.path.dirname(model_dir)
        values = deep_merge(base, {
            "modelVolume": {"type": "hostPath", "mountPath": mount, "hostPath": {"path": mount}},
            "config": {
                "model": {"path": model_dir},
                "router": {"routing": {"short_prompt_tokens": 32, "prefix_aware_routing": False},
                           "requests": {"request_timeout_ms": 60000},
                           "workers": {"worker_report_timeout_ms": 1000}},
                "pools": {"prefill": {"replicas": prefill, "min_replicas": prefill, "max_replicas": prefill},
                          "decode": {"replicas": decode, "min_replicas": decode, "max_replicas": decode}},
                "engine": {"threads": 1, "kv_cache_bytes": 67108864, "max_batch_tokens": 512},
                "logging": {"level": "warn"},
            },
        })
        values = deep_merge(values, values_over)
        self.values = values
        self.cluster_yaml, self.workloads, self.secret = render(values)
        self.cfg = yaml.safe_load(self.cluster_yaml)
        if (self.cfg.get("cluster") or {}).get("secret_file"):
            assert self.secret is not None, "cluster.yaml names a secret file but the chart made no Secret"
            path = os.path.join(work_dir, "cluster-secret")
            write_secret(path, self.secret)
            self.cfg["cluster"]["secret_file"] = path
        self.config_path = os.path.join(work_dir, "cluster.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(self.cfg, f)
        self.router_hosts = [f"router-{i}" for i in range(routers)]
        self.prefill_hosts = [f"prefill-{i}" for i in range(prefill)]
        self.decode_hosts = [f"decode-{i}" for i in range(decode)]
        hosts = self.router_hosts + self.prefill_hosts + self.decode_hosts + ["client"] + list(extra_hosts)
        router_args = self.workloads["router"][0]
        svc = re.match(r"([^:]+):", self.workloads["decode"][0][self.workloads["decode"][0].index("--router") + 1])
        self.bed = netbed.Bed(hosts, hosts_file={svc.group(1): self.router_hosts})
        self.http_port = int(router_args[router_args.index("--port") + 1])
        self.metrics_port = {r: int(self.workloads[r][0][self.workloads[r][0].index("--metrics-port") + 1])
                             for r in ("prefill", "decode")}
        self.procs = {}

    def __enter__(self):
        self.bed.create()
        try:
            for h in self.router_hosts:
                self.start(h)
            for h in self.prefill_hosts + self.decode_hosts:
                self.start(h)
            self.wait_ready()
        except BaseException:
            self.bed.destroy()
            raise
        return self

    def __exit__(self, *exc):
        self.bed.destroy()

    def start(self, host):
        role = host.split("-")[0]
        argv, env = self.workloads[role]
        argv = expand(argv, host, self.bed.addr[host])
        argv[0] = os.path.join(self.build_dir, "bin", argv[0])
        argv[argv.index("--config") + 1] = self.config_path
        self.procs[host] = self.bed.spawn(host, argv, env=env, log=os.path.join(self.work_dir, host + ".log"))

    def start_as(self, host, role, config_path):
        """A `role` process on an extra host, with its own cluster.yaml (a wrong secret, say)."""
        argv, env = self.workloads[role]
        argv = expand(argv, host, self.bed.addr[host])
        argv[0] = os.path.join(self.build_dir, "bin", argv[0])
        argv[argv.index("--config") + 1] = config_path
        self.procs[host] = self.bed.spawn(host, argv, env=env, log=os.path.join(self.work_dir, host + ".log"))

    def kill(self, host, sig=9):
        p = self.procs[host]
        os.killpg(p.pid, sig)
        p.wait(10)

    def url(self, path, host="router-0", port=None):
        return f"http://{self.bed.addr[host]}:{port or self.http_port}{path}"

    def http(self, url, body=None, timeout=60, frm="client"):
        """(status, headers, body) of one request made from host `frm` with curl; status 0: no reply."""
        argv = ["curl", "-s", "-i", "-m", str(timeout), url]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        r = self.bed.run_in(frm, argv, timeout=timeout + 10, check=False)
        if r.returncode != 0 or not r.stdout:
            return 0, "", f"curl exit {r.returncode}"
        head, _, rest = r.stdout.replace("\r\n", "\n").partition("\n\n")
        m = re.match(r"HTTP/\S+ (\d+)", head)
        return (int(m.group(1)) if m else 0), head.lower(), rest

    def metric(self, host, name, labels=""):
        """Sum of the series of `name` whose labels contain every `k="v"` in labels."""
        role = host.split("-")[0]
        port = self.metrics_port.get(role, self.http_port)
        status, _, text = self.http(self.url("/metrics", host, port), timeout=5)
        if status != 200:
            return -1.0
        want = [l for l in labels.split(",") if l]
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line[len(name):len(name) + 1] not in (" ", "{"):
                continue
            if all(w in line for w in want):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for h, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{h} exited with {p.returncode}: " + self.log_tail(h))
            ok = True
            for r in self.router_hosts:
                if r not in self.procs:
                    continue
                for pool, hosts in (("prefill", self.prefill_hosts), ("decode", self.decode_hosts)):
                    n = self.metric(r, "pdserve_worker_healthy", f'pool="{pool}"')
                    ok = ok and n == len(hosts)
            if ok:
                return
            time.sleep(0.2)
        raise RuntimeError("cluster not ready in time: " + " | ".join(f"{h}: {self.log_tail(h)}" for h in self.procs))

    def log_tail(self, host, n=600):
        try:
            return open(os.path.join(self.work_dir, host + ".log")).read()[-n:]
        except OSError:
            return ""
