"""Bed case `pulls` (docs/kv_cache.md, "Peer pulls"): a prefix held by one decode host is pulled by the
other decode host across the bed (tcp between network namespaces), and the prompt's greedy ids equal
pdserve generate's."""
import re
import threading
import time


def header(head, name):
    m = re.search(r"(?im)^" + re.escape(name) + r":\s*(.+?)\s*$", head)
    return m.group(1) if m else ""


def run(c, build, model, check, complete, prompt, reference):
    w = prompt(320, 4100)
    status, head, text, _ = complete(c, w, 2)
    check(status == 200 and "x-pdserve-route: disaggregated" in head, f"pulls: W prefilled on a prefill host ({status})")
    source = header(head, "x-pdserve-decode-worker")
    check(source in c.decode_hosts, f"pulls: W landed on decode host {source!r}")
    if source not in c.decode_hosts:
        return
    target = [h for h in c.decode_hosts if h != source][0]
    q = w[:256] + prompt(31, 4200)[1:]
    ref = reference(build, model, q, 8)
    # The router indexed the source's blocks and knows the lanes the prefill hosts measured.
    deadline = time.time() + 20
    while time.time() < deadline and c.metric("router-0", "pdserve_router_prefix_index_blocks",
                                              f'index="exact",worker="{source}"') < 16:
        time.sleep(0.2)
    # A stream keeps the source busier than the target while Q is routed.
    busy = {}
    r = w[:256] + prompt(11, 99)[1:]
    t = threading.Thread(target=lambda: busy.setdefault("r", complete(c, r, 300, timeout=120)))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and c.metric(source, "pdserve_num_requests_running") < 1:
        time.sleep(0.1)
    time.sleep(0.3)
    before = c.metric(target, "pdserve_kv_pulls_total", 'outcome="done",transport="tcp"')
    status, head, text, ids = complete(c, q, 8)
    t.join()
    check(status == 200, f"pulls: Q answered ({status} {text[:200]})")
    check(header(head, "x-pdserve-decode-worker") == target, f"pulls: Q served on {target} ({head!r})")
    check("kv_pull;dur=" in header(head, "server-timing"), "pulls: server-timing has the pull")
    cached = None
    try:
        import json
        cached = json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (ValueError, KeyError, TypeError):
        pass
    check(cached == 256, f"pulls: cached_tokens {cached} == 256 pulled across hosts")
    check(ids == ref, f"pulls: ids {ids} == pdserve generate {ref}")
    after = c.metric(target, "pdserve_kv_pulls_total", 'outcome="done",transport="tcp"')
    check(after - before == 1, f"pulls: {target} counts one pull done over tcp ({before} -> {after})")
    check(c.metric(target, "pdserve_kv_blocks_quarantined") <= 0, "pulls: nothing quarantined on the target")
