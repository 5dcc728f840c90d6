#!/usr/bin/env python3
"""Summarises the engine's per-step trace: the `decode step` and `prefill step` events that
mlxd-engine writes under target `mlxd_engine::step` (RUST_LOG=mlxd_engine::step=trace), from a
log file (the engine's own, or mlxd's, which re-emits them under `mlxd::engine` when its
RUST_LOG also holds `mlxd::engine=trace`).

    .venv/bin/python scripts/bench/step_trace.py <log file>
    .venv/bin/python scripts/bench/step_trace.py --slow MS <log file>
    .venv/bin/python scripts/bench/step_trace.py --rounds MS <log file>

Prints one JSON line per batch size seen in steady steps (no row joining): the number of steps
and the median microseconds of each part (building the model's graph, building the
sampler's, async_eval, waiting for the previous step's tokens, the whole step on the host).
Run it on a greedy and a sampled run to see where sampling costs.

With `--slow MS`: one JSON line per step whose host time passed MS milliseconds (a decode
step's `total_us`; a prefill step's `build_us + wait_us`, its build split into `graph_us` and
`async_eval_us`), with its time stamp, kind and
fields, and the idle gap before it (from the end of the step logged before). This finds a
stall: a wait that all streams share shows up as one slow step or one long gap. A gap is the
engine not stepping: idle between requests, or busy outside a step. In mlxd's log the time
stamps are when mlxd re-emitted each line, so its gaps are good to a millisecond or so.

With `--rounds MS`: the log cut into rounds at every idle gap over MS milliseconds (a load
client started once per round leaves one between rounds), one JSON line per round: its wall
time from the first step's start to the last step's end, its decode steps and their median
host time and `async_eval`, the host time of its first five steps, its prefill steps, and the
steady steps (no row joining) of its commonest batch size with their medians of building the
graph, `async_eval` and the whole step: the figures to set beside the engine core's.
Where a round's time goes (a slow start, or every step slower) shows in it.
"""
import collections
import datetime
import json
import re
import statistics
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\d+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")
PARTS = ["build_forward_us", "build_sampler_us", "async_eval_us", "wait_tokens_us", "total_us"]


def steps(path):
    """(kind, time stamp or None, fields) for each step event of the log, in order."""
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            line = ANSI.sub("", line)
            kind = "decode" if "decode step" in line else "prefill" if "prefill step" in line else None
            if kind is None:
                continue
            stamp = STAMP.match(line)
            at = datetime.datetime.fromisoformat(stamp.group(1)) if stamp else None
            yield kind, at, {k: int(v) for k, v in FIELD.findall(line)}


def host_us(kind, fields):
    if kind == "decode":
        return fields.get("total_us", 0)
    return fields.get("build_us", 0) + fields.get("wait_us", 0)


def slow(path, ms):
    found = False
    previous_end = None
    for kind, at, fields in steps(path):
        took = host_us(kind, fields)
        start = at - datetime.timedelta(microseconds=took) if at else None
        gap = (start - previous_end).total_seconds() * 1e3 if start and previous_end else None
        if took >= ms * 1e3 or (gap is not None and gap >= ms):
            found = True
            print(json.dumps({"at": at.isoformat() if at else None, "kind": kind,
                              "host_ms": round(took / 1e3, 2),
                              "gap_before_ms": None if gap is None else round(gap, 2), **fields}))
        previous_end = at or previous_end
    if not found:
        print(json.dumps({"slow_steps": 0, "over_ms": ms}))


def steady_parts(decode):
    """The steady steps of a round's commonest batch size: their rows, count and medians of
    building the model's graph, `async_eval` and the whole step."""
    steady = [f for f in decode if f.get("joined", 1) == 0]
    if not steady:
        return {"steady_rows": None}
    rows = collections.Counter(f["rows"] for f in steady).most_common(1)[0][0]
    group = [f for f in steady if f["rows"] == rows]
    return {
        "steady_rows": rows, "steady_steps": len(group),
        **{f"steady_median_{part}": statistics.median(f.get(part, 0) for f in group)
           for part in ("build_forward_us", "async_eval_us", "total_us")},
    }


def rounds(path, ms):
    current, previous_end = None, None

    def emit(r):
        decode = [f for k, f in r["steps"] if k == "decode" and f.get("rows", 0) > 0]
        print(json.dumps({
            "round": r["n"], "wall_ms": round((r["end"] - r["start"]).total_seconds() * 1e3, 1),
            "decode_steps": len(decode),
            "median_total_us": statistics.median(f["total_us"] for f in decode) if decode else None,
            "median_async_eval_us":
                statistics.median(f.get("async_eval_us", 0) for f in decode) if decode else None,
            "first_steps_us": [host_us(k, f) for k, f in r["steps"][:5]],
            "prefill_steps": sum(1 for k, _ in r["steps"] if k == "prefill"),
            # Steps of the round's commonest batch size with no row joining: the same work
            # each, so their medians compare from round to round (and with the engine core's).
            **steady_parts(decode),
        }))

    n = 0
    for kind, at, fields in steps(path):
        if at is None:
            sys.exit(f"{path}: step events without time stamps cannot be cut into rounds")
        took = host_us(kind, fields)
        start = at - datetime.timedelta(microseconds=took)
        gap = (start - previous_end).total_seconds() * 1e3 if previous_end else None
        if current is None or (gap is not None and gap >= ms):
            if current is not None:
                emit(current)
            n += 1
            current = {"n": n, "start": start, "end": at, "steps": []}
        current["steps"].append((kind, fields))
        current["end"] = at
        previous_end = at
    if current is not None:
        emit(current)


def summary(path):
    by_rows = collections.defaultdict(list)
    for kind, _, fields in steps(path):
        if kind != "decode" or fields.get("joined", 1) != 0 or fields.get("rows", 0) == 0:
            continue
        by_rows[fields["rows"]].append(fields)
    if not by_rows:
        sys.exit(f"no steady 'decode step' events in {path} "
                 "(was RUST_LOG=mlxd_engine::step=trace set?)")
    for rows, group in sorted(by_rows.items()):
        line = {"rows": rows, "steps": len(group),
                "sampled_rows": statistics.median(s.get("sampled", 0) for s in group)}
        for part in PARTS:
            line[f"median_{part}"] = statistics.median(s.get(part, 0) for s in group)
        print(json.dumps(line))


def main():
    args = sys.argv[1:]
    if len(args) == 3 and args[0] == "--slow":
        slow(args[2], float(args[1]))
    elif len(args) == 3 and args[0] == "--rounds":
        rounds(args[2], float(args[1]))
    elif len(args) == 1:
        summary(args[0])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
