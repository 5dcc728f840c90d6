//! GGUF files of the `qwen2`, `qwen3`, `qwen3moe`, `gemma3` and `phi3` architectures, written
//! with llama.cpp's own `gguf` Python package the way its convert_hf_to_gguf.py writes them
//! (scripts/gen_gguf_fixture.py: tiny mlx-lm models with random weights, Hugging Face names
//! mapped by the package's tensor name map, llama.cpp's value transforms), converted here.
//!
//! Each architecture's files (all F32, F16 matrices, Q8_0 matrices, and a mix of Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0 and F16) are converted to f32 and, for two of them, f16; then
//! `gen_gguf_fixture.py check` compares every tensor with the `gguf` package's dequantization
//! (transforms inverted independently), config.json with the source model's, mlx-lm's logits on
//! the directory with the source model's (identical for F32 files), and transformers' tokens
//! with the reference tokenizer's. Here: the Rust `tokenizers` crate on the same reference,
//! and the config.json and tensor facts each family depends on. The engine side is
//! engine/tests/engine/families/gguf_families.rs.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use mlxd_store::convert::{convert_gguf_with, ConvertOptions, FloatDtype};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

const MIXES: [&str; 4] = ["F32", "F16", "Q8_0", "MIX"];

/// Runs `scripts/gen_gguf_fixture.py <args>`, failing with its output if it fails.
fn fixture_script(args: &[&str]) -> String {
    let script = mlxd_tests::workspace_root().join("scripts/gen_gguf_fixture.py");
    let out = Command::new(common::python())
        .arg(&script)
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gen_gguf_fixture.py {args:?} failed ({}); if a module is missing, run scripts/setup.sh --test:\n{stdout}\n{stderr}",
        out.status
    );
    eprint!("{stdout}");
    stdout
}

fn read_json(path: PathBuf) -> Value {
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// name → (dtype, shape)
fn tensor_shapes(dir: &Path) -> HashMap<String, (Dtype, Vec<usize>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec())))
        .collect()
}

/// The converted directories of one architecture, by `<mix>-<f32|f16>`.
struct Family {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    arch: &'static str,
}

impl Family {
    fn gguf(&self, mix: &str) -> PathBuf {
        self.root.join(format!("{}-{mix}.gguf", self.arch))
    }

    fn dir(&self, mix: &str, dtype: &str) -> PathBuf {
        self.root.join(format!("out-{mix}-{dtype}"))
    }

    fn config(&self, mix: &str) -> Value {
        read_json(self.dir(mix, "f32").join("config.json"))
    }
}

/// Writes the fixtures of `arch`, converts every mix to f32 (and F32 and MIX to f16 too), and
/// runs the independent check on all of them.
fn convert_and_check(arch: &'static str) -> Family {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    fixture_script(&["write", arch, root.to_str().unwrap()]);
    let family = Family {
        _tmp: tmp,
        root,
        arch,
    };
    let mut pairs = Vec::new();
    for mix in MIXES {
        let mut dtypes = vec![(FloatDtype::F32, "f32")];
        if matches!(mix, "F32" | "MIX") {
            dtypes.push((FloatDtype::F16, "f16"));
        }
        for (float_dtype, tag) in dtypes {
            let (gguf, out) = (family.gguf(mix), family.dir(mix, tag));
            let report = convert_gguf_with(&gguf, &out, &ConvertOptions { float_dtype })
                .unwrap_or_else(|e| panic!("{arch} {mix} {tag}: {e}"));
            // Every type here converts exactly, except f32 values rounded to f16.
            for (ty, t) in &report.types {
                let rounded = float_dtype == FloatDtype::F16 && ty == "F32";
                assert!(
                    rounded || t.error.is_exact(),
                    "{arch} {mix} {tag} {ty}: {t:?}"
                );
            }
            pairs.push(gguf.to_str().unwrap().to_string());
            pairs.push(out.to_str().unwrap().to_string());
        }
    }
    let mut args = vec!["check"];
    args.extend(pairs.iter().map(String::as_str));
    let stdout = fixture_script(&args);
    let count = |s: &str| stdout.matches(s).count();
    assert_eq!(count("GGUF tensors match"), 6, "{stdout}");
    assert_eq!(count("source keys agree"), 6, "{stdout}");
    assert_eq!(count("strings identical"), 6, "{stdout}");
    // The F32 file converted to f32 is the source model, logit for logit.
    assert_eq!(
        count("logits identical to the source model's"),
        1,
        "{stdout}"
    );
    assert!(
        common::check_reference_tokens(
            &family.gguf("Q8_0"),
            &tokenizers::Tokenizer::from_file(family.dir("Q8_0", "f32").join("tokenizer.json"))
                .unwrap(),
        ) >= 17
    );
    family
}

/// `eos_token_id` as a list of ids.
fn stop_ids(config: &Value) -> Vec<u64> {
    match &config["eos_token_id"] {
        Value::Array(a) => a.iter().map(|v| v.as_u64().unwrap()).collect(),
        v => vec![v.as_u64().unwrap()],
    }
}

fn token_id(dir: &Path, token: &str) -> u64 {
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    tok.token_to_id(token)
        .unwrap_or_else(|| panic!("{token} is not a token")) as u64
}

#[test]
fn qwen2_converts_with_qkv_biases_and_tied_embeddings() {
    let f = convert_and_check("qwen2");
    let c = f.config("Q8_0");
    assert_eq!(c["architectures"], json!(["Qwen2ForCausalLM"]));
    assert_eq!(c["tie_word_embeddings"], true);
    assert!(c.get("head_dim").is_none());
    let dir = f.dir("Q8_0", "f32");
    let t = tensor_shapes(&dir);
    assert!(!t.contains_key("lm_head.weight"));
    // A quantized projection keeps its bias as a float vector.
    assert_eq!(t["model.layers.1.self_attn.k_proj.weight"].0, Dtype::U32);
    assert_eq!(
        t["model.layers.1.self_attn.k_proj.bias"],
        (Dtype::F32, vec![32])
    );
    assert_eq!(
        stop_ids(&c),
        vec![
            token_id(&dir, "<|im_end|>"),
            token_id(&dir, "<|endoftext|>")
        ]
    );
    let tc = read_json(dir.join("tokenizer_config.json"));
    assert_eq!(tc["tokenizer_class"], "Qwen2Tokenizer");
    assert_eq!(tc["add_bos_token"], false);
    // <think> is an added token that is not special, as in Qwen's own tokenizer.
    assert_eq!(
        tc["added_tokens_decoder"][token_id(&dir, "<think>").to_string()]["special"],
        false
    );
}

#[test]
fn qwen3_converts_with_its_own_head_dimension_and_qk_norms() {
    let f = convert_and_check("qwen3");
    let c = f.config("F32");
    assert_eq!(c["model_type"], "qwen3");
    assert_eq!(c["head_dim"], 32);
    assert_eq!(c["tie_word_embeddings"], false);
    let t = tensor_shapes(&f.dir("F32", "f32"));
    assert_eq!(t["model.layers.0.self_attn.q_proj.weight"].1, vec![128, 64]);
    assert_eq!(t["model.layers.0.self_attn.q_norm.weight"].1, vec![32]);
    assert!(t.contains_key("lm_head.weight"));
}

#[test]
fn qwen3_moe_experts_become_switch_mlp() {
    let f = convert_and_check("qwen3moe");
    let c = f.config("Q8_0");
    assert_eq!(c["architectures"], json!(["Qwen3MoeForCausalLM"]));
    assert_eq!(
        (
            &c["num_experts"],
            &c["num_experts_per_tok"],
            &c["moe_intermediate_size"]
        ),
        (&json!(4), &json!(2), &json!(32))
    );
    assert_eq!(c["norm_topk_prob"], true);
    let q = &c["quantization"];
    assert_eq!((&q["bits"], &q["group_size"]), (&json!(8), &json!(32)));
    // llama.cpp keeps the router in F32: a float matrix among quantized ones.
    assert_eq!(q["model.layers.0.mlp.gate"], false);
    let t = tensor_shapes(&f.dir("Q8_0", "f32"));
    let p = "model.layers.1.mlp.switch_mlp";
    assert_eq!(
        t[&format!("{p}.gate_proj.weight")],
        (Dtype::U32, vec![4, 32, 16])
    );
    assert_eq!(
        t[&format!("{p}.gate_proj.scales")],
        (Dtype::F32, vec![4, 32, 2])
    );
    assert_eq!(
        t[&format!("{p}.down_proj.weight")],
        (Dtype::U32, vec![4, 64, 8])
    );
    assert_eq!(
        t[&format!("{p}.down_proj.biases")],
        (Dtype::F32, vec![4, 64, 1])
    );
    assert_eq!(
        t["model.layers.1.mlp.gate.weight"],
        (Dtype::F32, vec![4, 64])
    );
    let t = tensor_shapes(&f.dir("F32", "f16"));
    assert_eq!(
        t[&format!("{p}.up_proj.weight")],
        (Dtype::F16, vec![4, 32, 64])
    );
}

#[test]
fn gemma3_norms_lose_llama_cpp_s_plus_one() {
    let f = convert_and_check("gemma3");
    let c = f.config("F32");
    assert_eq!(c["model_type"], "gemma3_text");
    assert_eq!(c["query_pre_attn_scalar"], 32);
    assert_eq!(
        (&c["sliding_window"], &c["sliding_window_pattern"]),
        (&json!(8), &json!(6))
    );
    assert_eq!(
        c["rope_scaling"],
        json!({"rope_type": "linear", "factor": 8.0})
    );
    assert_eq!(c["tie_word_embeddings"], true);
    let dir = f.dir("F32", "f32");
    assert_eq!(
        stop_ids(&c),
        vec![token_id(&dir, "<eos>"), token_id(&dir, "<end_of_turn>")]
    );
    // The source norms are within 0.25 of 0 (Gemma's scale is 1 + w); stored, they are 1 + w.
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let norm = st
        .tensor("model.layers.5.post_feedforward_layernorm.weight")
        .unwrap();
    let values: Vec<f32> = norm
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(values.iter().all(|v| v.abs() <= 0.25), "{values:?}");
    let tc = read_json(dir.join("tokenizer_config.json"));
    assert_eq!(tc["add_bos_token"], true);
    assert_eq!(tc["bos_token"], "<bos>");
}

#[test]
fn phi3_keeps_its_fused_projections_and_longrope() {
    let f = convert_and_check("phi3");
    let c = f.config("Q8_0");
    assert_eq!(c["partial_rotary_factor"], 0.75);
    assert_eq!(c["rope_scaling"]["type"], "longrope");
    assert_eq!(
        c["rope_scaling"]["long_factor"],
        json!([1.0, 1.25, 2.1, 3.7, 6.4, 11.5])
    );
    assert_eq!(c["original_max_position_embeddings"], 4096);
    assert_eq!(c["tie_word_embeddings"], true);
    assert!(c.get("sliding_window").is_none());
    let dir = f.dir("Q8_0", "f32");
    let t = tensor_shapes(&dir);
    assert_eq!(
        t["model.layers.0.self_attn.qkv_proj.scales"].1,
        vec![128, 2]
    );
    assert_eq!(t["model.layers.0.mlp.gate_up_proj.scales"].1, vec![256, 2]);
    assert!(!t.contains_key("lm_head.weight"));
    assert_eq!(
        stop_ids(&c),
        vec![token_id(&dir, "<|endoftext|>"), token_id(&dir, "<|end|>")]
    );
}
