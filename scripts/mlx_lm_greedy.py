#!/usr/bin/env python3
"""Reference greedy tokens from mlx-lm, for parity tests and benchmarks.

    .venv/bin/python scripts/mlx_lm_greedy.py <model dir> <max tokens> <token id>...

Prints the generated token ids on one line, space-separated.
"""
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def main():
    model_dir, max_tokens = sys.argv[1], int(sys.argv[2])
    prompt = mx.array([int(t) for t in sys.argv[3:]], dtype=mx.uint32)
    model, _ = load_model(__import__("pathlib").Path(model_dir))
    out = []
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        out.append(int(token))
    print(" ".join(map(str, out)))


if __name__ == "__main__":
    main()
