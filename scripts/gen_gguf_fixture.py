#!/usr/bin/env python3
"""Tiny GGUF files of the `qwen2`, `qwen3`, `qwen3moe`, `gemma3` and `phi3` architectures,
written the way llama.cpp's convert_hf_to_gguf.py writes them, and the independent checks of
what the store's converter (store/src/convert) makes of them.

    .venv/bin/python scripts/gen_gguf_fixture.py write <arch> <dir>
    .venv/bin/python scripts/gen_gguf_fixture.py check <gguf> <converted dir> [<gguf> <dir>]...

`write` builds a tiny model of the architecture with mlx-lm's own class and random weights,
saves it as an mlx-lm model directory `<dir>/<arch>-source` (the Hugging Face config.json and
tensors, the model the GGUF is made from), and writes one GGUF per tensor mix into
`<dir>/<arch>-<mix>.gguf`:
  F32  every tensor F32 (the conversion must give back the source model bit for bit);
  F16  matrices F16, norms and biases F32 (as llama.cpp keeps 1-D tensors);
  Q8_0 matrices Q8_0 (the MoE router F32, as llama.cpp keeps it);
  MIX  matrices in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and F16 by position.
Hugging Face names become GGUF names through the `gguf` package's own tensor name map, and
values go through llama.cpp's transforms for the architecture (Gemma norms stored as `1 + w`;
Qwen3-MoE experts stacked `[experts, out, in]`); hyper-parameters are written with the
GGUFWriter calls the converter makes. Each file gets a vocabulary of its family's kind: a
byte-level BPE with Qwen2's pre-tokenizer (Qwen), a SentencePiece BPE without a space prefix
(Gemma 3) or with one and Phi-3's added tokens (Phi-3); `<gguf>.reference.json` records the
reference tokenizer's ids and decodings of test strings.

`check` reads each GGUF with the `gguf` package and compares, tensor by tensor, its
dequantization (`gguf.quants.dequantize`, names and transforms inverted here) with the
converted directory (`mx.dequantize` of its quantized tensors): equal where the directory's
stamp says exact, within the stamp's error otherwise; the F32 fixtures must also equal the
source model. It checks config.json against the source config, loads the directory with
mlx-lm (strict weights), compares the logits with the source model's (identical for F32 files
converted to f32), and tokenizes the reference strings with transformers' AutoTokenizer.
Needs `gguf`, `mlx`, `mlx-lm`, `tokenizers`, `sentencepiece` and `transformers`
(scripts/setup.sh --test).
"""
import io
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store" / "tests"))
from gguf_fixtures import CORPUS, STRINGS  # noqa: E402

ARCHS = ("qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")
MIXES = ("F32", "F16", "Q8_0", "MIX")
CONTEXT = 512

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def source_config(arch):
    """The Hugging Face config.json of the tiny source model (vocabulary filled in later)."""
    base = {
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": CONTEXT, "hidden_act": "silu",
    }
    if arch == "qwen2":
        return {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "rope_theta": 1000000.0, "tie_word_embeddings": True}
    if arch == "qwen3":
        # A head dimension other than hidden / heads, as Qwen3 has.
        return {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "head_dim": 32, "rope_theta": 1000000.0, "tie_word_embeddings": False}
    if arch == "qwen3moe":
        return {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "head_dim": 16, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if arch == "gemma3":
        # Six layers: llama.cpp's fixed pattern makes layer 5 the global one.
        gemma = {k: v for k, v in base.items() if k != "hidden_act"}
        return {**gemma, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "num_hidden_layers": 6, "head_dim": 32, "query_pre_attn_scalar": 32,
                "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "sliding_window": 8, "sliding_window_pattern": 6,
                "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "phi3":
        # Phi-4-mini's partial rotary embedding and Phi-3's LongRoPE, tied embeddings.
        return {**base, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "rope_scaling": {"type": "longrope",
                                 "short_factor": [1.0, 1.05, 1.1, 1.3, 1.8, 2.5],
                                 "long_factor": [1.0, 1.25, 2.1, 3.7, 6.4, 11.5]},
                "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "sliding_window": 262144, "tie_word_embeddings": True}
    raise SystemExit(f"unknown architecture {arch!r} (known: {', '.join(ARCHS)})")


# --- vocabularies ---------------------------------------------------------------------------


def qwen_vocab(w, reference):
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer, written as llama.cpp's
    `_set_vocab_gpt2` does (pre-tokenizer name `qwen2`)."""
    import gguf
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    # Qwen3's <think> markers are added tokens that are not special.
    tok.add_tokens(["<think>", "</think>"])
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    T = gguf.TokenType
    types = [T.CONTROL if t in specials else T.USER_DEFINED if t in ("<think>", "</think>")
             else T.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for s in STRINGS + ["<|im_start|>user\nHi<think>x</think><|im_end|>", "e\u0301 cafe\u0301"]:
        ids = tok.encode(s, add_special_tokens=False).ids
        reference.append({"text": s, "ids": ids, "ids_with_bos": ids,
                          "decoded": tok.decode(ids, skip_special_tokens=False)})
    return len(tokens)


def train_spm(**options):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([CORPUS] * 20), model_writer=model, model_type="bpe",
        vocab_size=420, byte_fallback=True, character_coverage=0.98, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", hard_vocab_limit=False, minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_pieces(sp):
    """Pieces, scores and GGUF token types of a SentencePiece model, as llama.cpp reads them."""
    import gguf

    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i)
                     else T.UNUSED if sp.is_unused(i) else T.BYTE if sp.is_byte(i)
                     else T.NORMAL)
    return tokens, scores, types


def gemma_vocab(w, reference):
    """Gemma's SentencePiece layout: <pad> <eos> <bos> <unk>, turn markers as control tokens,
    and no space prefix (llama.cpp's Gemma 3 converter writes add_space_prefix false)."""
    sp = train_spm(add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                   pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                   control_symbols=["<start_of_turn>", "<end_of_turn>"])
    tokens, scores, types = spm_pieces(sp)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA_TEMPLATE)
    for s in STRINGS:
        ids = sp.encode(s)
        reference.append({"text": s, "ids": ids, "ids_with_bos": [2] + ids,
                          "decoded": sp.decode(ids)})
    return len(tokens)


def phi3_vocab(w, reference):
    """Phi-3's vocabulary as llama.cpp's Phi3MiniModel.set_vocab writes it: Llama 2's
    SentencePiece pieces, the added chat tokens as control tokens with score -1000, and
    `[PADn]` unused tokens up to the model's vocabulary size."""
    import gguf

    sp = train_spm(add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    tokens, scores, types = spm_pieces(sp)
    for t in ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]:
        tokens.append(t)
        scores.append(-1000.0)
        types.append(gguf.TokenType.CONTROL)
    for i in range(3):
        tokens.append(f"[PAD{len(tokens)}]")
        scores.append(-10000.0)
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(PHI3_TEMPLATE)
    for s in STRINGS:
        ids = sp.encode(s)
        reference.append({"text": s, "ids": ids, "ids_with_bos": ids, "decoded": sp.decode(ids)})
    return len(tokens)


def write_vocab(arch, w, reference):
    if arch.startswith("qwen"):
        return qwen_vocab(w, reference)
    if arch == "gemma3":
        return gemma_vocab(w, reference)
    return phi3_vocab(w, reference)


# --- the source model -----------------------------------------------------------------------


def source_model(arch, vocab_size, out):
    """Builds the tiny model with mlx-lm's class, random weights, and saves it to `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = source_config(arch)
    config["vocab_size"] = vocab_size
    config["torch_dtype"] = "float32"
    rng = np.random.default_rng(sum(map(ord, arch)))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if arch == "gemma3":
        # Gemma 3 ties its output projection to the embedding, as its GGUFs do: mlx-lm's
        # sanitize drops lm_head when the checkpoint has none.
        model.sanitize({})
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # Multiples of 2^-10 near the neutral scale: `1 + w` and back is exact in f32.
            k = rng.integers(-256, 257, size=p.shape)
            base = 0.0 if arch == "gemma3" else 1.0
            v = base + k.astype(np.float32) / 1024.0
        else:
            v = rng.normal(0.0, p.shape[-1] ** -0.5, size=p.shape)
        weights.append((name, mx.array(v.astype(np.float32))))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(str(out), model)
    save_config(config, out / "config.json")
    return config, {n: np.array(a) for n, a in weights}


# --- GGUF ---------------------------------------------------------------------------------


def hf_name(mlx_name):
    """The Hugging Face name llama.cpp's converter sees for an mlx-lm parameter: Qwen3-MoE's
    `switch_mlp` is Hugging Face's merged `experts` tensor."""
    return mlx_name.replace(".mlp.switch_mlp.", ".mlp.experts.")


def gguf_name(arch, name_map, mlx_name):
    new = name_map.get_name(hf_name(mlx_name), try_suffixes=(".weight", ".bias"))
    if new is None:
        raise SystemExit(f"{arch}: the gguf package maps no tensor name to {mlx_name}")
    return new


def tensor_type(mix, gguf_tensor, position):
    """The GGML type of a tensor of the mix; 1-D tensors and the MoE router stay F32."""
    import gguf

    T = gguf.GGMLQuantizationType
    if gguf_tensor.endswith(".bias") or gguf_tensor.endswith("norm.weight") \
            or ".ffn_gate_inp." in gguf_tensor or mix == "F32":
        return T.F32
    if mix == "F16":
        return T.F16
    if mix == "Q8_0":
        return T.Q8_0
    return [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16][position % 6]


def write_hparams(arch, w, c):
    """The hyper-parameters, with the GGUFWriter calls convert_hf_to_gguf.py makes."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    if "head_dim" in c:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if arch == "qwen3moe":
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "gemma3":
        w.add_sliding_window(c["sliding_window"])
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    if arch == "phi3":
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        rope_dims = int(c["partial_rotary_factor"] * c["hidden_size"]) // c["num_attention_heads"]
        assert rope_dims == int(head_dim * c["partial_rotary_factor"])
        w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(c["sliding_window"])
        scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
        orig = c["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))


def write_gguf(arch, mix, path, config, weights):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{mix}")
    write_hparams(arch, w, config)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if mix == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    reference = []
    n_vocab = write_vocab(arch, w, reference)
    assert n_vocab == config["vocab_size"], (n_vocab, config["vocab_size"])
    w.add_vocab_size(n_vocab)
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    if arch == "phi3":
        rs = config["rope_scaling"]
        w.add_tensor("rope_factors_long.weight", np.array(rs["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rs["short_factor"], dtype=np.float32))
    for position, (name, value) in enumerate(weights.items()):
        new = gguf_name(arch, name_map, name)
        if arch == "gemma3" and name.endswith("norm.weight"):
            # Gemma3Model.modify_tensors: llama.cpp scales by the stored value.
            value = value + np.float32(1.0)
        t = tensor_type(mix, new, position)
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(new, value.astype(np.float32))
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(new, value.astype(np.float16))
        else:
            w.add_tensor(new, gguf.quants.quantize(value.astype(np.float32), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".reference.json").write_text(
        json.dumps(reference, ensure_ascii=False, indent=1) + "\n")


def write(arch, out_dir):
    import gguf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The vocabulary decides the model's size, so it is built once up front.
    probe = gguf.GGUFWriter(str(out_dir / ".probe.gguf"), arch)
    n_vocab = write_vocab(arch, probe, [])
    probe.close()
    (out_dir / ".probe.gguf").unlink(missing_ok=True)
    config, weights = source_model(arch, n_vocab, out_dir / f"{arch}-source")
    for mix in MIXES:
        path = out_dir / f"{arch}-{mix}.gguf"
        write_gguf(arch, mix, path, config, weights)
        print(f"wrote {path}: {len(weights)} tensors, vocabulary of {n_vocab}")


# --- checks ---------------------------------------------------------------------------------


def inverse_names(arch, source_dir):
    """GGUF name -> mlx-lm name, from the source model's parameters and the gguf package."""
    import gguf
    import mlx.core as mx

    config = json.loads((source_dir / "config.json").read_text())
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    source = mx.load(str(source_dir / "model.safetensors"))
    return {gguf_name(arch, name_map, n): n for n in source}, source, config


def dequantized(w, module, quant):
    import mlx.core as mx

    spec = quant.get(module, quant)
    assert spec is not False, module
    return mx.dequantize(w[f"{module}.weight"], w[f"{module}.scales"].astype(mx.float32),
                         w[f"{module}.biases"].astype(mx.float32),
                         group_size=spec["group_size"], bits=spec["bits"])


def check_weights(arch, reader, out_dir, source_dir):
    import gguf
    import mlx.core as mx

    names, source, _ = inverse_names(arch, source_dir)
    config = json.loads((out_dir / "config.json").read_text())
    stamp = json.loads((out_dir / "mlxd-convert.json").read_text())["tensor_types"]
    quant = config.get("quantization", {})
    w = mx.load(str(out_dir / "model.safetensors"))
    used, measured, equal_to_source = set(), {}, 0
    for t in reader.tensors:
        if t.name.startswith("rope_factors_"):
            continue  # read as config.json's rope_scaling, checked with the config
        name = names[t.name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        ref = ref.reshape([int(d) for d in reversed(t.shape)])
        if arch == "gemma3" and name.endswith("norm.weight"):
            ref = ref - 1.0
        module, param = name.rsplit(".", 1)
        if param == "weight" and f"{module}.scales" in w:
            got = dequantized(w, module, quant)
            used.update(f"{module}.{s}" for s in ("weight", "scales", "biases"))
        else:
            if param == "weight":
                assert quant.get(module) in (None, False), (module, quant.get(module))
            got = w[name]
            used.add(name)
        got = np.array(got.astype(mx.float32)).astype(np.float64)
        assert got.shape == ref.shape, (t.name, got.shape, ref.shape)
        err = np.abs(got - ref)
        m = measured.setdefault(t.tensor_type.name, {"max": 0.0, "sq": 0.0, "n": 0})
        m["max"] = max(m["max"], float(err.max()))
        m["sq"] += float((err ** 2).sum())
        m["n"] += err.size
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and stamp["F32"]["exact"]:
            # An F32 file holds the source values themselves: the round trip is the identity.
            src = np.array(source[name]).astype(np.float64)
            assert np.array_equal(got, src), (t.name, float(np.abs(got - src).max()))
            equal_to_source += 1
    assert used == set(w.keys()), sorted(set(w.keys()) ^ used)
    assert set(measured) == set(stamp), (sorted(measured), sorted(stamp))
    for ty, m in sorted(measured.items()):
        s = stamp[ty]
        if s["exact"]:
            assert m["max"] == 0.0, (ty, m["max"], "the stamp says exact")
        else:
            assert m["max"] <= s["max_abs_error"] * (1 + 1e-5) + 1e-9, (ty, m["max"], s)
        verdict = "exact" if m["max"] == 0.0 else f"max abs error {m['max']:.3e}"
        print(f"  {ty}: {m['n']} elements -> {s['output']}: {verdict}")
    print(f"weights: {len(reader.tensors)} GGUF tensors match ({equal_to_source} equal to the "
          f"source model)")


# Keys of the source config that the conversion does not carry, and why.
NOT_CARRIED = {
    # llama.cpp turns Phi-3's sliding window off and mlx-lm's Phi-3 has none.
    ("phi3", "sliding_window"),
}


def check_config(arch, out_dir, source_dir):
    source = json.loads((source_dir / "config.json").read_text())
    got = json.loads((out_dir / "config.json").read_text())
    for key, want in source.items():
        if (arch, key) in NOT_CARRIED or key in ("torch_dtype",):
            continue
        assert key in got, (key, "missing from config.json")
        have = got[key]
        if isinstance(want, float) or isinstance(have, float):
            assert np.float32(have) == np.float32(want), (key, have, want)
        elif isinstance(want, dict):
            for k, v in want.items():
                h = have.get(k)
                if isinstance(v, list):
                    assert np.array_equal(np.float32(h), np.float32(v)), (key, k, h, v)
                elif isinstance(v, float):
                    assert np.float32(h) == np.float32(v), (key, k, h, v)
                else:
                    assert h == v, (key, k, h, v)
        else:
            assert have == want, (key, have, want)
    print(f"config: {len(source)} source keys agree ({got['architectures'][0]})")


def check_model(out_dir, source_dir, exact):
    """mlx-lm loads the directory (strict) and computes the source model's logits: identical
    when `exact` (an F32 file converted to f32)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    prompt = mx.array([[3, 17, 42, 99, 5, 64, 8, 23, 11, 57, 30, 2]], dtype=mx.uint32)
    model, _ = load_model(out_dir, strict=True)
    # MLX's CPU gather_mm (the experts' matmul) takes float32 only.
    model.set_dtype(mx.float32)
    ours = model(prompt).astype(mx.float32)
    src, _ = load_model(source_dir, strict=True)
    theirs = src(prompt).astype(mx.float32)
    assert not bool(mx.any(mx.isnan(ours))), "NaN logits"
    diff = float(mx.max(mx.abs(ours - theirs)))
    if exact:
        assert diff == 0.0, f"logits differ from the source model's by {diff}"
        print("mlx-lm: logits identical to the source model's")
    else:
        same = bool(mx.all(mx.argmax(ours, -1) == mx.argmax(theirs, -1)))
        print(f"mlx-lm: loads; logits within {diff:.3e} of the source model's "
              f"({'same' if same else 'some different'} argmax)")


def check_tokenizer(gguf_path, out_dir):
    import transformers

    reference = json.loads(Path(str(gguf_path) + ".reference.json").read_text())
    auto = transformers.AutoTokenizer.from_pretrained(out_dir)
    for case in reference:
        s = case["text"]
        ids = auto.encode(s, add_special_tokens=False)
        assert ids == case["ids"], (s, ids, case["ids"])
        assert auto.encode(s) == case["ids_with_bos"], (s, auto.encode(s), case["ids_with_bos"])
        got = auto.decode(case["ids"])
        assert got == case["decoded"], (s, got, case["decoded"])
    prompt = auto.apply_chat_template([{"role": "user", "content": "Hi"}],
                                      add_generation_prompt=True, tokenize=False)
    assert "Hi" in prompt, prompt
    print(f"tokenizer: {len(reference)} strings identical in the reference and transformers "
          f"({type(auto).__name__}); chat template renders")


def check(pairs):
    import gguf

    for gguf_path, out_dir in pairs:
        gguf_path, out_dir = Path(gguf_path), Path(out_dir)
        reader = gguf.GGUFReader(str(gguf_path))
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        source_dir = gguf_path.parent / f"{arch}-source"
        stamp = json.loads((out_dir / "mlxd-convert.json").read_text())
        print(f"{gguf_path.name} -> {out_dir.name} ({arch}, {stamp['float_dtype']})")
        check_weights(arch, reader, out_dir, source_dir)
        check_config(arch, out_dir, source_dir)
        exact = gguf_path.stem.endswith("-F32") and stamp["float_dtype"] == "float32"
        check_model(out_dir, source_dir, exact)
        check_tokenizer(gguf_path, out_dir)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "check" and len(sys.argv) % 2 == 0:
        check(list(zip(sys.argv[2::2], sys.argv[3::2])))
    else:
        raise SystemExit(__doc__)
