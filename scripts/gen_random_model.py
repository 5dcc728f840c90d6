#!/usr/bin/env python3
"""Generate a random-weight model directory in MLX / Hugging Face format.

Used by tests (tiny shapes, seconds to load) and benchmarks (real shapes such as Llama-1B).
The directory holds config.json, model.safetensors (sharded above --shard-mb), and a small
byte-level BPE tokenizer trained here on a fixed text, with a ChatML chat template.
mlx-lm loads the result unchanged, which is how parity is checked.

    .venv/bin/python scripts/gen_random_model.py --shape tiny-llama --out /tmp/m
    .venv/bin/python scripts/gen_random_model.py --shape llama-1b --dtype bfloat16 --out /tmp/m
"""
import argparse
import json
import os
import shutil
import tempfile

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

SHAPES = {
    "tiny-llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=True),
    "tiny-llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=512,
                        tie_word_embeddings=False,
                        rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                          original_max_position_embeddings=64,
                                          rope_type="llama3")),
    # tiny-llama with as many KV heads as query heads (4): four tensor-parallel ranks divide
    # them (tiny-llama's 2 KV heads allow two ranks at most).
    "tiny-llama-kv4": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                           hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=512,
                           tie_word_embeddings=True),
    "tiny-qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=512, tie_word_embeddings=False),
    "tiny-qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=512,
                       tie_word_embeddings=True),
    # Mistral (mlx-lm reads it with its Llama code, as we do), with a context longer than two
    # prefill chunks (2 048 tokens) so parity covers chunked prefill.
    "tiny-mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"],
                         hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=8192,
                         sliding_window=None, tie_word_embeddings=False),
    "llama-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                     intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                     max_position_embeddings=131072, tie_word_embeddings=True,
                     rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                       original_max_position_embeddings=8192,
                                       rope_type="llama3")),
    "llama-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                     rope_theta=500000.0, max_position_embeddings=131072,
                     tie_word_embeddings=False,
                     rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                       original_max_position_embeddings=8192,
                                       rope_type="llama3")),
}

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is "
    "the capital of France. Numbers 0123456789 and symbols !?.,;:'\"()[]{} appear too. "
    "Hello, world! Tiny models say random things, and that is fine for tests. "
) * 4


def write_tokenizer(out, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 512,
        "chat_template": CHATML,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return tok.get_vocab_size(), tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--quantize", type=int, choices=[4, 8], default=None,
                    help="quantize linear and embedding layers to this many bits (group 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (default: a 512-token trained tokenizer; real "
                         "shapes pad the embedding to 128256 rows)")
    ap.add_argument("--shard-mb", type=int, default=2048)
    args = ap.parse_args()

    from mlx_lm.utils import _get_classes as get_model_classes  # noqa: E402

    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=parent)
    try:
        tok_vocab, bos, eos = write_tokenizer(tmp, 512)
        config = dict(SHAPES[args.shape])
        config["vocab_size"] = args.vocab or (tok_vocab if args.shape.startswith("tiny") else 128256)
        config["bos_token_id"], config["eos_token_id"] = bos, eos
        config["torch_dtype"] = args.dtype
        mx.random.seed(args.seed)
        model_class, args_class = get_model_classes(config)
        model = model_class(args_class.from_dict(config))
        dtype = getattr(mx, args.dtype)
        # Unit-variance-preserving init: tiny models then produce varied (if meaningless) text
        # instead of echoing their input through the tied embedding.
        params = tree_flatten(model.parameters())
        new = []
        for name, p in params:
            if name.endswith("norm.weight"):
                new.append((name, mx.ones(p.shape, dtype=dtype)))
            else:
                new.append((name, (mx.random.normal(p.shape) * p.shape[-1] ** -0.5).astype(dtype)))
        model.load_weights(new)
        if args.quantize:
            nn.quantize(model, group_size=64, bits=args.quantize)
            config["quantization"] = {"group_size": 64, "bits": args.quantize}
        weights = dict(tree_flatten(model.parameters()))
        mx.eval(weights)
        shards, shard, size = [], {}, 0
        for k in sorted(weights):
            nbytes = weights[k].nbytes
            if shard and size + nbytes > args.shard_mb * 2**20:
                shards.append(shard)
                shard, size = {}, 0
            shard[k], size = weights[k], size + nbytes
        shards.append(shard)
        if len(shards) == 1:
            mx.save_safetensors(os.path.join(tmp, "model.safetensors"), shards[0],
                                metadata={"format": "mlx"})
        else:
            index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
                     "weight_map": {}}
            for i, s in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                mx.save_safetensors(os.path.join(tmp, name), s, metadata={"format": "mlx"})
                index["weight_map"].update({k: name for k in s})
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if os.path.exists(args.out):
            shutil.rmtree(args.out)
        os.rename(tmp, args.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(args.out)


if __name__ == "__main__":
    main()
