//! GGUF files of the `qwen2`, `qwen3`, `qwen3moe`, `gemma3` and `phi3` architectures, written
//! with llama.cpp's `gguf` package the way convert_hf_to_gguf.py writes them
//! (scripts/gen_gguf_fixture.py), converted by the store and served by the engine:
//! - the engine loads every converted directory (every tensor used, the family's config
//!   accepted) and its greedy tokens equal mlx-lm's on the same directory, for an F32 file and
//!   a Q8_0 one (converted with f32 scales, as the store converts on this CPU);
//! - for the F32 file, those tokens are also the source model's: GGUF and back changes nothing;
//! - the engine's chat-template ids equal transformers', and its stop tokens are config.json's.
//!
//! The conversion itself is checked tensor by tensor in store/tests/convert_families.rs.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use mlxd_engine::models;
use mlxd_engine::runtime::reference::greedy;
use mlxd_engine::tokenizer::Tokenizer;
use mlxd_protocol::openai::ChatMessage;
use mlxd_store::convert::{convert_gguf_with, ConvertOptions, FloatDtype};

const MAX_TOKENS: usize = 16;

/// Writes the fixtures of `arch` into `dir` (`<arch>-<mix>.gguf` and `<arch>-source`).
fn write_fixtures(dir: &Path, arch: &str) {
    let root = common::workspace_root();
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("scripts/gen_gguf_fixture.py"))
        .args(["write", arch, dir.to_str().unwrap()])
        .output()
        .expect("run .venv/bin/python (scripts/setup.sh --test creates it)");
    assert!(
        out.status.success(),
        "gen_gguf_fixture.py write {arch} failed; if a module is missing, run scripts/setup.sh --test: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Converts `<arch>-<mix>.gguf` with f32 floats; returns the directory.
fn convert(dir: &Path, arch: &str, mix: &str) -> PathBuf {
    let out = dir.join(format!("{arch}-{mix}-converted"));
    let opts = ConvertOptions {
        float_dtype: FloatDtype::F32,
    };
    convert_gguf_with(&dir.join(format!("{arch}-{mix}.gguf")), &out, &opts)
        .unwrap_or_else(|e| panic!("{arch} {mix}: {e}"));
    out
}

/// A prompt of 20 ids below 400 (every fixture vocabulary is larger), long enough that with
/// the generated tokens it crosses Gemma's sliding window of 8.
fn prompt() -> Vec<u32> {
    let mut state = 7u32;
    (0..20)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (state >> 16) % 400
        })
        .collect()
}

/// The engine's greedy tokens on `dir`, after checking that it loads and reports config.json's
/// stop tokens.
fn engine_greedy(dir: &Path) -> Vec<u32> {
    let model = models::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        model.info().eos_token_ids,
        models::eos_ids(&config),
        "{}",
        dir.display()
    );
    greedy(model.as_ref(), &prompt(), MAX_TOKENS, &[]).expect("generate")
}

fn check(arch: &str) {
    let tmp = tempfile::tempdir().unwrap();
    write_fixtures(tmp.path(), arch);

    let exact = convert(tmp.path(), arch, "F32");
    let ours = engine_greedy(&exact);
    assert_eq!(ours.len(), MAX_TOKENS);
    assert_eq!(
        ours,
        common::mlx_lm_greedy(&exact, MAX_TOKENS, &prompt()),
        "{arch} F32: greedy tokens differ from mlx-lm on the converted directory"
    );
    assert_eq!(
        ours,
        common::mlx_lm_greedy(
            &tmp.path().join(format!("{arch}-source")),
            MAX_TOKENS,
            &prompt()
        ),
        "{arch} F32: greedy tokens differ from the source model's"
    );

    let quantized = convert(tmp.path(), arch, "Q8_0");
    assert_eq!(
        engine_greedy(&quantized),
        common::mlx_lm_greedy(&quantized, MAX_TOKENS, &prompt()),
        "{arch} Q8_0: greedy tokens differ from mlx-lm on the converted directory"
    );

    let tok = Tokenizer::from_dir(&quantized).expect("tokenizer");
    let user = "What is the capital of France?";
    let messages: Vec<ChatMessage> =
        serde_json::from_value(serde_json::json!([{"role": "user", "content": user}])).unwrap();
    let (_, ids) = tok
        .encode_chat(&messages, None, true)
        .expect("chat template");
    assert_eq!(
        ids,
        common::hf_chat_tokens(&quantized, user),
        "{arch}: chat ids differ from transformers'"
    );
}

#[test]
fn qwen2_gguf_serves_like_mlx_lm() {
    check("qwen2");
}

#[test]
fn qwen3_gguf_serves_like_mlx_lm() {
    check("qwen3");
}

#[test]
fn qwen3_moe_gguf_serves_like_mlx_lm() {
    check("qwen3moe");
}

#[test]
fn gemma3_gguf_serves_like_mlx_lm() {
    check("gemma3");
}

#[test]
fn phi3_gguf_serves_like_mlx_lm() {
    check("phi3");
}
