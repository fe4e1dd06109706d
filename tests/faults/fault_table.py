#!/usr/bin/env python3
"""The fault suite's table (docs/reliability.md): reads the records the fault cases wrote in this run
(BUILD/fault-records/*.json: tests/faults/fault_report.h, tests/multihost/bed_test.py FaultLog)
and renders docs/reliability.md's table from them.

  fault_table.py --build BUILD [--doc docs/reliability.md] [--write] [--require]

Always writes BUILD/fault-table.md. Fails (exit 1) when a record says its case failed, or when
the doc's table lacks a row this run recorded (run it again with --write to put this run's table
in the doc). --require (CI as root, where every case runs): also when a kind of fault the
issue names has no record, or the doc's rows are not exactly this run's.
"""
import argparse
import glob
import json
import os
import re
import sys

BEGIN = "<!-- fault-table:begin (written by tests/faults/fault_table.py --write; do not edit) -->"
END = "<!-- fault-table:end -->"

# The kinds of fault the fault suite must cover, each matched against the records' fault text.
KINDS = {
    "kill the prefill worker mid-transfer": r"prefill worker killed",
    "kill the decode worker mid-stream": r"decode worker killed",
    "stop the prefill worker during its transfer, resume it after the decode gave up":
        r"prefill worker stopped during its transfer",
    "stop the prefill worker past its lease": r"prefill worker stopped \(SIGSTOP\) mid-request",
    "drop and restore links": r"links .* down",
    "partitions": r"partitioned",
    "stall a transport": r"transport stall",
    "client aborts, 100 times": r"client abort.*100 times",
    "SIGTERM under load": r"SIGTERM under load",
    "router restart": r"router.*(stopped|killed)",
    "overload": r"overload",
}


def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(records):
    rows = ["| fault | test | asserted | detected (bound) | measured in this run | result |",
            "|---|---|---|---|---|---|"]
    for r in records:
        rows.append("| " + " | ".join(cell(x) for x in (
            r["fault"], "`" + r["test"] + "`", r["asserted"], r["detected"], r["measured"],
            "passed" if r["passed"] else "**FAILED**")) + " |")
    return "\n".join(rows) + "\n"


def doc_rows(doc_text):
    """(fault, test) of each row of the doc's table, or None when the doc has no table."""
    if BEGIN not in doc_text or END not in doc_text:
        return None
    table = doc_text.split(BEGIN, 1)[1].split(END, 1)[0]
    keys = set()
    for line in table.splitlines():
        cols = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cols) == 6 and cols[1].startswith("`"):
            keys.add((cols[0].replace("\\|", "|"), cols[1].strip("`")))
    return keys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--doc", default=os.path.join(os.path.dirname(__file__), "..", "..", "docs", "reliability.md"))
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--require", action="store_true",
                    default=os.environ.get("PD_REQUIRE_NETNS") == "1")  # CI as root: every case runs
    a = ap.parse_args()
    records = []
    for path in sorted(glob.glob(os.path.join(a.build, "fault-records", "*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    records.sort(key=lambda r: (r["test"].split(":")[0], r["fault"]))
    table = render(records)
    with open(os.path.join(a.build, "fault-table.md"), "w") as f:
        f.write(table)
    print(table)
    problems = [f"the case recorded as failed: {r['test']} ({r['fault']})" for r in records if not r["passed"]]
    missing = [kind for kind, pattern in KINDS.items() if not any(re.search(pattern, r["fault"]) for r in records)]
    if missing:
        print("kinds of fault with no record in this run: " + "; ".join(missing))
        if a.require:
            problems += [f"no record for '{k}'" for k in missing]
    with open(a.doc) as f:
        doc = f.read()
    if a.write:
        if BEGIN not in doc or END not in doc:
            print(f"{a.doc} has no {BEGIN} ... {END} block to write into")
            return 1
        head, rest = doc.split(BEGIN, 1)
        doc = head + BEGIN + "\n" + table + rest[rest.index(END):]
        with open(a.doc, "w") as f:
            f.write(doc)
        print(f"wrote the table of {len(records)} records into {a.doc}")
    documented = doc_rows(doc)
    run = {(r["fault"], r["test"]) for r in records}
    if documented is None:
        problems.append(f"{a.doc} has no fault table block")
    else:
        for fault, test in sorted(run - documented):
            problems.append(f"{a.doc} lacks the row '{fault}' ({test}): rerun with --write")
        if a.require:
            for fault, test in sorted(documented - run):
                problems.append(f"{a.doc} has a row this run did not record: '{fault}' ({test})")
    for p in problems:
        print("FAIL: " + p)
    print(f"{len(records)} fault records, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
