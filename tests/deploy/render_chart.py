#!/usr/bin/python3
"""Renders the pdserve chart (with gotemplate.py, since helm is not packaged for Debian 12)
for several value sets and checks the Kubernetes objects that come out.

Positive scenarios (defaults + a model volume, each deploy/k8s/examples/*.yaml, and one with
every optional feature on) must render, parse as YAML and pass these checks:
  - every object has apiVersion/kind/metadata.name, names and labels are valid, no duplicates;
  - each Deployment's selector matches its pod labels and no other workload's pods; each
    Service and PDB selects exactly one workload; each ServiceMonitor selects a Service that
    has its port; each ScaledObject targets a Deployment, min >= 1, thresholds from the SLOs;
  - container args are strings and give every process its specified flags, with values that
    agree with the container ports, the Services and the cluster YAML (--router reaches the
    control Service, which publishes not-ready pods);
  - probes name existing ports; GPUs and RDMA slots are equal in requests and limits; RDMA
    adds IPC_LOCK; /dev/shm is a memory emptyDir; volume mounts name volumes;
  - the rendered cluster.yaml is the values' config and uses only the allowed keys;
  - every Prometheus query is well-formed and names only metrics pdserve exports.
Negative scenarios must be refused with a message naming the problem.

Usage: render_chart.py [--root REPO] [--show SCENARIO]   (--show prints the rendered manifests)
       render_chart.py --write-configs DIR   (also writes each scenario's cluster.yaml there, less
                                              cluster.secret_file, for test_config to load)
"""

import argparse
import copy
import json
import os
import re
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gotemplate  # noqa: E402
from lint_chart import CONFIG_KEYS, METRICS, HISTOGRAM_SUFFIXES  # noqa: E402

CHART = "deploy/k8s/pdserve"
EXAMPLES = "deploy/k8s/examples"
NAMESPACE = "llm"
RELEASE = "pdserve"
WORKER_FLAGS = ["--config", "--router", "--id", "--advertise-host", "--bind-host", "--port", "--metrics-port"]
ROUTER_FLAGS = ["--config", "--host", "--port", "--control-port"]

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# Field names of core/v1 Container and PodSpec (the ones a chart could plausibly emit).
CONTAINER_FIELDS = {
    "name", "image", "imagePullPolicy", "command", "args", "workingDir", "ports", "env", "envFrom",
    "resources", "volumeMounts", "volumeDevices", "livenessProbe", "readinessProbe", "startupProbe",
    "lifecycle", "securityContext", "stdin", "tty", "terminationMessagePath",
    "terminationMessagePolicy", "restartPolicy", "resizePolicy"}
POD_FIELDS = {
    "containers", "initContainers", "volumes", "serviceAccountName", "automountServiceAccountToken",
    "imagePullSecrets", "nodeSelector", "tolerations", "affinity", "priorityClassName",
    "runtimeClassName", "terminationGracePeriodSeconds", "securityContext", "hostNetwork", "hostIPC",
    "dnsPolicy", "topologySpreadConstraints", "schedulerName", "enableServiceLinks",
    "shareProcessNamespace", "hostname", "subdomain", "restartPolicy", "resourceClaims"}

MODEL_PVC = {"modelVolume": {"pvc": {"claimName": "models"}}}
EVERYTHING = {
    "config": {"router": {"http": {"api_keys": ["k1", "k2"]}},
               "engine": {"tensor_parallel_size": 2}},
    "prefill": {"gpus": 2, "extraArgs": ["--log-format", "json"], "podLabels": {"team": "llm"},
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}], "podAnnotations": {"a": "b"}},
    "decode": {"gpus": 2, "priorityClassName": "high", "nodeSelector": {"gpu": "h200"}},
    "gpu": {"runtimeClassName": "nvidia"},
    "clusterConfig": {"asSecret": True},
    "router": {"service": {"type": "NodePort", "nodePort": 30080}, "extraArgs": ["--x"],
               "podLabels": {"team": "llm"}},
    "ingress": {"enabled": True, "className": "nginx",
                "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
                "tls": [{"secretName": "tls", "hosts": ["pdserve.example.com"]}]},
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "gateway"}],
                  "hostnames": ["llm.example.com"], "timeouts": {"request": "600s"}},
    "ucx": {"extraEnv": {"UCX_IB_GID_INDEX": "3"}},
    "autoscaling": {"keda": {"extraMatchers": 'cluster="a"'},
                    "prefill": {"routerRecommendation": True},
                    "decode": {"routerRecommendation": True, "kvCacheUsage": 0.85}},
    "metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}},
    "workerSecurityContext": {"capabilities": {"add": ["SYS_NICE"]}},
}
# /metrics behind a token (docs/security.md): the router's ServiceMonitor must send it.
METRICS_AUTH_FILE = {
    "config": {"router": {"http": {"metrics_auth": "bearer_file",
                                   "metrics_bearer_file": "/etc/pdserve/metrics-token/token"}}},
    "metrics": {"serviceMonitor": {"enabled": True, "bearerTokenSecret": {"name": "pdserve-metrics"}}},
}
METRICS_AUTH_KEY = {
    "config": {"router": {"http": {"api_keys": ["sha256:" + "0" * 64], "metrics_auth": "api_key"}}},
    "clusterConfig": {"asSecret": True},
    "metrics": {"serviceMonitor": {"enabled": True,
                                   "bearerTokenSecret": {"name": "prometheus-key", "key": "api-key"}}},
}
NEGATIVE = [
    ("metrics auth, ServiceMonitor without a token",
     {"config": {"router": {"http": {"api_keys": ["k"], "metrics_auth": "api_key"}}},
      "metrics": {"serviceMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.bearerTokenSecret.name is empty: Prometheus could not scrape the router"),
    ("metrics token file outside the mount",
     {**METRICS_AUTH_FILE, "config": {"router": {"http": {"metrics_auth": "bearer_file",
                                                          "metrics_bearer_file": "/tmp/t"}}}},
     "config.router.http.metrics_bearer_file must be /etc/pdserve/metrics-token/token"),
    ("no model claim", {}, "modelVolume.pvc.claimName is required"),
    ("no router", {"router": {"replicas": 0}}, "router.replicas: 0: at least 1 router is needed"),
    ("grace shorter than the drain", {"decode": {"terminationGracePeriodSeconds": 20}},
     "decode.terminationGracePeriodSeconds (20 s) must exceed config.engine.drain_timeout_ms (30000 ms)"),
    ("router grace shorter than preStop + drain", {"router": {"terminationGracePeriodSeconds": 30}},
     "router.terminationGracePeriodSeconds (30 s) must exceed router.preStopSleepSeconds (5 s) plus "
     "config.router.requests.drain_timeout_ms (30000 ms)"),
    ("model outside the mount", {"config": {"model": {"path": "/data/m"}}},
     "is not under modelVolume.mountPath"),
    ("GPUs != TP", {"decode": {"gpus": 2}}, "decode.gpus (2) must equal config.engine.tensor_parallel_size"),
    ("unknown config key", {"config": {"tracing": {"on": True}}}, "config.tracing: unknown key"),
    ("cluster key beside the chart's secret", {"config": {"cluster": {"secret_file": "/x"}}},
     "config.cluster: the chart sets cluster.secret_file"),
    ("same router ports", {"config": {"router": {"workers": {"control_port": 8000}}}},
     "must differ"),
    # The router's flat keys of before would sit beside the grouped defaults (docs/config.md).
    ("a router key by its old flat name", {"config": {"router": {"short_prompt_tokens": 64}}},
     "config.router.short_prompt_tokens is now config.router.routing.short_prompt_tokens"),
    ("HTTPRoute without parents", {"httpRoute": {"enabled": True}}, "httpRoute.parentRefs is required"),
    ("Multus without networks", {"multus": {"enabled": True}}, "multus.networks is required"),
    ("KEDA with no trigger", {"autoscaling": {"decode": {"enabled": True, "itlTrigger": False,
                                                          "kvCacheUsage": 0,
                                                          "runningRequestsPerReplica": 0,
                                                          "routerRecommendation": False}}},
     "every trigger is off"),
    ("KEDA max below 1", {"config": {"pools": {"prefill": {"replicas": 0, "min_replicas": 0,
                                                           "max_replicas": 0}}},
                          "autoscaling": {"prefill": {"enabled": True}}}, "below the KEDA minimum"),
    ("unknown volume type", {"modelVolume": {"type": "nfs"}}, 'modelVolume.type: "nfs" is not one of'),
    ("loopback KV endpoint", {"config": {"kv_transfer": {"listen_host": "127.0.0.1"}}},
     "config.kv_transfer.listen_host: 127.0.0.1 is a loopback address"),
    ("KV usage as a percentage", {"autoscaling": {"decode": {"enabled": True, "kvCacheUsage": 80}}},
     "is a fraction in (0, 1]"),
]


def merge(base, over):
    """Helm's coalescing of user values over the chart's: maps merge, null deletes a key."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class Renderer:
    def __init__(self, root):
        self.root = root
        self.chart_dir = os.path.join(root, CHART)
        with open(os.path.join(self.chart_dir, "Chart.yaml")) as f:
            self.chart = yaml.safe_load(f)
        with open(os.path.join(self.chart_dir, "values.yaml")) as f:
            self.defaults = yaml.safe_load(f)
        self.engine = gotemplate.Engine()
        tdir = os.path.join(self.chart_dir, "templates")
        self.files = sorted(os.listdir(tdir))
        for name in self.files:  # helpers first, so defines exist before anything renders
            with open(os.path.join(tdir, name)) as f:
                self.engine.add(name, f.read())

    def file_text(self, path):
        """Helm's .Files.Get: a chart file's text (links followed, as helm does); "" if none."""
        full = os.path.join(self.chart_dir, path)
        if not os.path.isfile(full):
            return ""
        with open(full) as f:
            return f.read()

    def render(self, user_values):
        values = merge(self.defaults, user_values)
        dot = {
            "Values": gotemplate.helmify(values),
            "Release": {"Name": RELEASE, "Namespace": NAMESPACE, "Service": "Helm",
                        "IsInstall": True, "IsUpgrade": False, "Revision": 1.0},
            "Chart": {"Name": self.chart["name"], "Version": self.chart["version"],
                      "AppVersion": self.chart["appVersion"]},
            "Files": {"Get": self.file_text},
        }
        manifests, notes = {}, ""
        for name in self.files:
            if name.startswith("_"):
                continue
            out = self.engine.render(name, dot)
            if name == "NOTES.txt":
                notes = out
            else:
                manifests[name] = out
        return values, manifests, notes


class Checker:
    def __init__(self, scenario, values, manifests, notes, root):
        self.scenario, self.values, self.notes, self.root = scenario, values, notes, root
        self.errors = []
        self.objs = []
        for name, text in manifests.items():
            try:
                docs = [d for d in yaml.safe_load_all(text) if d is not None]
            except yaml.YAMLError as e:
                self.err(name, f"rendered output is not YAML: {e}\n--- rendered ---\n{text}")
                continue
            for d in docs:
                self.objs.append((name, d))

    def err(self, where, msg):
        self.errors.append(f"[{self.scenario}] {where}: {msg}")

    def by_kind(self, kind):
        return [(n, o) for n, o in self.objs if o.get("kind") == kind]

    def run(self):
        self.check_meta()
        if self.errors:
            return self.errors
        self.deps = {o["metadata"]["name"]: o for _, o in self.by_kind("Deployment")}
        self.svcs = {o["metadata"]["name"]: o for _, o in self.by_kind("Service")}
        for check in (self.check_deployments, self.check_selectors, self.check_config,
                      self.check_scaled_objects, self.check_routes, self.check_dashboard,
                      self.check_prometheus_rules, self.check_expected_objects):
            try:
                check()
            except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
                # a missing or mistyped field: the object is malformed, say where
                self.err(check.__name__, f"malformed object ({type(e).__name__}: {e})")
        if f"{RELEASE}-router" not in self.notes or "port-forward" not in self.notes and \
                not (self.values["ingress"]["enabled"] or self.values["httpRoute"]["enabled"]
                     or self.values["router"]["service"]["type"] != "ClusterIP"):
            self.err("NOTES.txt", "does not say how to reach the router")
        return self.errors

    # ---- every object ---------------------------------------------------------------------
    def check_meta(self):
        seen = set()
        for name, o in self.objs:
            if not isinstance(o, dict):
                self.err(name, f"document is not a mapping: {o!r}")
                continue
            for k in ("apiVersion", "kind", "metadata"):
                if k not in o:
                    self.err(name, f"missing {k}")
            md = o.get("metadata") or {}
            n = md.get("name")
            if not isinstance(n, str) or not DNS1123_LABEL.match(n) or len(n) > 63:
                self.err(name, f"metadata.name {n!r} is not a DNS-1123 label")
            key = (o.get("kind"), n)
            if key in seen:
                self.err(name, f"duplicate {key}")
            seen.add(key)
            for lk, lv in (md.get("labels") or {}).items():
                if not isinstance(lv, str) or len(lv) > 63 or not LABEL_VALUE.match(lv):
                    self.err(name, f"label {lk}={lv!r} is not a valid label value")
            for ak, av in (md.get("annotations") or {}).items():
                if not isinstance(av, str):
                    self.err(name, f"annotation {ak} is not a string: {av!r}")

    # ---- workloads ------------------------------------------------------------------------
    def check_deployments(self):
        cfg = self.values["config"]
        for dname, d in self.deps.items():
            where = f"Deployment {dname}"
            spec = d["spec"]
            pod = spec["template"]
            labels = pod["metadata"].get("labels") or {}
            sel = spec["selector"]["matchLabels"]
            if not sel or any(labels.get(k) != v for k, v in sel.items()):
                self.err(where, f"selector {sel} does not match pod labels {labels}")
            role = labels.get("pdserve.io/role")
            if role not in ("router", "prefill", "decode") or sel.get("pdserve.io/role") != role:
                self.err(where, f"pdserve.io/role is {role!r} (selector {sel.get('pdserve.io/role')!r})")
                continue
            for k, v in (pod["metadata"].get("annotations") or {}).items():
                if not isinstance(v, str):
                    self.err(where, f"pod annotation {k} is not a string")
            ps = pod["spec"]
            vols = {v["name"]: v for v in ps.get("volumes", [])}
            for v in vols.values():
                srcs = [k for k in v if k != "name"]
                if len(srcs) != 1:
                    self.err(where, f"volume {v['name']} has sources {srcs}")
            (c,) = ps["containers"]
            unknown = set(c) - CONTAINER_FIELDS
            if unknown:
                self.err(where, f"unknown container field(s) {sorted(unknown)} (indentation?)")
            unknown = set(ps) - POD_FIELDS
            if unknown:
                self.err(where, f"unknown pod spec field(s) {sorted(unknown)} (indentation?)")
            if not isinstance(c.get("resources"), dict):
                self.err(where, f"resources is {c.get('resources')!r}, not a mapping")
                continue
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for pn, pv in ports.items():
                if not PORT_NAME.match(pn) or len(pn) > 15 or not isinstance(pv, int) or not 0 < pv < 65536:
                    self.err(where, f"port {pn}={pv!r} is invalid")
            args = c.get("args", [])
            if not all(isinstance(a, str) for a in args):
                self.err(where, f"args must all be strings: {args}")
            flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if str(args[i]).startswith("--")}
            env = {e["name"]: e for e in c.get("env", [])}
            for e in env.values():
                if "value" in e and not isinstance(e["value"], str):
                    self.err(where, f"env {e['name']} value is not a string")
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for m in mounts.values():
                if m["name"] not in vols:
                    self.err(where, f"volumeMount {m['name']} names no volume")
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                p = c.get(probe)
                if not p:
                    self.err(where, f"no {probe}")
                    continue
                handlers = [h for h in ("httpGet", "tcpSocket", "exec", "grpc") if h in p]
                if len(handlers) != 1:
                    self.err(where, f"{probe} has handlers {handlers}")
                    continue
                port = p[handlers[0]].get("port")
                if port not in ports:
                    self.err(where, f"{probe} port {port!r} is not a container port")
            if c.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/health":
                self.err(where, "liveness on /health would restart pods for their peers' faults")
            if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/health":
                self.err(where, "readiness is not GET /health")
            if mounts.get("/etc/pdserve", {}).get("name") != "config" or flags.get("--config") != "/etc/pdserve/cluster.yaml":
                self.err(where, "cluster.yaml is not mounted where --config points")
            model_mount = mounts.get(self.values["modelVolume"]["mountPath"])
            if not model_mount or not model_mount.get("readOnly"):
                self.err(where, "the model volume is not mounted read-only")
            if role == "router":
                self.check_router(where, c, flags, ports, spec, cfg)
            else:
                self.check_worker(where, role, c, flags, ports, env, mounts, vols, spec, pod, cfg)

    def check_router(self, where, c, flags, ports, spec, cfg):
        if c.get("command") != ["pdserve-router"]:
            self.err(where, f"command {c.get('command')}")
        for f in ROUTER_FLAGS:
            if f not in flags:
                self.err(where, f"pdserve-router is not given {f}")
        http_port = cfg["router"]["http"]["port"]
        control_port = cfg["router"]["workers"]["control_port"]
        if flags.get("--port") != str(http_port) or ports.get("http") != http_port:
            self.err(where, "--port / http port differ from config.router.http.port")
        if flags.get("--control-port") != str(control_port) or ports.get("control") != control_port:
            self.err(where, "--control-port / control port differ from "
                            "config.router.workers.control_port")
        strategy = spec.get("strategy", {})
        if spec.get("replicas", 0) < 1 or strategy.get("type") != "RollingUpdate" or \
                strategy.get("rollingUpdate", {}).get("maxUnavailable") != 0:
            self.err(where, "the router must have >= 1 replica and a rolling update that keeps one serving")
        # Deletion (docs/reliability.md): a preStop sleep keeps it serving while its endpoints go, then the drain.
        sleep = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if self.values["router"]["preStopSleepSeconds"] > 0 and \
                sleep != ["sleep", str(self.values["router"]["preStopSleepSeconds"])]:
            self.err(where, f"router preStop is {sleep}, not a sleep of router.preStopSleepSeconds")

    def check_worker(self, where, role, c, flags, ports, env, mounts, vols, spec, pod, cfg):
        pool = self.values[role]
        if c.get("command") != [f"pdserve-{role}"]:
            self.err(where, f"command {c.get('command')}")
        for f in WORKER_FLAGS:
            if f not in flags:
                self.err(where, f"pdserve-{role} is not given {f}")
        if flags.get("--port") != str(pool["port"]) or ports.get("control") != pool["port"]:
            self.err(where, "--port and the control port disagree")
        if ports.get("kv-tcp") != pool["port"] + 1:
            self.err(where, "the TCP KV port is not --port + 1")
        if flags.get("--metrics-port") != str(pool["metricsPort"]) or ports.get("metrics") != pool["metricsPort"]:
            self.err(where, "--metrics-port and the metrics port disagree")
        if flags.get("--id") != "$(POD_NAME)" or \
                env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
            self.err(where, "--id is not the pod name")
        if flags.get("--advertise-host") != "$(POD_IP)" or \
                env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
            self.err(where, "--advertise-host is not the pod IP")
        # Peers dial the pod IP: the endpoints must bind an address that accepts it (a
        # control port left on pools.<pool>.host's default 127.0.0.1 refused every decode pod).
        if flags.get("--bind-host") not in ("0.0.0.0", "::"):
            self.err(where, f"--bind-host {flags.get('--bind-host')!r} is not a wildcard: peers dialling the pod IP "
                            "would be refused")
        kv_host = cfg.get("kv_transfer", {}).get("listen_host", "127.0.0.1")
        if kv_host not in ("0.0.0.0", "::"):
            self.err(where, f"config.kv_transfer.listen_host {kv_host!r} is not a wildcard: peers dialling the pod "
                            "IP's tcp KV port would be refused")
        # --router must reach the control Service on the control port
        m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", flags.get("--router", ""))
        svc = self.svcs.get(m.group(1)) if m else None
        if not m or m.group(2) != NAMESPACE or not svc:
            self.err(where, f"--router {flags.get('--router')!r} names no Service of the release")
        else:
            sports = {p["port"]: p for p in svc["spec"]["ports"]}
            if int(m.group(3)) not in sports or not svc["spec"].get("publishNotReadyAddresses"):
                self.err(where, "--router's Service lacks the port or does not publish not-ready routers")
            if svc["spec"]["selector"].get("pdserve.io/role") != "router":
                self.err(where, "--router's Service does not select the router")
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        gname = self.values["gpu"]["resourceName"]
        if pool["gpus"] > 0:
            if req.get(gname) != str(pool["gpus"]) or lim.get(gname) != str(pool["gpus"]):
                self.err(where, f"{gname} requests {req.get(gname)!r} / limits {lim.get(gname)!r}, "
                                f"want {pool['gpus']} in both")
        elif gname in req or gname in lim:
            self.err(where, "GPUs requested with gpus: 0")
        if cfg["engine"]["backend"] == "cuda" and pool["gpus"] != cfg["engine"].get("tensor_parallel_size", 1):
            self.err(where, "GPUs differ from the TP size")
        rd = self.values["rdma"]
        sc = c.get("securityContext") or {}
        if rd["enabled"]:
            want = str(rd["count"])
            if req.get(rd["resourceName"]) != want or lim.get(rd["resourceName"]) != want:
                self.err(where, f"{rd['resourceName']} not {want} in requests and limits")
            if "IPC_LOCK" not in (sc.get("capabilities") or {}).get("add", []):
                self.err(where, "RDMA without IPC_LOCK")
            if rd["runAsRoot"] and sc.get("runAsUser") != 0:
                self.err(where, "RDMA with runAsRoot but runAsUser is not 0")
        for extra in (self.values["workerSecurityContext"].get("capabilities") or {}).get("add", []):
            if extra not in (sc.get("capabilities") or {}).get("add", []):
                self.err(where, f"workerSecurityContext capability {extra} lost")
        shm = mounts.get("/dev/shm")
        if not shm or vols.get(shm["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
            self.err(where, "/dev/shm is not a memory emptyDir")
        ucx = self.values["ucx"]
        if ucx["tls"] and env.get("UCX_TLS", {}).get("value") != ucx["tls"]:
            self.err(where, "UCX_TLS not passed")
        if ucx["netDevices"] and env.get("UCX_NET_DEVICES", {}).get("value") != ucx["netDevices"]:
            self.err(where, "UCX_NET_DEVICES not passed")
        for k, v in ucx["extraEnv"].items():
            if env.get(k, {}).get("value") != str(v):
                self.err(where, f"ucx.extraEnv {k} not passed")
        if not ucx["tls"] and "UCX_TLS" in env:
            self.err(where, "UCX_TLS set though ucx.tls is empty")
        keda = self.values["autoscaling"][role]["enabled"]
        if keda and "replicas" in spec:
            self.err(where, "replicas set although KEDA owns the pool (helm upgrade would fight the HPA)")
        if not keda and spec.get("replicas") != cfg["pools"][role]["replicas"]:
            self.err(where, f"replicas {spec.get('replicas')} != config.pools.{role}.replicas")
        ann = pod["metadata"].get("annotations") or {}
        if self.values["multus"]["enabled"] and ann.get("k8s.v1.cni.cncf.io/networks") != self.values["multus"]["networks"]:
            self.err(where, "Multus annotation missing")
        if "checksum/config" not in ann:
            self.err(where, "no config checksum annotation")

    # ---- selectors ------------------------------------------------------------------------
    def pods_selected(self, sel):
        out = []
        for dname, d in self.deps.items():
            labels = d["spec"]["template"]["metadata"].get("labels") or {}
            if sel and all(labels.get(k) == v for k, v in sel.items()):
                out.append(dname)
        return out

    def check_selectors(self):
        for _, s in self.by_kind("Service"):
            where = f"Service {s['metadata']['name']}"
            hit = self.pods_selected(s["spec"].get("selector") or {})
            if len(hit) != 1:
                self.err(where, f"selects workloads {hit}, want exactly one")
                continue
            d = self.deps[hit[0]]
            cports = {p["name"] for p in d["spec"]["template"]["spec"]["containers"][0].get("ports", [])}
            for p in s["spec"]["ports"]:
                if p.get("targetPort") not in cports:
                    self.err(where, f"targetPort {p.get('targetPort')!r} is not a port of {hit[0]}")
                if not isinstance(p.get("port"), int):
                    self.err(where, f"port {p.get('port')!r} is not a number")
            if s["spec"].get("clusterIP") == "None" and s["spec"].get("type") not in (None, "ClusterIP"):
                self.err(where, "headless Service with a type")
        for _, p in self.by_kind("PodDisruptionBudget"):
            hit = self.pods_selected(p["spec"]["selector"]["matchLabels"])
            if len(hit) != 1:
                self.err(f"PDB {p['metadata']['name']}", f"selects workloads {hit}, want exactly one")
        for _, m in self.by_kind("ServiceMonitor"):
            sel = m["spec"]["selector"]["matchLabels"]
            port = m["spec"]["endpoints"][0]["port"]
            ok = [n for n, s in self.svcs.items()
                  if all((s["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())
                  and port in {p["name"] for p in s["spec"]["ports"]}]
            if not ok:
                self.err(f"ServiceMonitor {m['metadata']['name']}", f"selects no Service with port {port}")
        self.check_metrics_auth()

    def check_metrics_auth(self):
        """With config.router.http.metrics_auth on, the router's ServiceMonitor sends the token (else
        every scrape is a 401 and KEDA reads nothing), and bearer_file mounts it in the router."""
        auth = self.values["config"]["router"]["http"].get("metrics_auth", "none")
        secret = self.values["metrics"]["serviceMonitor"]["bearerTokenSecret"]
        for _, m in self.by_kind("ServiceMonitor"):
            if not m["metadata"]["name"].endswith("-router"):
                continue
            got = m["spec"]["endpoints"][0].get("bearerTokenSecret")
            want = {"name": secret["name"], "key": secret["key"]} if auth != "none" else None
            if got != want:
                self.err(f"ServiceMonitor {m['metadata']['name']}",
                         f"bearerTokenSecret {got}, want {want} (config.router.http.metrics_auth: {auth})")
        router = self.deps.get(f"{RELEASE}-router")
        if router is None:
            return
        pod = router["spec"]["template"]["spec"]
        mounts = {v["mountPath"]: v["name"] for v in pod["containers"][0].get("volumeMounts", [])}
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        if auth == "bearer_file":
            path = self.values["config"]["router"]["http"]["metrics_bearer_file"]
            d = os.path.dirname(path)
            v = vols.get(mounts.get(d, ""), {})
            if v.get("secret", {}).get("secretName") != secret["name"] or \
                    os.path.basename(path) not in [i["path"] for i in v["secret"].get("items", [])]:
                self.err("router", f"metrics_bearer_file {path} is not the mounted Secret {secret['name']}")
        elif "/etc/pdserve/metrics-token" in mounts:
            self.err("router", "mounts a metrics token although metrics_auth is not bearer_file")

    # ---- the Grafana dashboard ConfigMap ------------------------------------------------------
    def check_dashboard(self):
        """metrics.grafanaDashboard: the sidecar's label, and deploy/grafana/pdserve.json verbatim."""
        g = self.values["metrics"]["grafanaDashboard"]
        maps = [o for _, o in self.by_kind("ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
        if not g["enabled"]:
            if maps:
                self.err("dashboard", "a dashboard ConfigMap although metrics.grafanaDashboard.enabled is false")
            return
        if len(maps) != 1:
            self.err("dashboard", f"expected one dashboard ConfigMap, got {len(maps)}")
            return
        m = maps[0]
        for k, v in g["labels"].items():
            if m["metadata"]["labels"].get(k) != v:
                self.err("dashboard", f"label {k}={v!r} missing (the Grafana sidecar selects on it)")
        with open(os.path.join(self.root, "deploy/grafana/pdserve.json")) as f:
            want = f.read()
        got = m.get("data", {}).get("pdserve.json")
        if got is None or json.loads(got) != json.loads(want):
            self.err("dashboard", "data.pdserve.json is not deploy/grafana/pdserve.json")

    # ---- cluster.yaml ---------------------------------------------------------------------
    def check_config(self):
        objs = self.by_kind("Secret" if self.values["clusterConfig"]["asSecret"] else "ConfigMap")
        objs = [o for o in objs if not o[1]["metadata"]["name"].endswith(("-cluster-secret", "-dashboard"))]
        if len(objs) != 1:
            self.err("config", f"expected one config object, got {len(objs)}")
            return
        o = objs[0][1]
        text = (o.get("stringData") or o.get("data") or {}).get("cluster.yaml")
        if not isinstance(text, str):
            self.err("config", "no cluster.yaml key")
            return
        cfg = yaml.safe_load(text)
        self.config_text = text
        want = copy.deepcopy(self.values["config"])
        cs = self.values["clusterSecret"]
        if cs["enabled"]:
            # The chart names the mounted secret (docs/security.md); every pod must mount it there.
            want["cluster"] = {"secret_file": "/etc/pdserve-secret/" + cs["key"]}
            self.check_cluster_secret(cs)
        if cfg != want:
            self.err("config", f"rendered cluster.yaml differs from .Values.config:\n{text}")
        for k in cfg:
            if k not in CONFIG_KEYS:
                self.err("config", f"cluster.yaml has key {k!r}")

    def check_cluster_secret(self, cs):
        fullname = next((n[:-len("-router")] for n in self.deps if n.endswith("-router")), RELEASE)
        name = cs["existingSecret"] or f"{fullname}-cluster-secret"
        made = [o for _, o in self.by_kind("Secret") if o["metadata"]["name"] == name]
        if cs["existingSecret"]:
            if made:
                self.err("cluster secret", f"the chart made Secret {name} although existingSecret names it")
        elif len(made) != 1:
            self.err("cluster secret", f"expected the chart to make Secret {name}")
        else:
            import base64
            raw = base64.b64decode((made[0].get("data") or {}).get(cs["key"], ""))
            if len(raw) < 32:
                self.err("cluster secret", f"Secret {name} holds {len(raw)} bytes under {cs['key']}; >= 32 needed")
        for where, o in self.by_kind("Deployment"):
            pod = o["spec"]["template"]["spec"]
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            v = vols.get("cluster-secret")
            if not v or v.get("secret", {}).get("secretName") != name:
                self.err(where, f"no cluster-secret volume from Secret {name}")
                continue
            if v["secret"].get("defaultMode") != 0o400:
                self.err(where, "the cluster secret must be mounted with mode 0400 (the processes refuse others' read)")
            for c in pod["containers"]:
                mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
                if mounts.get("cluster-secret", {}).get("mountPath") != "/etc/pdserve-secret":
                    self.err(where, f"container {c['name']} does not mount the cluster secret at /etc/pdserve-secret")

    # ---- KEDA -----------------------------------------------------------------------------
    def check_scaled_objects(self):
        seen = set()
        for _, so in self.by_kind("ScaledObject"):
            where = f"ScaledObject {so['metadata']['name']}"
            spec = so["spec"]
            tgt = spec["scaleTargetRef"]["name"]
            if tgt not in self.deps:
                self.err(where, f"targets {tgt!r}, not a Deployment of the release")
                continue
            role = self.deps[tgt]["spec"]["template"]["metadata"]["labels"]["pdserve.io/role"]
            seen.add(role)
            pool = self.values["config"]["pools"][role]
            if spec["minReplicaCount"] < 1 or spec["minReplicaCount"] != max(1, pool["min_replicas"]):
                self.err(where, f"minReplicaCount {spec['minReplicaCount']}")
            if spec["maxReplicaCount"] != pool["max_replicas"]:
                self.err(where, f"maxReplicaCount {spec['maxReplicaCount']}")
            for t in spec["triggers"]:
                md = t["metadata"]
                if t["type"] != "prometheus" or t.get("metricType") not in ("Value", "AverageValue"):
                    self.err(where, f"trigger {t.get('name')}: type/metricType")
                try:
                    th = float(md["threshold"])
                except (KeyError, ValueError):
                    self.err(where, f"trigger {t.get('name')}: threshold {md.get('threshold')!r} is not a number")
                    continue
                if not isinstance(md["threshold"], str) or th <= 0:
                    self.err(where, f"trigger {t.get('name')}: threshold must be a positive string")
                q = md["query"]
                if q.count("(") != q.count(")") or q.count("{") != q.count("}") or "\n" in q:
                    self.err(where, f"trigger {t.get('name')}: malformed query {q!r}")
                for metric in re.findall(r"\bpdserve_\w+", q):
                    base = metric
                    for suf in HISTOGRAM_SUFFIXES:
                        if metric.endswith(suf):
                            base = metric[:-len(suf)]
                    if base not in METRICS:
                        self.err(where, f"query names unknown metric {metric}")
                for sel in re.findall(r"\{([^}]*)\}", q):
                    for matcher in sel.split(","):
                        if not re.fullmatch(r'\s*\w+\s*(=|!=|=~|!~)\s*"[^"]*"\s*', matcher):
                            self.err(where, f"bad label matcher {matcher!r} in {q!r}")
                if f'namespace="{NAMESPACE}"' not in q:
                    self.err(where, f"query not scoped to the namespace: {q}")
                slo = pool["slo"]
                if t.get("name") == "ttft" and abs(th - slo["ttft_ms"] / 1000) > 1e-9:
                    self.err(where, "TTFT threshold is not slo.ttft_ms / 1000")
                if t.get("name") == "itl" and abs(th - slo["itl_ms"] / 1000) > 1e-9:
                    self.err(where, "ITL threshold is not slo.itl_ms / 1000")
                if t.get("name") == "ttft" and 'route="disaggregated"' not in q:
                    self.err(where, f"the prefill pool's TTFT trigger must read disaggregated requests only: {q}")
                if t.get("name") in ("ttft", "itl") and f"histogram_quantile({slo['percentile'] / 100:g}," not in q:
                    self.err(where, f"quantile is not slo.percentile / 100: {q}")
        for role in ("prefill", "decode"):
            if self.values["autoscaling"][role]["enabled"] != (role in seen):
                self.err("KEDA", f"autoscaling.{role}.enabled but ScaledObject present={role in seen}")

    def check_prometheus_rules(self):
        """The PrometheusRule carries deploy/prometheus/pdserve-rules.yaml's groups unchanged, and
        promtool (Debian's prometheus package) accepts them."""
        for _, pr in self.by_kind("PrometheusRule"):
            where = f"PrometheusRule {pr['metadata']['name']}"
            with open(os.path.join(self.root, "deploy/prometheus/pdserve-rules.yaml")) as f:
                plain = yaml.safe_load(f)
            if pr["spec"] != plain:
                self.err(where, "spec differs from deploy/prometheus/pdserve-rules.yaml")
            for k, val in self.values["metrics"]["prometheusRule"]["labels"].items():
                if pr["metadata"]["labels"].get(k) != val:
                    self.err(where, f"label {k} missing (metrics.prometheusRule.labels)")
            import shutil
            import subprocess
            import tempfile
            promtool = shutil.which("promtool")
            if not promtool:
                continue  # scripts/setup installs it; the rules' own ctest skips without it
            with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
                yaml.safe_dump(pr["spec"], f)
                f.flush()
                r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
                if r.returncode != 0:
                    self.err(where, f"promtool check rules: {r.stdout}{r.stderr}")

    def check_routes(self):
        rsvc = f"{RELEASE}-router"
        for _, ing in self.by_kind("Ingress"):
            for rule in ing["spec"]["rules"]:
                for p in rule["http"]["paths"]:
                    b = p["backend"]["service"]
                    if b["name"] != rsvc or b["port"].get("name") not in {x["name"] for x in self.svcs[rsvc]["spec"]["ports"]}:
                        self.err("Ingress", f"backend {b} is not the router Service")
        for _, r in self.by_kind("HTTPRoute"):
            for rule in r["spec"]["rules"]:
                for b in rule["backendRefs"]:
                    if b["name"] != rsvc or b["port"] not in {x["port"] for x in self.svcs[rsvc]["spec"]["ports"]}:
                        self.err("HTTPRoute", f"backend {b} is not the router Service")

    def check_expected_objects(self):
        kinds = {}
        for _, o in self.objs:
            kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
        want = {"Deployment": 3, "Service": 4}
        v = self.values
        want["PodDisruptionBudget"] = sum(v[r]["pdb"]["enabled"] for r in ("router", "prefill", "decode"))
        want["ServiceMonitor"] = 3 if v["metrics"]["serviceMonitor"]["enabled"] else 0
        want["ConfigMap"] = (0 if v["clusterConfig"]["asSecret"] else 1) + (1 if v["metrics"]["grafanaDashboard"]["enabled"] else 0)
        want["PrometheusRule"] = 1 if v["metrics"]["prometheusRule"]["enabled"] else 0
        want["ScaledObject"] = sum(v["autoscaling"][r]["enabled"] for r in ("prefill", "decode"))
        want["Ingress"] = 1 if v["ingress"]["enabled"] else 0
        want["HTTPRoute"] = 1 if v["httpRoute"]["enabled"] else 0
        for k, n in want.items():
            if kinds.get(k, 0) != n:
                self.err("objects", f"{kinds.get(k, 0)} {k}, expected {n}")


def scenarios(root):
    out = [("defaults+pvc", MODEL_PVC)]
    edir = os.path.join(root, EXAMPLES)
    for name in sorted(os.listdir(edir)):
        if name.endswith(".yaml"):
            with open(os.path.join(edir, name)) as f:
                out.append((f"examples/{name}", yaml.safe_load(f)))
    gpu = dict(out)["examples/gpu-rdma.yaml"]
    out.append(("everything", merge(gpu, EVERYTHING)))
    out.append(("metrics auth bearer_file", merge(MODEL_PVC, METRICS_AUTH_FILE)))
    out.append(("metrics auth api_key", merge(MODEL_PVC, METRICS_AUTH_KEY)))
    # The user's own Secret, and the planes left open on purpose.
    out.append(("existing cluster secret", merge(MODEL_PVC, {"clusterSecret": {"existingSecret": "my-secret",
                                                                              "key": "token"}})))
    out.append(("unauthenticated", merge(MODEL_PVC, {"clusterSecret": {"enabled": False}})))
    out.append(("grafana dashboard", merge(MODEL_PVC, {"metrics": {"grafanaDashboard": {"enabled": True}},
                                                       "config": {"metrics": {"vllm_compatible_names": True}}})))
    return out


def write_config(write_dir, name, text):
    """The scenario's cluster.yaml as the processes read it, less cluster.secret_file (a path in
    the pods that loading reads)."""
    cfg = yaml.safe_load(text)
    cfg.pop("cluster", None)
    os.makedirs(write_dir, exist_ok=True)
    file_name = re.sub(r"[^a-z0-9]+", "-", name.lower()) + ".yaml"
    with open(os.path.join(write_dir, file_name), "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


def run_all(root, show=None, quiet=False, write_dir=None):
    """Renders every scenario and every refused value set; returns the problems."""
    say = (lambda *a: None) if quiet else print
    try:
        r = Renderer(root)
    except gotemplate.TemplateError as e:
        return [f"parse error: {e}"], 0
    errors, n_objs = [], 0
    for name, vals in scenarios(root):
        try:
            values, manifests, notes = r.render(vals)
        except gotemplate.TemplateError as e:
            errors.append(f"[{name}] render failed: {e}")
            continue
        if show == name:
            for f, text in manifests.items():
                print(f"# ---- {f}\n{text}")
            print(f"# ---- NOTES.txt\n{notes}")
        c = Checker(name, values, manifests, notes, root)
        errors += c.run()
        n_objs += len(c.objs)
        if write_dir and getattr(c, "config_text", None):
            write_config(write_dir, name, c.config_text)
        say(f"rendered {name}: {len(c.objs)} objects")
    for name, vals, expect in NEGATIVE:
        full = vals if name == "no model claim" else merge(MODEL_PVC, vals)
        try:
            r.render(full)
            errors.append(f"[refuse: {name}] rendered, but the chart should have refused it")
        except gotemplate.Fail as e:
            if expect not in str(e):
                errors.append(f"[refuse: {name}] refused with {str(e)!r}, expected {expect!r}")
            else:
                say(f"refused {name}: {e}")
        except gotemplate.TemplateError as e:
            errors.append(f"[refuse: {name}] template error instead of a clear refusal: {e}")
    return errors, n_objs


# Breaks the render checks must catch (file, old, new, expected text in a problem).
MUTATIONS = [
    ("cluster secret readable by all", "templates/_helpers.tpl", "defaultMode: 256", "defaultMode: 420",
     "mounted with mode 0400"),
    ("resources indented wrong", "templates/decode-deployment.yaml",
     '(dict "ctx" . "pool" .Values.decode) | nindent 12', '(dict "ctx" . "pool" .Values.decode) | nindent 10',
     "unknown container field(s) ['limits', 'requests'] (indentation?)"),
    ("float compared with int", "templates/decode-scaledobject.yaml",
     "gt (int .Values.autoscaling.decode.runningRequestsPerReplica) 0",
     "gt .Values.autoscaling.decode.runningRequestsPerReplica 0", "incompatible types for comparison"),
    ("unquoted numeric arg", "templates/prefill-deployment.yaml",
     "- {{ .Values.prefill.port | quote }}", "- {{ .Values.prefill.port }}", "args must all be strings"),
    ("GPU only in limits", "templates/_helpers.tpl",
     "{{- $_ := set $requests $ctx.Values.gpu.resourceName (int .pool.gpus | toString) }}\n", "",
     "want 1 in both"),
    ("prefill TTFT trigger over every route", "templates/prefill-scaledobject.yaml",
     ' ,route="disaggregated"}', "}", "must read disaggregated requests only"),
    ("PrometheusRule without the rules", "templates/prometheusrule.yaml",
     '{{- .Files.Get "rules/pdserve-rules.yaml" | nindent 2 }}', "  groups: []",
     "spec differs from deploy/prometheus/pdserve-rules.yaml"),
    ("ITL threshold off by 10x", "templates/decode-scaledobject.yaml",
     "divf .Values.config.pools.decode.slo.itl_ms 1000", "divf .Values.config.pools.decode.slo.itl_ms 100",
     "ITL threshold is not slo.itl_ms / 1000"),
    ("control Service hides the loading router", "templates/router-service.yaml",
     "  publishNotReadyAddresses: true\n", "", "does not publish not-ready routers"),
    ("replicas fighting KEDA", "templates/prefill-deployment.yaml",
     "{{- if not .Values.autoscaling.prefill.enabled }}\n  replicas:", "{{- if true }}\n  replicas:",
     "replicas set although KEDA owns the pool"),
    ("shm on disk", "templates/_helpers.tpl", "    medium: Memory\n", "", "/dev/shm is not a memory emptyDir"),
    ("ServiceMonitor without the metrics token", "templates/router-servicemonitor.yaml",
     "      bearerTokenSecret:\n", "      bearerTokenSecretX:\n", "bearerTokenSecret None, want"),
    ("dashboard without the sidecar's label", "templates/grafana-dashboard.yaml",
     "    {{- with .Values.metrics.grafanaDashboard.labels }}", "    {{- with .Values.metrics.grafanaDashboard.annotations }}",
     "label grafana_dashboard='1' missing"),
    ("dashboard not the repository's", "templates/grafana-dashboard.yaml",
     '{{- .Files.Get "dashboards/pdserve.json" | nindent 4 }}', '{{- "{}" | nindent 4 }}',
     "data.pdserve.json is not deploy/grafana/pdserve.json"),
    ("missing fail for a bad volume type", "templates/_helpers.tpl",
     '{{- fail (printf "modelVolume.type: %q is not one of pvc, hostPath" .Values.modelVolume.type) }}\n', "",
     "[refuse: unknown volume type] rendered"),
]


def self_test(root):
    import shutil
    import tempfile
    failures = 0
    for desc, rel, old, new, expect in MUTATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            for sub in (CHART, EXAMPLES, "deploy/grafana", "deploy/prometheus"):
                shutil.copytree(os.path.join(root, sub), os.path.join(tmp, sub))
            path = os.path.join(tmp, CHART, rel)
            with open(path) as f:
                text = f.read()
            if old not in text:
                print(f"SELF-TEST BROKEN: {desc}: {old!r} not in {rel}")
                failures += 1
                continue
            with open(path, "w") as f:
                f.write(text.replace(old, new, 1))
            errors, _ = run_all(tmp, quiet=True)
            if any(expect in e for e in errors):
                print(f"caught: {desc}")
            else:
                print(f"MISSED: {desc}: expected {expect!r} in {errors}")
                failures += 1
    print(f"chart render self-test: {len(MUTATIONS) - failures} of {len(MUTATIONS)} breaks caught")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..")))
    ap.add_argument("--show", help="print the manifests of this scenario")
    ap.add_argument("--self-test", action="store_true",
                    help="break the chart in known ways (in a copy) and check each is caught")
    ap.add_argument("--write-configs", metavar="DIR",
                    help="write each scenario's rendered cluster.yaml into DIR")
    a = ap.parse_args()
    errors, n_objs = run_all(a.root, show=a.show, write_dir=a.write_configs)
    for e in errors:
        print(e)
    print(f"chart render: {'FAILED, ' + str(len(errors)) + ' problem(s)' if errors else 'ok'} "
          f"({n_objs} objects checked, {len(NEGATIVE)} bad value sets refused)")
    if errors:
        return 1
    if a.self_test:
        return 1 if self_test(a.root) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
