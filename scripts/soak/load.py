#!/usr/bin/env python3
"""Soak scenarios 1 and 2 of the hardening issue: N concurrent streaming chat clients
through mlxd for a while, optionally SIGKILLing the engine every K seconds.

    python3 scripts/soak/load.py [--url http://127.0.0.1:PORT] [--clients 64] [--seconds 300] \
        [--max-tokens 8] [--kill-every 0]

Each client loops: one streaming chat (`stream_options.include_usage`), classified by how
it ended (see `common.stream_chat`), then the next, until `--seconds` are over; requests in
flight then finish. Every `--sample-every` s (5) the VmRSS and open fds of mlxd and of every
engine pid in `GET /engines` are sampled. With `--kill-every K`, the engine pid from
`/engines` gets SIGKILL every K s; after the run the script waits for the engine to come
back, reports `/engines` and sends a one-token chat.

Pass (one JSON line on stdout, exit 1 on failure):
- without kills: every request "done"; mlxd's fd count after the run (clients gone) at most
  its count before (+2); the largest RSS of mlxd and of the engine in the second half of the
  samples within 10 % + 16 MiB of the largest in the first half (growth to the working set
  is expected early on; growth after it is not); the engine pid unchanged;
- with kills: no "truncated", "bad_http_error", "conn_error" or "hang" outcome (every
  request completed, or got an HTTP error with a JSON body, or an SSE error event); the
  one-token chat after the run succeeds.
"""
import argparse
import collections
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--sample-every", type=float, default=5)
    ap.add_argument("--kill-every", type=float, default=0,
                    help="SIGKILL the engine every this many seconds (0 = never)")
    ap.add_argument("--request-timeout", type=float, default=300,
                    help="seconds without a byte before a request counts as a hang")
    ap.add_argument("--error-pause", type=float, default=1.0,
                    help="seconds a client waits after a failed request")
    ap.add_argument("--recover-timeout", type=float, default=120,
                    help="after a killing run, how long to wait for the engine to be ready")
    args = ap.parse_args()
    common.raise_nofile()

    m = common.Mlxd(args)
    summary = {"scenario": "kill" if args.kill_every else "load", "url": m.url,
               "clients": args.clients, "seconds": args.seconds,
               "max_tokens": args.max_tokens, "kill_every_s": args.kill_every}
    try:
        summary["warmup"] = m.warm(args.model)
        time.sleep(1)
        before = common.proc_sample(m.pid)
        summary["mlxd_idle_before"] = before
        summary["engines_before"] = common.engine_summary(m.url)

        sampler = common.Sampler(m, args.sample_every)
        results = []
        lock = threading.Lock()
        deadline = time.time() + args.seconds
        counter = iter(range(10**9))

        def client():
            while time.time() < deadline:
                with lock:
                    i = next(counter)
                r = common.stream_chat(m.url, i, args.max_tokens, args.model,
                                       args.request_timeout)
                r["at"] = round(time.time() - (deadline - args.seconds), 1)
                with lock:
                    results.append(r)
                if r["outcome"] != "done":
                    time.sleep(args.error_pause)  # no busy loop on a failed model's 503s

        kills = []

        def killer():
            t_next = time.time() + args.kill_every
            while True:
                wait = t_next - time.time()
                if wait > 0:
                    time.sleep(wait)
                if time.time() >= deadline:
                    return
                t_next += args.kill_every
                try:
                    pids = m.engine_pids()
                except Exception as e:  # noqa: BLE001
                    kills.append({"at": round(time.time() - (deadline - args.seconds), 1),
                                  "error": str(e)[:100]})
                    continue
                for model, pid in pids.items():
                    entry = {"at": round(time.time() - (deadline - args.seconds), 1),
                             "model": model, "pid": pid}
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        entry["error"] = "gone"
                    kills.append(entry)
                if not pids:
                    kills.append({"at": round(time.time() - (deadline - args.seconds), 1),
                                  "skipped": "no engine pid in /engines",
                                  "engines": [(e["state"], e.get("failure"))
                                              for e in common.engine_summary(m.url)]})

        sampler.start()
        t0 = time.time()
        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        kt = None
        if args.kill_every:
            kt = threading.Thread(target=killer, daemon=True)
            kt.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        sampler.sample_once(t0)  # the last one under load: right when the clients end
        sampler.stop()
        if kt:
            kt.join()

        counts = collections.Counter(r["outcome"] for r in results)
        summary["wall_s"] = round(wall, 1)
        summary["requests"] = len(results)
        summary["outcomes"] = dict(counts)
        summary["completed"] = counts.get("done", 0)
        summary["errors"] = len(results) - counts.get("done", 0)
        summary["completion_tokens"] = sum(r["tokens"] for r in results
                                           if r["outcome"] == "done")
        done_ms = [r["ms"] for r in results if r["outcome"] == "done"]
        summary["latency_ms"] = {"p50": round(common.pct(done_ms, 50) or 0),
                                 "p99": round(common.pct(done_ms, 99) or 0),
                                 "max": round(max(done_ms, default=0))}
        samples = collections.defaultdict(list)
        for r in results:
            if r["outcome"] != "done" and len(samples[r["outcome"]]) < 3:
                samples[r["outcome"]].append({"at": r["at"], "detail": r["detail"]})
        summary["error_samples"] = dict(samples)
        error_details = collections.Counter((r["outcome"], (r["detail"] or "")[:90])
                                            for r in results if r["outcome"] != "done")
        summary["error_kinds"] = [{"outcome": o, "detail": d, "n": n}
                                  for (o, d), n in error_details.most_common(8)]
        summary["resources"] = sampler.summary()

        time.sleep(2)
        after = common.proc_sample(m.pid)
        summary["mlxd_idle_after"] = after

        if args.kill_every:
            summary["kills"] = len([k for k in kills if "pid" in k and "error" not in k])
            summary["kill_log"] = kills
            end = time.time() + args.recover_timeout
            while time.time() < end:
                st = common.engine_summary(m.url)
                if all(e["state"] in ("ready", "idle", "failed") for e in st) and \
                        not any(e["state"] == "idle" and e["restarts"] for e in st):
                    break
                time.sleep(1)
            summary["engines_after"] = common.engine_summary(m.url)
            summary["chat_after"] = common.one_token_chat(m.url, args.model)
            if not summary["chat_after"]["ok"]:
                # Report what a reset gives too (it is not part of the pass condition).
                st, body, _ = common.http_json(m.url, "POST", "/engines/reset", {})
                summary["reset"] = {"status": st}
                summary["chat_after_reset"] = common.one_token_chat(m.url, args.model)
                summary["engines_after_reset"] = common.engine_summary(m.url)
            bad = sum(counts.get(k, 0) for k in ("truncated", "bad_http_error", "conn_error",
                                                 "hang"))
            summary["unclear_failures"] = bad
            ok = bad == 0 and summary["chat_after"]["ok"] and m.alive()
        else:
            res = summary["resources"]
            checks = {"zero_errors": summary["errors"] == 0,
                      "fds_not_grown": bool(after and before and
                                            after["fds"] <= before["fds"] + 2)}

            def rss_stable(col):
                # No growth once warmed up: the largest RSS of the second half of the run
                # within 10 % + 16 MiB of the largest of the first half (the first half
                # includes the growth to the working set: KV caches for the batch, etc.).
                vals = [row[col] for row in res["series"] if row[col] is not None]
                if len(vals) < 4:
                    return False
                half = len(vals) // 2
                return max(vals[half:]) <= 1.1 * max(vals[:half]) + 16
            checks["mlxd_rss_stable"] = rss_stable(1)
            checks["engine_rss_stable"] = rss_stable(3)
            checks["engine_pid_unchanged"] = len(res["engines"]) == 1
            checks["mlxd_alive"] = m.alive()
            summary["checks"] = checks
            ok = all(checks.values())
        summary["mlxd_alive"] = m.alive()
    except Exception as e:  # noqa: BLE001
        summary["exception"] = f"{type(e).__name__}: {e}"
        summary["mlxd_log_tail"] = m.tail()
        ok = False
    finally:
        summary["mlxd_exit"] = m.stop()
    return common.emit(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
