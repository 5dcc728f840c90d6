"""Quantized-KV decode attention on MLX's CUDA backend over the cache's whole buffer.

    python3 scripts/bench/cuda_qkv_whole_buffer.py

MLX 0.32.4's CUDA `quantized_matmul` refuses a prefix view of a larger buffer (the layout a
growing KV cache hands attention) but runs on a contiguous array (`cuda_qmm_probe.py`). A
cache's whole buffer is contiguous: attending over all of it, with the positions past the
written length masked out, needs no copy. This probe checks that the masked whole-buffer
attention (1) runs, (2) equals attention over the written prefix, and (3) what it costs
against bf16 fused attention and against dequantizing the prefix every step. It also shows
whether mlx-lm's own QuantizedKVCache runs at a length that is not a multiple of its step.
"""
import json
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_qmm_probe import attention_q, quantized as quantize  # noqa: E402

STEP = 256


def masked_quantized_attention(q, kq, vq, mask, bits, group):
    return attention_q(q, kq, vq, bits, group, mask=mask)


def dequantized_attention(q, kq, vq, bits, group, t):
    k = mx.dequantize(*[a[:, :, :t] for a in kq], group_size=group, bits=bits).astype(q.dtype)
    v = mx.dequantize(*[a[:, :, :t] for a in vq], group_size=group, bits=bits).astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)


def timed(f, n=50):
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return round((time.perf_counter() - start) / n * 1e3, 4)


def case(d, bits, group, t, b, kvh=8, h=32):
    cap = (t + STEP - 1) // STEP * STEP + STEP  # spare capacity, as a growing cache has
    q = mx.random.normal((b, h, 1, d)).astype(mx.bfloat16)
    k = mx.zeros((b, kvh, cap, d), dtype=mx.bfloat16)
    v = mx.zeros((b, kvh, cap, d), dtype=mx.bfloat16)
    k[:, :, :t] = mx.random.normal((b, kvh, t, d)).astype(mx.bfloat16)
    v[:, :, :t] = mx.random.normal((b, kvh, t, d)).astype(mx.bfloat16)
    kq, vq = quantize(k, bits, group), quantize(v, bits, group)
    mask = mx.where(mx.arange(cap) < t, 0.0, -float("inf")).astype(mx.bfloat16)
    mx.eval(q, k, v, kq, vq, mask)
    line = {"d": d, "bits": bits, "group": group, "t": t, "b": b, "cap": cap}
    try:
        got = masked_quantized_attention(q, kq, vq, mask, bits, group)
        want = dequantized_attention(q, kq, vq, bits, group, t)
        err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
        line["whole_buffer_max_abs_err"] = round(err, 5)
        line["whole_buffer_ms"] = timed(lambda: masked_quantized_attention(q, kq, vq, mask, bits, group))
    except Exception as e:  # the probe's answer: report it
        line["whole_buffer_ms"] = f"fails: {e}"
    line["dequant_prefix_sdpa_ms"] = timed(lambda: dequantized_attention(q, kq, vq, bits, group, t))
    kb, vb = k[:, :, :t], v[:, :, :t]
    line["bf16_prefix_sdpa_ms"] = timed(
        lambda: mx.fast.scaled_dot_product_attention(q, kb, vb, scale=d**-0.5)
    )
    print(json.dumps(line), flush=True)


def mlx_lm_cache(d, bits, group, t, b=1, kvh=8, h=32):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    k = mx.random.normal((b, kvh, t, d)).astype(mx.bfloat16)
    v = mx.random.normal((b, kvh, t, d)).astype(mx.bfloat16)
    q = mx.random.normal((b, h, 1, d)).astype(mx.bfloat16)
    c = QuantizedKVCache(group_size=group, bits=bits)
    c.update_and_fetch(k[:, :, : t - 1], v[:, :, : t - 1])
    kk, vv = c.update_and_fetch(k[:, :, t - 1 :], v[:, :, t - 1 :])
    try:
        mx.eval(quantized_scaled_dot_product_attention(q, kk, vv, scale=d**-0.5, mask=None, group_size=group, bits=bits))
        verdict = "ok"
    except Exception as e:
        verdict = f"fails: {e}"
    print(json.dumps({"mlx_lm_QuantizedKVCache": verdict, "d": d, "bits": bits, "group": group, "t": t}), flush=True)


if __name__ == "__main__":
    print("mlx", mx.__version__, mx.default_device(), flush=True)
    for t in (500, 512, 16000):
        mlx_lm_cache(128, 8, 64, t)
    mlx_lm_cache(64, 8, 64, 500)
    mlx_lm_cache(64, 8, 32, 500)
    for d, group in ((128, 64), (64, 32), (64, 64)):
        for bits in (8, 4):
            case(d, bits, group, 1000, 1)
    for t in (4096, 16384):
        for bits in (8, 4):
            for b in (1, 8, 32):
                case(128, bits, 64, t, b)
