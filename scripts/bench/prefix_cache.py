#!/usr/bin/env python3
"""Prefix-cache benchmark: time to first token of a chat's second turn after a long first turn
(the server has the history's KV), against the same second turn over a history it has never
seen (it must prefill everything).

    python3 scripts/bench/prefix_cache.py --url http://127.0.0.1:PORT [--history-words 1500] [--runs 3]

Prints one JSON object: median TTFT of hits and misses, their ratio, and the prompt and
cached token counts the server reported.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import choice_tokens, connect, events  # noqa: E402

WORDS = ("river stone lantern harbour meadow copper violet engine whisper orchard canyon "
         "glacier ember falcon market ribbon quartz thunder willow saddle").split()


def history(seed, words):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(url, messages, max_tokens):
    conn = connect(url, timeout=600)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first, text, usage = None, "", None
    for msg in events(resp):
        if msg.get("usage"):
            usage = msg["usage"]
        for c in msg.get("choices") or []:
            if first is None and choice_tokens(c):
                first = time.perf_counter()
            text += (c.get("delta") or {}).get("content") or ""
    conn.close()
    return first - start, text, usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--history-words", type=int, default=1500)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hits, misses, last = [], [], {}
    for run in range(args.runs + 1):
        turn1 = [{"role": "user", "content": "Summarise this: " + history(2 * run, args.history_words)}]
        _, answer, _ = chat(args.url, turn1, 16)
        turn2 = turn1 + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "Now in one sentence."}]
        hit, _, hit_usage = chat(args.url, turn2, 8)
        cold = [{"role": "user", "content": "Summarise this: " + history(2 * run + 1, args.history_words)},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Now in one sentence."}]
        miss, _, miss_usage = chat(args.url, cold, 8)
        if run == 0:
            continue  # warm-up
        hits.append(hit)
        misses.append(miss)
        last = {"hit_usage": hit_usage, "miss_usage": miss_usage}
    h, m = statistics.median(hits), statistics.median(misses)
    out = {"ttft_hit_ms": round(h * 1000, 1), "ttft_miss_ms": round(m * 1000, 1),
           "ratio_hit_over_miss": round(h / m, 3), **last}
    print(json.dumps(out), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
