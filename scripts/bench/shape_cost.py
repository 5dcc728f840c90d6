"""What a pass of a new shape costs on the GPU, and where: a matrix product of a new row count
alone, and a whole model's prefill pass of new (rows, tokens), each timed on its first call and
on its best repeat.

    python3 scripts/bench/shape_cost.py --model DIR [--label TEXT]

Run it once per environment to compare, e.g. `CUDA_MODULE_LOADING=EAGER` (CUDA loads every
kernel of cuBLAS when the library loads, not on its first use) or `MLX_USE_CUDA_GRAPHS=0`
(MLX launches kernels one by one instead of instantiating a CUDA graph per new sequence of
them). Set `MLX_CUDA_USE_CUDNN_SDPA=0` to keep cuDNN's per-shape attention plans out of the
model's figures, as mlxd's engine does for such passes. Prints one JSON line per measurement.
"""

import argparse
import json
import os
import time

T0 = time.perf_counter()
import mlx.core as mx  # noqa: E402

mx.eval(mx.ones(1) + 1)
FIRST_OP_S = time.perf_counter() - T0


def timed(fn) -> float:
    """Milliseconds of one call of `fn`, evaluated and synchronized."""
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def first_and_repeat(fn, repeats: int = 3) -> tuple[float, float]:
    first = timed(fn)
    return first, min(timed(fn) for _ in range(repeats))


def emit(label: str, **fields) -> None:
    print(json.dumps(dict(label=label, **fields)), flush=True)


def matmuls(label: str) -> None:
    """The 1B shape's projections (in -> out) at row counts a server meets."""
    weights = {(k, n): mx.random.normal((n, k)).astype(mx.bfloat16)
               for k, n in [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]}
    mx.eval(list(weights.values()))
    for m in [32, 33, 48, 64, 100, 128, 648, 1000, 2048, 2682, 16000]:
        for (k, n), w in weights.items():
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x)
            first, repeat = first_and_repeat(lambda: x @ w.T)
            emit(label, what="matmul", m=m, k=k, n=n, first_ms=round(first, 3),
                 repeat_ms=round(repeat, 3))


def passes(label: str, model_dir: str) -> None:
    """Prefill passes of the model at new (rows, tokens), then a decode step after each."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(model_dir)
    vocab = model.args.vocab_size

    def prefill(rows: int, tokens: int):
        x = mx.random.randint(0, vocab, (rows, tokens))
        mx.eval(x)
        return lambda: model(x, cache=make_prompt_cache(model))

    shapes = [(4, 128), (4, 162), (9, 298), (22, 727), (32, 128), (32, 129), (31, 128),
              (4, 162), (22, 727), (16, 256), (16, 257), (8, 512), (1, 2048), (2, 1024)]
    for rows, tokens in shapes:
        first, repeat = first_and_repeat(prefill(rows, tokens))
        emit(label, what="prefill", rows=rows, tokens=tokens, first_ms=round(first, 2),
             repeat_ms=round(repeat, 2))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    env = {k: os.environ.get(k) for k in
           ["CUDA_MODULE_LOADING", "MLX_USE_CUDA_GRAPHS", "MLX_CUDA_USE_CUDNN_SDPA"]}
    label = args.label or ",".join(f"{k}={v}" for k, v in env.items() if v is not None) or "default"
    emit(label, what="start", first_op_s=round(FIRST_OP_S, 3), mlx=mx.__version__,
         device=str(mx.default_device()))
    matmuls(label)
    passes(label, args.model)
    emit(label, what="memory", active_gb=round(mx.get_active_memory() / 1e9, 3),
         peak_gb=round(mx.get_peak_memory() / 1e9, 3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
