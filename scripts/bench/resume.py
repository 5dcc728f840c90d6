#!/usr/bin/env python3
"""A resumed stream's pause against the engine's restart time.

    .venv/bin/python scripts/bench/resume.py [runs] [max tokens] [kill after] [model] [streams] [checkpoint] [standby]

`model` is a name (default smollm2-135m) or a model directory.

Per run: `streams` greedy streams through mlxd; once the first has received `kill after`
content chunks, the engine is killed with SIGKILL; mlxd restarts it and continues every
stream on the new engine (transparent resumption). Measured per run:
- restart: from the kill to the new engine's `ready` in `/engines` (polled every 5 ms);
- pause: the longest gap between two content chunks of the first stream (the one across
  the kill);
- extra: pause minus restart, what resuming costs on top of the restart (re-queueing,
  the continuation's prefill of prompt + tokens already sent, the first new token);
- ttft: for comparison, the time to first token of the same request uninterrupted on the
  warm engine just before (the continuation is such a request, `kill after` tokens longer).
With `checkpoint` N > 0 the engine runs with the SSD KV tier on a temporary directory and
`generation_checkpoint = N` (and its prefix cache on): the continuation restores the KV of the
last checkpoint instead of prefilling everything, and each run's prompts carry the run's
number so that no earlier run's finished entry matches them. With `standby` 1 the model keeps a
standby engine (`standby = true`): each run waits for the spare to be ready before it starts,
the kill hands the streams to the spare (restart is then the spare's takeover), and a new spare
loads behind it. `RESUME_ENGINE_OPTIONS` adds engine options (TOML lines, `;` between
them). Prints one JSON line per run and
the medians. Uses `$MLXD_BIN_DIR` (default
target/release) for `mlxd` and `mlxd-engine`.
"""
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import choice_tokens, events  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["Tell me about the sea.", "Describe a forest.", "Explain rain.", "Name some birds.",
           "Write about the moon.", "Talk about mountains.", "Describe a city.", "Explain wind."]


def engine_row(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/engines")
    row = json.loads(conn.getresponse().read())["engines"][0]
    conn.close()
    return row


def stream(port, prompt, max_tokens, arrivals, on_chunk=None):
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    for msg in events(resp):
        assert "error" not in msg, msg
        for choice in msg.get("choices") or []:
            if choice_tokens(choice):
                arrivals.append(time.perf_counter())
                if on_chunk:
                    on_chunk(len(arrivals))
    conn.close()


def ttft(port, prompt):
    arrivals = []
    start = time.perf_counter()
    stream(port, prompt, 1, arrivals)
    return arrivals[0] - start


def one_run(port, max_tokens, kill_after, n_streams, tag="", standby=False):
    prompts = [p + tag for p in PROMPTS]
    fresh = ttft(port, prompts[0])
    old = engine_row(port)
    while standby and (old.get("standby") or {}).get("state") != "ready":
        time.sleep(0.05)
        old = engine_row(port)
    killed = {}

    def maybe_kill(n):
        if n == kill_after and "at" not in killed:
            killed["at"] = time.perf_counter()
            os.kill(old["pid"], signal.SIGKILL)

    arrivals = [[] for _ in range(n_streams)]
    threads = [threading.Thread(target=stream, args=(port, prompts[i % len(prompts)], max_tokens,
                                                     arrivals[i], maybe_kill if i == 0 else None))
               for i in range(n_streams)]
    for t in threads:
        t.start()
    ready_at = None
    while ready_at is None:
        if "at" in killed:
            row = engine_row(port)
            if row["state"] == "ready" and row["pid"] != old["pid"]:
                ready_at = time.perf_counter()
                break
        time.sleep(0.005)
    for t in threads:
        t.join()
    a = arrivals[0]
    gaps = [b - x for x, b in zip(a, a[1:])]
    pause = max(gaps)
    restart = ready_at - killed["at"]
    return {"restart_ms": round(restart * 1e3, 1), "pause_ms": round(pause * 1e3, 1),
            "extra_ms": round((pause - restart) * 1e3, 1),
            "ttft_ms": round(fresh * 1e3, 1),
            "median_gap_ms": round(statistics.median(gaps) * 1e3, 1), "chunks": len(a)}


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    kill_after = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    model = sys.argv[4] if len(sys.argv) > 4 else "smollm2-135m"
    n_streams = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    checkpoint = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    standby = len(sys.argv) > 7 and sys.argv[7] == "1"
    bins = os.environ.get("MLXD_BIN_DIR", os.path.join(ROOT, "target", "release"))
    runtime = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # RESUME_RUST_LOG: mlxd's (and its engines') log filter, e.g. `warn,mlxd_engine::step=trace`
    # for the spare's passes after a takeover (the log goes to stderr).
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime, RUST_LOG=os.environ.get("RESUME_RUST_LOG", "warn"))
    # Without checkpoints the prefix cache is off: each continuation prefills its prompt and
    # the tokens already sent, the cost a restarted engine pays without a restored KV.
    engine_options = 'prompt_cache = "0"\n'
    if checkpoint > 0:
        engine_options = (f'ssd_cache = "{os.path.join(runtime, "ssd")}"\n'
                          f'generation_checkpoint = "{checkpoint}"\n')
    # More engine options, as TOML lines (e.g. `prefill_pad_to = "64"`).
    engine_options += os.environ.get("RESUME_ENGINE_OPTIONS", "").replace(";", "\n") + "\n"

    cfg = os.path.join(runtime, "mlxd.toml")
    with open(cfg, "w") as f:
        f.write(f'[server]\nport = {port}\nengine_bin = "{os.path.join(bins, "mlxd-engine")}"\n'
                f'backoff_initial_ms = 50\ncrash_limit = 1000\n[server.engine_options]\n{engine_options}'
                + (f'[[model]]\nid = "{os.path.basename(model.rstrip("/"))}"\npath = "{model}"\n'
                   if os.path.isdir(model) else f'[[model]]\nid = "{model}"\n')
                + ("standby = true\n" if standby else ""))
    mlxd = subprocess.Popen([os.path.join(bins, "mlxd"), "serve", "--config", cfg, "--port", str(port)],
                            env=env, stdin=subprocess.DEVNULL)
    try:
        for _ in range(400):
            try:
                http.client.HTTPConnection("127.0.0.1", port).request("GET", "/health")
                break
            except OSError:
                time.sleep(0.05)
        stream(port, PROMPTS[0], 4, [])  # starts and warms the engine
        results = []
        for run in range(runs):
            tag = f" (take {run})" if checkpoint > 0 else ""
            r = one_run(port, max_tokens, kill_after, n_streams, tag, standby)
            print(json.dumps(r), flush=True)
            results.append(r)
            time.sleep(1)  # let the crash window see a stable engine
        print(json.dumps({k + "_median": statistics.median(r[k] for r in results)
                          for k in ("restart_ms", "pause_ms", "extra_ms", "ttft_ms", "median_gap_ms")}
                         | {"runs": runs, "max_tokens": max_tokens, "kill_after": kill_after,
                            "streams": n_streams, "model": model, "checkpoint": checkpoint,
                            "standby": standby}
                         | ({"ssd": (engine_row(port).get("stats") or {}).get("ssd")}
                            if checkpoint > 0 else {})))
    finally:
        mlxd.terminate()
        mlxd.wait()


if __name__ == "__main__":
    main()
