"""When does a supervisor learn that a GPU process died? After `kill -9` of a child that holds
a CUDA context (and some GPU memory), the times at which the supervisor sees: the end of the
child's stdout (descriptor 1, opened before the context), the end of a pipe the child holds
at a high descriptor (opened after the context, as a server's accepted connections are), its
pidfd becoming readable, and `waitpid` returning.

    python3 scripts/bench/exit_order.py [--gpu-mb 0 16000] [--repeats 3]

The kernel closes a dying process's descriptors in ascending order, after unmapping its
memory; the GPU driver tears the context down when its descriptors close. Prints one JSON line
per run with milliseconds after the kill, and the child's descriptors that name a device.
"""

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
import mlx.core as mx
mb = int(sys.argv[1])
keep = mx.zeros((max(mb, 1), 1 << 20), mx.uint8)
mx.eval(keep)
mx.synchronize()
os.dup2(int(sys.argv[2]), 900)
os.close(int(sys.argv[2]))
sys.stdout.write("ready\n")
sys.stdout.flush()
time.sleep(3600)
"""


def one(mb: int) -> dict:
    r_hi, w_hi = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mb), str(w_hi)],
                             stdout=subprocess.PIPE, pass_fds=(w_hi,))
    os.close(w_hi)
    line = child.stdout.readline()
    if line.strip() != b"ready":
        raise SystemExit(f"the child did not start: {line!r}")
    devices = []
    for fd in os.listdir(f"/proc/{child.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{child.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            devices.append((int(fd), target))
    pidfd = os.pidfd_open(child.pid)
    out_fd = child.stdout.fileno()
    watch = {out_fd: "stdout_eof_ms", r_hi: "high_fd_eof_ms", pidfd: "pidfd_ms"}
    seen = {}
    t0 = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    while len(seen) < len(watch):
        ready, _, _ = select.select([fd for fd in watch if watch[fd] not in seen], [], [], 10)
        if not ready:
            break
        now = (time.perf_counter() - t0) * 1e3
        for fd in ready:
            if fd != pidfd and os.read(fd, 4096):
                continue
            seen[watch[fd]] = round(now, 2)
    os.waitpid(child.pid, 0)
    seen["waitpid_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    os.close(r_hi)
    os.close(pidfd)
    child.stdout.close()
    return dict(gpu_mb=mb, **seen, device_fds=sorted(devices)[:3], device_fd_count=len(devices))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-mb", type=int, nargs="+", default=[0, 16000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for mb in args.gpu_mb:
        for _ in range(args.repeats):
            print(json.dumps(one(mb)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
