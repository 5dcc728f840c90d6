#!/usr/bin/env python3
"""Soak scenario 3 of the hardening issue: N malformed requests, generated deterministically
from a seed, against mlxd (and through it the engine).

    python3 scripts/soak/malformed.py [--url http://127.0.0.1:PORT] [--count 10000] [--seed 7]

Every request is raw bytes on its own TCP connection (`Connection: close`): bad JSON, wrong
types, huge numbers, missing fields, wrong methods, unknown routes, oversized headers and
paths, invalid UTF-8, bad Content-Length / Transfer-Encoding, bad request lines, deep
nesting, foreign Host and Origin. Each is meant to be refused; none may generate (the
bodies ask for one token at most, so one accepted by mistake costs little).

Pass (one JSON line, exit 1 on failure): every response is 4xx; no 5xx, no 2xx/3xx, no
connection closed without a response, no reset, no timeout; mlxd and the engine alive
afterwards with the same pids and no engine restart. `--dump N` prints the first N failing
requests (repr of the bytes) to stderr.
"""
import argparse
import collections
import json
import os
import random
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
GOOD_MSG = [{"role": "user", "content": "hi"}]


def raw(method, path, host, body=b"", headers=None, content_length=True, version="HTTP/1.1"):
    if isinstance(body, str):
        body = body.encode()
    if isinstance(path, str):
        path = path.encode()
    if isinstance(method, str):
        method = method.encode()
    lines = [method + b" " + path + b" " + version.encode()]
    hdrs = [(b"Host", host.encode()), (b"Connection", b"close")]
    if body or method in (b"POST", b"PUT", b"PATCH"):
        hdrs.append((b"Content-Type", b"application/json"))
    if content_length:
        hdrs.append((b"Content-Length", str(len(body)).encode()))
    for k, v in headers or []:
        hdrs.append((k.encode() if isinstance(k, str) else k,
                     v.encode() if isinstance(v, str) else v))
    for k, v in hdrs:
        lines.append(k + b": " + v)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chat_with(field, value, endpoint=CHAT):
    if endpoint == COMPLETIONS:
        body = {"prompt": "hi", "max_tokens": 1}
    else:
        body = {"messages": GOOD_MSG, "max_tokens": 1}
    body[field] = value
    return json.dumps(body)


# Values that no field of the documented API accepts where they are put.
WRONG = {
    "messages": ["hi", 5, None, {}, [], [5], ["hi"], [None], [{"role": 5, "content": "x"}],
                 [{"content": "x"}], [{"role": "wizard", "content": "x"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": {"a": 1}}],
                 [{"role": "user", "content": [{"type": "image_url", "image": 3}]}],
                 [{"role": ["user"], "content": "x"}]],
    "max_tokens": ["8", -1, 1.5, True, [], {}, 10**30, -10**30, 2**64, 2**63, "1e9"],
    "max_completion_tokens": ["8", -5, 2**64, [1]],
    "temperature": ["hot", -1, [], {}, -1e308, True],
    "top_p": ["x", -0.5, 5, [], {}],
    "top_k": ["x", -5, 1.5, 2**64, [], {}],
    "min_p": ["x", -1, 7, []],
    "repetition_penalty": ["x", -1, [], {}],
    "presence_penalty": ["x", [], {}],
    "frequency_penalty": ["x", [], {}],
    "logit_bias": ["x", 5, [], {"a": 1}, {"1": "x"}, {"-1": 1}, {"99999999999999999999": 1}],
    "seed": ["x", 1.5, [], {}, 2**70, -2**70],
    "stop": [5, [1, 2], {}, [None], [[]]],
    "stream": ["yes", 1, [], {}],
    "stream_options": ["x", 5, [], {"include_usage": "yes"}],
}
WRONG_PROMPT = [5, None, {}, [{}], [[-1]], [[10**12]], [[1.5]], [["a", 1]], [[2**64]],
                [True], [[]]]

NUMBER_LITERALS = ["1e400", "-1e400", "99999999999999999999999999999999999999",
                   "1" + "0" * 400, "0x10", "NaN", "Infinity", "-Infinity", "01", "+1",
                   "1.", ".5", "1e", "--1"]


def gen_request(rng, host):
    """One malformed request as (kind, bytes)."""
    kind = rng.choice([
        "bad_json", "bad_json", "wrong_type", "wrong_type", "wrong_type", "huge_number",
        "missing_field", "wrong_method", "unknown_route", "oversized_header", "invalid_utf8",
        "bad_framing", "bad_request_line", "deep_nesting", "foreign_host", "random_bytes",
        "bad_prompt", "bad_messages_api", "long_path", "bad_content_type"])
    ep = rng.choice([CHAT, CHAT, COMPLETIONS])
    if kind == "bad_json":
        good = chat_with("temperature", 0.0, ep) if ep == CHAT else chat_with("seed", 1, ep)
        cut = rng.randrange(1, len(good) - 1)
        variants = [good[:cut], good + rng.choice(["}", "]", ",", "x", "{}"]),
                    good.replace(":", "=", 1), good.replace('"', "'"), "{" * rng.randint(1, 5),
                    "", "null", "[]", "true", "\"str\"", "{,}", "{\"messages\":}",
                    good.replace("{", "{\"a\":1,,", 1), "\x00" * rng.randint(1, 50)]
        return kind, raw("POST", ep, host, rng.choice(variants))
    if kind == "wrong_type":
        field = rng.choice(sorted(WRONG))
        return kind, raw("POST", ep if field != "messages" else CHAT, host,
                         chat_with(field, rng.choice(WRONG[field]),
                                   ep if field != "messages" else CHAT))
    if kind == "huge_number":
        field = rng.choice(["max_tokens", "temperature", "top_p", "top_k", "seed", "min_p",
                            "max_completion_tokens"])
        lit = rng.choice(NUMBER_LITERALS)
        body = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"%s":%s}' % (
            field, lit) if field != "max_tokens" else \
            '{"messages":[{"role":"user","content":"hi"}],"max_tokens":%s}' % lit
        return kind, raw("POST", CHAT, host, body)
    if kind == "missing_field":
        variants = [("POST", CHAT, {"max_tokens": 1}),
                    ("POST", CHAT, {"messages": [{"role": "user"}], "max_tokens": 1}),
                    ("POST", CHAT, {"messages": [{}], "max_tokens": 1}),
                    ("POST", CHAT, {"prompt": "hi", "max_tokens": 1}),
                    ("POST", CHAT, {}),
                    ("POST", COMPLETIONS, {"max_tokens": 1}),
                    ("POST", COMPLETIONS, {"messages": GOOD_MSG, "max_tokens": 1}),
                    ("POST", COMPLETIONS, {})]
        m, p, b = rng.choice(variants)
        return kind, raw(m, p, host, json.dumps(b))
    if kind == "wrong_method":
        m, p = rng.choice([("GET", CHAT), ("PUT", CHAT), ("DELETE", CHAT), ("PATCH", CHAT),
                           ("GET", COMPLETIONS), ("PUT", COMPLETIONS),
                           ("POST", "/health"), ("DELETE", "/health"), ("PUT", "/v1/models"),
                           ("POST", "/v1/models"), ("DELETE", "/engines"),
                           ("POST", "/engines"), ("GET", "/engines/reset"),
                           ("PUT", "/metrics"), ("BREW", CHAT), ("post", CHAT),
                           ("GET", "/admin/models/no-such-model/load")])
        body = chat_with("max_tokens", 1) if m not in ("GET", "DELETE") else ""
        return kind, raw(m, p, host, body)
    if kind == "unknown_route":
        p = rng.choice(["/", "/v2/chat/completions", "/v1/chat/completion", "/v1/chat",
                        "/v1/embeddings", "/v1/models/x/y/z", "/../../etc/passwd",
                        "/v1/chat/completions/extra", "/%00", "/v1//chat/completions",
                        "/admin/models/no-such-model/load", "/logs/no-such-model",
                        "/engines/" + "x" * rng.randint(1, 100), "/health/whatever",
                        "/v1/models/no-such-model"])
        m = "POST" if ("admin" in p or "chat" in p) else "GET"
        return kind, raw(m, p, host, chat_with("max_tokens", 1) if m == "POST" else "")
    if kind == "oversized_header":
        v = rng.random()
        if v < 0.3:
            headers = [("X-Big", "a" * rng.choice([70_000, 200_000, 500_000, 1_100_000]))]
        elif v < 0.6:
            headers = [(f"X-H{i}", "v") for i in range(rng.choice([120, 300, 1000]))]
        elif v < 0.8:
            headers = [("X-" + "n" * rng.choice([70_000, 500_000]), "v")]
        else:
            headers = [("Cookie", "c=" + "z" * rng.choice([100_000, 800_000]))]
        return kind, raw("POST", CHAT, host, chat_with("max_tokens", "x"), headers)
    if kind == "invalid_utf8":
        junk = bytes(rng.choice([0xff, 0xfe, 0xc0, 0x80, 0xed]) for _ in range(rng.randint(1, 8)))
        v = rng.randrange(6)
        if v == 0:
            body = b'{"messages":[{"role":"user","content":"' + junk + b'"}],"max_tokens":1}'
            return kind, raw("POST", CHAT, host, body)
        if v == 1:
            body = b'{"prompt":"' + junk + b'","max_tokens":1}'
            return kind, raw("POST", COMPLETIONS, host, body)
        if v == 2:
            body = b'{"messages":[{"role":"' + junk + b'","content":"x"}],"max_tokens":1}'
            return kind, raw("POST", CHAT, host, body)
        if v == 3:
            return kind, raw("GET", b"/v1/" + junk, host)
        if v == 4:
            body = b'{"' + junk + b'":1}'
            return kind, raw("POST", CHAT, host, body)
        return kind, raw("POST", CHAT, host, chat_with("max_tokens", []),
                         [(b"Authorization", b"Bearer " + junk)])
    if kind == "bad_framing":
        body = chat_with("max_tokens", 1)
        v = rng.randrange(7)
        if v == 0:
            return kind, raw("POST", CHAT, host, body, [("Content-Length", "abc")],
                             content_length=False)
        if v == 1:
            return kind, raw("POST", CHAT, host, body, [("Content-Length", "-1")],
                             content_length=False)
        if v == 2:
            return kind, raw("POST", CHAT, host, body,
                             [("Content-Length", "99999999999999999999999")],
                             content_length=False)
        if v == 3:
            return kind, raw("POST", CHAT, host, body,
                             [("Content-Length", "5"), ("Content-Length", "7")],
                             content_length=False)
        if v == 4:
            return kind, raw("POST", CHAT, host, b"zz\r\n" + body.encode() + b"\r\n0\r\n\r\n",
                             [("Transfer-Encoding", "chunked")], content_length=False)
        if v == 5:
            return kind, raw("POST", CHAT, host, body,
                             [("Transfer-Encoding", "gzip, chunked, identity")],
                             content_length=False)
        # Declares more than the 32 MiB body limit, sends nothing: refused from the header.
        return kind, raw("POST", CHAT, host, b"", [("Content-Length", str(40 * 1024 * 1024))],
                         content_length=False)
    if kind == "bad_request_line":
        line = rng.choice([b"GARBAGE", b"POST", b"POST /v1/chat/completions",
                           b"POST /v1/chat/completions HTTP/9.9",
                           b"POST /v1/chat/completions HTTP/1.1 extra",
                           b"GET  /health  HTTP/1.1", b"\x00\x01\x02 / HTTP/1.1",
                           b"GET /health HTTP/1.1\nX: \r", b"GET http://[::1 HTTP/1.1",
                           b"GET /health HTTP/1.1\r\n: novalue", b"GET /health HTTP/1.1\r\n x: y"])
        return kind, line + b"\r\n\r\n"
    if kind == "deep_nesting":
        depth = rng.choice([200, 1000, 10_000, 100_000])
        v = rng.randrange(3)
        if v == 0:
            body = '{"messages":' + "[" * depth + "]" * depth + ',"max_tokens":1}'
        elif v == 1:
            body = '{"messages":[{"role":"user","content":' + '{"a":' * depth + "1" + \
                "}" * depth + '}],"max_tokens":1}'
        else:
            body = '{"max_tokens":1,"x":' + "[" * depth + "]" * depth + "}"
        return kind, raw("POST", ep, host, body)
    if kind == "foreign_host":
        v = rng.randrange(3)
        if v == 0:
            return kind, raw("POST", CHAT, "evil.example", chat_with("max_tokens", 1))
        if v == 1:
            return kind, raw("POST", CHAT, host, chat_with("max_tokens", 1),
                             [("Origin", "http://evil.example")])
        return kind, raw("GET", "/v1/models", "attacker.example:80")
    if kind == "random_bytes":
        n = rng.randint(1, 2000)
        data = bytes(rng.randrange(256) for _ in range(n)).replace(b"\r\n\r\n", b"")
        if rng.random() < 0.5:
            return kind, raw("POST", ep, host, data)
        return kind, data + b"\r\n\r\n"
    if kind == "bad_prompt":
        return kind, raw("POST", COMPLETIONS, host, chat_with("prompt", rng.choice(WRONG_PROMPT),
                                                             COMPLETIONS))
    if kind == "bad_messages_api":
        b = rng.choice([{}, {"messages": "x", "max_tokens": 1}, {"max_tokens": "x"},
                        {"messages": [{"role": "user", "content": 5}], "max_tokens": 1},
                        {"messages": GOOD_MSG}, {"messages": GOOD_MSG, "max_tokens": -1}])
        return kind, raw("POST", MESSAGES, host, json.dumps(b))
    if kind == "long_path":
        n = rng.choice([10_000, 70_000, 300_000])
        return kind, raw("GET", "/" + "p" * n, host)
    # bad_content_type: a content type that is not JSON with a body that is not JSON either
    ct = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     "application/json; charset=\xff"])
    return kind, raw("POST", CHAT, host, "messages=hi&max_tokens=1",
                     [("Content-Type", ct.encode("latin-1"))])


def send(port, data, timeout):
    """(status or None, what happened)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    got, note = b"", None
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as e:
            note = f"send:{type(e).__name__}"  # the server may answer early and close
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            if len(got) > 1 << 20:
                break
    except socket.timeout:
        return None, "timeout", got
    except ConnectionResetError:
        if not got:
            return None, "reset" if note is None else "reset_after_" + note, got
    finally:
        s.close()
    if not got:
        return None, "closed_without_response" if note is None else "closed_after_" + note, got
    try:
        status = int(got.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None, "unparsable_response", got
    return status, note, got


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap)
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=40,
                    help="seconds a response may take (above the 30 s body timeout)")
    ap.add_argument("--dump", type=int, default=0)
    args = ap.parse_args()
    common.raise_nofile()

    m = common.Mlxd(args)
    port = int(m.url.rsplit(":", 1)[1])
    host = f"127.0.0.1:{port}"
    summary = {"scenario": "malformed", "url": m.url, "count": args.count, "seed": args.seed}
    try:
        m.warm(args.model)
        before = common.engine_summary(m.url)
        summary["pids_before"] = {"mlxd": m.pid, "engines": {e["model"]: e["pid"] for e in before}}
        rng = random.Random(args.seed)
        reqs = [gen_request(rng, host) for _ in range(args.count)]
        summary["kinds"] = dict(collections.Counter(k for k, _ in reqs))
        results = [None] * len(reqs)
        next_i = iter(range(len(reqs)))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = next(next_i, None)
                if i is None:
                    return
                t = time.perf_counter()
                try:
                    status, note, got = send(port, reqs[i][1], args.timeout)
                except OSError as e:
                    status, note, got = None, f"connect:{type(e).__name__}", b""
                results[i] = (status, note, (time.perf_counter() - t) * 1000, got[:300])

        t0 = time.time()
        threads = [threading.Thread(target=worker) for _ in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        summary["wall_s"] = round(time.time() - t0, 1)

        statuses = collections.Counter()
        by_kind = collections.defaultdict(collections.Counter)
        failures = []
        for (kind, data), (status, note, ms, got) in zip(reqs, results):
            key = str(status) if status is not None else note
            statuses[key] += 1
            by_kind[kind][key] += 1
            if status is None or not 400 <= status < 500:
                failures.append({"kind": kind, "outcome": key, "ms": round(ms),
                                 "request": repr(data[:240]), "response": repr(got[:240])})
        summary["statuses"] = dict(sorted(statuses.items()))
        summary["by_kind"] = {k: dict(v) for k, v in sorted(by_kind.items())}
        summary["non_4xx"] = len(failures)
        seen, samples = set(), []
        for f in failures:
            sig = (f["kind"], f["outcome"])
            if sig not in seen:
                seen.add(sig)
                samples.append(f)
        summary["failure_samples"] = samples[:12]
        for f in failures[:args.dump]:
            print(json.dumps(f), file=sys.stderr)
        slow = sorted(r[2] for r in results)
        summary["latency_ms"] = {"p50": round(common.pct(slow, 50)),
                                 "p99": round(common.pct(slow, 99)), "max": round(slow[-1])}

        after = common.engine_summary(m.url)
        summary["pids_after"] = {"mlxd": m.pid if m.alive() else None,
                                 "engines": {e["model"]: e["pid"] for e in after}}
        summary["engine_restarts"] = {e["model"]: e["restarts"] for e in after}
        summary["chat_after"] = common.one_token_chat(m.url, args.model)
        same = summary["pids_before"] == summary["pids_after"] and m.alive()
        ok = same and not failures and summary["chat_after"]["ok"] and \
            all(r == 0 for r in summary["engine_restarts"].values())
        summary["same_pids"] = same
    except Exception as e:  # noqa: BLE001
        summary["exception"] = f"{type(e).__name__}: {e}"
        summary["mlxd_log_tail"] = m.tail()
        ok = False
    finally:
        summary["mlxd_exit"] = m.stop()
    return common.emit(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
