#!/usr/bin/env python3
"""Proxy overhead with the real engine: streaming requests alternately straight to the
engine's unix socket and through mlxd (TCP), in one run, on the same engine process.

    .venv/bin/python scripts/bench/proxy_real_engine.py [requests per path] [max tokens] [model]

Prints, per path, time to first token p50/p99 and median decode tok/s, then the ratios
proxy / direct, and mlxd's resident memory. Uses target/release binaries (build them with
`cargo build --release`).
"""
import glob
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import UnixConnection, choice_tokens, events  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stream(conn, max_tokens):
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me about the sea."}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first, tokens = None, 0
    for msg in events(resp):
        for choice in msg.get("choices") or []:
            n = choice_tokens(choice)
            tokens += n
            if n and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return first - start, (tokens - 1) / (end - first)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    model = sys.argv[3] if len(sys.argv) > 3 else "smollm2-135m"
    bins = os.environ.get("MLXD_BIN_DIR", os.path.join(ROOT, "target", "release"))
    runtime = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime, RUST_LOG="warn")
    mlxd = subprocess.Popen([os.path.join(bins, "mlxd"), "serve", "--model", model, "--port", str(port)],
                            env=env, stdin=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                http.client.HTTPConnection("127.0.0.1", port).request("GET", "/health")
                break
            except OSError:
                time.sleep(0.05)
        idle_rss = [l for l in open(f"/proc/{mlxd.pid}/status") if l.startswith("VmRSS")][0].split()[1]
        stream(http.client.HTTPConnection("127.0.0.1", port), 4)  # starts and warms the engine
        sock = glob.glob(os.path.join(runtime, "mlxd-*", "*.sock"))[0]
        results = {"direct": [], "proxy": []}
        for _ in range(n):
            results["direct"].append(stream(UnixConnection(sock), max_tokens))
            results["proxy"].append(stream(http.client.HTTPConnection("127.0.0.1", port), max_tokens))
        out = {}
        for path, rs in results.items():
            ttft = [r[0] for r in rs]
            out[path] = {"ttft_p50_ms": round(pct(ttft, 50) * 1e3, 2), "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 2),
                         "decode_tps": round(statistics.median(r[1] for r in rs), 3)}
            print(json.dumps({"path": path, **out[path]}))
        print(json.dumps({
            "added_ttft_p50_ms": round(out["proxy"]["ttft_p50_ms"] - out["direct"]["ttft_p50_ms"], 2),
            "ratio_decode_tps": round(out["proxy"]["decode_tps"] / out["direct"]["decode_tps"], 4),
            "mlxd_idle_rss_kib": int(idle_rss),
        }))
    finally:
        mlxd.terminate()
        mlxd.wait()


if __name__ == "__main__":
    main()
