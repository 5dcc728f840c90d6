"""Cross-checks a directory made by `convert_gguf` from the SmolLM2 GGUF, independently of
our Rust code: llama.cpp's own `gguf` Python package reads the GGUF.

usage: .venv/bin/python store/tests/convert_gguf_check.py <gguf> <converted_dir> [--llama-cpp [--write-fixture]]

1. Weights: every tensor of the GGUF is dequantized by the `gguf` package
   (`gguf.quants.dequantize`), Q/K rows un-permuted here independently, and compared with
   `mx.dequantize` of the converted MLX tensors (must be equal up to f16 rounding of norms).
2. Vocabulary: the GGUF's `tokenizer.ggml.tokens`, token types and merges, as the `gguf`
   package reads them, against the converted tokenizer.json.
3. Tokenizer: the ids in store/tests/testdata/smollm2_tokens.json (recorded from llama.cpp)
   must come out of Python `tokenizers` and `transformers.AutoTokenizer` on the converted
   tokenizer.json, and decode back.

Steps 1 to 3 need only `gguf`, `mlx`, `tokenizers` and `transformers` (installed by
`scripts/setup.sh --test`); the Rust test `convert_gguf::gguf_package_agrees_with_conversion`
runs them. With --llama-cpp the ids are re-derived from llama.cpp itself (llama_cpp_python,
vocab only; not installed by setup.sh, since it compiles llama.cpp for ~11 minutes), and with
--write-fixture written to the fixture, which the Rust test `converts_smollm2` also compares
against the Rust `tokenizers` crate.
"""
import json
import sys
from pathlib import Path

import numpy as np

STRINGS = [
    "What is the capital of France?",
    "Hello world",
    " leading space",
    "   three spaces then text",
    "tabs\tand\nnewlines\n\n\nend",
    "trailing spaces   ",
    "digits 1234567890 and 3.14159 and 1,000,000",
    "2024-05-17T12:34:56Z",
    "unicode: héllo wörld — ñ ç ß",
    "日本語のテキストと中文",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "Ελληνικά и русский текст",
    "code: fn main() { println!(\"{}\", x); }",
    "def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>special<repo_name>tokens<file_sep>",
    "don't won't I'm you're we've they'll",
    "URL https://example.com/a?b=c&d=e#frag",
    "mixed CASE words ALLCAPS camelCase snake_case",
    "",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]


def check_weights(gguf_path, out_dir):
    import gguf
    import mlx.core as mx

    reader = gguf.GGUFReader(gguf_path)
    meta = {k: f for k, f in reader.fields.items()}
    n_head = int(meta["llama.attention.head_count"].parts[-1][0])
    n_kv = int(meta["llama.attention.head_count_kv"].parts[-1][0])
    w = mx.load(str(Path(out_dir) / "model.safetensors"))
    names = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    worst = {}
    used = set()
    for t in reader.tensors:
        base = t.name[: -len(".weight")]
        if base.startswith("blk."):
            _, layer, part = base.split(".")
            module = f"model.layers.{layer}.{names[part]}"
        else:
            part = base
            module = names[base]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        ref = ref.reshape([int(d) for d in reversed(t.shape)] if ref.ndim == 1 else ref.shape)
        if part in ("attn_q", "attn_k"):
            heads = n_head if part == "attn_q" else n_kv
            rows, cols = ref.shape
            hd = rows // heads
            # GGUF row (h, i, j) with j < 2 holds HF row (h, j, i).
            ref = ref.reshape(heads, hd // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)
        if f"{module}.scales" in w:
            bits = 8 if t.tensor_type.name == "Q8_0" else 4
            # Dequantized with the f16 scales and biases widened to f32, so the check sees
            # the stored representation rather than f16 arithmetic rounding.
            got = mx.dequantize(
                w[f"{module}.weight"],
                w[f"{module}.scales"].astype(mx.float32),
                w[f"{module}.biases"].astype(mx.float32),
                group_size=32, bits=bits,
            )
            used.update(f"{module}.{s}" for s in ("weight", "scales", "biases"))
            tol = 1e-6
        else:
            got = w[f"{module}.weight"]
            used.add(f"{module}.weight")
            tol = 1e-3  # f32 norms stored as f16
        got = np.array(got.astype(mx.float32))
        assert got.shape == ref.shape, (t.name, got.shape, ref.shape)
        diff = float(np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref))))
        key = t.tensor_type.name
        worst[key] = max(worst.get(key, 0.0), diff)
        assert diff <= tol, (t.name, diff)
    assert used == set(w.keys()), sorted(set(w.keys()) - used)
    print(f"weights: {len(reader.tensors)} GGUF tensors match; worst relative diff per type: {worst}")


def check_vocab(gguf_path, out_dir):
    import gguf

    reader = gguf.GGUFReader(gguf_path)

    def strings(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    f = reader.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    merges = strings("tokenizer.ggml.merges")
    tj = json.loads((Path(out_dir) / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for t in tj.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    assert len(vocab) == len(tokens), (len(vocab), len(tokens))
    for i, tok in enumerate(tokens):
        assert vocab.get(tok) == i, (i, tok, vocab.get(tok))
    got_merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert got_merges == merges, "merges differ"
    control = {tokens[i] for i, t in enumerate(types) if t == gguf.TokenType.CONTROL}
    added = {t["content"] for t in tj.get("added_tokens", []) if t.get("special")}
    assert control <= added, sorted(control - added)
    print(f"vocab: {len(tokens)} tokens, {len(merges)} merges and {len(control)} control "
          "tokens match")


def fixture_path():
    return Path(__file__).parent / "testdata" / "smollm2_tokens.json"


def check_tokenizer(out_dir, reference):
    """`reference` maps a string to its ids: llama.cpp, or the recorded fixture."""
    import tokenizers
    import transformers

    fast = tokenizers.Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out_dir)
    cases = []
    for s in STRINGS:
        ref = reference(s)
        ids = fast.encode(s, add_special_tokens=False).ids
        ids_auto = auto.encode(s, add_special_tokens=False)
        assert ids == ref, (s, ids, ref)
        assert ids_auto == ref, (s, ids_auto, ref)
        assert fast.decode(ids, skip_special_tokens=False) == s, s
        assert auto.decode(ids) == s, (s, auto.decode(ids))
        cases.append({"text": s, "ids": ids})
    # The chat template renders through transformers as mlx-lm uses it.
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n"), prompt
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    print(f"tokenizer: {len(cases)} strings identical in the reference, tokenizers "
          f"{tokenizers.__version__} and transformers {transformers.__version__} "
          f"({type(auto).__name__})")
    return cases


def fixture_reference():
    recorded = {c["text"]: c["ids"] for c in json.loads(fixture_path().read_text())}
    missing = [s for s in STRINGS if s not in recorded]
    assert not missing, f"strings missing from {fixture_path()}: {missing}"
    return lambda s: recorded[s]


def llama_cpp_reference(gguf_path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    return lambda s: llm.tokenize(s.encode(), add_bos=False, special=True)


if __name__ == "__main__":
    gguf_path, out_dir = sys.argv[1], sys.argv[2]
    flags = sys.argv[3:]
    check_weights(gguf_path, out_dir)
    check_vocab(gguf_path, out_dir)
    if "--llama-cpp" in flags:
        cases = check_tokenizer(out_dir, llama_cpp_reference(gguf_path))
        if "--write-fixture" in flags:
            fixture_path().write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")
            print(f"wrote {fixture_path()}")
    else:
        check_tokenizer(out_dir, fixture_reference())
