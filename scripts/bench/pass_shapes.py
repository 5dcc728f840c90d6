#!/usr/bin/env python3
"""What a prefill pass of a shape never run before costs on this device (issue 21).

    python3 scripts/bench/pass_shapes.py MODEL_DIR [--out result.jsonl]

mlx-lm's own model and batch cache (the reference) prefill batches of left-padded prompts, as
mlx-lm's BatchGenerator and mlxd's batched prefill do, for a sequence of `[rows, length]` shapes: each shape's first pass
and then the same shape again. The difference is what a new shape costs beyond its compute
(MLX's kernel compilation, cuDNN attention graphs, cuBLAS heuristics). The shapes vary the
length alone, the rows alone, and both, so that the answer says which one to bucket: a length
one off, a multiple of 32, a row count one off.

One JSON line per pass: shape, first or repeat, milliseconds.
"""
import argparse
import json
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

# (rows, length), in the order run; a shape listed twice is run once (first) then repeated.
SHAPES = [
    (32, 128),
    (32, 129),   # length one off
    (32, 160),   # length at the next multiple of 32
    (32, 192),
    (31, 128),   # rows one off
    (16, 128),
    (24, 136),   # both new
    (1, 128),
    (1, 517),
    (8, 256),
]


def prefill(model, rows, length):
    tokens = mx.random.randint(0, 1000, (rows, length)).astype(mx.uint32)
    # Left padding as mlx-lm's BatchGenerator prefills a group: its BatchKVCache makes the
    # attention mask an array that hides each row's padding.
    pads = [i % 8 for i in range(rows)]
    cache = [BatchKVCache(left_padding=pads) for _ in model.layers]
    logits = model(tokens, cache=cache)
    mx.eval(logits[:, -1, :], [c.state for c in cache])


def timed(model, rows, length):
    mx.synchronize()
    t0 = time.perf_counter()
    prefill(model, rows, length)
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out")
    a = ap.parse_args()
    model, _ = load(a.model)
    # The first pass of all compiles what every shape shares; it is not counted.
    timed(model, 2, 16)
    lines = []
    for rows, length in SHAPES:
        first = timed(model, rows, length)
        repeats = [timed(model, rows, length) for _ in range(3)]
        line = {"rows": rows, "length": length, "first_ms": round(first, 1),
                "repeat_ms": round(min(repeats), 1),
                "new_shape_ms": round(first - min(repeats), 1),
                "device": str(mx.default_device()), "mlx": mx.__version__}
        print(json.dumps(line), flush=True)
        lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(l) + "\n" for l in lines)


if __name__ == "__main__":
    main()
