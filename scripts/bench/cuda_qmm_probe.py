"""Which quantized-KV attention calls MLX's CUDA backend runs, and what each costs.

    python3 scripts/bench/cuda_qmm_probe.py

Tries `mx.quantized_matmul` on the layouts a KV cache hands attention (a fresh quantized
array, a prefix view of a larger buffer, mlx-lm's QuantizedKVCache after a decode step),
printing which run and which raise; then times one decode step's attention over a quantized
cache three ways (quantized matmuls, dequantize + fused attention, bf16 fused attention).
"""
import time

import mlx.core as mx


def quantized(x, bits, group):
    return mx.quantize(x, group_size=group, bits=bits)


def attention_q(q, kq, vq, bits, group, mask=None):
    """Unfused attention through quantized matmuls; `mask` is added to the scores."""
    b, h, l, d = q.shape
    kvh = kq[0].shape[1]
    rep = h // kvh
    q = (q * (d**-0.5)).reshape(b, kvh, rep, l, d)
    kq = [a[:, :, None] for a in kq]
    vq = [a[:, :, None] for a in vq]
    s = mx.quantized_matmul(q, *kq, transpose=True, group_size=group, bits=bits)
    if mask is not None:
        s = s + mask
    w = mx.softmax(s, axis=-1, precise=True)
    o = mx.quantized_matmul(w, *vq, transpose=False, group_size=group, bits=bits)
    return o.reshape(b, h, l, d)


def attention_deq(q, kq, vq, bits, group):
    k = mx.dequantize(*kq, group_size=group, bits=bits).astype(q.dtype)
    v = mx.dequantize(*vq, group_size=group, bits=bits).astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)


def try_call(label, f):
    try:
        mx.eval(f())
        print(f"ok    {label}")
        return True
    except Exception as e:  # report, not hide: this is the probe's answer
        print(f"FAIL  {label}: {e}")
        return False


def probe(d, bits, group, t=512, cap=768, b=1, kvh=8, h=32):
    q = mx.random.normal((b, h, 1, d)).astype(mx.bfloat16)
    k = mx.random.normal((b, kvh, cap, d)).astype(mx.bfloat16)
    v = mx.random.normal((b, kvh, cap, d)).astype(mx.bfloat16)
    kq_full, vq_full = quantized(k[:, :, :t], bits, group), quantized(v[:, :, :t], bits, group)
    kq_buf, vq_buf = quantized(k, bits, group), quantized(v, bits, group)
    kq_view = [a[:, :, :t] for a in kq_buf]
    vq_view = [a[:, :, :t] for a in vq_buf]
    tag = f"D={d} bits={bits} group={group} B={b}"
    try_call(f"{tag} fresh contiguous", lambda: attention_q(q, kq_full, vq_full, bits, group))
    try_call(f"{tag} prefix view of a buffer", lambda: attention_q(q, kq_view, vq_view, bits, group))
    try_call(
        f"{tag} prefix view made contiguous",
        lambda: attention_q(
            q, [mx.contiguous(a) for a in kq_view], [mx.contiguous(a) for a in vq_view], bits, group
        ),
    )
    try:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention
        from mlx_lm.models.cache import QuantizedKVCache

        c = QuantizedKVCache(group_size=group, bits=bits)
        c.update_and_fetch(k[:, :, : t - 1], v[:, :, : t - 1])
        kk, vv = c.update_and_fetch(k[:, :, t - 1 : t], v[:, :, t - 1 : t])
        try_call(
            f"{tag} mlx-lm QuantizedKVCache",
            lambda: quantized_scaled_dot_product_attention(
                q, kk, vv, scale=d**-0.5, mask=None, group_size=group, bits=bits
            ),
        )
    except ImportError as e:
        print(f"skip  mlx-lm: {e}")


def timed(f, n=50):
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - start) / n * 1e3


def cost(d, bits, group, t, b, kvh=8, h=32):
    q = mx.random.normal((b, h, 1, d)).astype(mx.bfloat16)
    k = mx.random.normal((b, kvh, t, d)).astype(mx.bfloat16)
    v = mx.random.normal((b, kvh, t, d)).astype(mx.bfloat16)
    kq, vq = quantized(k, bits, group), quantized(v, bits, group)
    mx.eval(q, k, v, kq, vq)
    line = {"d": d, "bits": bits, "t": t, "b": b}
    line["bf16_sdpa_ms"] = round(timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5)), 4)
    line["dequant_sdpa_ms"] = round(timed(lambda: attention_deq(q, kq, vq, bits, group)), 4)
    try:
        line["quantized_ms"] = round(timed(lambda: attention_q(q, kq, vq, bits, group)), 4)
    except Exception as e:
        line["quantized_ms"] = f"fails: {e}"
    print(line)


if __name__ == "__main__":
    print("mlx", mx.__version__, mx.default_device())
    for d in (64, 128):
        for bits in (4, 8):
            probe(d, bits, 64)
    probe(128, 8, 64, b=8)
    for t in (4096, 16384):
        for bits in (8, 4):
            for b in (1, 8):
                cost(128, bits, 64, t, b)
