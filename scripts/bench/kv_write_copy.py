"""Does a decode step's KV write copy the whole cache buffer when it is queued while the
previous step is still running? And what does a custom kernel node cost the host against a
plain one?

MLX writes a slice in place only when nothing else holds the buffer when the write is
encoded. A decode step queued one step ahead (as mlxd's runtime and mlx-lm's generators do)
finds each layer's buffer still held by the previous step's attention, so the write would
copy the buffer. This measures it with MLX alone: `layers` layers of `[rows, heads, T,
head_dim]` bf16 K and V buffers, each step writing one position per layer and attending over
the written prefix, queued ahead ("pipelined") or after waiting for the previous step
("waited"). One JSON line per case: milliseconds per step and MLX's peak memory over the timed
steps above what the buffers hold.

With `--kernels` (CUDA only), a chain of 128 custom-kernel nodes against 128 plain adds on a
small array: microseconds of graph building and of `async_eval` per node, with a short and a
long kernel source (MLX builds the source at every call and hashes it at every launch).

    python3 scripts/bench/kv_write_copy.py [--rows 32,128] [--context 1024] [--kernels]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx


def kv_case(rows, context, layers, heads, head_dim, steps, pipelined, cache_limit):
    if cache_limit:
        mx.set_cache_limit(cache_limit)
    ks = [mx.zeros((rows, heads, context, head_dim), dtype=mx.bfloat16) for _ in range(layers)]
    vs = [mx.zeros((rows, heads, context, head_dim), dtype=mx.bfloat16) for _ in range(layers)]
    mx.eval(ks, vs)
    held = sum(a.nbytes for a in ks + vs)
    start_pos = context // 2
    x = mx.random.normal((rows, heads, 1, head_dim)).astype(mx.bfloat16)
    mx.eval(x)
    scale = head_dim**-0.5

    def step(x, pos):
        for i in range(layers):
            k, v = ks[i], vs[i]
            k[:, :, pos : pos + 1, :] = x
            v[:, :, pos : pos + 1, :] = x * 0.5
            ks[i], vs[i] = k, v
            o = mx.fast.scaled_dot_product_attention(
                x, k[:, :, : pos + 1, :], v[:, :, : pos + 1, :], scale=scale
            )
            x = (o + x).astype(mx.bfloat16)
        return x

    def run(n, first):
        nonlocal x
        times = []
        cur = step(x, first)
        mx.async_eval(cur)
        for s in range(1, n):
            t = time.perf_counter()
            nxt = step(cur, first + s)
            if pipelined:
                mx.async_eval(nxt)
                mx.eval(cur)
            else:
                mx.eval(cur)
                mx.async_eval(nxt)
            cur = nxt
            times.append(time.perf_counter() - t)
        mx.eval(cur)
        x = cur
        return times

    run(8, start_pos - 16)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    times = run(steps, start_pos)
    peak = mx.get_peak_memory()
    out = {
        "case": "kv_write",
        "device": str(mx.default_device()),
        "rows": rows,
        "context": context,
        "layers": layers,
        "pipelined": pipelined,
        "cache_limit": cache_limit,
        "kv_bytes": held,
        "step_ms_median": round(statistics.median(times) * 1e3, 3),
        "peak_above_active_bytes": peak - base,
    }
    del ks[:], vs[:]
    mx.clear_cache()
    mx.set_cache_limit(1 << 40)
    return out


def kernel_case(source_pad, nodes, reps):
    body = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n if (i < N) out[i] = inp[i] + static_cast<T>(1);\n"
    source = ("// " + "x" * 78 + "\n") * source_pad + body
    kernel = mx.fast.cuda_kernel(name="chain_add", input_names=["inp"], output_names=["out"], source=source)
    y0 = mx.zeros((32, 2048), dtype=mx.bfloat16)
    mx.eval(y0)
    n = y0.size

    def custom(y):
        return kernel(
            inputs=[y],
            template=[("T", y.dtype), ("N", n)],
            grid=(n, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[y.shape],
            output_dtypes=[y.dtype],
        )[0]

    def plain(y):
        return y + 1

    res = {}
    for label, f in (("custom", custom), ("plain", plain)):
        builds, queues, totals = [], [], []
        for r in range(reps + 3):
            t0 = time.perf_counter()
            y = y0
            for _ in range(nodes):
                y = f(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            t3 = time.perf_counter()
            if r >= 3:
                builds.append(t1 - t0)
                queues.append(t2 - t1)
                totals.append(t3 - t0)
        res[label] = {
            "build_us_per_node": round(statistics.median(builds) * 1e6 / nodes, 2),
            "async_eval_us_per_node": round(statistics.median(queues) * 1e6 / nodes, 2),
            "total_us_per_node": round(statistics.median(totals) * 1e6 / nodes, 2),
        }
    return {"case": "kernel_nodes", "source_bytes": len(source), "nodes": nodes, **res}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="32,128")
    p.add_argument("--context", default="1024")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cache-limit", type=int, default=0)
    p.add_argument("--kernels", action="store_true")
    a = p.parse_args()
    for rows in [int(r) for r in a.rows.split(",")]:
        for context in [int(c) for c in a.context.split(",")]:
            for pipelined in (True, False):
                print(json.dumps(kv_case(rows, context, a.layers, a.heads, a.head_dim, a.steps, pipelined, a.cache_limit)), flush=True)
    if a.kernels:
        for pad in (0, 60):
            print(json.dumps(kernel_case(pad, 128, 20)), flush=True)


if __name__ == "__main__":
    main()
