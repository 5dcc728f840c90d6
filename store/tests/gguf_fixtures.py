"""Tiny GGUF files written by llama.cpp's own `gguf` Python package, and the independent checks
of what `convert_gguf` makes of them. Used by store/tests/convert_kquants.rs and
engine/tests/engine/gguf_kquants.rs; needs `gguf`, `mlx`, `tokenizers`, `sentencepiece` and
`transformers` (scripts/setup.sh --test).

usage:
  gguf_fixtures.py write <out.gguf> <mix> <vocab>
      A two-layer Llama (hidden 256, 4 heads, 2 KV heads, FFN 512) with random weights.
      <mix>: Q4_K, Q5_K, Q6_K, Q8_0 (every matrix that type) or Q4_K_M (llama.cpp's mix:
      Q4_K with Q6_K, Q5_K, Q8_0, Q5_0 and F16 tensors, plus Q5_1, Q4_0 and Q4_1 ones).
      Blocks of the 32-weight types come from `gguf.quants.quantize`; the package only dequantizes K-quants, so their blocks are random
      bytes with realistic super-block scales (every bit pattern of the rest is a valid block).
      <vocab>: llama-bpe (a byte-level BPE trained here with Llama 3's pre-tokenizer) or spm
      (a SentencePiece BPE model with byte fallback trained here, Llama 2 style). Writes
      <out.gguf>.reference.json: the reference tokenizer's ids and decodings of STRINGS.
  gguf_fixtures.py check-weights <gguf> <converted_dir>
      Every GGUF tensor dequantized by `gguf.quants.dequantize` against `mx.dequantize` of the
      converted tensors; the measured error must be zero where the stamp (mlxd-convert.json)
      says exact, and within the error it reports otherwise. Prints one line per type.
  gguf_fixtures.py check-tokenizer <gguf> <converted_dir>
      transformers' AutoTokenizer on the converted directory (what mlx-lm uses) must give the
      reference ids and decodings, and render the chat template.
"""
import json
import sys
from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, CONTEXT = 256, 512, 4, 2, 2, 512
HEAD_DIM = HIDDEN // HEADS

STRINGS = [
    "Hello world",
    "What is the capital of France?",
    " leading space",
    "   three spaces then text",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nend",
    "digits 1234567890 and 3.14159",
    "don't won't I'm you're we've they'll",
    "unicode: héllo wörld — ñ ç ß",
    "日本語のテキストと中文",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "Ελληνικά и русский текст",
    "rare: ǅ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
    "code: fn main() { println!(\"{}\", x); }",
    "",
    " ",
    "\u00a0non-breaking\u2009thin",
]

CORPUS = (
    "Hello world. What is the capital of France? The capital of France is Paris. "
    "The quick brown fox jumps over the lazy dog; 1234567890 and 3.14159. "
    "Don't won't I'm you're we've they'll. fn main() { println!(\"{}\", x); } "
    "def f(x):\n    return x * 2\n\n"
    "unicode: héllo wörld — ñ ç ß. 日本語のテキストと中文. Ελληνικά и русский текст. "
    "emoji 😀👍 and more text about models, tokens, weights and quantization. "
)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def llama_bpe_vocab(w, reference):
    """Trains a small Llama 3 style byte-level BPE and writes it as llama.cpp does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    import gguf
    types = [gguf.TokenType.CONTROL if t in LLAMA3_SPECIALS else gguf.TokenType.NORMAL
             for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(tok.token_to_id("<|eot_id|>"))
    w.add_add_bos_token(True)
    w.add_chat_template(LLAMA3_TEMPLATE)

    for s in STRINGS + ["<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"]:
        plain = tok.encode(s, add_special_tokens=False).ids
        reference.append({
            "text": s,
            "ids": plain,
            "ids_with_bos": tok.encode(s, add_special_tokens=True).ids,
            "decoded": tok.decode(plain, skip_special_tokens=False),
        })
    return len(tokens)


def spm_vocab(w, reference, work):
    """Trains a small SentencePiece BPE model with byte fallback and writes it as llama.cpp's
    convert_hf_to_gguf.py does for Llama 2 / Mistral."""
    import io

    import gguf
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([CORPUS] * 20), model_writer=model, model_type="bpe",
        vocab_size=420, byte_fallback=True, character_coverage=0.98, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        add_dummy_prefix=True, normalization_rule_name="identity", unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    (work / "spm.model").write_bytes(model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(LLAMA2_TEMPLATE)
    for s in STRINGS:
        plain = sp.encode(s)
        reference.append({
            "text": s,
            "ids": plain,
            "ids_with_bos": [1] + plain,
            "decoded": sp.decode(plain),
        })
    return len(tokens)


def llama3_rope_factors(base, factor, low=1.0, high=4.0, old_len=8192):
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 rope scaling."""
    import math

    freqs = 1.0 / (base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def random_blocks(rng, qtype, rows, cols):
    """Valid random blocks of a type the `gguf` package cannot quantize."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, size=(rows, cols // block)).astype(np.float16).view(np.uint8)

    name = qtype.name
    if name in ("Q4_K", "Q5_K"):
        data[..., 0:2] = f16(2e-5, 1.2e-4).reshape(rows, cols // block, 2)
        data[..., 2:4] = f16(1e-5, 8e-5).reshape(rows, cols // block, 2)
    elif name == "Q6_K":
        data[..., 208:210] = f16(1e-5, 3e-5).reshape(rows, cols // block, 2)
    else:
        raise ValueError(name)
    return data.reshape(rows, -1)


def tensor_bytes(rng, qtype, rows, cols):
    import gguf

    if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
        return random_blocks(rng, qtype, rows, cols)
    w = rng.normal(0.0, 0.02, size=(rows, cols)).astype(np.float32)
    if qtype.name == "F16":
        return w.astype(np.float16)
    return gguf.quants.quantize(w, qtype)


def mix_types(mix):
    """GGUF tensor part -> type, per layer."""
    import gguf

    T = gguf.GGMLQuantizationType
    if mix != "Q4_K_M":
        t = T[mix]
        return lambda part, layer: t
    table = {
        ("token_embd", None): T.Q4_K, ("output", None): T.Q6_K,
        ("attn_v", 0): T.Q6_K, ("attn_v", 1): T.Q8_0,
        ("ffn_down", 0): T.Q6_K, ("ffn_down", 1): T.Q5_K,
        ("attn_k", 1): T.F16, ("attn_output", 1): T.Q5_0,
        # The legacy 32-weight types, which older and fallback tensors still use.
        ("attn_q", 1): T.Q5_1, ("ffn_gate", 1): T.Q4_0, ("ffn_up", 1): T.Q4_1,
    }
    return lambda part, layer: table.get((part, layer), T.Q4_K)


def write(out, mix, vocab_kind):
    import gguf

    out = Path(out)
    rng = np.random.default_rng(sum(map(ord, mix + vocab_kind)))
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"tiny-llama-{mix}")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    # The Llama 3 vocabulary comes with Llama 3.1's rope: theta 500000 and the rope_freqs
    # factors convert_hf_to_gguf.py writes for rope_scaling factor 8.
    base = 500000.0 if vocab_kind == "llama-bpe" else 10000.0
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if mix == "Q4_K_M" else gguf.LlamaFileType.ALL_F32)
    reference = []
    if vocab_kind == "llama-bpe":
        n_vocab = llama_bpe_vocab(w, reference)
    elif vocab_kind == "spm":
        n_vocab = spm_vocab(w, reference, out.parent)
    else:
        raise SystemExit(f"unknown vocab {vocab_kind!r}")
    w.add_vocab_size(n_vocab)
    ty = mix_types(mix)

    def matrix(name, part, layer, rows, cols):
        t = ty(part, layer)
        data = tensor_bytes(rng, t, rows, cols)
        w.add_tensor(name, data, raw_shape=data.shape if t.name == "F16" else None, raw_dtype=t)

    def norm(name):
        w.add_tensor(name, (1.0 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", "token_embd", None, n_vocab, HIDDEN)
    if vocab_kind == "llama-bpe":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(base, 8.0))
    for l in range(LAYERS):
        norm(f"blk.{l}.attn_norm.weight")
        matrix(f"blk.{l}.attn_q.weight", "attn_q", l, HEADS * HEAD_DIM, HIDDEN)
        matrix(f"blk.{l}.attn_k.weight", "attn_k", l, KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"blk.{l}.attn_v.weight", "attn_v", l, KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"blk.{l}.attn_output.weight", "attn_output", l, HIDDEN, HEADS * HEAD_DIM)
        norm(f"blk.{l}.ffn_norm.weight")
        matrix(f"blk.{l}.ffn_gate.weight", "ffn_gate", l, FFN, HIDDEN)
        matrix(f"blk.{l}.ffn_up.weight", "ffn_up", l, FFN, HIDDEN)
        matrix(f"blk.{l}.ffn_down.weight", "ffn_down", l, HIDDEN, FFN)
    norm("output_norm.weight")
    matrix("output.weight", "output", None, n_vocab, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(out) + ".reference.json").write_text(
        json.dumps(reference, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {out}: {mix}, {vocab_kind} vocabulary of {n_vocab} tokens")


NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def check_weights(gguf_path, out_dir):
    import gguf
    import mlx.core as mx

    out_dir = Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    field = lambda k: int(reader.fields[k].parts[-1][0])
    n_head, n_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    config = json.loads((out_dir / "config.json").read_text())
    stamp = json.loads((out_dir / "mlxd-convert.json").read_text())["tensor_types"]
    quant = config.get("quantization", {})
    w = mx.load(str(out_dir / "model.safetensors"))
    measured = {}
    used = set()
    for t in reader.tensors:
        base = t.name[: -len(".weight")]
        if base == "rope_freqs":
            # Becomes config.json's rope_scaling: the same factors from mlx-lm's formula.
            check_rope(t, config)
            continue
        if base.startswith("blk."):
            _, layer, part = base.split(".")
            module = f"model.layers.{layer}.{NAMES[part]}"
        else:
            part, module = base, NAMES[base]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        ref = ref.reshape([int(d) for d in reversed(t.shape)] if ref.ndim == 1 else ref.shape)
        if part in ("attn_q", "attn_k"):
            heads = n_head if part == "attn_q" else n_kv
            rows, cols = ref.shape
            hd = rows // heads
            # GGUF row (h, i, j) with j < 2 holds HF row (h, j, i).
            ref = ref.reshape(heads, hd // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)
        if f"{module}.scales" in w:
            spec = quant.get(module, quant)
            assert spec is not False, module
            # The stored scales and biases in f32 arithmetic, as the converter measures.
            got = mx.dequantize(
                w[f"{module}.weight"], w[f"{module}.scales"].astype(mx.float32),
                w[f"{module}.biases"].astype(mx.float32),
                group_size=spec["group_size"], bits=spec["bits"])
            used.update(f"{module}.{s}" for s in ("weight", "scales", "biases"))
        else:
            assert quant.get(module) in (None, False), (module, quant.get(module))
            got = w[f"{module}.weight"]
            used.add(f"{module}.weight")
        got = np.array(got.astype(mx.float32))
        assert got.shape == ref.shape, (t.name, got.shape, ref.shape)
        err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        m = measured.setdefault(t.tensor_type.name, {"max": 0.0, "sq": 0.0, "ref_sq": 0.0, "n": 0})
        m["max"] = max(m["max"], float(err.max()))
        m["sq"] += float((err ** 2).sum())
        m["ref_sq"] += float((ref.astype(np.float64) ** 2).sum())
        m["n"] += err.size
    assert used == set(w.keys()), sorted(set(w.keys()) - used)
    measured.pop("rope_freqs", None)
    assert set(measured) == set(stamp), (sorted(measured), sorted(stamp))
    for name, m in sorted(measured.items()):
        s = stamp[name]
        rms = (m["sq"] / m["n"]) ** 0.5
        rel = (m["sq"] / m["ref_sq"]) ** 0.5 if m["ref_sq"] else 0.0
        if s["exact"]:
            assert m["max"] == 0.0, (name, m["max"], "the stamp says exact")
        else:
            # MLX's dequantization may round its f32 arithmetic differently in the last bit.
            assert m["max"] <= s["max_abs_error"] * (1 + 1e-5) + 1e-9, (name, m["max"], s)
            assert abs(rms - s["rms_error"]) <= 1e-3 * s["rms_error"] + 1e-9, (name, rms, s)
        verdict = "exact" if m["max"] == 0.0 else (
            f"max abs error {m['max']:.3e}, RMS error {rms:.3e}, relative RMS {rel:.3e}")
        print(f"{name}: {m['n']} elements -> {s['output']}: {verdict} (mx.dequantize vs gguf.quants)")
    print(f"weights: {len(reader.tensors)} GGUF tensors checked")


def check_rope(t, config):
    from mlx_lm.models.rope_utils import initialize_rope

    import mlx.core as mx

    rs = config["rope_scaling"]
    rope = initialize_rope(config["head_dim"], config["rope_theta"], False, rs,
                           config["max_position_embeddings"])
    base_freqs = config["rope_theta"] ** (np.arange(0, config["head_dim"], 2) / config["head_dim"])
    factors = np.array(rope._freqs.astype(mx.float32)) / base_freqs
    assert np.allclose(factors, np.array(t.data, dtype=np.float64), rtol=1e-4), (factors, t.data)
    print(f"rope_freqs: {len(t.data)} factors reproduced by mlx-lm's llama3 rope ({rs})")


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
    assert prompt.startswith(auto.bos_token), prompt
    assert "Hi" in prompt, prompt
    print(f"tokenizer: {len(reference)} strings identical in the reference and transformers "
          f"{transformers.__version__} ({type(auto).__name__}); chat template renders")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "write":
        write(*args)
    elif cmd == "check-weights":
        check_weights(*args)
    elif cmd == "check-tokenizer":
        check_tokenizer(*args)
    else:
        raise SystemExit(__doc__)
