#!/usr/bin/env python3
"""Random-weight models at the real shapes of today's most-run families, for the H200
family benchmarks (scripts/bench/families_h200.sh), built with mlx-lm's own classes.

    python3 scripts/bench/gen_family_shape.py --shape qwen3-30b-a3b --quantize 4 --out /tmp/models/q3moe
    python3 scripts/bench/gen_family_shape.py --shape gpt-oss-20b --mode mxfp4 --out /tmp/models/gptoss
    python3 scripts/bench/gen_family_shape.py --shape gemma-3-12b --out /tmp/models/gemma3

Weights are drawn lazily in bf16 and (optionally) quantized before anything is evaluated, so
the float32 initialisation of mlx-lm's classes is never materialised: the peak is one shard.
A tokenizer directory (`--tokenizer`) is copied in when given.
"""
import argparse
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        vocab_size=151936, tie_word_embeddings=False, attention_bias=False),
    # openai/gpt-oss-20b config.json.
    "gpt-oss-20b": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        experts_per_token=4, sliding_window=128, rope_theta=150000.0,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=4096, truncate=False),
        vocab_size=201088, rms_norm_eps=1e-5, swiglu_limit=7.0,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=True),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (48 layers: 3 gated delta-nets, then one
    # gated attention layer, repeated).
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=2048,
        intermediate_size=5120, num_hidden_layers=48, full_attention_interval=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000000.0, partial_rotary_factor=0.25,
        max_position_embeddings=262144, vocab_size=151936, tie_word_embeddings=False,
        attention_bias=False),
    # google/gemma-3-12b-it text_config.
    "gemma-3-12b": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=3840,
        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=dict(factor=8.0, rope_type="linear"), vocab_size=262208,
        rms_norm_eps=1e-6, max_position_embeddings=131072),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quantize", type=int, default=None, help="bits (affine, group 64)")
    ap.add_argument("--mode", default=None, help="quantization mode, e.g. mxfp4 (4 bits)")
    ap.add_argument("--tokenizer", default=None, help="dir with tokenizer.json and its config")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (default: the real one; 49152 fits SmolLM2's "
                         "tokenizer, for served text)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only this many layers (the largest that fits the machine)")
    ap.add_argument("--attention-only", action="store_true",
                    help="every layer full attention (a hybrid's same-size attention-only twin)")
    args = ap.parse_args()

    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = dict(SHAPES[args.shape])
    config["torch_dtype"] = "bfloat16"
    if args.vocab:
        config["vocab_size"] = args.vocab
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if args.attention_only:
        config["full_attention_interval"] = 1
    config.setdefault("eos_token_id", 2)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if not mx.issubdtype(p.dtype, mx.floating):
            new.append((name, p))
        elif "norm" in name:
            new.append((name, mx.ones(p.shape, dtype=mx.bfloat16)))
        else:
            fan_in = p.shape[-1] if p.ndim > 1 else max(p.shape[0], 1)
            new.append((name, (mx.random.normal(p.shape, dtype=mx.bfloat16) * fan_in ** -0.5)))
    model.load_weights(new, strict=False)
    if args.quantize or args.mode:
        mode = args.mode or "affine"
        model, config = quantize_model(model, config, None, args.quantize, mode=mode)
    out = Path(args.out)
    save_model(out, model)
    save_config(config, out / "config.json")
    if args.tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(args.tokenizer) / f, out / f)


if __name__ == "__main__":
    main()
