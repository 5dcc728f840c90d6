#!/usr/bin/env python3
"""Rewrite a generated DeepSeek family model (scripts/gen_family_models.py) into the layout of
Hugging Face checkpoints and of mlx-community conversions made before mlx-lm absorbed
`kv_b_proj`, for engine/tests/engine/families/deepseek_layouts.rs:

    .venv/bin/python scripts/deepseek_hf_layout.py <generated dir> <out dir> [--quantize]

- DeepSeek-V3: `kv_b_proj` instead of `embed_q`/`unembed_out`, rotary `inv_freq` tensors and a
  multi-token-prediction layer (index 61, as mlx-lm's sanitize expects it);
- both: one matrix per expert (`experts.{e}.*`) instead of the stacked `switch_mlp`.
With --quantize, `kv_b_proj` is quantized (4 bits, groups of 64) and config.json says so; the
rest stays as generated (dense), which mlx-lm's loader accepts layer by layer.
"""
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
quantize = "--quantize" in sys.argv
if dst.exists():
    shutil.rmtree(dst)
shutil.copytree(src, dst)
for f in ["model.safetensors.index.json", "reference.json"]:
    (dst / f).unlink(missing_ok=True)
config = json.loads((src / "config.json").read_text())
w = mx.load(str(src / "model.safetensors"))
H = config["num_attention_heads"]
out = {}
for k, v in w.items():
    if ".embed_q." in k or ".unembed_out." in k:
        continue
    if ".switch_mlp." in k:
        pre, rest = k.split(".switch_mlp.")
        proj, part = rest.split(".")
        for e in range(v.shape[0]):
            out[f"{pre}.experts.{e}.{proj}.{part}"] = v[e]
        continue
    out[k] = v
for l in range(config["num_hidden_layers"]):
    p = f"model.layers.{l}.self_attn"
    if f"{p}.embed_q.weight" in w:
        wk = w[f"{p}.embed_q.weight"]       # [H, latent, nope]
        wv = w[f"{p}.unembed_out.weight"]   # [H, v, latent]
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1).reshape(-1, wk.shape[1])
        if quantize:
            q, s, b = mx.quantize(kv_b, 64, 4)
            out[f"{p}.kv_b_proj.weight"], out[f"{p}.kv_b_proj.scales"], out[f"{p}.kv_b_proj.biases"] = q, s, b
        else:
            out[f"{p}.kv_b_proj.weight"] = kv_b
    if config["model_type"] == "deepseek_v3":
        out[f"{p}.rotary_emb.inv_freq"] = mx.ones((8,))
if config["model_type"] == "deepseek_v3":
    # mlx-lm drops DeepSeek-V3's multi-token-prediction layer by its index in the full model.
    out["model.layers.61.eh_proj.weight"] = mx.zeros((4, 4))
    out["model.layers.61.mlp.gate.weight"] = mx.zeros((4, 4))
if quantize:
    config["quantization"] = {"group_size": 64, "bits": 4}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
