#!/usr/bin/env python3
"""Multi-host bed tests (docs/deploy.md): a router, 2 prefill and 2 decode hosts, each its own network
namespace, running the cluster the Helm chart renders. Cases share one cluster where they can.

  bed_test.py --build BUILD_DIR --case tcp|ucx|faults|routers|pulls [--ucx 0|1]

Exit 0: passed; 1: failed; 77: skipped (no namespaces here: not root), unless
PD_REQUIRE_NETNS=1 (set by .ci/run), which makes that a failure.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import netbed  # noqa: E402

SKIP = 77
FAILURES = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)
    return cond


class FaultLog:
    """The bed's records for the fault table of docs/reliability.md (tests/faults/fault_table.py,
    the same format as tests/faults/fault_report.h). record() closes one scenario: it passed when no
    check failed since the previous record."""

    def __init__(self, build, test):
        self.dir = os.path.join(build, "fault-records")
        self.test = test
        self.mark = len(FAILURES)

    def record(self, fault, asserted, detected, measured):
        os.makedirs(self.dir, exist_ok=True)
        slug = "".join(ch if ch.isalnum() else "-" for ch in f"{fault} {self.test}")[:120]
        with open(os.path.join(self.dir, slug + ".json"), "w") as f:
            json.dump({"fault": fault, "test": self.test, "asserted": asserted, "detected": detected,
                       "measured": measured, "passed": len(FAILURES) == self.mark, "time": time.time()}, f, indent=2)
        self.mark = len(FAILURES)


def prompt(n, seed):
    rng = random.Random(seed)
    return [257] + [rng.randrange(256) for _ in range(n - 1)]  # 257: the made model's BOS


def make_model(build):
    d = os.path.join(build, "test_models", "bed_small")
    if not os.path.exists(os.path.join(d, "config.json")):
        tmp = f"{d}.tmp.{os.getpid()}"
        subprocess.run([os.path.join(build, "bin", "pdserve"), "make-model", "--out", tmp, "--preset", "small"],
                       check=True, capture_output=True)
        os.rename(tmp, d)
    return d


def reference(build, model, p, n):
    """Greedy ids from `pdserve generate` (one process, no cluster)."""
    r = subprocess.run([os.path.join(build, "bin", "pdserve"), "generate", "--model", model, "--prompt-ids",
                        ",".join(map(str, p)), "--max-tokens", str(n), "--ignore-eos", "--threads", "2"],
                       capture_output=True, text=True, check=True, timeout=120)
    return [int(x) for x in r.stdout.strip().split(",") if x.strip()]


def complete(c, p, n, host="router-0", timeout=60, **extra):
    import json
    body = {"model": "small", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    body.update(extra)
    status, head, text = c.http(c.url("/v1/completions", host), body, timeout=timeout)
    ids = None
    if status == 200:
        try:
            ids = json.loads(text)["choices"][0]["token_ids"]
        except (ValueError, KeyError):
            pass
    return status, head, text, ids


def disaggregates(c, build, model, transport):
    """Long prompts go through a prefill host and their KV crosses the bed over `transport`;
    the greedy ids equal pdserve generate's."""
    lengths = [40, 100, 200, 333, 64, 150]
    refs = [reference(build, model, prompt(n, i), 6) for i, n in enumerate(lengths)]
    before = sum(c.metric(h, "pdserve_remote_prefill_total", 'outcome="ok"') for h in c.decode_hosts)
    # All at once, so the router spreads them over both prefill and both decode hosts.
    results = [None] * len(lengths)
    threads = [threading.Thread(target=lambda i=i, n=n: results.__setitem__(i, complete(c, prompt(n, i), 6)))
               for i, n in enumerate(lengths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, n in enumerate(lengths):
        status, head, text, ids = results[i]
        check(status == 200, f"{transport}: prompt of {n} tokens answered (got {status} {text[:200]})")
        check("x-pdserve-route: disaggregated" in head, f"{transport}: prompt of {n} tokens disaggregated")
        check(ids == refs[i], f"{transport}: prompt of {n} tokens: ids {ids} == pdserve generate {refs[i]}")
    short = reference(build, model, prompt(10, 99), 6)
    status, head, _, ids = complete(c, prompt(10, 99), 6)
    check(status == 200 and "x-pdserve-route: colocated" in head and ids == short, f"{transport}: short prompt colocated, same ids")
    ok = sum(c.metric(h, "pdserve_remote_prefill_total", 'outcome="ok"') for h in c.decode_hosts) - before
    check(ok == len(lengths), f"{transport}: decode hosts count {ok} remote prefills ok, want {len(lengths)}")
    per_decode = [c.metric(h, "pdserve_remote_prefill_total", 'outcome="ok"') for h in c.decode_hosts]
    print(f"     remote prefills per decode host: {per_decode}", flush=True)
    moved = [c.metric(h, "pdserve_kv_transfers_total", f'transport="{transport}",outcome="ok"')
             for h in c.prefill_hosts]
    check(sum(moved) >= len(lengths), f"{transport}: the prefill hosts pushed KV over {transport} (per host: {moved})")
    fallbacks = sum(c.metric(h, "pdserve_kv_transfer_fallbacks_total") for h in c.prefill_hosts)
    check(fallbacks <= 0, f"{transport}: no fallback to another transport ({fallbacks})")


def intruder(c, work):
    """the bed runs with the chart's cluster secret; a decode worker on another host
    (its own netns) with a wrong secret cannot register, and the cluster serves on."""
    import copy
    import yaml
    import bed_cluster
    check(c.metric("router-0", "pdserve_internal_auth_enabled") == 1, "auth: the router's internal planes are authenticated")
    cfg = copy.deepcopy(c.cfg)
    wrong = os.path.join(work, "wrong-secret")
    bed_cluster.write_secret(wrong, os.urandom(24).hex().encode())
    cfg["cluster"]["secret_file"] = wrong
    path = os.path.join(work, "intruder.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    before = c.metric("router-0", "pdserve_auth_failures_total", 'plane="router_control"')
    c.start_as("intruder", "decode", path)
    after = before
    deadline = time.time() + 60
    while time.time() < deadline and after <= before:
        time.sleep(0.3)
        after = c.metric("router-0", "pdserve_auth_failures_total", 'plane="router_control"')
    check(after > before, f"auth: the router refused the intruder ({before} -> {after} auth failures)")
    healthy = c.metric("router-0", "pdserve_worker_healthy", 'pool="decode"')
    check(healthy == len(c.decode_hosts), f"auth: the intruder is not a decode worker ({healthy} healthy)")
    check("authentication failed" in c.log_tail("intruder", 20000), "auth: the intruder's log says authentication failed")
    status, head, text, _ = complete(c, prompt(10, 7), 4)
    check(status == 200, f"auth: the cluster still serves ({status})")
    c.kill("intruder")


def other_weights(c, build, work):
    """A prefill worker on another host, with the cluster's secret and a model of the same name and
    shape but other weights (another seed: two checkpoints of one model), is refused at
    registration; the reason is on both sides (the router's counter, the worker's log) and the
    cluster serves on with its own prefill hosts."""
    import copy
    import yaml
    d = os.path.join(build, "test_models", "bed_small_seed2")
    if not os.path.exists(os.path.join(d, "config.json")):
        tmp = f"{d}.tmp.{os.getpid()}"
        subprocess.run([os.path.join(build, "bin", "pdserve"), "make-model", "--out", tmp, "--preset", "small",
                        "--seed", "2"], check=True, capture_output=True)
        os.rename(tmp, d)
    cfg = copy.deepcopy(c.cfg)
    cfg["model"]["path"] = d
    # The same served name as the cluster's: only the weights differ.
    cfg["model"]["name"] = c.cfg["model"].get("name") or os.path.basename(c.cfg["model"]["path"].rstrip("/"))
    path = os.path.join(work, "other-weights.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    series = 'pool="prefill",reason="weights"'
    before = c.metric("router-0", "pdserve_worker_registrations_refused_total", series)
    c.start_as("intruder", "prefill", path)
    after = before
    deadline = time.time() + 90
    while time.time() < deadline and after <= before:
        time.sleep(0.3)
        after = c.metric("router-0", "pdserve_worker_registrations_refused_total", series)
    check(after > before, f"weights: the router refused the prefill worker with other weights ({before} -> {after})")
    healthy = c.metric("router-0", "pdserve_worker_healthy", 'pool="prefill"')
    check(healthy == len(c.prefill_hosts), f"weights: it is not a prefill worker ({healthy} healthy)")
    deadline = time.time() + 30
    while time.time() < deadline and "serves weights" not in c.log_tail("intruder", 20000):
        time.sleep(0.3)
    check("serves weights" in c.log_tail("intruder", 20000), "weights: the refused worker's log says why")
    status, head, text, _ = complete(c, prompt(200, 8), 4)
    check(status == 200 and "x-pdserve-route: disaggregated" in head, f"weights: the cluster still serves ({status})")
    c.kill("intruder")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--case", required=True, choices=["tcp", "ucx", "faults", "routers", "pulls"])
    ap.add_argument("--ucx", type=int, default=1)
    a = ap.parse_args()
    ok, why = netbed.can_make_namespaces()
    if not ok:
        if os.environ.get("PD_REQUIRE_NETNS") == "1":
            print(f"FAIL: PD_REQUIRE_NETNS=1 but the bed cannot run here: {why}")
            return 1
        print(f"SKIP: the multi-host bed needs network namespaces: {why}")
        return SKIP
    if a.case == "ucx" and not a.ucx:
        print("SKIP: this build has no UCX (PD_WITH_UCX)")
        return SKIP
    import bed_cluster
    build = os.path.abspath(a.build)
    model = make_model(build)
    work = os.path.join(build, "test_bed", a.case)
    started = time.time()
    if a.case == "tcp":
        over = {"config": {"kv_transfer": {"transports": ["tcp"]}}}
    elif a.case == "faults":
        import bed_faults
        over = bed_faults.values()
    elif a.case == "ucx":
        over = {"config": {"kv_transfer": {"transports": ["ucx", "tcp"]}},
                "ucx": {"tls": "tcp", "netDevices": "eth0"}}
    elif a.case == "routers":
        over = {"router": {"replicas": 2}, "config": {"kv_transfer": {"transports": ["tcp"]},
                                                       "router": {"routing": {
                                                           "short_prompt_tokens": 64}}}}
    elif a.case == "pulls":
        over = {"config": {"kv_transfer": {"transports": ["tcp"], "peer_pulls": True},
                           "router": {"routing": {"short_prompt_tokens": 64, "prefix_aware_routing": True},
                                      "workers": {"worker_report_timeout_ms": 5000}}}}
    extra = ("intruder",) if a.case == "tcp" else ()
    with bed_cluster.Cluster(build, model, work, over, routers=2 if a.case == "routers" else 1,
                             extra_hosts=extra) as c:
        print(f"bed up in {time.time() - started:.1f}s: " +
              ", ".join(f"{h}={c.bed.addr[h]}" for h in c.bed.hosts), flush=True)
        if a.case in ("tcp", "ucx"):
            disaggregates(c, build, model, a.case)
            if a.case == "tcp":
                intruder(c, work)
                other_weights(c, build, work)
        elif a.case == "pulls":
            import bed_pulls
            bed_pulls.run(c, build, model, check, complete, prompt, reference)
        elif a.case == "routers":
            import bed_routers
            bed_routers.run(c, build, model, check, complete, prompt, reference, FaultLog(build, "bed_routers"))
        else:
            bed_faults.run(c, build, model, check, complete, prompt, reference, FaultLog(build, "bed_faults"))
    print(f"{a.case}: {len(FAILURES)} failure(s) in {time.time() - started:.1f}s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
