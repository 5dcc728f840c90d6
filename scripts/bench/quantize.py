#!/usr/bin/env python3
"""mlxd's quantize job against `mlx_lm.convert -q`, same model, same MLX, in one run.

    scripts/bench/quantize.py <engine bin> <model dir> <bits> <group size> <runs> [--compare]

Each run quantizes the model twice into a fresh directory beside it (removed after): once with
`mlxd-engine __job` (the process `mlxd quantize` and `POST /v1/jobs` start, without the
supervisor around it) and once with `python -m mlx_lm convert -q`, alternating which goes first
so that drifting machine load (and the page cache) affects both alike. Wall time and the child's
peak RSS (`wait4`) per run; prints one JSON line with the medians. `--compare` also checks that
the two outputs of the first run hold the same tensors, bit for bit, in a child process after
the timed runs (Linux counts a parent's RSS at fork in its children's peak, so this process
never loads tensors itself).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def run(argv, stdin_pipe=False):
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=log)
        # The job exits when its stdin closes: it stays open until the process ends.
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            log.seek(0)
            err = log.read().decode(errors="replace")
            sys.exit(f"{argv[0]} failed ({code}):\n{err[-4000:]}")
    if proc.stdin:
        proc.stdin.close()
    return seconds, usage.ru_maxrss * 1024


def ours(engine, model, bits, group, out):
    spec = {"kind": "quantize", "source": model, "bits": bits, "group_size": group,
            "staging": out + ".staging", "out": out}
    return run([engine, "__job", json.dumps(spec)], stdin_pipe=True)


def mlx_lm(model, bits, group, out):
    return run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model, "--mlx-path", out,
                "-q", "--q-bits", str(bits), "--q-group-size", str(group)])


def tensors(d):
    import mlx.core as mx
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(mx.load(os.path.join(d, f)))
    return out


def same(a, b):
    import mlx.core as mx
    ta, tb = tensors(a), tensors(b)
    if set(ta) != set(tb):
        return False
    return all(ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
               and mx.array_equal(ta[k], tb[k]).item() for k in ta)


def main():
    if sys.argv[1] == "--same":
        sys.exit(0 if same(sys.argv[2], sys.argv[3]) else 1)
    engine, model, bits, group, runs = sys.argv[1], os.path.abspath(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    compare = "--compare" in sys.argv[6:]
    work = tempfile.mkdtemp(prefix=".quantize-bench-", dir=os.path.dirname(model))
    results = {"ours": [], "mlx_lm": []}
    identical = None
    try:
        for i in range(runs):
            order = ["ours", "mlx_lm"] if i % 2 == 0 else ["mlx_lm", "ours"]
            outs = {}
            for who in order:
                out = os.path.join(work, f"{who}-{i}")
                t, rss = ours(engine, model, bits, group, out) if who == "ours" else mlx_lm(model, bits, group, out)
                results[who].append((t, rss))
                outs[who] = out
                print(f"run {i + 1} {who}: {t:.2f} s, peak RSS {rss / 2**30:.2f} GiB", file=sys.stderr)
            if compare and i == 0:
                kept = outs
                continue
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
        if compare:
            check = subprocess.run([sys.executable, __file__, "--same", kept["ours"], kept["mlx_lm"]],
                                   capture_output=True, text=True)
            if check.returncode not in (0, 1):
                sys.exit(f"comparing the outputs failed:\n{check.stderr[-4000:]}")
            identical = check.returncode == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = lambda who, k: statistics.median(r[k] for r in results[who])
    line = {
        "model": os.path.basename(model), "bits": bits, "group_size": group, "runs": runs,
        "ours_s": round(med("ours", 0), 3), "mlx_lm_s": round(med("mlx_lm", 0), 3),
        "ours_peak_rss_gib": round(med("ours", 1) / 2**30, 2),
        "mlx_lm_peak_rss_gib": round(med("mlx_lm", 1) / 2**30, 2),
        "speedup": round(med("mlx_lm", 0) / med("ours", 0), 2),
    }
    if compare:
        line["identical_tensors"] = identical
    print(json.dumps(line))


if __name__ == "__main__":
    main()
