"""The memory of the two LoRA-training pieces that mlxd and mlx-lm run differently on CUDA, at
issue 25's shapes (Llama 3.2 1B: 32 heads over 8 KV heads of 64, vocabulary 128256; batch
4 x 511 targets), measured with MLX's plain ops (any device):

    .venv/bin/python scripts/bench/lora_memory_shares.py ce          # cross-entropy's gradient
    .venv/bin/python scripts/bench/lora_memory_shares.py grouped 8   # 8 unfused attention layers
    .venv/bin/python scripts/bench/lora_memory_shares.py ckpt 8      # the same, recomputed

`ce`: the peak of the plain cross-entropy's gradient (log-sum-exp minus the target's logit)
above the logits; MLX's fused kernel (`mx.fast.cross_entropy`, GPU) makes one logit-sized
gradient. `grouped` against `ckpt`: attention unfused with its scores kept for the backward
pass (mlxd's CUDA path below 2^26 scores before issue 25) against the same recomputed in the
backward pass, which is what MLX's fused attention does in training when its cuDNN backward
does not apply (a query length not a multiple of 128, as 511): the difference per layer is
what each trained layer kept.
"""
import sys

import mlx.core as mx

B, H, KV, L, D, V = 4, 32, 8, 511, 64, 128256


def peak_of(f, *args):
    mx.eval(*args)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(f(*args))
    return (mx.get_peak_memory() - base) / 1e9


def grouped(q, k, v):
    q = (q * D ** -0.5).reshape(B, KV, H // KV * L, D)
    s = (q @ k.swapaxes(-1, -2)).reshape(B, KV, H // KV, L, L)
    causal = mx.arange(L)[None] <= mx.arange(L)[:, None]
    s = mx.where(causal, s, mx.array(-1e9, s.dtype))
    w = mx.softmax(s, -1, precise=True).reshape(B, KV, H // KV * L, L)
    return (w @ v).reshape(B, H, L, D)


def main():
    which = sys.argv[1]
    mx.random.seed(0)
    if which == "ce":
        logits = mx.random.normal((B, L, V)).astype(mx.bfloat16)
        targets = mx.random.randint(0, V, (B, L))

        def plain(x):
            score = mx.take_along_axis(x, targets[..., None], -1).squeeze(-1)
            return (mx.logsumexp(x, -1) - score).astype(mx.float32).sum()

        print(f"ce: logits {logits.nbytes / 1e9:.3f} GB, gradient's peak above them "
              f"{peak_of(mx.grad(plain), logits):.3f} GB")
        return
    n = int(sys.argv[2])
    attend = grouped if which == "grouped" else mx.checkpoint(grouped)
    x = mx.random.normal((B, L, H * D)).astype(mx.bfloat16) * 0.1

    def layers(x):
        for _ in range(n):
            q = x.reshape(B, L, H, D).transpose(0, 2, 1, 3)
            o = attend(q, q[:, :KV], q[:, KV:2 * KV])
            x = x + o.transpose(0, 2, 1, 3).reshape(B, L, H * D)
        return x.astype(mx.float32).sum()

    print(f"{which} x {n} layers: gradient's peak above the input "
          f"{peak_of(mx.grad(layers), x):.3f} GB")


if __name__ == "__main__":
    main()
