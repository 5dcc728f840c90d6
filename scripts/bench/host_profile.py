#!/usr/bin/env python3
"""Functions from a host profile that a benchmark wrote (`MLXD_HOST_PROFILE=<file>`,
engine/examples/support/host_sampler.rs).

    host_profile.py <profile> --binaries DIR[,DIR...] [--thread NAME] [--top N]
                    [--callers REGEX] [--compare <other profile>]

The profile holds return addresses and the process's memory map. Each mapped file is found by
its base name under the given directories (the unstripped binaries of the build that ran, and
the MLX wheel's `mlx/lib`), its symbols read with `nm` and its load segments with `readelf`;
frames of files not found are named `<file>+?`. Prints, for one thread (default: the one with
the most samples), the functions with the largest inclusive and self shares of its samples;
`--callers` adds the callers of the functions matching REGEX; `--compare` prints both
profiles' shares side by side (per sample of each), largest differences first.
"""
import argparse
import bisect
import collections
import os
import re
import subprocess
import sys

HANDLER_FRAMES = 2  # the signal handler and the kernel's return trampoline


def load(path):
    samples, threads, maps = [], {}, []
    with open(path) as f:
        for line in f:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "S":
                parts = rest.split()
                samples.append((int(parts[0]), [int(a, 16) for a in parts[1:]]))
            elif kind == "T":
                tid, _, name = rest.partition(" ")
                threads[int(tid)] = name
            elif kind == "M":
                fields = rest.split(None, 5)
                if len(fields) == 6 and "x" in fields[1]:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    maps.append((lo, hi, int(fields[2], 16), fields[5]))
    maps.sort()
    return samples, threads, maps


def symbols(path, flags):
    """The function symbols of `path` (`nm` with `flags`), sorted: start addresses, names."""
    starts, names = [], []
    out = subprocess.run(
        ["nm", "-C", "-n", "--defined-only", *flags, path], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        f = line.split(" ", 2)
        if len(f) == 3 and f[1] in "tTwWiI":
            starts.append(int(f[0], 16))
            names.append(f[2])
    return starts, names


class Binary:
    """One file's symbols by virtual address."""

    def __init__(self, path):
        self.segments = []
        out = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            f = line.split()
            if f and f[0] == "LOAD":
                self.segments.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
        starts, names = symbols(path, [])
        if not starts:  # stripped: the dynamic symbols
            starts, names = symbols(path, ["-D"])
        self.starts, self.names = starts, names

    def name(self, file_offset):
        vaddr = file_offset
        for offset, va, size in self.segments:
            if offset <= file_offset < offset + size:
                vaddr = file_offset - offset + va
                break
        i = bisect.bisect_right(self.starts, vaddr) - 1
        return self.names[i] if i >= 0 else None


# Each file's symbols, read once (`--compare` names two profiles' frames in the same files).
BINARIES = {}


def symbolizer(maps, dirs):
    found = {}
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                found.setdefault(f, os.path.join(root, f))
    cache = {}
    starts = [m[0] for m in maps]

    def name(address):
        if address in cache:
            return cache[address]
        i = bisect.bisect_right(starts, address) - 1
        result = "?"
        if i >= 0 and address < maps[i][1]:
            lo, _, offset, path = maps[i]
            base = os.path.basename(path)
            local = found.get(base)
            if local:
                if local not in BINARIES:
                    BINARIES[local] = Binary(local)
                n = BINARIES[local].name(address - lo + offset)
                result = n if n else f"{base}+?"
            else:
                result = f"{base}+?"
        cache[address] = result
        return result

    return name


def shorten(name):
    name = re.sub(r"\(.*\)( const)?$", "", name)
    return name if len(name) <= 110 else name[:107] + "..."


def analyse(path, dirs, thread):
    samples, threads, maps = load(path)
    by_thread = collections.Counter(tid for tid, _ in samples)
    if thread:
        tids = {t for t, n in threads.items() if n == thread}
    else:
        tids = {by_thread.most_common(1)[0][0]} if by_thread else set()
    name = symbolizer(maps, dirs)
    inclusive, own = collections.Counter(), collections.Counter()
    stacks = []
    for tid, frames in samples:
        if tid not in tids:
            continue
        # Past the handler's frames, every frame but the interrupted one is a return address:
        # one byte back names the call.
        frames = frames[HANDLER_FRAMES:]
        names = [shorten(name(a if i == 0 else a - 1)) for i, a in enumerate(frames)]
        stacks.append(names)
        if names:
            own[names[0]] += 1
        for n in set(names):
            inclusive[n] += 1
    summary = {
        "samples": len(stacks),
        "threads": {threads.get(t, "?"): n for t, n in by_thread.most_common(8)},
        "thread": sorted(threads.get(t, "?") for t in tids),
    }
    return summary, inclusive, own, stacks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("profile")
    p.add_argument("--binaries", required=True)
    p.add_argument("--thread")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--callers")
    p.add_argument("--compare")
    a = p.parse_args()
    dirs = a.binaries.split(",")
    summary, inclusive, own, stacks = analyse(a.profile, dirs, a.thread)
    total = max(summary["samples"], 1)
    print(f"# {a.profile}: {summary}")
    if a.compare:
        s2, inc2, _, _ = analyse(a.compare, dirs, a.thread)
        total2 = max(s2["samples"], 1)
        print(f"# {a.compare}: {s2}")
        keys = set(inclusive) | set(inc2)
        rows = sorted(keys, key=lambda k: -abs(inc2[k] / total2 - inclusive[k] / total))
        print("first %   second %   (inclusive)")
        for k in rows[: a.top]:
            print(f"{100 * inclusive[k] / total:6.1f} {100 * inc2[k] / total2:8.1f}   {k}")
        return
    print("inclusive %  self %")
    for n, c in inclusive.most_common(a.top):
        print(f"{100 * c / total:8.1f} {100 * own[n] / total:7.1f}   {n}")
    print("\nself %")
    for n, c in own.most_common(a.top):
        print(f"{100 * c / total:6.1f}   {n}")
    if a.callers:
        pattern = re.compile(a.callers)
        counts = collections.Counter()
        for names in stacks:
            for i, n in enumerate(names[:-1]):
                if pattern.search(n):
                    counts[(n, names[i + 1])] += 1
                    break
        print(f"\ncallers of /{a.callers}/ (first match in each stack)")
        for (n, caller), c in counts.most_common(a.top):
            print(f"{100 * c / total:6.1f}   {n}  <-  {caller}")


if __name__ == "__main__":
    sys.exit(main())
