#!/usr/bin/env python3
"""SSE streams behind real reverse proxies (Debian's nginx and haproxy) whose idle read timeout
(2 s) is shorter than the wait for the first token (the prefill worker is stopped for
STALL_S): with router.requests.stream_heartbeat_ms the router's SSE comment lines keep the
stream alive through both proxies, and the longest silence on the wire stays near the
heartbeat period; with the heartbeat off (0) the same stream through nginx is cut, so the
test shows it is the heartbeat that saves it.

nginx: proxy_buffering off, proxy_read_timeout 2s (docs/deploy.md, "Proxies").
haproxy: option http-no-delay, timeout server 2s.
Exit 77 (ctest SKIP) when nginx or haproxy is missing, with the reason.

usage: sse_proxy_test.py --build BUILD_DIR
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

PROXY_TIMEOUT_S = 2
HEARTBEAT_MS = 500
STALL_S = 5  # the first token waits at least this long: 2.5x the proxies' read timeout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def wait_port(port, proc, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            fail(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    fail(f"{what} did not listen on {port} in {timeout} s")


class Cluster:
    def __init__(self, bindir, work, heartbeat_ms):
        self.work = work
        os.makedirs(work, exist_ok=True)
        self.port, control = free_port(), free_port()
        model = os.path.join(os.path.dirname(work), "small")
        if not os.path.isdir(model):
            subprocess.run([os.path.join(bindir, "pdserve"), "make-model", "--preset", "small", "--out", model],
                           check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(work, "cluster.yaml"), "w") as f:
            # The stopped prefill worker stays routed to and its KV connection open (long report
            # timeout and lease), so the request waits instead of failing over.
            f.write(f"""model: {{path: {model}, name: small}}
router:
  workers: {{control_port: {control}, worker_report_timeout_ms: 60000}}
  routing: {{short_prompt_tokens: 64}}
  admission: {{overload_shedding: false}}
  requests: {{stream_heartbeat_ms: {heartbeat_ms}}}
pools: {{prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}
engine: {{threads: 1, kv_cache_bytes: 67108864}}
kv_transfer: {{transports: [tcp], lease_ms: 60000, timeout_ms: 60000}}
logging: {{level: warn}}
""")
        self.log = os.path.join(work, "up.log")
        self.proc = subprocess.Popen([os.path.join(bindir, "pdserve"), "up", "--config",
                                      os.path.join(work, "cluster.yaml"), "--port", str(self.port), "--no-autoscale",
                                      "--prometheus-targets", os.path.join(work, "targets.json")],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while "pdserve is up" not in open(self.log).read():
            if self.proc.poll() is not None or time.time() > deadline:
                fail("pdserve up did not start:\n" + open(self.log).read())
            time.sleep(0.3)
        pids = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "pdserve-prefill"], capture_output=True,
                              text=True).stdout.split()
        if len(pids) != 1:
            fail(f"expected one prefill worker under pdserve up, found {pids}")
        self.prefill_pid = int(pids[0])
        # One request first: the decode worker's KV connection to the prefill worker is then in
        # place, and the stop lands on the prefill itself (a connect would time out instead).
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "small", "prompt": "warm up " * 60,
                                                            "max_tokens": 2}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        warm = r.read()
        if r.status != 200 or r.getheader("x-pdserve-route") != "disaggregated":
            fail(f"warm-up: {r.status} {r.getheader('x-pdserve-route')} {warm!r}")
        conn.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_nginx(work, upstream):
    port = free_port()
    os.makedirs(os.path.join(work, "tmp"), exist_ok=True)
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log info;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {work}/tmp;
  proxy_temp_path {work}/tmp;
  fastcgi_temp_path {work}/tmp;
  uwsgi_temp_path {work}/tmp;
  scgi_temp_path {work}/tmp;
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout {PROXY_TIMEOUT_S}s;
    }}
  }}
}}
""")
    proc = subprocess.Popen(["nginx", "-c", conf, "-p", work, "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "nginx.out"), "w"))
    wait_port(port, proc, "nginx")
    return proc, port


def start_haproxy(work, upstream):
    port = free_port()
    conf = os.path.join(work, "haproxy.cfg")
    with open(conf, "w") as f:
        f.write(f"""global
  maxconn 64
defaults
  mode http
  option http-no-delay
  timeout connect 2s
  timeout client 60s
  timeout server {PROXY_TIMEOUT_S}s
frontend api
  bind 127.0.0.1:{port}
  default_backend router
backend router
  server r1 127.0.0.1:{upstream}
""")
    r = subprocess.run(["haproxy", "-c", "-f", conf], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"haproxy -c: {r.stdout}{r.stderr}")
    proc = subprocess.Popen(["haproxy", "-db", "-f", conf], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(work, "haproxy.out"), "w"))
    wait_port(port, proc, "haproxy")
    return proc, port


def stream_through(port, cluster, name):
    """A streamed completion through `port` while the prefill worker is stopped for STALL_S.
    Returns (complete: saw [DONE], longest silence between received bytes in s, the body)."""
    # A prompt of its own (a cached prefix would route it colocated).
    body = json.dumps({"model": "small", "prompt": f"{name} {time.time()} " + "hello " * 120, "max_tokens": 4, "stream": True,
                       "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    os.kill(cluster.prefill_pid, signal.SIGSTOP)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return False, 0.0, f"HTTP {resp.status}: {resp.read()!r}"
        if resp.getheader("x-pdserve-route") != "disaggregated":
            return False, 0.0, f"routed {resp.getheader('x-pdserve-route')}, not to the stopped prefill worker"
        stalled_until = time.time() + STALL_S
        resumed = False
        got, last, longest = b"", time.time(), 0.0
        while True:
            if not resumed and time.time() >= stalled_until:
                os.kill(cluster.prefill_pid, signal.SIGCONT)
                resumed = True
            try:
                chunk = resp.read1(4096)
            except (http.client.IncompleteRead, ConnectionError, socket.timeout) as e:
                got += f"\n<{type(e).__name__}>".encode()
                break
            now = time.time()
            if not chunk:
                break
            longest = max(longest, now - last)
            last = now
            got += chunk
        return b"data: [DONE]" in got, longest, got.decode(errors="replace")
    finally:
        os.kill(cluster.prefill_pid, signal.SIGCONT)
        conn.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args = ap.parse_args()
    for tool in ("nginx", "haproxy"):
        if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}"):
            print(f"SKIPPED: {tool} not installed (scripts/setup installs Debian's {tool})")
            return 1 if os.environ.get("PD_REQUIRE_TOOLS") == "1" else 77
    os.environ["PATH"] += ":/usr/sbin"
    build = os.path.abspath(args.build)
    bindir = os.path.join(build, "bin")
    root = os.path.join(build, "test_sse_proxy")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    procs = []
    try:
        # 1. Heartbeat on: the stream survives nginx and haproxy.
        c = Cluster(bindir, os.path.join(root, "heartbeat"), HEARTBEAT_MS)
        procs.append(c)
        ng, ng_port = start_nginx(os.path.join(root, "heartbeat"), c.port)
        procs.append(ng)
        hp, hp_port = start_haproxy(os.path.join(root, "heartbeat"), c.port)
        procs.append(hp)
        for name, port in (("nginx", ng_port), ("haproxy", hp_port), ("direct", c.port)):
            t0 = time.time()
            done, longest, text = stream_through(port, c, name)
            took = time.time() - t0
            print(f"{name}: complete={done} in {took:.1f} s, longest silence {longest:.2f} s, "
                  f"{text.count(': keepalive')} heartbeats", flush=True)
            if not done:
                fail(f"through {name} with the heartbeat the stream did not finish:\n{text}")
            if took < STALL_S:
                fail(f"the first token did not wait for the stopped prefill worker ({took:.1f} s)")
            if text.count(": keepalive") < 2:
                fail(f"through {name}: no heartbeats while the first token waited {STALL_S} s:\n{text}")
            # The wire is never silent much past one heartbeat period (scheduling slack on a
            # loaded machine), and never as long as the proxies' timeout.
            if longest >= PROXY_TIMEOUT_S:
                fail(f"through {name}: {longest:.2f} s of silence, past the proxies' {PROXY_TIMEOUT_S} s")
        c.stop()
        for p in (ng, hp):
            p.terminate()
            p.wait(timeout=10)

        # 2. Heartbeat off: nginx cuts the same stream, so (1) passed because of the heartbeat.
        c = Cluster(bindir, os.path.join(root, "off"), 0)
        procs.append(c)
        ng, ng_port = start_nginx(os.path.join(root, "off"), c.port)
        procs.append(ng)
        done, longest, text = stream_through(ng_port, c, "off")
        print(f"nginx, heartbeat off: complete={done}, longest silence {longest:.2f} s", flush=True)
        if done:
            fail("with the heartbeat off the stream survived nginx's read timeout: the test cannot tell")
        print("sse proxy test: ok", flush=True)
        return 0
    finally:
        for p in reversed(procs):
            if isinstance(p, Cluster):
                p.stop()
            elif p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    sys.exit(main())
