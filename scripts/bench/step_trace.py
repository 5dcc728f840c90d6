#!/usr/bin/env python3
"""Summarises the engine's per-step trace: the `decode step` events that mlxd-engine writes
under target `mlxd_engine::step` (RUST_LOG=mlxd_engine::step=trace), from a log file.

    .venv/bin/python scripts/bench/step_trace.py <log file>

Prints one JSON line per batch size seen in steady steps (no row joining): the number of steps
and the median microseconds of each part (building the model's graph, building the
sampler's, async_eval, waiting for the previous step's tokens, the whole step on the host).
Run it on a greedy and a sampled run to see where sampling costs.
"""
import collections
import json
import re
import statistics
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\d+)")
PARTS = ["build_forward_us", "build_sampler_us", "async_eval_us", "wait_tokens_us", "total_us"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    by_rows = collections.defaultdict(list)
    with open(sys.argv[1], encoding="utf-8", errors="replace") as log:
        for line in log:
            line = ANSI.sub("", line)
            if "decode step" not in line:
                continue
            fields = {k: int(v) for k, v in FIELD.findall(line)}
            if fields.get("joined", 1) != 0 or fields.get("rows", 0) == 0:
                continue
            by_rows[fields["rows"]].append(fields)
    if not by_rows:
        sys.exit(f"no steady 'decode step' events in {sys.argv[1]} "
                 "(was RUST_LOG=mlxd_engine::step=trace set?)")
    for rows, steps in sorted(by_rows.items()):
        summary = {"rows": rows, "steps": len(steps),
                   "sampled_rows": statistics.median(s.get("sampled", 0) for s in steps)}
        for part in PARTS:
            summary[f"median_{part}"] = statistics.median(s.get(part, 0) for s in steps)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
