#!/usr/bin/env python3
"""Reference greedy tokens from mlx-lm's pipeline parallelism, for the engine-group tests.

One rank of a group, as `mlx.launch` starts it (the ring backend reads `MLX_RANK` and
`MLX_HOSTFILE`); run one process per rank:

    MLX_RANK=<r> MLX_HOSTFILE=<hosts.json> .venv/bin/python scripts/mlx_lm_pipeline_greedy.py \
        <model dir> <max tokens> <token id>...

The model is loaded with `mlx_lm.utils.sharded_load(..., pipeline_group=...)` (its layers
divided among the ranks, the checkpoint needing a `model.safetensors.index.json`). Rank 0
prints the generated token ids on one line, space-separated.
"""
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import sharded_load


def main():
    model_dir, max_tokens = sys.argv[1], int(sys.argv[2])
    prompt = mx.array([int(t) for t in sys.argv[3:]], dtype=mx.uint32)
    group = mx.distributed.init(backend="ring", strict=True)
    model, _ = sharded_load(model_dir, pipeline_group=group)
    out = [int(token) for token, _ in generate_step(prompt, model, max_tokens=max_tokens)]
    # generate_step queues one step beyond the last token: every rank waits for the others
    # before leaving, so no rank exits while a peer still sends to it.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    if group.rank() == 0:
        print(" ".join(map(str, out)))


if __name__ == "__main__":
    main()
