#!/usr/bin/env python3
"""What one warm decode step at one row asks of MLX, mlxd against mlx-lm: the graph of the
32nd step of each (Graphviz DOT, written before the step is queued), counted by primitive.

    .venv/bin/python scripts/bench/step_graph.py <model dir> <out dir> [prompt tokens]

mlxd's step is written by the engine (`MLXD_STEP_DOT`, engine/src/runtime/step_graph.rs)
while `bench_generate` runs one row (BENCH_BIN, default target/release/examples/bench_generate);
mlx-lm's by wrapping `mx.async_eval` around its own `generate_step`, greedy. The step before,
still in flight, is evaluated first on both sides so that only one step's graph is written.
On a GPU a step at one row is host-bound (BENCHMARKS.md, session 54: 1.4 ms, of which the
graph's build and commit take most), so fewer nodes is a faster step. Prints one JSON line:
each side's primitive count, leaf count (inputs: weights, caches, arrays made on the host)
and the primitives whose counts differ.
"""
import collections
import json
import os
import pathlib
import re
import subprocess
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

STEP = 32


def counts(path):
    text = pathlib.Path(path).read_text()
    prims = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))
    leaves = len(re.findall(r"rank=source", text))
    return prims, leaves


def mlx_lm_graph(model_dir, prompt_len, out):
    model, config = load_model(pathlib.Path(model_dir))
    real = mx.async_eval
    calls = {"n": 0, "last": ()}

    def spying(*arrays):
        calls["n"] += 1
        if calls["n"] == STEP:
            mx.eval(*calls["last"])
            mx.export_to_dot(str(out), *arrays)
        calls["last"] = arrays
        return real(*arrays)

    mx.async_eval = spying
    try:
        vocab = config["vocab_size"]
        prompt = mx.array([(100 + i * 7919) % vocab for i in range(prompt_len)])
        for n, _ in enumerate(generate_step(prompt, model, max_tokens=STEP + 4)):
            if n > STEP + 2:
                break
    finally:
        mx.async_eval = real


def mlxd_graph(model_dir, prompt_len, out):
    bench = os.environ.get("BENCH_BIN", "target/release/examples/bench_generate")
    env = dict(os.environ, MLXD_STEP_DOT=str(out))
    subprocess.run(
        [bench, model_dir, str(prompt_len), str(STEP + 8), "1", "1", "0"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def main():
    model_dir, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    out_dir.mkdir(parents=True, exist_ok=True)
    mlxd_dot, mlx_lm_dot = out_dir / "mlxd-step.dot", out_dir / "mlx-lm-step.dot"
    mlxd_graph(model_dir, prompt_len, mlxd_dot)
    mlx_lm_graph(model_dir, prompt_len, mlx_lm_dot)
    (ours, our_leaves), (theirs, their_leaves) = counts(mlxd_dot), counts(mlx_lm_dot)
    differ = {
        k: [ours.get(k, 0), theirs.get(k, 0)]
        for k in sorted(set(ours) | set(theirs))
        if ours.get(k, 0) != theirs.get(k, 0)
    }
    print(
        json.dumps(
            {
                "model": pathlib.Path(model_dir).name,
                "mlxd_primitives": sum(ours.values()),
                "mlx_lm_primitives": sum(theirs.values()),
                "mlxd_leaves": our_leaves,
                "mlx_lm_leaves": their_leaves,
                "differ_mlxd_mlx_lm": differ,
            }
        )
    )


if __name__ == "__main__":
    main()
