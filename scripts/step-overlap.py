#!/usr/bin/env python3
"""How much slower a 1P1D cluster's steps run while the other worker computes.

usage: scripts/step-overlap.py PREFILL.steps.csv DECODE.steps.csv MIX.cal.json

The two workers' step traces (logging.step_trace_dir; `KEEP=DIR scripts/validate-plan.sh`
keeps them in DIR/MIX.traced.steps/) and `pdserve plan --calibrate`'s file. The simulator
gives each worker a device of its own; on one host the workers share its cores with the
router, the client and their own I/O threads. This prints, per kind of step, the measured time
over the calibrated one (time-weighted), split by how much of the step the other worker spent
in a step of its own. Prompt steps are priced by their prompt tokens and decode steps by their
streams at 256 tokens of context, so read the ratio between the rows of one kind, not its level.
"""
import bisect
import csv
import json
import sys


def read_steps(path):
    """(start, end, streams, prompt tokens, ms) per step, by the trace's wall clock."""
    steps = []
    for row in csv.DictReader(open(path)):
        end, seconds = float(row["time_s"]), float(row["seconds"])
        steps.append((end - seconds, end, int(row["decode_rows"]), int(row["prompt_tokens"]), seconds * 1e3))
    return steps


def interpolate(points, x):
    xs = [a for a, _ in points]
    i = bisect.bisect_left(xs, x)
    if i <= 0:
        return points[0][1] * x / points[0][0]
    if i >= len(points):
        return points[-1][1] * x / points[-1][0]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def overlap(start, end, others):
    busy = sum(min(end, e) - max(start, s) for s, e, *_ in others if e > start and s < end)
    return min(1.0, busy / (end - start)) if end > start else 0.0


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    steps = {"prefill-0": read_steps(sys.argv[1]), "decode-0": read_steps(sys.argv[2])}
    cal = json.load(open(sys.argv[3]))["points"]
    prompt = sorted((p["tokens_per_seq"], p["seconds"] * 1e3) for p in cal if p["batch"] == 1 and p["tokens_per_seq"] > 1)
    decode = sorted((p["batch"], p["seconds"] * 1e3) for p in cal if p["tokens_per_seq"] == 1 and p["context"] == 256)
    kinds = [("prefill worker, prompt steps", "prefill-0", "decode-0", lambda st: st[3] > 0, lambda st: interpolate(prompt, st[3])),
             ("decode worker, decode-only steps", "decode-0", "prefill-0", lambda st: st[3] == 0 and st[2] > 0,
              lambda st: interpolate(decode, st[2])),
             ("decode worker, steps with prompt tokens", "decode-0", "prefill-0", lambda st: st[3] > 0,
              lambda st: interpolate(prompt, st[3]))]
    for name, worker, other, select, calibrated in kinds:
        bins = {}
        for st in steps[worker]:
            if select(st):
                b = min(4, int(overlap(st[0], st[1], steps[other]) * 5))
                bins.setdefault(b, []).append((st[4], calibrated(st)))
        print(name)
        for b in sorted(bins):
            measured = sum(m for m, _ in bins[b])
            expected = sum(c for _, c in bins[b])
            print(f"  other worker in a step {b * 20:3d}-{b * 20 + 20:3d}% of it: {len(bins[b]):5d} steps, "
                  f"measured / calibrated {measured / expected:.3f}")


if __name__ == "__main__":
    main()
