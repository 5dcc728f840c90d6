#!/usr/bin/env python3
"""Soak scenario 4 of the hardening issue: N stalled clients (half a request header, or a
whole header and half the body, then nothing) held open while other clients are served.

    python3 scripts/soak/stall.py [--url http://127.0.0.1:PORT] [--stalled 1000] [--seconds 60]

First `--baseline-seconds` of probes without stalled clients, then the stalled connections
are opened (half of each kind) and kept at N for `--seconds`: one the server closes (header
timeout) or answers (408 on the body timeout) is counted and replaced at once. Meanwhile
two probes run back to back, each on a fresh connection: `GET /health` (every 0.25 s) and a
one-token chat. mlxd's fds are sampled every 5 s.

Pass (one JSON line, exit 1 on failure): every probe succeeds, `/health` p99 under stall
below `--max-health-ms` (1000), mlxd alive, and its fd count back within +8 of the
baseline after the stalled clients have gone.
"""
import argparse
import collections
import os
import select
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def half_request(kind, host):
    if kind == "header":
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                "Content-Type: application/json\r\nContent-Le").encode()
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() \
        + body[:len(body) // 2]


def probe(url, what, timeout):
    t = time.perf_counter()
    try:
        if what == "health":
            status, data, _ = common.http_json(url, "GET", "/health", timeout=timeout)
            ok = status == 200
        else:
            r = common.one_token_chat(url, None, timeout=timeout)
            status, ok = r["status"], r["ok"]
        err = None if ok else f"HTTP {status}"
    except Exception as e:  # noqa: BLE001
        ok, err = False, f"{type(e).__name__}: {e}"[:120]
    return ok, (time.perf_counter() - t) * 1000, err


class Prober(threading.Thread):
    def __init__(self, url, what, pause, timeout):
        super().__init__(daemon=True)
        self.url, self.what, self.pause, self.timeout = url, what, pause, timeout
        self.rows, self.phase, self.stop_ev = [], "baseline", threading.Event()

    def run(self):
        while not self.stop_ev.is_set():
            ok, ms, err = probe(self.url, self.what, self.timeout)
            self.rows.append((self.phase, ok, ms, err))
            self.stop_ev.wait(self.pause)

    def stats(self, phase):
        rows = [r for r in self.rows if r[0] == phase]
        ms = [r[2] for r in rows if r[1]]
        errs = collections.Counter(r[3] for r in rows if not r[1])
        return {"n": len(rows), "errors": sum(errs.values()), "error_kinds": dict(errs),
                "p50_ms": round(common.pct(ms, 50), 1) if ms else None,
                "p99_ms": round(common.pct(ms, 99), 1) if ms else None,
                "max_ms": round(max(ms), 1) if ms else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--stalled", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--baseline-seconds", type=float, default=15)
    ap.add_argument("--max-health-ms", type=float, default=1000)
    ap.add_argument("--probe-timeout", type=float, default=120)
    args = ap.parse_args()
    common.raise_nofile()

    m = common.Mlxd(args)
    port = int(m.url.rsplit(":", 1)[1])
    host = f"127.0.0.1:{port}"
    summary = {"scenario": "stall", "url": m.url, "stalled": args.stalled,
               "seconds": args.seconds}
    socks = {}  # fileno -> (socket, kind, opened_at)
    try:
        m.warm(args.model)
        time.sleep(1)
        base = common.proc_sample(m.pid)
        summary["mlxd_before"] = base
        health = Prober(m.url, "health", 0.25, args.probe_timeout)
        chat = Prober(m.url, "chat", 0.0, args.probe_timeout)
        health.start()
        chat.start()
        time.sleep(args.baseline_seconds)

        events = collections.Counter()
        lifetimes = collections.defaultdict(list)
        open_errors = collections.Counter()

        def open_one(kind):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(half_request(kind, host))
                s.setblocking(False)
                socks[s.fileno()] = (s, kind, time.time())
            except OSError as e:
                open_errors[type(e).__name__] += 1

        t_open = time.perf_counter()
        for i in range(args.stalled):
            open_one("header" if i % 2 == 0 else "body")
        summary["open_s"] = round(time.perf_counter() - t_open, 2)
        health.phase = chat.phase = "stall"
        t0 = time.time()
        samples = []
        next_sample = 0.0
        while time.time() - t0 < args.seconds:
            if time.time() - t0 >= next_sample:
                samples.append(common.proc_sample(m.pid))
                next_sample += 5
            readable, _, _ = select.select(list(socks), [], [], 0.5) if socks else ([], [], [])
            for fd in readable:
                s, kind, opened = socks.pop(fd)
                try:
                    data = s.recv(4096)
                except OSError:
                    data = None
                if data is None:
                    what = "reset"
                elif not data:
                    what = "closed"
                else:
                    try:
                        what = "status_" + data.split(b" ", 2)[1].decode()
                    except (IndexError, UnicodeDecodeError):
                        what = "other"
                events[f"{kind}:{what}"] += 1
                lifetimes[f"{kind}:{what}"].append(time.time() - opened)
                s.close()
                open_one(kind)
        health.phase = chat.phase = "after"
        summary["held_at_end"] = len(socks)
        for s, _, _ in list(socks.values()):
            s.close()
        socks.clear()
        time.sleep(args.baseline_seconds)
        health.stop_ev.set()
        chat.stop_ev.set()
        health.join()
        chat.join()
        time.sleep(1)
        after = common.proc_sample(m.pid)

        summary["stalled_events"] = dict(events)
        summary["stalled_lifetime_s"] = {k: round(sum(v) / len(v), 1)
                                         for k, v in lifetimes.items()}
        summary["open_errors"] = dict(open_errors)
        summary["health"] = {p: health.stats(p) for p in ("baseline", "stall", "after")}
        summary["chat"] = {p: chat.stats(p) for p in ("baseline", "stall", "after")}
        rows = [s for s in samples if s]
        summary["mlxd_during"] = {
            "fds_max": max(s["fds"] for s in rows) if rows else None,
            "rss_mib_max": round(max(s["rss_kib"] for s in rows) / 1024, 1) if rows else None}
        summary["mlxd_after"] = after
        checks = {
            "probes_ok": all(summary[w][p]["errors"] == 0 and summary[w][p]["n"] > 0
                             for w in ("health", "chat") for p in ("baseline", "stall",
                                                                    "after")),
            "health_p99_under_stall": (summary["health"]["stall"]["p99_ms"] or 1e9)
            < args.max_health_ms,
            "all_stalled_opened": not open_errors,
            "mlxd_alive": m.alive(),
            "fds_recovered": bool(after and base and after["fds"] <= base["fds"] + 8),
        }
        summary["checks"] = checks
        ok = all(checks.values())
    except Exception as e:  # noqa: BLE001
        summary["exception"] = f"{type(e).__name__}: {e}"
        summary["mlxd_log_tail"] = m.tail()
        ok = False
    finally:
        for s, _, _ in list(socks.values()):
            s.close()
        summary["mlxd_exit"] = m.stop()
    return common.emit(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
