#!/usr/bin/env python3
"""Accelerated memory soak (issue 23, finding 10): hours of mixed traffic compressed into
minutes, with faults, while the resident memory of `mlxd` and of its engine is sampled.

    python3 scripts/soak/memory.py [--warmup 240] [--seconds 480] [--clients 4] \
        [--prompt-cache-mib 32]

Traffic, from `--clients` threads each picking at random (seeded) among
- a short chat, streaming or not (a distinct prompt each, so the prefix cache keeps storing);
- a long prompt (~250 tokens; prefill on two CPU cores is slow), streaming;
- a cancelled stream: the client hangs up after the first token;
- a rejected huge prompt: ~200 KB of text, more tokens than the context (400 from the engine);
and, beside them,
- every `--big-body-every` s one 30 MB body (read, parsed, refused by the engine) and one
  body announced above `max_body_bytes` (413 at once, never read);
- every `--slow-every` s a burst of `--slow-burst` connections that send a request header one
  byte a second for `--slow-hold` s, then hang up;
- one `kill -9` of the engine at the middle of the measured phase (the supervisor restarts
  it, and the traffic goes on against the new process).

Phases: `--warmup` s of the same traffic (caches fill to their budgets, allocators reach
their working set), then `--seconds` s measured. Every `--sample-every` s: VmRSS of mlxd and
of the engine, and the engine's own memory figures from `GET /engines` (`stats.memory`,
where the engine reports them). The prefix cache is given `--prompt-cache-mib` so that it
reaches its budget within the warm-up: a larger budget only moves the plateau up.

The reference levels are the medians of the samples in the last `--level-window` s of the
warm-up; the end levels the medians of the last `--level-window` s of the run (the
restarted engine's for the engine). Pass (one JSON line on stdout, exit 1 on failure):
- mlxd at the end within 10 % of its reference;
- the engine just before the kill, and the restarted engine at the end, within 10 % of the
  engine's reference;
- mlxd alive, the engine restarted once, no connection error or truncated stream among the
  requests that were not deliberately cut, and a one-token chat after the run succeeds.
"""
import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from sse_client import connect, events  # noqa: E402

WORDS = ("harbour lantern tide granite beacon keeper storm gull rope signal fog shore "
         "reef compass anchor wave chart mast").split()


def text(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat_body(content, max_tokens, stream, model):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.7, "stream": stream}
    if model:
        body["model"] = model
    return json.dumps(body).encode()


def post(url, body, timeout, stream, cancel_after_first=False):
    """One POST to /v1/chat/completions; returns an outcome string."""
    conn = connect(url, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body,
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            try:
                json.loads(raw)["error"]["message"]
                return f"http_{resp.status}"
            except (ValueError, KeyError, TypeError):
                return f"bad_http_{resp.status}"
        if not stream:
            data = json.loads(resp.read())
            return "done" if data.get("choices") else "bad_body"
        for msg in events(resp):
            if "error" in msg:
                return "error_event"
            if cancel_after_first and msg.get("choices"):
                return "cancelled"
        return "done"
    except socket.timeout:
        return "hang"
    except (OSError, http.client.HTTPException, ValueError) as e:
        return f"conn_error:{type(e).__name__}"
    finally:
        conn.close()


def big_body(url, size, timeout=120):
    """A chat whose one message is `size` bytes; returns the status (or an error name)."""
    filler = b"x" * (size - 100)
    body = b'{"messages":[{"role":"user","content":"' + filler + b'"}],"max_tokens":1}'
    conn = connect(url, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body,
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        conn.close()


def announced_too_large(url, size):
    """Announces `size` bytes, sends none: the answer must come at once (413)."""
    u = urllib.parse.urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + u.netloc.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " +
                  str(size).encode() + b"\r\n\r\n")
        try:
            head = s.recv(64)
        except socket.timeout:
            return "no answer in 10 s"
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else repr(head[:40])


def slow_burst(url, n, hold, stop):
    """`n` connections each sending a request header a byte a second for `hold` s."""
    u = urllib.parse.urlparse(url)
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection((u.hostname, u.port), timeout=5)
            s.setblocking(False)
            socks.append(s)
        except OSError:
            break
    header = b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + u.netloc.encode() + b"\r\n"
    end = time.time() + hold
    i = 0
    while time.time() < end and not stop.is_set():
        for s in socks:
            try:
                s.send(header[i % len(header):i % len(header) + 1])
            except OSError:
                pass
        i += 1
        stop.wait(1.0)
    for s in socks:
        s.close()
    return len(socks)


def engine_row(url):
    try:
        rows = common.engines(url)
    except (OSError, RuntimeError, http.client.HTTPException, ValueError):
        return None
    return rows[0] if rows else None


def median_in(samples, key, t_from, t_to, pid=None):
    vals = [s[key] for s in samples
            if t_from <= s["t"] <= t_to and s.get(key) is not None
            and (pid is None or s.get("engine_pid") == pid)]
    return round(statistics.median(vals), 1) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=240)
    ap.add_argument("--seconds", type=float, default=480)
    ap.add_argument("--level-window", type=float, default=60)
    ap.add_argument("--sample-every", type=float, default=2)
    ap.add_argument("--prompt-cache-mib", type=float, default=32)
    ap.add_argument("--big-body-every", type=float, default=45)
    ap.add_argument("--slow-every", type=float, default=60)
    ap.add_argument("--slow-burst", type=int, default=300)
    ap.add_argument("--slow-hold", type=float, default=10)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--request-timeout", type=float, default=300)
    args = ap.parse_args()
    common.raise_nofile()
    if args.config_toml is None:
        gib = args.prompt_cache_mib / 1024
        args.config_toml = (f"[server]\\ncrash_limit = 100\\n"
                            f"[server.engine_options]\\nprompt_cache = \"{gib}\"\\n")

    m = common.Mlxd(args)
    summary = {"scenario": "memory", "url": m.url, "clients": args.clients,
               "warmup_s": args.warmup, "seconds": args.seconds,
               "prompt_cache_mib": args.prompt_cache_mib, "seed": args.seed}
    stop = threading.Event()
    lock = threading.Lock()
    outcomes = collections.Counter()
    by_kind = collections.defaultdict(collections.Counter)
    side = {"big_body": collections.Counter(), "announced_too_large": collections.Counter(),
            "slow_connections": 0}
    samples, kills = [], []
    try:
        summary["warmup_chat"] = m.warm(args.model)
        t0 = time.time()
        total = args.warmup + args.seconds
        kill_at = args.warmup + args.seconds / 2

        def client(k):
            rng = random.Random(args.seed * 1000 + k)
            i = 0
            while time.time() - t0 < total:
                i += 1
                kind = rng.choices(["short", "short_stream", "long", "cancel", "huge"],
                                   [3, 3, 1, 1, 1])[0]
                tag = f"client {k} request {i}: "
                if kind == "short":
                    o = post(m.url, chat_body(tag + text(rng, 12), args.max_tokens, False,
                                              args.model), args.request_timeout, False)
                elif kind == "short_stream":
                    o = post(m.url, chat_body(tag + text(rng, 12), args.max_tokens, True,
                                              args.model), args.request_timeout, True)
                elif kind == "long":
                    o = post(m.url, chat_body(tag + text(rng, 200), args.max_tokens, True,
                                              args.model), args.request_timeout, True)
                elif kind == "cancel":
                    o = post(m.url, chat_body(tag + text(rng, 40), 64, True, args.model),
                             args.request_timeout, True, cancel_after_first=True)
                else:
                    # ~200 KB: far more tokens than the context; the engine refuses it.
                    o = post(m.url, chat_body(tag + text(rng, 30000), 1, False, args.model),
                             args.request_timeout, False)
                with lock:
                    outcomes[o] += 1
                    by_kind[kind][o] += 1
                if o.startswith(("conn_error", "hang", "bad_")):
                    time.sleep(1)

        def side_traffic():
            next_big, next_slow = 20.0, 30.0
            while not stop.is_set() and time.time() - t0 < total:
                now = time.time() - t0
                if now >= next_big:
                    next_big += args.big_body_every
                    s = big_body(m.url, 30_000_000)
                    a = announced_too_large(m.url, 1 << 30)
                    with lock:
                        side["big_body"][str(s)] += 1
                        side["announced_too_large"][str(a)] += 1
                if now >= next_slow:
                    next_slow += args.slow_every
                    n = slow_burst(m.url, args.slow_burst, args.slow_hold, stop)
                    with lock:
                        side["slow_connections"] += n
                stop.wait(1.0)

        def sampler():
            while not stop.is_set():
                t = round(time.time() - t0, 1)
                row = engine_row(m.url)
                pid = row.get("pid") if row else None
                mx = common.proc_sample(m.pid)
                en = common.proc_sample(pid) if pid else None
                mem = ((row or {}).get("stats") or {}).get("memory")
                s = {"t": t, "mlxd_mib": mx and round(mx["rss_kib"] / 1024, 1),
                     "engine_pid": pid, "engine_mib": en and round(en["rss_kib"] / 1024, 1),
                     "kv_mib": ((row or {}).get("stats") or {}).get("kv_bytes")}
                if s["kv_mib"] is not None:
                    s["kv_mib"] = round(s["kv_mib"] / 2**20, 1)
                if mem:
                    s["memory"] = {k: round(v / 2**20, 1) for k, v in mem.items()
                                   if isinstance(v, int)}
                with lock:
                    samples.append(s)
                if not kills and t >= kill_at and pid:
                    os.kill(pid, signal.SIGKILL)
                    kills.append({"at": t, "pid": pid})
                stop.wait(args.sample_every)

        threads = [threading.Thread(target=client, args=(k,), daemon=True)
                   for k in range(args.clients)]
        threads += [threading.Thread(target=side_traffic, daemon=True),
                    threading.Thread(target=sampler, daemon=True)]
        for th in threads:
            th.start()
        for th in threads[:-1]:
            th.join()
        stop.set()
        threads[-1].join()
        summary["wall_s"] = round(time.time() - t0, 1)

        w = args.level_window
        ref_to = args.warmup
        first_pid = next((s["engine_pid"] for s in samples if s["engine_pid"]), None)
        last_pid = next((s["engine_pid"] for s in reversed(samples) if s["engine_pid"]), None)
        kill_t = kills[0]["at"] if kills else total
        levels = {
            "mlxd_warm": median_in(samples, "mlxd_mib", ref_to - w, ref_to),
            "mlxd_end": median_in(samples, "mlxd_mib", total - w, total),
            "engine_warm": median_in(samples, "engine_mib", ref_to - w, ref_to, first_pid),
            "engine_before_kill": median_in(samples, "engine_mib", kill_t - w, kill_t,
                                            first_pid),
            "engine_end": median_in(samples, "engine_mib", total - w, total, last_pid),
        }
        summary["levels_mib"] = levels

        def within(value, ref):
            return value is not None and ref is not None and value <= ref * 1.10

        after = common.one_token_chat(m.url, args.model)
        summary["chat_after"] = after
        summary["engines_after"] = common.engine_summary(m.url)
        summary["kills"] = kills
        summary["outcomes"] = dict(outcomes)
        summary["by_kind"] = {k: dict(v) for k, v in by_kind.items()}
        summary["side"] = {k: dict(v) if isinstance(v, collections.Counter) else v
                           for k, v in side.items()}
        # A crash may cut a request (the kill): those are the only failures allowed, and
        # only as clear errors (an HTTP error with a JSON body, or an SSE error event).
        unclear = {k: v for k, v in outcomes.items()
                   if k.startswith(("conn_error", "hang", "bad_"))}
        checks = {
            "mlxd_within_10pct": within(levels["mlxd_end"], levels["mlxd_warm"]),
            "engine_before_kill_within_10pct": within(levels["engine_before_kill"],
                                                      levels["engine_warm"]),
            "engine_end_within_10pct": within(levels["engine_end"], levels["engine_warm"]),
            "engine_restarted_once": len(kills) == 1 and last_pid not in (None, first_pid),
            "no_unclear_failures": not unclear,
            "mlxd_alive": m.alive(),
            "chat_after": after["ok"],
        }
        summary["checks"] = checks
        summary["series"] = samples
        ok = all(checks.values())
    finally:
        stop.set()
        summary["mlxd_exit"] = m.stop()
    return common.emit(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
