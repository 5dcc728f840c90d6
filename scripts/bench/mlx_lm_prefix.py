#!/usr/bin/env python3
"""mlx-lm side of the prefix-cache benchmark: the same prompts and measurements as
engine/examples/bench_prefix.rs. Prints one JSON line per prefix length (medians of the timed
runs).

    .venv/bin/python scripts/bench/mlx_lm_prefix.py <model dir> <runs> <prefix tokens>...

A miss runs `generate_step` over prefix + a 16-token question with a fresh prompt cache; the
hit then does what `mlx_lm.server` does with its prompt cache: trims that cache back to the
shared prefix (`trim_prompt_cache`) and runs only the other 16-token question over it.
"""
import json
import pathlib
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model


def tokens(length, vocab, seed):
    x, out = 12345 + seed, []
    for _ in range(length):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(100 + x % (vocab - 100))
    return out


def ttft(model, prompt, cache, new_tokens=8):
    start = time.perf_counter()
    first = None
    for _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=new_tokens,
                           prompt_cache=cache):
        if first is None:
            first = time.perf_counter() - start
    return first


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    model, config = load_model(pathlib.Path(sys.argv[1]))
    runs = int(sys.argv[2])
    vocab = config["vocab_size"]
    seed = 0
    for n in (int(a) for a in sys.argv[3:]):
        misses, hits = [], []
        for run in range(runs + 1):
            seed += 1
            prefix = tokens(n, vocab, seed * 1000)
            cache = make_prompt_cache(model)
            miss = ttft(model, prefix + tokens(16, vocab, seed * 1000 + 1), cache)
            start = time.perf_counter()
            trim_prompt_cache(cache, cache[0].offset - n)
            trimmed = time.perf_counter() - start
            hit = trimmed + ttft(model, tokens(16, vocab, seed * 1000 + 2), cache)
            if run > 0:
                misses.append(miss)
                hits.append(hit)
        miss, hit = statistics.median(misses), statistics.median(hits)
        print(json.dumps({"impl": "mlx-lm", "prefix_tokens": n, "miss_ttft_s": round(miss, 4),
                          "hit_ttft_s": round(hit, 4), "hit_over_miss": round(hit / miss, 3)}))


if __name__ == "__main__":
    main()
