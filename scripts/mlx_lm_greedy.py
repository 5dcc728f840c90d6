#!/usr/bin/env python3
"""Reference greedy tokens from mlx-lm, for parity tests and benchmarks.

    .venv/bin/python scripts/mlx_lm_greedy.py [--adapter <dir>] <model dir> <max tokens> <token id>...
    .venv/bin/python scripts/mlx_lm_greedy.py [--adapter <dir>] --many <model dir> <max tokens> < prompts

`--adapter` applies an mlx-lm LoRA adapter directory (`adapter_config.json` +
`adapters.safetensors`) as `mlx_lm.load(..., adapter_path=...)` does. Prints the generated
token ids on one line, space-separated. With `--many`, the prompts come on standard input,
one per line (space-separated ids), and each prompt's tokens are printed on a line of their
own, in order: one process loads the model once for all of them (a test's Python start-up
and model load cost more than its generations).

Token ids outside the model's vocabulary are refused with a message (mlx indexes the
embedding without a bounds check, so such an id would read out of bounds).
"""
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def greedy(model, prompt, max_tokens, vocab):
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        sys.exit(f"mlx_lm_greedy: token ids {bad[:5]} are outside the vocabulary of {vocab}")
    out = []
    for token, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=max_tokens):
        out.append(int(token))
    return out


def main():
    args = sys.argv[1:]
    adapter = None
    if args[:1] == ["--adapter"]:
        adapter, args = args[1], args[2:]
    many = args[:1] == ["--many"]
    if many:
        args = args[1:]
    model_dir, max_tokens = args[0], int(args[1])
    model, config = load_model(Path(model_dir))
    if adapter is not None:
        from mlx_lm.tuner.utils import load_adapters

        model = load_adapters(model, adapter)
        model.eval()
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 2**32
    if many:
        prompts = [[int(t) for t in line.split()] for line in sys.stdin if line.strip()]
    else:
        prompts = [[int(t) for t in args[2:]]]
    for prompt in prompts:
        print(" ".join(map(str, greedy(model, prompt, max_tokens, vocab))), flush=True)


if __name__ == "__main__":
    main()
