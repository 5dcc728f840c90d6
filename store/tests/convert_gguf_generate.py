"""Greedy generation with mlx-lm on a directory made by `convert_gguf`.

usage: .venv/bin/python store/tests/convert_gguf_generate.py <converted_dir> [--f32]

Loads the directory with `mlx_lm.load` unchanged, applies its chat template, decodes greedily
for 20 tokens and requires "Paris" in the answer. `--f32` casts the loaded parameters (scales,
biases, norms) to float32 before generating: on the CPU build of MLX, float16 quantized matmuls
are ~50x slower than float32 ones, which makes a float16 run take many minutes.
"""
import sys
import time

import mlx.core as mx
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler

model_dir = sys.argv[1]
model, tokenizer = load(model_dir)
if "--f32" in sys.argv[2:]:
    model.set_dtype(mx.float32)
messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
start = time.time()
text = generate(model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.0))
print(f"{time.time() - start:.1f}s: {text!r}")
assert "Paris" in text, text
