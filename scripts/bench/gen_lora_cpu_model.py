#!/usr/bin/env python3
"""A random bf16 Llama small enough to train on a CPU, for `lora_train.py`'s memory comparison
there (issue 25): Llama 3.2's layout (tied embeddings, 64-wide heads, 4 query heads per KV
head) at a chosen width and depth, built with mlx-lm's own classes.

    .venv/bin/python scripts/bench/gen_lora_cpu_model.py --hidden 1024 --layers 8 \
        --tokenizer target/mlxd-test-home/models/smollm2-135m --out /tmp/llama-h1024

The vocabulary is 49152 (SmolLM2's tokenizer, copied in from `--tokenizer`, so that both
trainers tokenize real text). Weights are drawn in bf16 directly (norms ones).
"""
import argparse
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=None, help="default: 4 × hidden")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--tokenizer", required=True, help="dir with tokenizer.json and its config")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from mlx_lm.utils import _get_classes, save_config, save_model

    heads = args.hidden // 64
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"],
                  hidden_size=args.hidden, intermediate_size=args.intermediate or 4 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=heads,
                  num_key_value_heads=max(heads // 4, 1), head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=131072,
                  vocab_size=args.vocab, tie_word_embeddings=True, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if "norm" in name:
            new.append((name, mx.ones(p.shape, dtype=mx.bfloat16)))
        else:
            fan_in = p.shape[-1] if p.ndim > 1 else max(p.shape[0], 1)
            new.append((name, mx.random.normal(p.shape, dtype=mx.bfloat16) * fan_in ** -0.5))
    model.load_weights(new, strict=False)
    out = Path(args.out)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer) / f, out / f)


if __name__ == "__main__":
    main()
