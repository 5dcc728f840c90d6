"""Trains a tiny LoRA adapter with mlx-lm's own trainer (`mlx_lm.lora`'s `train_model`, in this
process), the fixture of the engine's adapter parity tests: an adapter directory as mlx-lm
writes it (`adapter_config.json` + `adapters.safetensors`) for a tiny random model, and beside
it what mlxd's training parity test needs to train the same adapter itself:

- `data/` (`train.jsonl`, `valid.jsonl`): the data;
- `init_adapters.safetensors`: the factors training starts from (mlx-lm's `LoRALinear`
  initialisation for `lora_a`, small random `lora_b`, so both get a gradient at once), passed
  to mlx-lm as `resume_adapter_file`; with `--fine-tune-type dora` the file has no DoRA
  magnitudes `m`, so each trainer starts them from the base weight's row norms itself;
- `train_log.json`: the settings and mlx-lm's training loss of every iteration and its
  validation losses: of the fixture's own run, of a parity run at a lower learning rate, and
  of one with a learning-rate schedule (warmup, then cosine decay).

One batch holds every training example, so the batch order does not depend on an RNG and mlxd
can follow the same steps. The data is a few generated lines of text, different per `--seed`,
so two adapters of one base pull its greedy output in different directions. The learning rate
is high on purpose: a handful of iterations must move the adapter far enough that its greedy
tokens differ from the base's (the tests check they do).

    python scripts/gen_lora_adapter.py --model target/test-models/tiny-llama \
        --seed 1 --out target/test-models/tiny-llama-lora-a

A DoRA adapter (`--fine-tune-type dora`) gets the fixture's and the parity run only;
`--runs parity` asks the same of a LoRA adapter, `--runs fixture` the fixture's run alone (a
second adapter that only serving tests use). On a mixture-of-experts base (the tiny Qwen3-MoE)
the expert stacks get mlx-lm's `LoRASwitchLinear` factors like every other layer.
"""

import argparse
import contextlib
import json
import os
import random
import sys
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


TRAIN_EXAMPLES = 8
VALID_EXAMPLES = 8


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the base model directory")
    ap.add_argument("--out", required=True, help="the adapter directory to write")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--scale", type=float, default=10.0)
    ap.add_argument("--num-layers", type=int, default=-1)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--fine-tune-type", choices=["lora", "dora"], default="lora")
    ap.add_argument("--runs", choices=["all", "parity", "fixture"], default="all",
                    help="which of the runs to make beside the fixture's own")
    args = ap.parse_args()
    dora = args.fine_tune_type == "dora"

    import types

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import lora as lora_cli
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    data.mkdir(exist_ok=True)
    for name, count in (("train", TRAIN_EXAMPLES), ("valid", VALID_EXAMPLES)):
        with open(data / f"{name}.jsonl", "w") as f:
            for row in lines(args.seed + (0 if name == "train" else 1000), count):
                f.write(json.dumps(row) + "\n")
    lora_parameters = {"rank": args.rank, "scale": args.scale, "dropout": 0.0}
    settings = {
        "num_layers": args.num_layers,
        "batch_size": TRAIN_EXAMPLES,
        "iters": args.iters,
        "learning_rate": 5e-2,
        "steps_per_report": 1,
        "steps_per_eval": 4,
        "val_batches": 1,
        "max_seq_length": 64,
        "seed": args.seed,
        "fine_tune_type": args.fine_tune_type,
    }

    model, tokenizer = load(args.model)
    # The starting factors: mlx-lm's initialisation of lora_a, a small random lora_b.
    mx.random.seed(args.seed)
    linear_to_lora_layers(model, args.num_layers, lora_parameters, use_dora=dora)
    init = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(".lora_a"):
            init[name] = value
        elif name.endswith(".lora_b"):
            init[name] = 0.05 * mx.random.normal(value.shape)
    init_file = out / "init_adapters.safetensors"
    mx.save_safetensors(str(init_file), init)

    def train(settings: dict, adapter_path: Path) -> dict:
        model, tokenizer = load(args.model)
        config = dict(lora_cli.CONFIG_DEFAULTS)
        config.update(settings)
        config.update(
            model=args.model,
            train=True,
            data=str(data),
            adapter_path=str(adapter_path),
            lora_parameters=lora_parameters,
            resume_adapter_file=str(init_file),
        )
        run = types.SimpleNamespace(**config)
        log = {"train": [], "valid": []}

        class Record(TrainingCallback):
            def on_train_loss_report(self, info):
                log["train"].append([info["iteration"], info["train_loss"]])

            def on_val_loss_report(self, info):
                log["valid"].append([info["iteration"], info["val_loss"]])

        train_set, valid_set, _ = lora_cli.load_dataset(run, tokenizer)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            lora_cli.train_model(run, model, train_set, valid_set, Record())
        log["settings"] = dict(settings, lora_parameters=lora_parameters)
        return log

    # The fixture: a high learning rate moves the greedy tokens in a few steps.
    log = train(settings, out)
    if args.runs == "fixture":
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        return 0
    # The parity run: at a learning rate that small rounding differences do not amplify
    # (Adam's first steps move every element by about lr * 3 whatever its gradient's size,
    # so at 5e-2 a last-bit difference in a near-zero gradient flips a step of 0.16).
    log["parity"] = train(dict(settings, learning_rate=1e-3), out / "parity")
    if dora or args.runs == "parity":
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        return 0
    # And with a learning-rate schedule (linear warmup, then cosine decay).
    schedule = {"name": "cosine_decay", "arguments": [2e-3, 8, 1e-4], "warmup": 3,
                "warmup_init": 1e-4}
    log["schedule"] = train(dict(settings, learning_rate=1e-3, lr_schedule=schedule),
                            out / "schedule")
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
