"""Random LoRA adapters for a base model, in mlx-lm's adapter format, for serving benchmarks.

mlx-lm's own `linear_to_lora_layers` places the factors (the same layers and names its trainer
would adapt); `lora_b` gets small random values instead of zeros so that every adapter really
changes the output. No training: a benchmark of serving cost needs the shapes, not a skill.

    python3 scripts/bench/random_lora.py --model DIR --out DIR [--seed 1] [--rank 8] [--num-layers 16]
"""

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--num-layers", type=int, default=16)
    # mlx-lm trains and saves factors in float32 (the default); bfloat16 shows what a pass
    # costs when the factors share the base's dtype.
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(args.model), lazy=True)
    mx.random.seed(args.seed)
    params = {"rank": args.rank, "scale": args.scale, "dropout": 0.0}
    linear_to_lora_layers(model, args.num_layers, params)
    factors = {}
    for name, value in tree_flatten(model.parameters()):
        dtype = getattr(mx, args.dtype)
        if name.endswith(".lora_a"):
            factors[name] = value.astype(dtype)
        elif name.endswith(".lora_b"):
            factors[name] = (0.01 * mx.random.normal(value.shape)).astype(dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), factors)
    config = {"fine_tune_type": "lora", "num_layers": args.num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    print(json.dumps({"adapter": str(out), "tensors": len(factors)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
