#!/usr/bin/python3
"""Lints the pdserve Helm chart without helm (helm is not packaged for Debian 12).

What it checks, each a mistake that would otherwise show up only at `helm install` time or,
worse, as a cluster that deploys but never works:
  - Chart.yaml, values.yaml and every deploy/k8s/examples/*.yaml parse as YAML;
  - every values.yaml key carries a comment (free-form subtrees and list items excepted);
  - every `.Values.a.b.c` path a template reads exists in values.yaml, also through
    `$var := .Values.x` aliases and `(dict "pool" .Values.x)` arguments of helpers;
  - every `include "x"` names a `define` in templates/_*.tpl, and every define is used;
  - `if/range/with/define` blocks are balanced in every template;
  - the cluster YAML (values' `config`, and each example's) uses only the keys the processes
    accept, and satisfies the rules the chart's own `fail`s enforce;
  - each example values file sets only keys values.yaml has (or free-form ones);
  - per workload, the Deployment's selector labels are among its pod template labels; each
    Service and PDB selects exactly the pods of its own role, each ServiceMonitor selects its
    role's Service, each ScaledObject targets its role's Deployment;
  - Service targetPorts, probe ports and ServiceMonitor ports name ports that exist;
  - the processes get the flags they are specified with;
  - every Prometheus metric a template queries is one pdserve exports (docs/design.md §6);
  - the prefill and decode templates are twins (same text with prefill -> decode).

Usage: lint_chart.py [--root REPO]            lint the chart, exit 1 on the first report
       lint_chart.py [--root REPO] --self-test break the chart in known ways, one at a time, and
                                               check that each break is caught
"""

import argparse
import copy
import os
import re
import shutil
import sys
import tempfile

import yaml

CHART = "deploy/k8s/pdserve"
EXAMPLES = "deploy/k8s/examples"
ROLES = ("router", "prefill", "decode")

# The cluster YAML's keys (common/config, docs/config.md). Top level as decided for the
# project; one level down as common/config accepts them.
CONFIG_KEYS = {
    "model": {"path", "preset", "name", "max_model_len", "dtype"},
    "router": {"http", "routing", "admission", "workers", "requests", "metrics", "autoscaler"},
    "pools": {"prefill", "decode"},
    "engine": {"backend", "threads", "block_size", "num_blocks", "kv_cache_bytes", "gpu_memory_utilization",
               "max_batch_tokens", "max_running_requests", "max_queue",
               "tensor_parallel_size", "enable_prefix_caching", "drain_timeout_ms",
               "slo_sized_prefill_chunks", "min_prefill_chunk_tokens", "weight_format",
               "kv_cache_dtype"},
    "kv_transfer": {"transports", "listen_host", "timeout_ms", "heartbeat_ms", "lease_ms",
                    "on_remote_prefill_failure"},
    "logging": {"level"},
    "metrics": {"vllm_compatible_names"},
    "cluster": {"secret_file"},
}
# The router's groups (docs/config.md); each key sat flat under router: before.
ROUTER_GROUP_KEYS = {
    "http": {"host", "port", "api_keys", "max_connections", "header_timeout_ms", "body_timeout_ms",
             "keepalive_timeout_ms", "max_body_bytes", "tls", "metrics_auth",
             "metrics_bearer_file"},
    "routing": {"short_prompt_tokens", "adaptive_threshold", "prefix_aware_routing",
                "exact_prefix_routing", "kv_event_max_lag_ms"},
    "admission": {"overload_shedding", "max_prompt_tokens", "rate_limits"},
    "workers": {"control_port", "load_report_interval_ms", "worker_report_timeout_ms"},
    "requests": {"request_timeout_ms", "max_migrations", "drain_timeout_ms", "stream_heartbeat_ms"},
    "metrics": {"ttft_buckets_s", "itl_buckets_s", "e2e_buckets_s"},
}
POOL_KEYS = {"replicas", "min_replicas", "max_replicas", "host", "base_port", "slo"}
SLO_KEYS = {"prefill": {"ttft_ms", "percentile"}, "decode": {"itl_ms", "percentile"}}

# docs/design.md §6: what the router and the workers export.
METRICS = {
    "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds", "pdserve_request_queue_time_seconds",
    "pdserve_route_decisions_total", "pdserve_desired_replicas",
    "pdserve_num_requests_running", "pdserve_num_requests_waiting",
    "pdserve_kv_cache_usage_perc", "pdserve_queued_prefill_tokens",
    "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_fallbacks_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# The command lines the processes implement (the serving code's contract).
REQUIRED_FLAGS = {
    "router": ["--config", "--host", "--port", "--control-port"],
    "prefill": ["--config", "--router", "--id", "--advertise-host", "--bind-host", "--port", "--metrics-port"],
    "decode": ["--config", "--router", "--id", "--advertise-host", "--bind-host", "--port", "--metrics-port"],
}
BINARIES = {"router": "pdserve-router", "prefill": "pdserve-prefill", "decode": "pdserve-decode"}
TWINS = ("deployment", "service", "pdb", "servicemonitor")


class Lint:
    def __init__(self, root):
        self.root = root
        self.chart = os.path.join(root, CHART)
        self.errors = []

    def err(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    # ---- loading --------------------------------------------------------------------------
    def load_yaml(self, path):
        rel = os.path.relpath(path, self.root)
        try:
            with open(path) as f:
                return yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            self.err(rel, f"does not parse as YAML: {e}")
            return None

    def load(self):
        self.chart_yaml = self.load_yaml(os.path.join(self.chart, "Chart.yaml"))
        self.values_path = os.path.join(self.chart, "values.yaml")
        self.values = self.load_yaml(self.values_path)
        with open(self.values_path) as f:
            self.values_text = f.read()
        tdir = os.path.join(self.chart, "templates")
        self.templates = {}
        for name in sorted(os.listdir(tdir)):
            with open(os.path.join(tdir, name)) as f:
                self.templates[name] = f.read()
        self.examples = {}
        edir = os.path.join(self.root, EXAMPLES)
        if os.path.isdir(edir):
            for name in sorted(os.listdir(edir)):
                if name.endswith(".yaml"):
                    self.examples[name] = self.load_yaml(os.path.join(edir, name))
        return self.chart_yaml is not None and isinstance(self.values, dict)

    # ---- Chart.yaml -----------------------------------------------------------------------
    def check_chart_yaml(self):
        c = self.chart_yaml
        if not isinstance(c, dict):
            self.err("Chart.yaml", "is not a mapping")
            return
        for key in ("apiVersion", "name", "version", "appVersion"):
            if key not in c:
                self.err("Chart.yaml", f"missing {key}")
        if c.get("apiVersion") != "v2":
            self.err("Chart.yaml", f"apiVersion is {c.get('apiVersion')!r}, Helm 3 charts use v2")
        if c.get("name") != "pdserve":
            self.err("Chart.yaml", f"name is {c.get('name')!r}, the directory is pdserve")
        if not re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", str(c.get("version", ""))):
            self.err("Chart.yaml", f"version {c.get('version')!r} is not SemVer")

    # ---- values.yaml comments -------------------------------------------------------------
    def check_values_comments(self):
        """Every key line has a comment right above it, unless it is inside a list item, under
        a key whose comment says free-form, or a grouping key whose children are commented."""
        lines = self.values_text.splitlines()
        key_re = re.compile(r"^(\s*)([A-Za-z_][\w.-]*):(.*)$")
        stack = []  # (indent, free_form)
        for i, line in enumerate(lines):
            m = key_re.match(line)
            if not m:
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            in_list = False
            for j in range(i - 1, -1, -1):  # inside a list item if a "- " line opens above
                prev = lines[j]
                if not prev.strip() or prev.lstrip().startswith("#"):
                    continue
                pind = len(prev) - len(prev.lstrip())
                if pind < indent and prev.lstrip().startswith("- "):
                    in_list = True
                    break
                if pind < indent:
                    break
            comment = []
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("#"):
                comment.insert(0, lines[j])
                j -= 1
            text = " ".join(comment)
            free = any(f for _, f in stack) or in_list
            rest = m.group(3).strip()
            is_parent = rest == "" and self._next_is_deeper(lines, i, indent)
            stack.append((indent, free or "free-form" in text))
            if free or comment:
                continue
            if is_parent and not self._next_is_list(lines, i):
                continue  # a grouping key: its children carry the comments
            self.err("values.yaml", f"line {i + 1}: key {m.group(2)!r} has no comment above it")

    @staticmethod
    def _next_content(lines, i):
        for j in range(i + 1, len(lines)):
            if lines[j].strip() and not lines[j].lstrip().startswith("#"):
                return lines[j]
        return ""

    def _next_is_deeper(self, lines, i, indent):
        nxt = self._next_content(lines, i)
        return nxt != "" and len(nxt) - len(nxt.lstrip()) > indent

    def _next_is_list(self, lines, i):
        return self._next_content(lines, i).lstrip().startswith("- ")

    # ---- templates: defines, includes, blocks ---------------------------------------------
    @staticmethod
    def strip_comments(text):
        return re.sub(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", "", text, flags=re.S)

    def collect_defines(self):
        self.defines = {}
        for name, text in self.templates.items():
            clean = self.strip_comments(text)
            for m in re.finditer(r'\{\{-?\s*define\s+"([^"]+)"\s*-?\}\}', clean):
                if not name.startswith("_"):
                    self.err(name, f'define "{m.group(1)}" outside a _*.tpl helpers file')
                if m.group(1) in self.defines:
                    self.err(name, f'define "{m.group(1)}" is defined twice')
                self.defines[m.group(1)] = self._define_body(clean, m.end())

    @staticmethod
    def _define_body(text, start):
        """The text of a define up to its matching end (nested blocks counted)."""
        depth = 1
        for m in re.finditer(r"\{\{-?\s*(if|range|with|define|block|end)\b", text[start:]):
            depth += -1 if m.group(1) == "end" else 1
            if depth == 0:
                return text[start:start + m.start()]
        return text[start:]

    def check_includes_and_blocks(self):
        used = set()
        for name, text in self.templates.items():
            clean = self.strip_comments(text)
            for m in re.finditer(r'\b(?:include|template)\s+"([^"]+)"', clean):
                used.add(m.group(1))
                if m.group(1) not in self.defines:
                    line = clean[:m.start()].count("\n") + 1
                    self.err(name, f'line {line}: include "{m.group(1)}" names no define in '
                                   f'templates/_*.tpl (defined: {", ".join(sorted(self.defines))})')
            opens = len(re.findall(r"\{\{-?\s*(?:if|range|with|define|block)\b", clean))
            ends = len(re.findall(r"\{\{-?\s*end\s*-?\}\}", clean))
            if opens != ends:
                self.err(name, f"unbalanced blocks: {opens} if/range/with/define opened, {ends} end")
            if "{{" in clean and clean.count("{{") != clean.count("}}"):
                self.err(name, f"unbalanced delimiters: {clean.count('{{')} '{{{{' vs "
                               f"{clean.count('}}')} '}}}}'")
        for d in sorted(set(self.defines) - used):
            self.err("_helpers.tpl", f'define "{d}" is never used')

    # ---- .Values paths --------------------------------------------------------------------
    def resolve(self, path):
        """Returns (found, node) for a dotted path in values.yaml."""
        node = self.values
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return True, node

    def check_values_paths(self):
        path_re = re.compile(r"\.Values((?:\.[A-Za-z_]\w*)+)")
        for name, text in self.templates.items():
            clean = self.strip_comments(text)
            refs = []  # (line, path tuple, how)
            for m in path_re.finditer(clean):
                refs.append((clean[:m.start()].count("\n") + 1, tuple(m.group(1)[1:].split(".")),
                             ".Values" + m.group(1)))
            # $var := .Values.x aliases, then $var.y
            aliases = {}
            for m in re.finditer(r"\$(\w+)\s*:?=\s*\.Values((?:\.[A-Za-z_]\w*)+)\s*(?:\}\}|-\}\})", clean):
                aliases[m.group(1)] = tuple(m.group(2)[1:].split("."))
            for var, base in aliases.items():
                for m in re.finditer(r"\$" + var + r"((?:\.[A-Za-z_]\w*)+)", clean):
                    refs.append((clean[:m.start()].count("\n") + 1,
                                 base + tuple(m.group(1)[1:].split(".")),
                                 f"${var}{m.group(1)} (${var} = .Values.{'.'.join(base)})"))
            for line, path, how in refs:
                found, _ = self.resolve(path)
                if not found:
                    self.err(name, f"line {line}: {how} is not in values.yaml")
        # include "helper" (dict "key" .Values.x ...) -> .key.y inside the helper
        for name, text in self.templates.items():
            clean = self.strip_comments(text)
            for m in re.finditer(r'include\s+"([^"]+)"\s+\(dict\s+([^()]*)\)', clean):
                helper, args = m.group(1), m.group(2)
                body = self.defines.get(helper)
                if body is None:
                    continue
                for am in re.finditer(r'"(\w+)"\s+\.Values((?:\.[A-Za-z_]\w*)+)', args):
                    key, base = am.group(1), tuple(am.group(2)[1:].split("."))
                    for bm in re.finditer(r"(?<![\w$])\." + key + r"((?:\.[A-Za-z_]\w*)+)", body):
                        path = base + tuple(bm.group(1)[1:].split("."))
                        if not self.resolve(path)[0]:
                            self.err(name, f'include "{helper}" passes {key}=.Values.{".".join(base)}, '
                                           f'and the helper reads .{key}{bm.group(1)}: '
                                           f'.Values.{".".join(path)} is not in values.yaml')

    # ---- cluster YAML ---------------------------------------------------------------------
    def check_cluster_config(self, cfg, where):
        if not isinstance(cfg, dict):
            self.err(where, "config is not a mapping")
            return
        for top, sub in cfg.items():
            if top not in CONFIG_KEYS:
                self.err(where, f"config.{top}: unknown cluster YAML key (allowed: "
                                f"{', '.join(CONFIG_KEYS)})")
                continue
            if sub is None:
                continue
            if not isinstance(sub, dict):
                self.err(where, f"config.{top}: expected a mapping")
                continue
            for k, v in sub.items():
                moved = [g for g, keys in ROUTER_GROUP_KEYS.items() if k in keys]
                if top == "router" and moved:
                    self.err(where, f"config.router.{k}: now config.router.{moved[0]}.{k}")
                elif k not in CONFIG_KEYS[top]:
                    self.err(where, f"config.{top}.{k}: unknown key (allowed: "
                                    f"{', '.join(sorted(CONFIG_KEYS[top]))})")
                elif top == "router" and k in ROUTER_GROUP_KEYS and isinstance(v, dict):
                    for gk in v:
                        if gk not in ROUTER_GROUP_KEYS[k]:
                            self.err(where, f"config.router.{k}.{gk}: unknown key (allowed: "
                                            f"{', '.join(sorted(ROUTER_GROUP_KEYS[k]))})")
                elif top == "pools" and isinstance(v, dict):
                    for pk, pv in v.items():
                        if pk not in POOL_KEYS:
                            self.err(where, f"config.pools.{k}.{pk}: unknown key")
                        elif pk == "slo" and isinstance(pv, dict):
                            for sk in pv:
                                if sk not in SLO_KEYS[k]:
                                    self.err(where, f"config.pools.{k}.slo.{sk}: unknown key "
                                                    f"(allowed: {', '.join(sorted(SLO_KEYS[k]))})")

    def check_configmap_renders_config(self):
        text = self.templates.get("configmap.yaml", "")
        helpers = self.templates.get("_helpers.tpl", "")
        # cluster.yaml is .Values.config plus cluster.secret_file (pdserve.renderedConfig).
        if not (re.search(r"cluster\.yaml:\s*\|\s*\n\s*\{\{-?\s*include \"pdserve\.renderedConfig\" \.", text)
                and re.search(r"\$cfg := deepCopy \.Values\.config\b", helpers)):
            self.err("configmap.yaml", "does not render cluster.yaml from .Values.config")

    def check_merged(self, merged, where):
        """The rules the chart's fail calls (and the processes) enforce, on merged values."""
        cfg = merged.get("config", {})
        pools = cfg.get("pools", {})
        for pool in ("prefill", "decode"):
            p = pools.get(pool, {})
            r, lo, hi = p.get("replicas", 1), p.get("min_replicas"), p.get("max_replicas")
            lo = r if lo is None else lo
            hi = r if hi is None else hi
            if not lo <= r <= hi:
                self.err(where, f"config.pools.{pool}: replicas {r} outside [min_replicas, "
                                f"max_replicas] = [{lo}, {hi}]")
            if merged.get("autoscaling", {}).get(pool, {}).get("enabled") and hi < max(1, lo):
                self.err(where, f"config.pools.{pool}.max_replicas {hi} below the KEDA minimum")
            if cfg.get("engine", {}).get("backend") == "cuda":
                tp = cfg.get("engine", {}).get("tensor_parallel_size", 1)
                if merged.get(pool, {}).get("gpus") != tp:
                    self.err(where, f"{pool}.gpus {merged.get(pool, {}).get('gpus')} != "
                                    f"config.engine.tensor_parallel_size {tp} on the cuda backend")
        mount = merged.get("modelVolume", {}).get("mountPath", "").rstrip("/") + "/"
        if not str(cfg.get("model", {}).get("path", "")).startswith(mount):
            self.err(where, f"config.model.path {cfg.get('model', {}).get('path')!r} is not "
                            f"under modelVolume.mountPath {mount!r}")
        router = cfg.get("router", {})
        if router.get("http", {}).get("port") == router.get("workers", {}).get("control_port"):
            self.err(where, "config.router.http.port equals config.router.workers.control_port")
        if merged.get("router", {}).get("replicas", 1) < 1:
            self.err(where, "router.replicas must be >= 1")
        if merged.get("config", {}).get("pools", {}).get("decode", {}).get("replicas", 1) < 1:
            self.err(where, "config.pools.decode.replicas must be >= 1")

    # ---- example values -------------------------------------------------------------------
    def free_form_paths(self):
        """Paths whose comment in values.yaml says free-form: anything may go below them."""
        out = set()
        lines = self.values_text.splitlines()
        stack = []
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
            if not m:
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            j, comment = i - 1, ""
            while j >= 0 and lines[j].lstrip().startswith("#"):
                comment = lines[j] + comment
                j -= 1
            if "free-form" in comment:
                out.add(tuple(k for _, k in stack))
        return out

    def check_example(self, name, data, free):
        where = f"{EXAMPLES}/{name}"
        if not isinstance(data, dict):
            self.err(where, "is not a mapping")
            return

        def walk(node, default, path):
            for k, v in node.items():
                p = path + (k,)
                if p == ("config",):
                    self.check_cluster_config(v, where)
                    continue
                if not isinstance(default, dict) or k not in default:
                    self.err(where, f"{'.'.join(p)} is not in values.yaml")
                    continue
                d = default[k]
                if p in free or isinstance(d, list) or d == {} or d is None:
                    continue
                if isinstance(v, dict) and isinstance(d, dict):
                    walk(v, d, p)

        walk(data, self.values, ())
        self.check_merged(deep_merge(self.values, data), where)

    # ---- label selectors ------------------------------------------------------------------
    def entries(self, lines, args, depth=0):
        """Label entries a block of template lines produces: (line, args) pairs, with
        `include "helper" ARG` lines expanded through the helper's body."""
        out = set()
        for raw in lines:
            s = raw.strip()
            m = re.match(r'\{\{-?\s*include\s+"([^"]+)"\s+(\((?:[^()]|\([^()]*\))*\)|\S+)', s)
            if m and depth < 8:
                helper, arg = m.group(1), " ".join(m.group(2).split())
                body = self.defines.get(helper)
                if body is None:
                    continue
                sub = args if arg == "." else (args + " > " + arg if args else arg)
                out |= self.entries(body.strip("\n").splitlines(), sub, depth + 1)
            elif re.match(r"^[\w./-]+:\s*\S", s):
                out.add((s, args))
        return out

    @staticmethod
    def block_after(lines, i):
        """Lines indented deeper than line i, up to the first one that is not."""
        ind = len(lines[i]) - len(lines[i].lstrip())
        out = []
        for line in lines[i + 1:]:
            if not line.strip():
                continue
            if len(line) - len(line.lstrip()) <= ind:
                break
            out.append(line)
        return out

    def find_key(self, lines, key, start=0, indent=None):
        for i in range(start, len(lines)):
            s = lines[i]
            if s.strip() == key + ":" and (indent is None or len(s) - len(s.lstrip()) == indent):
                return i
        return None

    def docs(self):
        """(file, role, kind, lines) of every rendered object the templates define."""
        out = []
        for name, text in self.templates.items():
            if name.startswith("_") or not name.endswith(".yaml"):
                continue
            role = name.split("-")[0] if name.split("-")[0] in ROLES else None
            for doc in re.split(r"^---\s*$", self.strip_comments(text), flags=re.M):
                km = re.search(r"^kind:\s*(\w+)", doc, re.M)
                if km:
                    out.append((name, role, km.group(1), doc.splitlines()))
        return out

    def selector_of(self, kind, lines):
        i = self.find_key(lines, "selector", indent=2)
        if i is None:
            return None
        if kind == "Service":
            return self.entries(self.block_after(lines, i), "")
        j = self.find_key(lines, "matchLabels", start=i + 1)
        return self.entries(self.block_after(lines, j), "") if j is not None else None

    def check_selectors(self):
        objs = self.docs()
        deployments, services = {}, {}
        for name, role, kind, lines in objs:
            if kind == "Deployment":
                sel = self.selector_of(kind, lines)
                t = self.find_key(lines, "template", indent=2)
                md = self.find_key(lines, "metadata", start=t + 1) if t is not None else None
                lb = self.find_key(lines, "labels", start=md + 1) if md is not None else None
                pod = self.entries(self.block_after(lines, lb), "") if lb is not None else set()
                if not sel:
                    self.err(name, "Deployment has no selector.matchLabels")
                    continue
                missing = sel - pod
                if missing:
                    self.err(name, "selector labels not among the pod template labels: "
                                   + "; ".join(f"{l} [{a}]" for l, a in sorted(missing)))
                self.check_role(name, role, sel)
                nm = re.search(r"^  name:\s*(.+)$", "\n".join(lines), re.M)
                deployments[role] = (sel, nm.group(1).strip() if nm else None, lines)
        for name, role, kind, lines in objs:
            if kind in ("Service", "PodDisruptionBudget"):
                sel = self.selector_of(kind, lines)
                if role not in deployments:
                    self.err(name, f"{kind} of role {role!r} but no Deployment of that role")
                    continue
                if sel != deployments[role][0]:
                    self.err(name, f"{kind} selector differs from the {role} Deployment's "
                                   f"selector: {sorted(sel or [])} vs {sorted(deployments[role][0])}")
                if kind == "Service":
                    md = self.find_key(lines, "labels", indent=2)
                    labels = self.entries(self.block_after(lines, md), "") if md is not None else set()
                    services.setdefault(role, []).append((labels, lines))
        for name, role, kind, lines in objs:
            if kind == "ServiceMonitor":
                sel = self.selector_of(kind, lines)
                if not any(sel and sel <= labels for labels, _ in services.get(role, [])):
                    self.err(name, f"ServiceMonitor selects no Service of role {role!r}")
                ports = set()
                for _, slines in services.get(role, []):
                    ports |= set(re.findall(r"^\s*- name:\s*([\w-]+)", "\n".join(slines), re.M))
                for p in re.findall(r"^\s*- port:\s*([\w-]+)", "\n".join(lines), re.M):
                    if p not in ports:
                        self.err(name, f"ServiceMonitor port {p!r} is not a port of the {role} Service")
            if kind == "ScaledObject":
                text = "\n".join(lines)
                tm = re.search(r"scaleTargetRef:\s*\n(?:\s+.*\n)*?\s+name:\s*(.+)", text)
                if role not in deployments or not tm or tm.group(1).strip() != deployments[role][1]:
                    self.err(name, f"scaleTargetRef does not name the {role} Deployment")
                if not re.search(r"kind:\s*Deployment", text):
                    self.err(name, "scaleTargetRef kind is not Deployment")
                if not re.search(r"\$min\s*:=\s*max 1\b", self.strip_comments(self.templates[name])):
                    self.err(name, "minReplicaCount is not clamped to >= 1")
        self.deployments = deployments
        self.services = services

    def check_role(self, name, role, sel):
        roles = set()
        for line, args in sel:
            if line.startswith("pdserve.io/role:"):
                roles |= set(re.findall(r'"role"\s+"(\w+)"', args))
        if roles != {role}:
            self.err(name, f"selector role label resolves to {sorted(roles) or 'nothing'}, "
                           f"the file is the {role!r} workload")

    # ---- ports, flags, metrics, twins -----------------------------------------------------
    def check_ports_and_flags(self):
        for role, (_, _, lines) in getattr(self, "deployments", {}).items():
            text = "\n".join(lines)
            names = set(re.findall(r"^\s*- name:\s*([\w-]+)\s*\n\s*containerPort:", text, re.M))
            for p in re.findall(r"^\s+port:\s*([A-Za-z][\w-]*)\s*$", text, re.M):
                if p not in names:
                    self.err(f"{role}-deployment.yaml", f"probe port {p!r} is not a container port "
                                                        f"({', '.join(sorted(names))})")
            for slabels, slines in self.services.get(role, []):
                for p in re.findall(r"targetPort:\s*([\w-]+)", "\n".join(slines)):
                    if p not in names:
                        self.err(f"{role} Service", f"targetPort {p!r} is not a container port of "
                                                    f"the {role} Deployment")
            if f'command: ["{BINARIES[role]}"]' not in text:
                self.err(f"{role}-deployment.yaml", f"does not run {BINARIES[role]}")
            args = re.findall(r"^\s+- (--[\w-]+)\s*$", text, re.M)
            for flag in REQUIRED_FLAGS[role]:
                if flag not in args:
                    self.err(f"{role}-deployment.yaml", f"{BINARIES[role]} is not given {flag}")
            if role != "router":
                for var, field in (("POD_NAME", "metadata.name"), ("POD_IP", "status.podIP")):
                    if f"$({var})" not in text:
                        self.err(f"{role}-deployment.yaml", f"does not pass $({var})")
                    if not re.search(rf"- name: {var}\s*\n\s*valueFrom:\s*\n\s*fieldRef:\s*\n\s*"
                                     rf"fieldPath: {re.escape(field)}", self.defines.get("pdserve.workerEnv", "")):
                        self.err("_helpers.tpl", f"{var} is not taken from {field}")

    def check_metrics(self):
        for name, text in self.templates.items():
            for m in set(re.findall(r"\bpdserve_\w+", self.strip_comments(text))):
                base = m
                for suf in HISTOGRAM_SUFFIXES:
                    if m.endswith(suf) and m[:-len(suf)] in METRICS and m[:-len(suf)].endswith("_seconds"):
                        base = m[:-len(suf)]
                if base not in METRICS:
                    self.err(name, f"queries unknown metric {m!r} (pdserve exports: "
                                   f"{', '.join(sorted(METRICS))})")

    def check_twins(self):
        for kind in TWINS:
            a = self.templates.get(f"prefill-{kind}.yaml")
            b = self.templates.get(f"decode-{kind}.yaml")
            if a is None or b is None:
                self.err(f"prefill/decode-{kind}.yaml", "one of the twins is missing")
                continue
            a2 = self.strip_comments(a).replace("prefill", "decode").replace("Prefill", "Decode")
            b2 = self.strip_comments(b)
            if a2 != b2:
                al, bl = a2.splitlines(), b2.splitlines()
                diff = next((i for i in range(max(len(al), len(bl)))
                             if i >= len(al) or i >= len(bl) or al[i] != bl[i]), None)
                self.err(f"decode-{kind}.yaml", f"differs from prefill-{kind}.yaml with prefill -> "
                                                f"decode, first at rendered line {diff + 1}: "
                                                f"{bl[diff] if diff < len(bl) else '<end>'!r}")

    def run(self):
        if not self.load():
            return self.errors
        self.check_chart_yaml()
        self.check_values_comments()
        self.collect_defines()
        self.check_includes_and_blocks()
        self.check_values_paths()
        self.check_cluster_config(self.values.get("config"), "values.yaml")
        self.check_configmap_renders_config()
        self.check_merged(self.values, "values.yaml")
        free = self.free_form_paths()
        for name, data in self.examples.items():
            self.check_example(name, data, free)
        if not self.examples:
            self.err(EXAMPLES, "no example values files")
        self.check_selectors()
        self.check_ports_and_flags()
        self.check_metrics()
        self.check_twins()
        return self.errors


def deep_merge(base, over):
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# ---- self-test: each break must be caught, with a message that names it ---------------------
MUTATIONS = [
    # (description, file, old, new, expected text in a report)
    ("decode pods labelled prefill", f"{CHART}/templates/decode-deployment.yaml",
     '(dict "ctx" . "role" "decode") | nindent 8', '(dict "ctx" . "role" "prefill") | nindent 8',
     "selector labels not among the pod template labels"),
    ("Service selecting another role", f"{CHART}/templates/router-service.yaml",
     '"pdserve.selectorLabels" (dict "ctx" . "role" "router") | nindent 4 }}\n  ports:\n    - name: http',
     '"pdserve.selectorLabels" (dict "ctx" . "role" "decode") | nindent 4 }}\n  ports:\n    - name: http',
     "Service selector differs"),
    ("renamed values key", f"{CHART}/values.yaml",
     "  metricsPort: 9200", "  metricPort: 9200", ".Values.prefill.metricsPort is not in values.yaml"),
    ("helper-read key missing", f"{CHART}/values.yaml",
     "  shmSize: 16Gi\n  # -- Deployment update strategy (free-form); the default never",
     "  # -- Deployment update strategy (free-form); the default never",
     ".Values.prefill.shmSize is not in values.yaml"),
    ("helper-read pool key missing", f"{CHART}/values.yaml",
     "  podAnnotations: {}\n  # -- Extra pod labels (free-form).\n  podLabels: {}\n  # -- Node selector (free-form; e.g. a GPU",
     "  podAnnotation: {}\n  # -- Extra pod labels (free-form).\n  podLabels: {}\n  # -- Node selector (free-form; e.g. a GPU",
     "the helper reads .pool.podAnnotations: .Values.prefill.podAnnotations is not in values.yaml"),
    ("include of a missing define", f"{CHART}/templates/router-pdb.yaml",
     "pdserve.selectorLabels", "pdserve.selectorLabel", 'include "pdserve.selectorLabel" names no define'),
    ("unknown cluster YAML key", f"{CHART}/values.yaml",
     "  logging:\n", "  tracing:\n    # -- x\n    on: true\n  logging:\n", "config.tracing: unknown"),
    ("unbalanced block", f"{CHART}/templates/router-pdb.yaml", "{{- end }}\n", "", "unbalanced blocks"),
    ("misspelt metric", f"{CHART}/templates/decode-scaledobject.yaml",
     "pdserve_kv_cache_usage_perc", "pdserve_kv_cache_usage_pct", "unknown metric 'pdserve_kv_cache_usage_pct'"),
    ("twin drift", f"{CHART}/templates/decode-deployment.yaml",
     "      containers:\n", "      hostNetwork: true\n      containers:\n", "differs from prefill-deployment.yaml"),
    ("probe on a missing port", f"{CHART}/templates/router-deployment.yaml",
     "path: /health\n              port: http", "path: /health\n              port: api",
     "probe port 'api' is not a container port"),
    ("missing worker flag", f"{CHART}/templates/prefill-deployment.yaml",
     "            - --advertise-host\n            - $(POD_IP)\n", "",
     "pdserve-prefill is not given --advertise-host"),
    ("uncommented values key", f"{CHART}/values.yaml",
     "  # -- Pull policy; IfNotPresent also works for images side-loaded with `kind load`.\n", "",
     "key 'pullPolicy' has no comment"),
    ("example sets an unknown key", f"{EXAMPLES}/cpu-kind.yaml",
     "\ndecode:\n", "\ndecod:\n", "decod is not in values.yaml"),
    ("example breaks the replica rule", f"{EXAMPLES}/gpu-rdma.yaml",
     "      replicas: 2\n", "      replicas: 99\n", "outside [min_replicas, max_replicas]"),
    ("ScaledObject targeting the wrong Deployment", f"{CHART}/templates/prefill-scaledobject.yaml",
     'name: {{ include "pdserve.fullname" . }}-prefill\n  pollingInterval',
     'name: {{ include "pdserve.fullname" . }}-decode\n  pollingInterval',
     "scaleTargetRef does not name the prefill Deployment"),
]


def self_test(root):
    failures = 0
    for desc, rel, old, new, expect in MUTATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            for sub in (CHART, EXAMPLES):
                shutil.copytree(os.path.join(root, sub), os.path.join(tmp, sub))
            path = os.path.join(tmp, rel)
            with open(path) as f:
                text = f.read()
            if old not in text:
                print(f"SELF-TEST BROKEN: {desc}: {old!r} not found in {rel}")
                failures += 1
                continue
            with open(path, "w") as f:
                f.write(text.replace(old, new, 1))
            errors = Lint(tmp).run()
            if any(expect in e for e in errors):
                print(f"caught: {desc}")
            else:
                print(f"MISSED: {desc}: expected a report containing {expect!r}, got {errors}")
                failures += 1
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..")))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    errors = Lint(a.root).run()
    if errors:
        for e in errors:
            print(e)
        print(f"chart lint: {len(errors)} problem(s)")
        return 1
    if a.self_test:
        failures = self_test(a.root)
        print(f"chart lint self-test: {len(MUTATIONS) - failures} of {len(MUTATIONS)} breaks caught")
        return 1 if failures else 0
    print(f"chart lint: ok ({CHART}, {len(os.listdir(os.path.join(a.root, CHART, 'templates')))} templates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
