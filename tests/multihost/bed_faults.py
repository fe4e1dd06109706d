"""Network faults on the bed (docs/deploy.md), on one tcp cluster: kv_transfer.timeout_ms 3000,
router.requests.request_timeout_ms 10000, on_remote_prefill_failure: recompute.

Each fault drops packets silently (netbed: a link set down at the switch, or a partition by
pinned bogus ARP entries): no reset, no ICMP, as a cable pull or a dead switch port would.
"""
import threading
import time

KV_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 10.0


def values():
    return {"config": {"kv_transfer": {"transports": ["tcp"], "timeout_ms": int(KV_TIMEOUT_S * 1000)},
                       "router": {"requests": {
                           "request_timeout_ms": int(REQUEST_TIMEOUT_S * 1000)}}}}


class Call(threading.Thread):
    """One completion in the background; .result = (status, head, text, ids), .seconds."""

    def __init__(self, complete, c, p, n):
        super().__init__()
        self.args_ = (c, p, n)
        self.complete = complete
        self.start()

    def run(self):
        t = time.time()
        self.result = self.complete(*self.args_, timeout=int(REQUEST_TIMEOUT_S) + 20)
        self.seconds = time.time() - t


def counter(c, hosts, name, labels):
    return sum(max(0.0, c.metric(h, name, labels)) for h in hosts)


def wait_healthy(c, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(c.metric("router-0", "pdserve_worker_healthy", f'worker="{h}"') == 1
               for h in c.prefill_hosts + c.decode_hosts):
            return True
        time.sleep(0.2)
    return False


def heals(c, complete, prompt, check, what):
    """After a fault is undone: every worker healthy again and a long prompt disaggregates."""
    check(wait_healthy(c), f"{what}: every worker healthy again after the heal")
    deadline, ok = time.time() + 20, False
    while time.time() < deadline and not ok:
        before = counter(c, c.decode_hosts, "pdserve_remote_prefill_total", 'outcome="ok"')
        status, head, _, _ = complete(c, prompt(120, 7000 + int(time.time())), 4)
        ok = status == 200 and "disaggregated" in head and \
            counter(c, c.decode_hosts, "pdserve_remote_prefill_total", 'outcome="ok"') > before
        if not ok:
            time.sleep(0.5)
    check(ok, f"{what}: long prompts disaggregate again (remote prefill ok) after the heal")


def run(c, build, model, check, complete, prompt, reference, faults):
    long_p = prompt(1200, 1)
    ref_long = reference(build, model, long_p, 8)
    short_p = prompt(12, 2)
    ref_short = reference(build, model, short_p, 24)

    # 1. Both prefill hosts' links go down while a long prompt is prefilled and pushed: the
    # decode host's remote prefill times out and it recomputes; a short prompt beside it is
    # untouched.
    recomputed0 = counter(c, c.decode_hosts, "pdserve_remote_prefill_total", 'outcome="recomputed"')
    long_call = Call(complete, c, long_p, 8)
    time.sleep(0.4)
    for h in c.prefill_hosts:
        c.bed.link(h, False)
    short_call = Call(complete, c, short_p, 24)
    short_call.join()
    long_call.join()
    status, head, text, ids = long_call.result
    check(status == 200 and ids == ref_long,
          f"link down mid-transfer: the long request recomputed, same ids ({status} {text[:160]})")
    check(long_call.seconds < KV_TIMEOUT_S + 8, f"link down mid-transfer: it ended in {long_call.seconds:.1f}s")
    recomputed = counter(c, c.decode_hosts, "pdserve_remote_prefill_total", 'outcome="recomputed"') - recomputed0
    check(recomputed >= 1, f"link down mid-transfer: the decode host counts a recompute ({recomputed})")
    status, head, _, ids = short_call.result
    check(status == 200 and ids == ref_short and short_call.seconds < 5,
          f"link down mid-transfer: a short request beside it is undisturbed ({status}, {short_call.seconds:.1f}s)")
    for h in c.prefill_hosts:
        c.bed.link(h, True)
    heals(c, complete, prompt, check, "prefill links back up")
    faults.record("links of both prefill hosts down mid-transfer, then restored",
                  "the long request recomputes with the same ids within the KV timeout + 8 s; a short one beside "
                  "it is undisturbed (< 5 s); everything heals",
                  f"no packets, no reset: kv_transfer.lease_ms / timeout_ms ({KV_TIMEOUT_S:.0f} s here)",
                  f"long request ended in {long_call.seconds:.1f} s, short in {short_call.seconds:.1f} s")

    # 2. Decode and prefill partitioned (the router still reaches both): long prompts recompute
    # within kv_transfer.timeout_ms; short ones are undisturbed.
    for d in c.decode_hosts:
        for p in c.prefill_hosts:
            c.bed.partition(d, p)
    recomputed0 = counter(c, c.decode_hosts, "pdserve_remote_prefill_total", 'outcome="recomputed"')
    calls = [Call(complete, c, prompt(300, 10 + i), 6) for i in range(2)]
    short_call = Call(complete, c, short_p, 24)
    for x in calls + [short_call]:
        x.join()
    for i, x in enumerate(calls):
        status, _, text, ids = x.result
        check(status == 200 and ids == reference(build, model, prompt(300, 10 + i), 6) and
              x.seconds < KV_TIMEOUT_S + 8,
              f"decode|prefill partition: long request {i} recomputed in {x.seconds:.1f}s ({status} {text[:120]})")
    check(short_call.result[0] == 200 and short_call.result[3] == ref_short and short_call.seconds < 5,
          f"decode|prefill partition: a short request is undisturbed ({short_call.seconds:.1f}s)")
    recomputed = counter(c, c.decode_hosts, "pdserve_remote_prefill_total", 'outcome="recomputed"') - recomputed0
    check(recomputed >= 2, f"decode|prefill partition: decode hosts count the recomputes ({recomputed})")
    for d in c.decode_hosts:
        for p in c.prefill_hosts:
            c.bed.heal(d, p)
    heals(c, complete, prompt, check, "decode|prefill partition healed")
    faults.record("decode and prefill hosts partitioned (the router reaches both)",
                  "long prompts recompute with the same ids; short ones undisturbed; everything heals",
                  f"no packets, no reset: kv_transfer.lease_ms / timeout_ms ({KV_TIMEOUT_S:.0f} s here)",
                  "long requests ended in " + ", ".join(f"{x.seconds:.1f} s" for x in calls))

    # 3. Router and decode-1 partitioned: decode-1's in-flight streams end within the request
    # deadline with an error; new requests go to decode-0 and succeed; decode-1 comes back.
    calls = [Call(complete, c, prompt(12, 20 + i), 200) for i in range(4)]
    time.sleep(0.5)
    c.bed.partition("router-0", "decode-1")
    time.sleep(1.5)  # > worker_report_timeout_ms: decode-1 is out of rotation
    fresh = [complete(c, prompt(12, 40 + i), 4, timeout=15) for i in range(3)]
    check(all(f[0] == 200 for f in fresh), f"router|decode-1 partition: new requests succeed {[f[0] for f in fresh]}")
    for x in calls:
        x.join()
    ends = [(x.result[0], round(x.seconds, 1)) for x in calls]
    check(all(x.seconds < REQUEST_TIMEOUT_S + 5 for x in calls),
          f"router|decode-1 partition: every in-flight request ended within its deadline {ends}")
    check(all(x.result[0] == 200 or ("timed out" in x.result[2] or "error" in x.result[2]) for x in calls),
          f"router|decode-1 partition: each ended complete or with an error naming it {[x.result[2][-120:] for x in calls]}")
    c.bed.heal("router-0", "decode-1")
    heals(c, complete, prompt, check, "router|decode-1 partition healed")
    faults.record("router and a decode host partitioned",
                  "its in-flight requests end within the request deadline, complete or with an error naming it; "
                  "new requests go to the other decode host; it comes back",
                  "its load reports stop: router.workers.worker_report_timeout_ms (1 s)",
                  "in-flight requests ended in " + ", ".join(f"{s} s" for _, s in ends))
