"""Two routers on the bed (docs/deploy.md): every worker registers with both (the chart's headless
control Service name resolves to both router hosts). One router is killed while streams run
through both: only its own streams end; the other router's streams finish with the exact ids;
new requests through the surviving router succeed; the workers stay healthy there."""
import json
import threading
import time


def stream(c, p, n, host, out):
    """A streaming completion through `host`; out gets (finished, token ids seen)."""
    body = {"model": "small", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    status, _, text = c.http(c.url("/v1/completions", host), body, timeout=90)
    ids, done = [], False
    for line in text.splitlines():
        if line.startswith("data: [DONE]"):
            done = True
        elif line.startswith("data: "):
            try:
                choice = json.loads(line[6:])["choices"][0]
            except (ValueError, KeyError, IndexError):
                continue
            ids += choice.get("token_ids") or []
    out.update(status=status, done=done, ids=ids)


def run(c, build, model, check, complete, prompt, reference, faults):
    for r in c.router_hosts:
        for pool, hosts in (("prefill", c.prefill_hosts), ("decode", c.decode_hosts)):
            n = c.metric(r, "pdserve_worker_healthy", f'pool="{pool}"')
            check(n == len(hosts), f"{r} sees all {len(hosts)} {pool} workers healthy ({n})")
    # Long streams through both routers (one colocated, one disaggregated each).
    plan = [("router-0", 20, 1), ("router-0", 120, 2), ("router-1", 20, 3), ("router-1", 120, 4)]
    refs = {seed: reference(build, model, prompt(n, seed), 300) for _, n, seed in plan}
    results = {seed: {} for _, _, seed in plan}
    threads = [threading.Thread(target=stream, args=(c, prompt(n, seed), 300, host, results[seed]))
               for host, n, seed in plan]
    for t in threads:
        t.start()
    time.sleep(1.0)  # streams are running on the decode hosts
    c.kill("router-0")
    killed_at = time.time()
    for t in threads:
        t.join()
    for host, n, seed in plan:
        r = results[seed]
        if host == "router-0":
            check(not r.get("done"), f"a stream through the killed router ended without [DONE] ({len(r.get('ids', []))} ids)")
        else:
            check(r.get("done") and r.get("ids") == refs[seed],
                  f"a {n}-token stream through router-1 finished with the exact ids ({len(r.get('ids', []))} of 300)")
    status, head, _, ids = complete(c, prompt(150, 9), 6, host="router-1")
    check(status == 200 and ids == reference(build, model, prompt(150, 9), 6),
          f"a new request through router-1 after the kill succeeds ({status})")
    time.sleep(1.5)  # past worker_report_timeout_ms: reports still reach router-1
    for pool, hosts in (("prefill", c.prefill_hosts), ("decode", c.decode_hosts)):
        n = c.metric("router-1", "pdserve_worker_healthy", f'pool="{pool}"')
        check(n == len(hosts), f"router-1 still sees all {len(hosts)} {pool} workers healthy ({n})")
    for h in c.decode_hosts:
        free = c.metric(h, "pdserve_kv_cache_free_blocks")
        total = c.metric(h, "pdserve_kv_cache_num_blocks")
        check(free == total, f"{h}: every KV block free after the kill ({free}/{total})")
    print(f"     router killed {time.time() - killed_at:.1f}s before the last check", flush=True)
    faults.record("one of two routers killed (SIGKILL) under traffic",
                  "streams through the other router finish with the exact ids; it keeps every worker healthy "
                  "and serves new requests; every KV block free",
                  "the killed router's connections close: at once",
                  f"checked {time.time() - killed_at:.1f} s after the kill")
