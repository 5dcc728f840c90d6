//! GGUF files in the K-quants and a Q4_K_M-style mix, written by llama.cpp's `gguf` Python
//! package (store/tests/gguf_fixtures.py), converted by the store and served by the engine:
//! the engine's chat-template ids equal transformers', and its greedy tokens equal mlx-lm's on
//! the same converted directory (per-module bit widths included). The conversion itself is
//! checked tensor by tensor in store/tests/convert_kquants.rs.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use mlxd_engine::models;
use mlxd_engine::runtime::reference::greedy;
use mlxd_engine::tokenizer::Tokenizer;
use mlxd_protocol::openai::ChatMessage;
use mlxd_store::convert::{convert_gguf_with, ConvertOptions, FloatDtype};

/// Writes the fixture GGUF `mix` with vocabulary `vocab` into `dir` and converts it the way the
/// store does (f32 scales); returns the converted directory.
fn converted(dir: &Path, mix: &str, vocab: &str) -> PathBuf {
    let root = common::workspace_root();
    let gguf = dir.join(format!("{mix}-{vocab}.gguf"));
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("store/tests/gguf_fixtures.py"))
        .args(["write", gguf.to_str().unwrap(), mix, vocab])
        .output()
        .expect("run .venv/bin/python (scripts/setup.sh --test creates it)");
    assert!(
        out.status.success(),
        "gguf_fixtures.py write failed; if a module is missing, run scripts/setup.sh --test: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model = dir.join(format!("{mix}-{vocab}"));
    let opts = ConvertOptions {
        float_dtype: FloatDtype::F32,
    };
    convert_gguf_with(&gguf, &model, &opts).expect("convert");
    model
}

fn check(mix: &str, vocab: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = converted(tmp.path(), mix, vocab);
    let tok = Tokenizer::from_dir(&dir).expect("tokenizer");
    let user = "What is the capital of France?";
    let messages: Vec<ChatMessage> =
        serde_json::from_value(serde_json::json!([{"role": "user", "content": user}])).unwrap();
    let (_, prompt) = tok
        .encode_chat(&messages, None, true)
        .expect("chat template");
    assert_eq!(
        prompt,
        common::hf_chat_tokens(&dir, user),
        "{mix} {vocab}: chat ids differ from transformers'"
    );
    let model = models::load(&dir).expect("load");
    let ours = greedy(model.as_ref(), &prompt, 12, &[]).expect("generate");
    let reference = common::mlx_lm_greedy(&dir, 12, &prompt);
    assert_eq!(
        ours, reference,
        "{mix} {vocab}: greedy tokens differ from mlx-lm"
    );
    assert_eq!(ours.len(), 12);
}

#[test]
fn q4_k_m_mix_matches_mlx_lm() {
    check("Q4_K_M", "llama-bpe");
}

#[test]
fn q5_k_matches_mlx_lm() {
    check("Q5_K", "llama-bpe");
}

#[test]
fn q6_k_with_a_sentencepiece_vocabulary_matches_mlx_lm() {
    check("Q6_K", "spm");
}
