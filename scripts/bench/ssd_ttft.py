#!/usr/bin/env python3
"""TTFT of a request with a long shared prefix after an engine restart: restored from the SSD
KV tier against prefilled.

    .venv/bin/python scripts/bench/ssd_ttft.py [runs] [prefix tokens] [model]

`model` is a name (default smollm2-135m) or a model directory. One `mlxd` serves the model
with `ssd_cache` on a fresh temporary directory. Per run, with a prefix of about `prefix
tokens` (default 2000) that no earlier run used:
- `prefilled`: the engine is unloaded and loaded again (a new process, nothing of the prefix
  on disk), and a streamed request of prefix + a question is timed to its first token;
- `restored`: the engine is unloaded (it spills) and loaded again, and a request of the same
  prefix + another question is timed the same way: its prefix comes from the SSD tier.
Both requests are the first of a freshly loaded engine, so both pay the same first-request
costs. `restart_ms` is the load time; `cached` the `cached_tokens` the engine reported.
Prints one JSON line per request and the medians. Uses `$MLXD_BIN_DIR` (default
target/release) for `mlxd` and `mlxd-engine`.
"""
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import events  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTENCE = "The station log records wind, tide and the ships that passed the harbour light. "


def request(port, method, path, body=None, timeout=3600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200, (path, resp.status, data)
    return json.loads(data) if data else None


def first_token(port, model, prompt):
    """Seconds to the first content chunk, and the usage's cached tokens."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, cached, prompt_tokens = None, 0, 0
    for msg in events(resp):
        assert "error" not in msg, msg
        if ttft is None and any(c.get("text") for c in msg.get("choices") or []):
            ttft = time.perf_counter() - start
        usage = msg.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            prompt_tokens = usage["prompt_tokens"]
    conn.close()
    return ttft, cached, prompt_tokens


def serve(bins, model, options):
    runtime = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = os.path.join(runtime, "mlxd.toml")
    opts = "".join(f'{k} = "{v}"\n' for k, v in options.items())
    model_id = os.path.basename(model.rstrip("/"))
    with open(cfg, "w") as f:
        f.write(f'[server]\nport = {port}\nengine_bin = "{os.path.join(bins, "mlxd-engine")}"\n'
                f'[server.engine_options]\n{opts}'
                + (f'[[model]]\nid = "{model_id}"\npath = "{model}"\n'
                   if os.path.isdir(model) else f'[[model]]\nid = "{model}"\n'))
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime, RUST_LOG="warn")
    proc = subprocess.Popen([os.path.join(bins, "mlxd"), "serve", "--config", cfg, "--port", str(port)],
                            env=env, stdin=subprocess.DEVNULL)
    for _ in range(400):
        try:
            http.client.HTTPConnection("127.0.0.1", port).request("GET", "/health")
            break
        except OSError:
            time.sleep(0.05)
    return proc, port, model_id


def restart(port, model_id):
    request(port, "POST", f"/admin/models/{model_id}/unload")
    t = time.perf_counter()
    request(port, "POST", f"/admin/models/{model_id}/load")
    return time.perf_counter() - t


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    prefix_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    model = sys.argv[3] if len(sys.argv) > 3 else "smollm2-135m"
    bins = os.environ.get("MLXD_BIN_DIR", os.path.join(ROOT, "target", "release"))
    ssd_dir = tempfile.mkdtemp()
    proc, port, model_id = serve(bins, model, {"ssd_cache": ssd_dir})
    results = []
    try:
        request(port, "POST", f"/admin/models/{model_id}/load")
        for run in range(runs):
            # About 17 tokens a sentence with SmolLM2's tokenizer; each run its own prefix.
            prefix = f"Log book {run}. " + SENTENCE * max(1, prefix_tokens // 17)
            for mode, question in (("prefilled", "what passed first?"), ("restored", "what passed next?")):
                load = restart(port, model_id)
                ttft, cached, prompt_tokens = first_token(port, model_id, prefix + "Question: " + question)
                r = {"mode": mode, "run": run, "ttft_ms": round(ttft * 1e3, 1),
                     "restart_ms": round(load * 1e3, 1), "cached": cached,
                     "prompt_tokens": prompt_tokens}
                print(json.dumps(r), flush=True)
                results.append(r)
        row = request(port, "GET", "/engines")["engines"][0]
        ssd = (row.get("stats") or {}).get("ssd")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(ssd_dir, ignore_errors=True)
    summary = {"runs": runs, "prefix_tokens": prefix_tokens, "model": model,
               "prompt_tokens": results[-1]["prompt_tokens"], "ssd": ssd}
    for mode in ("prefilled", "restored"):
        rs = [r for r in results if r["mode"] == mode]
        summary[f"{mode}_ttft_ms_median"] = statistics.median(r["ttft_ms"] for r in rs)
        summary[f"{mode}_restart_ms_median"] = statistics.median(r["restart_ms"] for r in rs)
        summary[f"{mode}_cached"] = rs[-1]["cached"]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
