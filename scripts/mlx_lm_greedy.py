#!/usr/bin/env python3
"""Reference greedy tokens from mlx-lm, for parity tests and benchmarks.

    .venv/bin/python scripts/mlx_lm_greedy.py [--adapter <dir>] <model dir> <max tokens> <token id>...

`--adapter` applies an mlx-lm LoRA adapter directory (`adapter_config.json` +
`adapters.safetensors`) as `mlx_lm.load(..., adapter_path=...)` does. Prints the generated token ids on one line, space-separated.
"""
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def main():
    args = sys.argv[1:]
    adapter = None
    if args[:1] == ["--adapter"]:
        adapter, args = args[1], args[2:]
    model_dir, max_tokens = args[0], int(args[1])
    prompt = mx.array([int(t) for t in args[2:]], dtype=mx.uint32)
    model, _ = load_model(__import__("pathlib").Path(model_dir))
    if adapter is not None:
        from mlx_lm.tuner.utils import load_adapters

        model = load_adapters(model, adapter)
        model.eval()
    out = []
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        out.append(int(token))
    print(" ".join(map(str, out)))


if __name__ == "__main__":
    main()
