"""HTTP helpers shared by the serving benchmarks: a connection to a TCP URL or an engine's
unix socket, and the SSE events of a streamed response as parsed JSON."""
import http.client
import json
import socket
import urllib.parse


class UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (an engine's own socket, without mlxd in front)."""

    def __init__(self, path, timeout=300):
        super().__init__("engine", timeout=timeout)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def connect(url, timeout=300):
    """`http://host:port` or `unix:/path/to.sock`."""
    if url.startswith("unix:"):
        return UnixConnection(url[len("unix:"):], timeout)
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def _raw_events(resp):
    """Yields (event name, data bytes) of each SSE event as it arrives (`message` where an
    event has no `event:` line); events without data are skipped."""
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            name, data = "message", b""
            for line in raw.split(b"\n"):
                line = line.strip()
                if line.startswith(b"event:"):
                    name = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    data += line[5:].strip()
            if data:
                yield name, data


def events(resp):
    """Yields each `data:` event of an SSE response as parsed JSON, as it arrives; `[DONE]`
    ends the iteration."""
    for _, data in _raw_events(resp):
        if data == b"[DONE]":
            return
        yield json.loads(data)


def named_events(resp):
    """Yields (event name, parsed data) of an SSE response with named events (`event:` then
    `data:`), as they arrive, until it ends."""
    for name, data in _raw_events(resp):
        yield name, json.loads(data)


def choice_tokens(choice):
    """Tokens a streamed choice carries: its `mlxd.token_ids` where present (random-weight
    models may emit ids whose text is empty), else 1 for a non-empty content delta."""
    ids = (choice.get("mlxd") or {}).get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if (choice.get("delta") or {}).get("content") else 0
