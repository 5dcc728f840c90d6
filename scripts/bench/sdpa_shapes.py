#!/usr/bin/env python3
"""Which attention calls pay a per-shape build on this device, and what unfused attention
costs instead (issues 21 and 23).

    python3 scripts/bench/sdpa_shapes.py [--out result.jsonl] [--decode ROWS:KEYS:BUFFER,...] [--no-prefill]

`pass_shapes.py` showed that on CUDA every prefill pass of a new `[rows, length]` costs
45-65 ms before its compute. MLX's CUDA fused attention hands a pass of several queries to
cuDNN, whose execution plans are cached per exact query, key and value shape; a decode step
goes to cuDNN too when its keys are a slice of a buffer whose length is a multiple of 256 (the
cache step of mlx-lm and mlxd), else to MLX's own vector kernel. This probe times one
attention layer's call alone (1B Llama shape: 32 query heads over 8 KV heads, head dim 64,
bf16) for each shape's first call and its best repeat:

- `prefill`: a causal pass of `rows x length` queries over as many keys (fused), and the
  same through the unfused grouped attention mlxd uses for small passes on CUDA (two batched
  matmuls and a float32-accurate softmax);
- `decode`: one query per row over `keys` positions, the keys a slice of a 256-multiple
  buffer (the cuDNN case) or of a buffer one position longer (the vector kernel's case).

`--decode` replaces the decode shapes (e.g. `64:3128:3329,64:3128:3328` for a long context
through the vector kernel and through cuDNN); `--no-prefill` skips the prefill shapes. The decode
lines add the bytes of keys and values a call must read at least once, over its repeat time.

Run it twice, with `MLX_CUDA_USE_CUDNN_SDPA=0` the second time: a build cost that vanishes
is cuDNN's. One JSON line per shape and path.
"""
import argparse
import json
import os
import time

import mlx.core as mx

HEADS, KV_HEADS, DIM = 32, 8, 64
PREFILL = [(32, 128), (32, 129), (31, 128), (32, 62), (64, 128), (1, 517), (1, 2048)]
DECODE = [(32, 200, 256), (32, 300, 512), (31, 300, 512), (32, 300, 513), (64, 700, 768)]


def timed(fn):
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def unfused(q, k, v, scale, causal):
    """Grouped unfused attention: the query heads of each KV head stacked, as mlxd's."""
    b, h, length, d = q.shape
    t = k.shape[2]
    r = h // KV_HEADS
    s = ((q * scale).reshape(b, KV_HEADS, r * length, d) @ k.swapaxes(-1, -2))
    s = s.reshape(b, KV_HEADS, r, length, t)
    if causal:
        allowed = mx.arange(t)[None, :] <= mx.arange(t - length, t)[:, None]
        s = mx.where(allowed, s, mx.array(-1e9, s.dtype))
    w = mx.softmax(s, axis=-1, precise=True).reshape(b, KV_HEADS, r * length, t)
    return (w @ v).reshape(b, h, length, d)


def measure(kind, path, shape, fn):
    first = timed(fn)
    best = min(timed(fn) for _ in range(3))
    line = {"kind": kind, "path": path, "shape": shape, "first_ms": round(first, 2),
            "repeat_ms": round(best, 3), "new_shape_ms": round(first - best, 2),
            "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1"),
            "device": str(mx.default_device()), "mlx": mx.__version__}
    print(json.dumps(line), flush=True)
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--decode", help="ROWS:KEYS:BUFFER,... (default: the built-in list)")
    ap.add_argument("--no-prefill", action="store_true")
    a = ap.parse_args()
    decode = DECODE
    if a.decode:
        decode = [tuple(int(n) for n in s.split(":")) for s in a.decode.split(",")]
    scale = DIM ** -0.5
    lines = []
    # Warm what every shape shares (the kernels' first load), not counted.
    w = mx.random.normal((2, HEADS, 16, DIM)).astype(mx.bfloat16)
    wk = mx.random.normal((2, KV_HEADS, 16, DIM)).astype(mx.bfloat16)
    timed(lambda: mx.fast.scaled_dot_product_attention(w, wk, wk, scale=scale, mask="causal"))
    timed(lambda: unfused(w, wk, wk, scale, True))
    for rows, length in [] if a.no_prefill else PREFILL:
        q = mx.random.normal((rows, HEADS, length, DIM)).astype(mx.bfloat16)
        k = mx.random.normal((rows, KV_HEADS, length, DIM)).astype(mx.bfloat16)
        v = mx.random.normal((rows, KV_HEADS, length, DIM)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        shape = [rows, length]
        lines.append(measure("prefill", "fused", shape, lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask="causal")))
        lines.append(measure("prefill", "unfused", shape, lambda: unfused(q, k, v, scale, True)))
    for rows, keys, buffer in decode:
        kb = mx.random.normal((rows, KV_HEADS, buffer, DIM)).astype(mx.bfloat16)
        vb = mx.random.normal((rows, KV_HEADS, buffer, DIM)).astype(mx.bfloat16)
        q = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.bfloat16)
        mx.eval(kb, vb, q)
        k, v = kb[:, :, :keys, :], vb[:, :, :keys, :]
        shape = [rows, keys, buffer]
        line = measure("decode", "fused", shape,
                       lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))
        kv_bytes = 2 * rows * KV_HEADS * keys * DIM * 2
        print(json.dumps({"kind": "decode_bandwidth", "shape": shape,
                          "gb_per_s": round(kv_bytes / (line["repeat_ms"] / 1e3) / 1e9, 1)}), flush=True)
        lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(l) + "\n" for l in lines)


if __name__ == "__main__":
    main()
