#!/usr/bin/env python3
"""How much faster or slower one run's steps ran than another's, shape for shape.

usage: scripts/step-pace.py BASE_STEPS_DIR OTHER_STEPS_DIR

Two runs' step-trace directories (logging.step_trace_dir: <worker id>.steps.csv each) of the
same cluster serving the same requests. Steps are grouped by worker and shape (decode rows
and context in 256-token bins; prompt tokens in 128-token bins); each group's median
period (gap + step) in OTHER is divided by its median in BASE, and the ratios are averaged
(geometric mean, weighted by the smaller group). Prints one line per kind of step. On a
host whose pace does not change the ratios are ~1.00; `scripts/validate-plan.sh` prints
them so a cell outside 10% can be read against how far the host moved between its traced
and measured runs.
"""
import csv
import glob
import math
import os
import statistics
import sys


def groups(directory):
    out = {}
    for path in glob.glob(os.path.join(directory, "*.steps.csv")):
        worker = os.path.basename(path)[: -len(".steps.csv")]
        for r in csv.DictReader(open(path)):
            rows, prompt = int(r["decode_rows"]), int(r["prompt_tokens"])
            if prompt > 0:
                kind, shape = "prompt steps", (prompt // 128, rows)
            else:
                kind, shape = "decode-only steps", (rows, int(r["decode_context_tokens"]) // max(rows, 1) // 256)
            out.setdefault((worker, kind), {}).setdefault(shape, []).append(float(r["seconds"]) + float(r["gap_seconds"]))
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    base, other = groups(sys.argv[1]), groups(sys.argv[2])
    parts = []
    for key in sorted(base):
        logs, weight = 0.0, 0
        for shape, times in base[key].items():
            theirs = other.get(key, {}).get(shape)
            if not theirs:
                continue
            n = min(len(times), len(theirs))
            logs += n * math.log(statistics.median(theirs) / statistics.median(times))
            weight += n
        if weight >= 10:
            parts.append(f"{key[0]} {key[1]} {math.exp(logs / weight):.2f}x ({weight} matched)")
    print("; ".join(parts) if parts else "too few matching steps")


if __name__ == "__main__":
    main()
