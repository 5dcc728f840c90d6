#!/usr/bin/env python3
"""mlx-lm side of the engine benchmark: same prompts, same measurements as
engine/examples/bench_generate.rs. Prints one JSON object (medians of the timed runs).

    .venv/bin/python scripts/bench/mlx_lm_bench.py <model dir> <prompt tokens> <new tokens> <runs> [batch] [temperature] [--draft-model DIR] [--num-draft N] [--prompt-ids FILE]

`--draft-model` runs mlx-lm's `speculative_generate_step` (what `mlx_lm.generate --draft-model`
uses; batch 1 only, as mlx-lm has no batched speculative decoding). `--prompt-ids` reads the
prompt (a JSON list of token ids) instead of the pseudo-random one.

Batch 1 runs mlx-lm's `generate_step` (what `mlx_lm.generate` uses); a larger batch runs its
`BatchGenerator` with every prompt prefilled together (prefill and completion batch sizes set
to the batch). `decode_tps` counts the tokens of all sequences once every sequence is decoding.
"""
import json
import pathlib
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model


def prompt(length, vocab, row=0):
    x, out = 12345 + row, []
    for _ in range(length):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(100 + x % (vocab - 100))
    return out


def summarise(start, arrivals, prompt_tokens):
    first = min(t[0] for t in arrivals)
    all_started = max(t[0] for t in arrivals)
    end = max(t[-1] for t in arrivals)
    steady = sum(1 for t in arrivals for x in t if x > all_started)
    return first - start, prompt_tokens / (all_started - start), steady / (end - all_started)


def run_single(model, tokens, new_tokens, temperature, kv_bits=None):
    sampler = make_sampler(temp=temperature)
    start = time.perf_counter()
    times = []
    kv = {"kv_bits": kv_bits, "kv_group_size": 64} if kv_bits else {}
    for _token, _ in generate_step(mx.array(tokens, dtype=mx.uint32), model,
                                   max_tokens=new_tokens, sampler=sampler, **kv):
        times.append(time.perf_counter())
    return summarise(start, [times], len(tokens))


def run_speculative(model, draft, num_draft, tokens, new_tokens, temperature):
    sampler = make_sampler(temp=temperature)
    start = time.perf_counter()
    times = []
    for _token, _, _from_draft in speculative_generate_step(
            mx.array(tokens, dtype=mx.uint32), model, draft, num_draft_tokens=num_draft,
            max_tokens=new_tokens, sampler=sampler):
        times.append(time.perf_counter())
    return summarise(start, [times], len(tokens))


def option(name):
    if name not in sys.argv:
        return None
    i = sys.argv.index(name)
    value = sys.argv[i + 1]
    del sys.argv[i:i + 2]
    return value


def run_batch(model, prompts, new_tokens, temperature):
    gen = BatchGenerator(model, stop_tokens=[], sampler=make_sampler(temp=temperature),
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    start = time.perf_counter()
    uids = gen.insert(prompts, [new_tokens] * len(prompts))
    arrivals = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            arrivals[r.uid].append(now)
    gen.close()
    return summarise(start, list(arrivals.values()), sum(len(p) for p in prompts))


def main():
    draft_dir = option("--draft-model")
    num_draft = int(option("--num-draft") or 3)
    prompt_ids = option("--prompt-ids")
    kv_bits = option("--kv-bits")
    kv_bits = int(kv_bits) if kv_bits else None
    model_dir, length, new_tokens, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    temperature = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    model, config = load_model(pathlib.Path(model_dir))
    prompts = [prompt(length, config["vocab_size"], r) for r in range(batch)]
    if prompt_ids:
        prompts = [json.load(open(prompt_ids))] * batch
        length = len(prompts[0])
    draft = load_model(pathlib.Path(draft_dir))[0] if draft_dir else None
    if draft is not None and batch != 1:
        sys.exit("mlx-lm's speculative decoding runs batch 1 only")

    def once(n):
        if draft is not None:
            return run_speculative(model, draft, num_draft, prompts[0], n, temperature)
        if batch == 1:
            return run_single(model, prompts[0], n, temperature, kv_bits)
        if kv_bits:
            sys.exit("mlx-lm's BatchGenerator has no quantized KV cache")
        return run_batch(model, prompts, n, temperature)

    once(min(8, new_tokens))
    results = [once(new_tokens) for _ in range(runs)]
    ttft = statistics.median(r[0] for r in results)
    prefill = statistics.median(r[1] for r in results)
    decode = statistics.median(r[2] for r in results)
    extra = {"draft": draft_dir, "num_draft": num_draft} if draft_dir else {}
    if kv_bits:
        extra["kv_bits"] = kv_bits
    print(json.dumps({"impl": "mlx-lm", **extra, "batch": batch, "temperature": temperature,
                      "prompt_tokens": length, "new_tokens": new_tokens,
                      "ttft_s": round(ttft, 4), "prefill_tps": round(prefill, 1),
                      "decode_tps": round(decode, 2)}))


if __name__ == "__main__":
    main()
