#!/usr/bin/env python3
"""Reference greedy tokens from mlx-lm's own sharding of a model, for the engine-group tests.

One rank of a group, as `mlx.launch` starts it (the ring backend reads `MLX_RANK` and
`MLX_HOSTFILE`); run one process per rank:

    MLX_RANK=<r> MLX_HOSTFILE=<hosts.json> .venv/bin/python scripts/mlx_lm_sharded_greedy.py \
        --mode tensor|pipeline <model dir> <max tokens> <token id>...

The model is loaded with `mlx_lm.utils.sharded_load`: `--mode tensor` passes the group as
`tensor_group` (the model file's `shard()`: attention heads and MLP features divided among the
ranks), `--mode pipeline` as `pipeline_group` (its layers divided among the ranks, the
checkpoint needing a `model.safetensors.index.json`). Rank 0 prints the generated token ids on
one line, space-separated.
"""
import argparse

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import sharded_load


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["tensor", "pipeline"], required=True)
    ap.add_argument("model_dir")
    ap.add_argument("max_tokens", type=int)
    ap.add_argument("prompt", type=int, nargs="+", help="token ids")
    args = ap.parse_args()
    prompt = mx.array(args.prompt, dtype=mx.uint32)
    group = mx.distributed.init(backend="ring", strict=True)
    if args.mode == "tensor":
        model, _ = sharded_load(args.model_dir, tensor_group=group)
    else:
        model, _ = sharded_load(args.model_dir, pipeline_group=group)
    out = [int(token) for token, _ in generate_step(prompt, model, max_tokens=args.max_tokens)]
    # generate_step queues one step beyond the last token: every rank waits for the others
    # before leaving, so no rank exits while a peer still sends to it.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    if group.rank() == 0:
        print(" ".join(map(str, out)))


if __name__ == "__main__":
    main()
