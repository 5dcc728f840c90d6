#!/usr/bin/env python3
"""mlx-lm side of the engine benchmark: same prompt, same measurements as
engine/examples/bench_generate.rs. Prints one JSON object (medians of the timed runs).

    .venv/bin/python scripts/bench/mlx_lm_bench.py <model dir> <prompt tokens> <new tokens> <runs>
"""
import json
import pathlib
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def prompt(length, vocab):
    x, out = 12345, []
    for _ in range(length):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(100 + x % (vocab - 100))
    return out


def run(model, tokens, new_tokens):
    start = time.perf_counter()
    first = None
    n = 0
    for _token, _ in generate_step(mx.array(tokens, dtype=mx.uint32), model, max_tokens=new_tokens):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


def main():
    model_dir, length, new_tokens, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model, config = load_model(pathlib.Path(model_dir))
    tokens = prompt(length, config["vocab_size"])
    run(model, tokens, min(8, new_tokens))
    results = [run(model, tokens, new_tokens) for _ in range(runs)]
    ttft = statistics.median(r[0] for r in results)
    decode = statistics.median(r[1] for r in results)
    print(json.dumps({"impl": "mlx-lm", "prompt_tokens": length, "new_tokens": new_tokens,
                      "ttft_s": round(ttft, 4), "prefill_tps": round(length / ttft, 1),
                      "decode_tps": round(decode, 2)}))


if __name__ == "__main__":
    main()
