#!/usr/bin/env python3
"""Out of GPU memory for real (issue 23): an engine driven past the device's free memory under
many long streams, beside a second model's engine that must not notice.

    python3 scripts/soak/gpu_oom.py --mlxd-bin DIR --model DIR --out result.json \
        [--free-gb 10] [--streams 64] [--prompt-words 4500] [--max-tokens 1000]

1. `mlxd` serves two engines of the same weights: `victim` (KV budget `--kv-budget-gib`,
   more than will be free) and `bystander` (a small budget), `limits_recovery_ms` 30 s.
2. A hog process (PyTorch) takes the GPU's free memory down to `--free-gb`.
3. The bystander gets a steady trickle of short requests; the victim gets `--streams` greedy
   streams with prompts of `--prompt-words` words, together needing more KV than is free.
4. What is recorded: `/engines` snapshots every second (the victim's `last_exit`, `restarts`,
   `limits`, and the GPU's free memory from `nvidia-smi`),
   every victim stream (tokens, finish, error, longest pause), every bystander request
   (status, latency) and the bystander engine's pid before and after; then the hog exits and
   the time until the victim's limits are back (`limits.reduced` false) is measured, and one
   more victim request must succeed.
The summary line says whether each claim held: the exit classified as out of memory, the
streams finished (resumed on the restarted engine), limits shrank then recovered, the
bystander undisturbed (same pid, no failed request). A SIGTERM (a `timeout` around the run)
still writes what was recorded to `--out`.
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import choice_tokens, engines, events, free_port, http_json  # noqa: E402

HOG = r"""
import json, sys, torch
target_free = float(sys.argv[1]) * 2**30
blocks = []
free, _ = torch.cuda.mem_get_info()
while free > target_free + 2**30:
    blocks.append(torch.empty(int(min(free - target_free, 8 * 2**30)), dtype=torch.uint8, device="cuda"))
    free, _ = torch.cuda.mem_get_info()
print(json.dumps({"hog_gib": round(sum(b.numel() for b in blocks) / 2**30, 2),
                  "free_gib": round(free / 2**30, 2)}), flush=True)
sys.stdin.read()
"""


def engine(url, model):
    return next((e for e in engines(url) if e.get("model") == model), None)


def gpu_free_gib():
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return round(int(out.stdout.split()[0]) / 1024, 2) if out.returncode == 0 else None


def victim_stream(port, i, words, max_tokens, out):
    text = " ".join(f"w{(i * 7919 + k) % 5000}" for k in range(words))
    body = {"model": "victim", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Stream {i}. {text}"}]}
    t0 = time.perf_counter()
    times, finish, error = [], None, None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for ev in events(r):
            if "error" in ev:
                raise RuntimeError(f"error event: {json.dumps(ev['error'])[:300]}")
            now = time.perf_counter()
            for ch in ev.get("choices") or []:
                times.extend([now] * choice_tokens(ch))
                finish = ch.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001 - counted and reported
        error = str(e)
    gaps = [b - a for a, b in zip(times, times[1:])]
    out[i] = dict(tokens=len(times), finish=finish, error=error,
                  ttft_s=round(times[0] - t0, 3) if times else None,
                  longest_pause_s=round(max(gaps), 3) if gaps else None,
                  total_s=round(time.perf_counter() - t0, 2))


def bystander_loop(url, stop, log):
    i = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            status, body, _ = http_json(url, "POST", "/v1/chat/completions", {
                "model": "bystander", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": f"Bystander request {i}."}]}, timeout=120)
            err = None if status == 200 else str(body)[:200]
        except Exception as e:  # noqa: BLE001
            status, err = None, str(e)
        log.append(dict(i=i, status=status, s=round(time.perf_counter() - t0, 3), error=err))
        i += 1
        stop.wait(0.5)


def summarize(result):
    """Whether each claim held, from what `result` recorded (all of it, or up to a cut)."""
    streams = result.get("streams", {})
    snapshots = result.get("snapshots", [])
    bys_log = result.get("bystander_requests", [])
    ok = [s for s in streams.values() if s["error"] is None]
    exits = {s["last_exit"] for s in snapshots if s["last_exit"]}
    reduced = [s for s in snapshots if s["limits"]["reduced"]]
    before = result.get("before", {}).get("bystander", {}).get("pid")
    after = (result.get("bystander_final") or {}).get("pid")
    return dict(
        victim_restarts=max([s["restarts"] for s in snapshots]
                            + [(result.get("victim_final") or {}).get("restarts") or 0]),
        exit_codes_seen=sorted(exits),
        oom_classified="out_of_memory" in exits,
        limits_shrank=bool(reduced),
        reduced_kv_budget_gib=round(min(s["limits"]["kv_budget_bytes"] for s in reduced) / 2**30, 2) if reduced else None,
        limits_recovered_after_s=result.get("limits_recovered_after_s"),
        streams_ok=len(ok), streams_failed=len(streams) - len(ok),
        streams_still_running=result["settings"]["streams"] - len(streams),
        stream_failures=[s["error"][:200] for s in streams.values() if s["error"]][:3],
        tokens=sum(s["tokens"] for s in ok),
        longest_pause_s=max((s["longest_pause_s"] or 0) for s in ok) if ok else None,
        bystander_requests=len(bys_log),
        bystander_failed=sum(1 for r in bys_log if r["status"] != 200),
        bystander_p99_s=sorted(r["s"] for r in bys_log)[int(0.99 * (len(bys_log) - 1))] if bys_log else None,
        bystander_restarts=max((s.get("bystander_restarts") or 0 for s in snapshots), default=0),
        bystander_same_pid=(before == after) if after else None,
        victim_request_after=result.get("victim_request_after"),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mlxd-bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    # 0: no hog (a dry run of the machinery, e.g. on a CPU).
    ap.add_argument("--free-gb", type=float, default=10)
    ap.add_argument("--kv-budget-gib", type=int, default=16)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=4500)
    ap.add_argument("--max-tokens", type=int, default=1000)
    # The victim's step watch: a GPU that crawls instead of failing an allocation (CUDA pages
    # managed buffers out under pressure) ends as a `stalled` exit within the run.
    ap.add_argument("--step-timeout-s", type=int, default=60)
    # Streams still running after this many seconds are left running (counted as such) while
    # the hog goes and the limits' recovery is timed, so a bounded run still shows every phase.
    ap.add_argument("--streams-deadline-s", type=float, default=0,
                    help="0: wait for every stream")
    args = ap.parse_args()
    # A `timeout` around the run (the first H100 run stalled) still gets the partial result.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = tempfile.mkdtemp(prefix="gpu-oom-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = os.path.join(work, "mlxd.toml")
    with open(cfg, "w") as f:
        f.write(f"""[server]
port = {port}
limits_recovery_ms = 30000

[pool]
max_engines = 2
memory_budget = "130GiB"

[[model]]
id = "victim"
path = "{os.path.abspath(args.model)}"
pinned = true
kv_budget_bytes = {args.kv_budget_gib * 2**30}
max_batch_size = {args.streams}
context_length = 32768
options = {{ step_timeout = "{args.step_timeout_s}" }}

[[model]]
id = "bystander"
path = "{os.path.abspath(args.model)}"
pinned = true
kv_budget_bytes = {2 * 2**30}
max_batch_size = 4
""")
    log_path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_oom_mlxd.log")
    env = dict(os.environ, XDG_RUNTIME_DIR=work, MLXD_HOME=os.path.join(work, "home"), RUST_LOG="info")
    mlxd = subprocess.Popen([f"{args.mlxd_bin}/mlxd", "serve", "--config", cfg],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    result = {"settings": vars(args)}
    hog = None
    # Set before mlxd is stopped, however the run ends: the bystander's requests after that
    # would count as its failures (a cut-short run of 2026-12-05 logged 41 refused connections).
    stop = threading.Event()
    bys = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                v, b = engine(url, "victim"), engine(url, "bystander")
                if v and b and v["state"] == "ready" and b["state"] == "ready":
                    break
            except (OSError, RuntimeError):
                pass
            time.sleep(1)
        else:
            raise SystemExit("the two engines did not become ready")
        for m in ("victim", "bystander"):
            status, body, _ = http_json(url, "POST", "/v1/chat/completions", {
                "model": m, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200, (m, status, body)
        result["before"] = {"victim": engine(url, "victim"), "bystander": engine(url, "bystander"),
                            "gpu_free_gib": gpu_free_gib()}
        if args.free_gb > 0:
            hog = subprocess.Popen([sys.executable, "-c", HOG, str(args.free_gb)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            result["hog"] = json.loads(hog.stdout.readline())
        bys_log = result["bystander_requests"] = []
        bys = threading.Thread(target=bystander_loop, args=(url, stop, bys_log), daemon=True)
        bys.start()
        streams = result["streams"] = {}
        threads = [threading.Thread(target=victim_stream,
                                    args=(port, i, args.prompt_words, args.max_tokens, streams),
                                    daemon=True)
                   for i in range(args.streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        snapshots = result["snapshots"] = []
        while any(t.is_alive() for t in threads):
            if args.streams_deadline_s and time.perf_counter() - t0 > args.streams_deadline_s:
                break
            v, b = engine(url, "victim"), engine(url, "bystander")
            snapshots.append(dict(t=round(time.perf_counter() - t0, 1), state=v["state"], pid=v["pid"],
                                  restarts=v["restarts"], limits=v["limits"],
                                  last_exit=(v.get("last_exit") or {}).get("code"),
                                  active=(v.get("stats") or {}).get("active"),
                                  kv_bytes=(v.get("stats") or {}).get("kv_bytes"),
                                  mlx_active_gib=round(((v.get("stats") or {}).get("memory") or {})
                                                       .get("mlx_active_bytes", 0) / 2**30, 2),
                                  gpu_free_gib=gpu_free_gib(),
                                  bystander_restarts=b["restarts"],
                                  bystander_last_exit=(b.get("last_exit") or {}).get("code")))
            time.sleep(1)
        result["streams_s"] = round(time.perf_counter() - t0, 1)
        result["victim_after_streams"] = engine(url, "victim")
        # The hog goes; the configured limits must come back after limits_recovery_ms.
        if hog:
            hog.stdin.close()
            hog.wait(timeout=60)
            hog = None
        t1 = time.perf_counter()
        recovered = None
        while time.perf_counter() - t1 < 180:
            v = engine(url, "victim")
            if not v["limits"]["reduced"]:
                recovered = round(time.perf_counter() - t1, 1)
                break
            time.sleep(1)
        result["limits_recovered_after_s"] = recovered
        status, body, _ = http_json(url, "POST", "/v1/chat/completions", {
            "model": "victim", "max_tokens": 8, "messages": [{"role": "user", "content": "after"}]})
        result["victim_request_after"] = status
        stop.set()
        bys.join()
        result["victim_final"] = engine(url, "victim")
        result["bystander_final"] = engine(url, "bystander")
        result["summary"] = summarize(result)
        print(json.dumps(result["summary"]), flush=True)
    finally:
        stop.set()
        if bys:
            bys.join(timeout=130)
        if hog:
            hog.kill()
        # Victim streams still open now end with the shutdown's error: a cut-short run's
        # summary says so (`complete: false`), and those errors are the harness's.
        mlxd.terminate()
        try:
            mlxd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            mlxd.kill()
        if "summary" not in result:
            # Cut short (a `timeout`, an error): what was recorded so far.
            result["summary"] = dict(summarize(result), complete=False)
            print(json.dumps(result["summary"]), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
