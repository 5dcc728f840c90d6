#!/usr/bin/env python3
"""Generate a tiny random-weight model of one architecture family, with mlx-lm's reference
tokens, for the engine's family tests (engine/tests/engine/families.rs).

    .venv/bin/python scripts/gen_family_models.py --family qwen3_moe --out target/test-models/family-qwen3_moe
    .venv/bin/python scripts/gen_family_models.py --family qwen3_moe --quantize --out target/test-models/family-qwen3_moe-q4
    .venv/bin/python scripts/gen_family_models.py --family qwen3_moe --kv-heads 4 --out target/test-models/family-qwen3_moe-kv4
    .venv/bin/python scripts/gen_family_models.py --all target/test-models

The family's config is `scripts/fixtures/families/<family>.json` (`{"config": {...}}`, the
config.json of a tiny model as mlx-community ships that architecture). The model is built with
mlx-lm's own class (the reference), given random weights that preserve activations' variance
(so greedy choices are not near-ties), optionally quantized with mlx-lm's own `quantize_model`
(4 bits, groups of 64, its per-layer rules), and saved as mlx-lm saves converted models.
`reference.json` holds mlx-lm's greedy tokens (`generate_step`) for the prompts below.
`--kv-heads N` gives the fixture's model N KV heads (the engine-group tests divide heads among
ranks: four ranks need four KV heads).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_random_model import write_tokenizer  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "families"
MAX_TOKENS = 24


def prompts():
    """Fixed prompts over the tiny vocabulary: a 40-token one (with 24 generated tokens it
    crosses the fixtures' small windows), short ones of other lengths for a ragged batch, and
    one that shares the long one's first 32 tokens (a prefix-cache hit)."""
    state = 12345

    def ids(n):
        nonlocal state
        out = []
        for _ in range(n):
            state = (state * 1103515245 + 12345) % (1 << 32)
            out.append((state >> 16) % 390)
        return out

    long = ids(40)
    return [long, [1], ids(7), ids(13), long[:32] + ids(8)]


def random_weights(model, dtype):
    new = []
    for name, p in tree_flatten(model.parameters()):
        if not mx.issubdtype(p.dtype, mx.floating):
            new.append((name, p))
        elif name.endswith("norm.weight") or name.endswith("norm.bias"):
            # Unit norm scales and zero norm biases, as an untrained model starts.
            new.append((name, mx.ones(p.shape, dtype=dtype) if name.endswith("weight")
                        else mx.zeros(p.shape, dtype=dtype)))
        else:
            fan_in = p.shape[-1] if p.ndim > 1 else max(p.shape[0], 1)
            new.append((name, (mx.random.normal(p.shape) * fan_in ** -0.5).astype(dtype)))
    model.load_weights(new, strict=False)


def generate(family, out, quantize=False, mode="affine", dtype="float32", seed=0, kv_heads=None):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

    fixture = json.loads((FIXTURES / f"{family}.json").read_text())
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=parent)
    try:
        vocab, bos, eos = write_tokenizer(tmp, 512)
        config = dict(fixture["config"])
        text = config.get("text_config")
        for c in [config] + ([text] if isinstance(text, dict) else []):
            c.setdefault("vocab_size", vocab)
            c.setdefault("bos_token_id", bos)
            c.setdefault("eos_token_id", eos)
        config["torch_dtype"] = dtype
        if kv_heads is not None:
            heads = config.get("num_attention_heads")
            if "num_key_value_heads" not in config or not heads or kv_heads < 1 \
                    or heads % kv_heads:
                raise SystemExit(f"--kv-heads {kv_heads}: {family}'s config has {heads} "
                                 "attention heads (a multiple of the KV heads needed) and "
                                 f"num_key_value_heads {config.get('num_key_value_heads')}")
            config["num_key_value_heads"] = kv_heads
        mx.random.seed(seed)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        random_weights(model, getattr(mx, dtype))
        if quantize:
            model, config = quantize_model(model, config, 64 if mode == "affine" else None, 4,
                                           mode=mode)
        mx.eval(model.parameters())
        save_model(tmp, model)
        save_config(config, Path(tmp) / "config.json")

        # The reference: mlx-lm loading the saved directory, as a user's mlx-lm would.
        loaded, _ = load_model(Path(tmp))
        cases = []
        for prompt in prompts():
            tokens = generate_step(mx.array(prompt, dtype=mx.uint32), loaded,
                                   max_tokens=MAX_TOKENS)
            cases.append({"prompt": prompt, "greedy": [int(t) for t, _ in tokens]})
        with open(os.path.join(tmp, "reference.json"), "w") as f:
            json.dump({"max_tokens": MAX_TOKENS, "cases": cases}, f)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


def stale(fixture, out):
    """Whether `out` is missing or older than its fixture (or than this script)."""
    made = Path(out) / "reference.json"
    if not made.is_file():
        return True
    newest = max(fixture.stat().st_mtime, Path(__file__).stat().st_mtime)
    return made.stat().st_mtime < newest


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", help="one fixture's name")
    ap.add_argument("--out", help="the directory to write (with --family)")
    ap.add_argument("--all", metavar="ROOT",
                    help="every fixture, plain and 4-bit, into ROOT/family-<name>[-q4], "
                         "skipping those up to date")
    ap.add_argument("--quantize", action="store_true", help="4-bit, groups of 64 (affine)")
    ap.add_argument("--mode", default="affine", help="quantization mode (with --quantize)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="this many KV heads instead of the fixture's (with --family)")
    args = ap.parse_args()
    if args.all and args.kv_heads is not None:
        ap.error("--kv-heads applies to one --family, not to --all")
    if args.all:
        for fixture in sorted(FIXTURES.glob("*.json")):
            # `"quantize": {"mode": "mxfp4"}` names the mode of the fixture's 4-bit twin.
            spec = json.loads(fixture.read_text()).get("quantize", True)
            mode = spec.get("mode", "affine") if isinstance(spec, dict) else "affine"
            for suffix, quantize in (("", False), ("-q4", True)):
                out = os.path.join(args.all, f"family-{fixture.stem}{suffix}")
                if stale(fixture, out):
                    print(f"generating {out}", flush=True)
                    generate(fixture.stem, out, quantize=quantize, mode=mode)
        return
    if not (args.family and args.out):
        ap.error("give --family and --out, or --all")
    generate(args.family, args.out, args.quantize, args.mode, args.dtype, args.seed,
             args.kv_heads)


if __name__ == "__main__":
    main()
