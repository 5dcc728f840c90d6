#!/usr/bin/env python3
"""Serving benchmark: N concurrent streaming chat clients against an OpenAI-compatible
server, with the metrics of `vllm bench serve`.

    python3 scripts/bench/serve.py --url http://127.0.0.1:PORT|unix:/path/to.sock --streams 32 --max-tokens 128 \
        --temperature 0.7 [--model NAME[,NAME...]] [--label mlxd] [--out result.json] [--context-words N]

With several comma-separated model names, stream i asks for the (i mod n)-th: streams spread
evenly over the models (e.g. over several adapters of one base, `base:adapter`).

Every stream sends its own prompt (numbered, so no two are identical) with
`stream_options.include_usage`. Numbers of different widths make prompts one token apart, so
the rows sit at different positions in the engine's batch (its padded layout, as real prompts
do); `--same-length` writes every number with the same width (zero-padded), so that the rows
line up, to measure what the padded layout costs. Prints one JSON object:
- `output_tok_s`: completion tokens of all streams over the wall time of the run;
- `ttft_ms_p50`/`p99`: request sent to first content token;
- `itl_ms_p50`/`p99`: gaps between consecutive streamed tokens (a chunk holding k tokens
  counts as k equal gaps);
- `failures`: streams that errored, were reset, or returned fewer tokens than their usage says.
Completion tokens come from the final usage chunk; where a server sends none, from the number
of content chunks.
"""
import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import choice_tokens, connect, events  # noqa: E402


def pct(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def one_stream(url, model, index, width, max_tokens, temperature, context_words, result):
    # A long context: numbered words after the request's own number (so no two streams share
    # a prefix beyond the template's), then the question.
    context = "".join(f" note{j}" for j in range(context_words))
    body = {
        "messages": [{"role": "user", "content":
                      f"Request {index:0{width}d}:{context} write a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    start = time.perf_counter()
    times, usage, error = [], None, None
    try:
        conn = connect(url)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for msg in events(resp):
            if "error" in msg:
                raise RuntimeError(f"error event: {msg['error']}")
            if msg.get("usage"):
                usage = msg["usage"]
            now = time.perf_counter()
            for choice in msg.get("choices") or []:
                times.extend([now] * choice_tokens(choice))
        conn.close()
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        error = str(e)
    end = time.perf_counter()
    completion = usage["completion_tokens"] if usage else len(times)
    result[index] = dict(start=start, end=end, times=times, completion=completion, error=error)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("--same-length", action="store_true")
    ap.add_argument("--context-words", type=int, default=0,
                    help="numbered words before each stream's question: a long prompt")
    args = ap.parse_args()

    models = args.model.split(",") if args.model else [None]
    result = {}
    threads = [threading.Thread(target=one_stream,
                                args=(args.url, models[i % len(models)], i,
                                      len(str(args.streams - 1)) if args.same_length else 0,
                                      args.max_tokens,
                                      args.temperature, args.context_words, result))
               for i in range(args.streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    runs = [result[i] for i in range(args.streams)]
    failures = [r for r in runs if r["error"] is not None]
    ok = [r for r in runs if r["error"] is None]
    ttft = [(r["times"][0] - r["start"]) * 1000 for r in ok if r["times"]]
    itl = []
    for r in ok:
        t = r["times"]
        # Equal gaps inside a chunk of k tokens: spread the gap before it over its tokens.
        i = 0
        while i < len(t):
            j = i
            while j + 1 < len(t) and t[j + 1] == t[i]:
                j += 1
            if i > 0:
                gap = (t[i] - t[i - 1]) * 1000 / (j - i + 1)
                itl.extend([gap] * (j - i + 1))
            i = j + 1
    tokens = sum(r["completion"] for r in ok)
    out = {
        "label": args.label, "models": models if args.model else None, "streams": args.streams, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "same_length": args.same_length,
        "context_words": args.context_words,
        "output_tok_s": round(tokens / wall, 1),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "ttft_ms_p50": round(pct(ttft, 50), 1) if ttft else None,
        "ttft_ms_p99": round(pct(ttft, 99), 1) if ttft else None,
        "itl_ms_p50": round(pct(itl, 50), 2) if itl else None,
        "itl_ms_p99": round(pct(itl, 99), 2) if itl else None,
        "failures": len(failures),
        "failure_samples": [f["error"][:160] for f in failures[:3]],
    }
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
