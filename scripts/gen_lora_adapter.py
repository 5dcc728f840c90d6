"""Trains a tiny LoRA adapter with mlx-lm's own trainer (`python -m mlx_lm lora --train`), the
fixture of the engine's adapter parity tests: an adapter directory as mlx-lm writes it
(`adapter_config.json` + `adapters.safetensors`) for a tiny random model.

The data is a few generated lines of text, different per `--seed`, so two adapters of one
base pull its greedy output in different directions. The learning rate is high on purpose: a
handful of iterations must move the adapter far enough from its zero-initialised `lora_b`
that its greedy tokens differ from the base's (the tests check they do).

    python scripts/gen_lora_adapter.py --model target/test-models/tiny-llama \
        --seed 1 --out target/test-models/tiny-llama-lora-a
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = [
    "red", "green", "blue", "cat", "dog", "bird", "runs", "sleeps", "eats", "the", "a",
    "quick", "slow", "river", "stone", "tree", "sky", "under", "over", "near",
]


def lines(seed: int, count: int) -> list:
    rng = random.Random(seed)
    # One phrase repeated with small variations: easy to learn in a few iterations.
    phrase = [rng.choice(WORDS) for _ in range(6)]
    out = []
    for _ in range(count):
        words = list(phrase)
        words[rng.randrange(len(words))] = rng.choice(WORDS)
        out.append({"text": " ".join(words * 3)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the base model directory")
    ap.add_argument("--out", required=True, help="the adapter directory to write")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--scale", type=float, default=10.0)
    ap.add_argument("--num-layers", type=int, default=-1)
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        for name, count in (("train", 16), ("valid", 4)):
            with open(data / f"{name}.jsonl", "w") as f:
                for row in lines(args.seed + (0 if name == "train" else 1000), count):
                    f.write(json.dumps(row) + "\n")
        config = Path(tmp) / "lora.yaml"
        config.write_text(
            "lora_parameters:\n"
            f"  rank: {args.rank}\n"
            f"  scale: {args.scale}\n"
            "  dropout: 0.0\n"
        )
        cmd = [
            sys.executable, "-m", "mlx_lm", "lora",
            "--model", args.model,
            "--train",
            "--data", str(data),
            "--adapter-path", args.out,
            "--num-layers", str(args.num_layers),
            "--batch-size", "2",
            "--iters", str(args.iters),
            "--learning-rate", "5e-2",
            "--steps-per-report", str(args.iters),
            "--steps-per-eval", str(args.iters + 1),
            "--val-batches", "1",
            "--max-seq-length", "64",
            "--seed", str(args.seed),
            "-c", str(config),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
