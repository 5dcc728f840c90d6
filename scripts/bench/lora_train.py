"""LoRA training speed and memory: mlxd's `lora` job against `mlx_lm.lora --train`, same base,
same data, same settings, one after the other on the same device.

    python3 scripts/bench/lora_train.py --model DIR --mlxd-bin DIR --out results.jsonl \
        [--iters 30] [--batch-size 4] [--num-layers 16] [--rank 8] [--seq 512]

The data is generated text (`text` lines long enough to fill `--seq` tokens, so every batch
is `batch_size x seq` tokens on both sides). Tokens/s is taken over the iterations after the
first third (compilation and warm-up excluded): for mlx-lm, the mean of its reports (every 5
iterations) there; for mlxd, the median of the per-iteration rates its progress events carry
(events are coalesced, so not every iteration is seen). Peak memory is each side's MLX peak
(mlx-lm's `Peak mem`, the job's `peak_memory_bytes`). Prints and appends one JSON line.

On a CPU (a model from `gen_lora_cpu_model.py`, a few iterations, small batches) both sides
run MLX's plain ops for attention and the cross-entropy, since MLX has fused kernels for them
on the GPU only: a CPU run compares everything else (weights, the step's other activations,
the optimizer), and the two kernels' share of the peak shows on a GPU only.
"""

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import named_events  # noqa: E402

WORDS = ("harbour lantern tide granite beacon keeper storm gull river stone tree sky under "
         "over near quick slow red green blue cat dog bird runs sleeps eats the a").split()


def make_data(d: Path, seq: int, n_train: int = 64, n_valid: int = 8) -> None:
    rng = random.Random(0)
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("valid", n_valid)):
        with open(d / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                # Words of a few tokens each: twice `seq` words always overflows `seq` tokens.
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(2 * seq))}) + "\n")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


MLX_LM_RUNNER = r"""
import contextlib, json, os, sys, types
import mlx.core as mx
from mlx_lm import lora as lora_cli
from mlx_lm.tuner.callbacks import TrainingCallback
settings = json.loads(sys.argv[1])
config = dict(lora_cli.CONFIG_DEFAULTS)
config.update(settings)
run = types.SimpleNamespace(**config)
reports = []
class Record(TrainingCallback):
    def on_train_loss_report(self, info):
        reports.append(dict(it=info["iteration"], loss=info["train_loss"],
                            tok_s=info["tokens_per_second"], peak_gb=info["peak_memory"],
                            active_gb=round(mx.get_active_memory() / 1e9, 3)))
# What `lora_cli.run` does for --train (it drops a callback given to it: it builds its own).
import numpy as np
np.random.seed(run.seed)
from mlx_lm.utils import load
with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
    model, tokenizer = load(run.model)
    train_set, valid_set, _ = lora_cli.load_dataset(run, tokenizer)
    lora_cli.train_model(run, model, train_set, valid_set, Record())
print(json.dumps(reports))
"""


def run_mlx_lm(args, data: Path, work: Path) -> dict:
    """mlx-lm's own trainer (what `mlx_lm lora --train` runs: `load`, `load_dataset`,
    `train_model`) in a process of its own, its figures from its reports every 5 iterations."""
    settings = dict(model=args.model, train=True, data=str(data), iters=args.iters,
                    batch_size=args.batch_size, num_layers=args.num_layers,
                    max_seq_length=args.seq, steps_per_report=1 if args.mlx_lm_only else 5,
                    steps_per_eval=10 * args.iters,
                    val_batches=1, save_every=10 * args.iters,
                    adapter_path=str(work / "mlx-lm-adapter"),
                    lora_parameters={"rank": args.rank, "scale": 20.0, "dropout": 0.0})
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MLX_LM_RUNNER, json.dumps(settings)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mlx-lm's lora run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    if not reports:
        raise SystemExit("mlx-lm's trainer made no reports")
    skip = args.iters // 3
    later = [r["tok_s"] for r in reports if r["it"] > skip] or [reports[-1]["tok_s"]]
    return dict(tok_s=round(statistics.mean(later), 1), peak_gb=round(max(r["peak_gb"] for r in reports), 3),
                first_loss=reports[0]["loss"], last_loss=reports[-1]["loss"], wall_s=round(wall, 1),
                reports=reports)


def follow(port: int, job_id: str):
    """Yields (event name, parsed data) of the job's SSE stream until it ends."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("GET", f"/v1/jobs/{job_id}?follow=1")
    yield from named_events(conn.getresponse())


def run_mlxd(args, data: Path, work: Path) -> dict:
    port = free_port()
    # LORA_RUST_LOG: the job's log filter (e.g. `warn,mlxd_engine::job=info` shows MLX's memory
    # after the load, the validation and the first training steps).
    env = dict(os.environ, XDG_RUNTIME_DIR=tempfile.mkdtemp(), MLXD_HOME=str(work / "home"),
               RUST_LOG=os.environ.get("LORA_RUST_LOG", "warn"))
    # The server serves the base too (an idle engine, its own process); the job process loads
    # its own copy, and its peak memory is its own, as mlx-lm's is.
    server = subprocess.Popen([f"{args.mlxd_bin}/mlxd", "serve", "--port", str(port),
                               "--model", args.model], env=env)
    try:
        for _ in range(240):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health/live")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("mlxd did not come up")
        spec = dict(kind="lora", model=args.model, data=str(data), out=str(work / "mlxd-adapter"),
                    iters=args.iters, batch_size=args.batch_size, num_layers=args.num_layers,
                    rank=args.rank, max_seq_length=args.seq, steps_per_eval=10 * args.iters,
                    save_every=10 * args.iters, val_batches=1)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/jobs", json.dumps(spec), {"content-type": "application/json"})
        r = c.getresponse()
        body = json.loads(r.read())
        if r.status >= 300:
            raise SystemExit(f"POST /v1/jobs answered {r.status}: {body}")
        job_id = body["id"]
        t0 = time.perf_counter()
        iters, final = {}, None
        for name, ev in follow(port, job_id):
            tr = (ev.get("training") if name == "progress" else None) or {}
            it = tr.get("iteration")
            if name == "progress" and it and it not in iters and tr.get("train_loss") is not None:
                iters[it] = dict(t=time.perf_counter(), tok_s=tr["tokens_per_second"],
                                 loss=tr["train_loss"], trained=tr["trained_tokens"],
                                 peak=tr["peak_memory_bytes"])
            if name == "result":
                final = ev
        wall = time.perf_counter() - t0
        if not final or final.get("state") != "succeeded":
            raise SystemExit(f"the mlxd job did not succeed: {json.dumps(final)[:2000]}")
        # Progress events are coalesced: not every iteration is seen. Each seen one carries
        # that iteration's own rate (its tokens over its step's time, evaluation excluded, as
        # mlx-lm's reports count).
        skip = args.iters // 3
        its = sorted(iters)
        later = [i for i in its if i > skip]
        if not later:
            raise SystemExit(f"no progress event after iteration {skip}: saw {its}")
        return dict(tok_s=round(statistics.median(iters[i]["tok_s"] for i in later), 1),
                    peak_gb=round(max(v["peak"] for v in iters.values()) / 1e9, 3),
                    first_loss=iters[its[0]]["loss"], last_loss=iters[its[-1]]["loss"],
                    wall_s=round(wall, 1), iterations_seen=len(later))
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mlxd-bin", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mlxd-only", action="store_true",
                    help="run mlxd's job alone (to probe its memory; no ratio)")
    ap.add_argument("--mlx-lm-only", action="store_true",
                    help="run mlx-lm's trainer alone, reporting every iteration with MLX's "
                         "active memory (to compare with mlxd's probe; no ratio)")
    args = ap.parse_args()
    args.model = os.path.abspath(args.model)
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    data = work / "data"
    make_data(data, args.seq)
    if args.mlx_lm_only:
        print(json.dumps(dict(model=os.path.basename(args.model), iters=args.iters,
                              mlx_lm=run_mlx_lm(args, data, work))), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return 0
    if args.mlxd_only:
        print(json.dumps(dict(model=os.path.basename(args.model), iters=args.iters,
                              mlxd=run_mlxd(args, data, work))), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return 0
    mlx_lm = run_mlx_lm(args, data, work)
    ours = run_mlxd(args, data, work)
    line = dict(model=os.path.basename(args.model), iters=args.iters, batch_size=args.batch_size,
                num_layers=args.num_layers, rank=args.rank, seq=args.seq, mlxd=ours,
                mlx_lm={k: v for k, v in mlx_lm.items() if k != "reports"},
                tok_s_ratio=round(ours["tok_s"] / mlx_lm["tok_s"], 3),
                peak_ratio=round(ours["peak_gb"] / mlx_lm["peak_gb"], 3) if mlx_lm["peak_gb"] else None)
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
