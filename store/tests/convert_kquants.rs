//! GGUF files that llama.cpp's own `gguf` Python package writes (`gguf_fixtures.py write`):
//! tiny Llamas in Q4_K, Q5_K, Q6_K, Q8_0 and a Q4_K_M-style mix (which also holds Q5_0, Q5_1,
//! Q4_0, Q4_1 and F16 tensors), with a Llama 3 (`llama-bpe`)
//! or SentencePiece (Llama 2 style) vocabulary. Each is converted here and checked
//! independently: every tensor against `gguf.quants.dequantize` through `mx.dequantize`
//! (`gguf_fixtures.py check-weights`), and the tokenizer, through the Rust `tokenizers` crate
//! and through transformers, against the tokenizer the vocabulary came from. The engine side
//! (greedy tokens against mlx-lm) is engine/tests/engine/gguf_kquants.rs.
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use mlxd_store::convert::{convert_gguf_with, ConversionReport, ConvertOptions, FloatDtype};
use serde_json::Value;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_fixtures.py")
}

/// Runs `gguf_fixtures.py <args>`, failing with its output (and what to install) if it fails.
fn fixtures(args: &[&str]) -> String {
    let out = Command::new(common::python())
        .arg(script())
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gguf_fixtures.py {args:?} failed ({}); if a module is missing, run scripts/setup.sh --test:\n{stdout}\n{stderr}",
        out.status
    );
    eprint!("{stdout}");
    stdout
}

/// Writes the GGUF for `mix` and `vocab` into `dir`.
fn write_gguf(dir: &Path, mix: &str, vocab: &str) -> PathBuf {
    let path = dir.join(format!("{mix}-{vocab}.gguf"));
    fixtures(&["write", path.to_str().unwrap(), mix, vocab]);
    path
}

fn convert(gguf: &Path, out: &Path, float_dtype: FloatDtype) -> ConversionReport {
    let report = convert_gguf_with(gguf, out, &ConvertOptions { float_dtype }).unwrap();
    for line in report.lines() {
        eprintln!("  {line}");
    }
    report
}

fn read_json(path: PathBuf) -> Value {
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

#[test]
fn k_quants_convert_exactly_or_within_the_reported_error() {
    let tmp = tempfile::tempdir().unwrap();
    for mix in ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_K_M"] {
        let gguf = write_gguf(tmp.path(), mix, "llama-bpe");
        for (float_dtype, tag) in [(FloatDtype::F32, "f32"), (FloatDtype::F16, "f16")] {
            let out = tmp.path().join(format!("{mix}-{tag}"));
            let report = convert(&gguf, &out, float_dtype);
            for (ty, t) in &report.types {
                // In f32 everything but Q6_K is exact; in f16 the types whose scales are
                // GGML's own f16 are. Q6_K adds well under 1% of the weights' RMS.
                let exact = match float_dtype {
                    FloatDtype::F32 => ty != "Q6_K",
                    FloatDtype::F16 => {
                        matches!(
                            ty.as_str(),
                            "Q8_0" | "Q5_0" | "Q5_1" | "Q4_0" | "Q4_1" | "F16"
                        )
                    }
                };
                assert_eq!(t.error.is_exact(), exact, "{mix} {tag} {ty}: {t:?}");
                assert!(t.error.relative_rms() < 5e-3, "{mix} {tag} {ty}: {t:?}");
            }
            let stdout = fixtures(&[
                "check-weights",
                gguf.to_str().unwrap(),
                out.to_str().unwrap(),
            ]);
            assert!(
                stdout.contains("weights: 22 GGUF tensors checked"),
                "{stdout}"
            );
            assert!(
                stdout.contains("rope_freqs: 32 factors reproduced"),
                "{stdout}"
            );
        }
    }

    // The mix records each module's own bits, as mlx-lm reads them.
    let config = read_json(tmp.path().join("Q4_K_M-f32/config.json"));
    let q = &config["quantization"];
    assert_eq!(
        (q["bits"].as_u64(), q["group_size"].as_u64()),
        (Some(4), Some(32))
    );
    let bits = |module: &str| q[module]["bits"].as_u64();
    assert_eq!(bits("lm_head"), Some(8));
    assert_eq!(bits("model.layers.0.self_attn.v_proj"), Some(8));
    assert_eq!(bits("model.layers.0.mlp.down_proj"), Some(8));
    assert_eq!(bits("model.layers.1.mlp.down_proj"), Some(5));
    assert_eq!(bits("model.layers.1.self_attn.o_proj"), Some(5));
    assert_eq!(bits("model.layers.1.self_attn.q_proj"), Some(5));
    assert!(q.get("model.layers.1.mlp.gate_proj").is_none());
    assert_eq!(q["model.layers.1.self_attn.k_proj"], false);
    assert!(q.get("model.embed_tokens").is_none());
    // llama.cpp's rope_freqs tensor (Llama 3.1) comes back as rope_scaling.
    assert_eq!(config["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(config["rope_scaling"]["factor"], 8.0);
    assert_eq!(config["rope_theta"], 500000.0);
    let stamp = read_json(tmp.path().join("Q4_K_M-f32/mlxd-convert.json"));
    assert_eq!(stamp["tensor_types"]["Q4_K"]["exact"], true);
    assert_eq!(stamp["tensor_types"]["Q6_K"]["exact"], false);
    assert!(
        stamp["tensor_types"]["Q6_K"]["max_abs_error"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

#[test]
fn llama_bpe_tokenizer_matches_the_tokenizer_it_came_from() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_gguf(tmp.path(), "Q8_0", "llama-bpe");
    let out = tmp.path().join("out");
    convert(&gguf, &out, FloatDtype::F32);
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    assert!(common::check_reference_tokens(&gguf, &tok) >= 18);
    // The special tokens are single ids; BOS is added; decoding can skip them.
    let bos = tok.token_to_id("<|begin_of_text|>").unwrap();
    let eot = tok.token_to_id("<|eot_id|>").unwrap();
    let ids = tok
        .encode(
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
            true,
        )
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids[0], bos);
    assert_eq!(ids[1], tok.token_to_id("<|start_header_id|>").unwrap());
    assert_eq!(*ids.last().unwrap(), eot);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\n\nHi");
    let tc = read_json(out.join("tokenizer_config.json"));
    assert_eq!(tc["bos_token"], "<|begin_of_text|>");
    assert_eq!(tc["eos_token"], "<|eot_id|>");
    assert_eq!(tc["add_bos_token"], true);
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|start_header_id|>"));
    let config = read_json(out.join("config.json"));
    assert_eq!(config["bos_token_id"], bos);
    assert_eq!(config["eos_token_id"], eot);
    let stdout = fixtures(&[
        "check-tokenizer",
        gguf.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("strings identical"), "{stdout}");
}

#[test]
fn sentencepiece_tokenizer_matches_sentencepiece() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_gguf(tmp.path(), "Q8_0", "spm");
    let out = tmp.path().join("out");
    convert(&gguf, &out, FloatDtype::F32);
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    assert!(common::check_reference_tokens(&gguf, &tok) >= 17);
    // Characters outside the vocabulary fall back to their UTF-8 bytes, and decode back.
    let ids = tok.encode("☃", false).unwrap().get_ids().to_vec();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    assert_eq!(pieces, ["\u{2581}", "<0xE2>", "<0x98>", "<0x83>"]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "☃");
    // Special tokens in the text are single ids, and the text after one gets the space
    // prefix again, as llama.cpp tokenizes it.
    let a = tok.encode("Hello", false).unwrap().get_ids().to_vec();
    let b = tok.encode("world", false).unwrap().get_ids().to_vec();
    let joined = tok
        .encode("Hello</s>world", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(joined, [a.clone(), vec![2], b].concat());
    assert_eq!(tok.encode("Hello", true).unwrap().get_ids()[0], 1);
    let tc = read_json(out.join("tokenizer_config.json"));
    assert_eq!(
        (&tc["bos_token"], &tc["eos_token"], &tc["unk_token"]),
        (
            &Value::from("<s>"),
            &Value::from("</s>"),
            &Value::from("<unk>")
        )
    );
    assert!(tc["chat_template"].as_str().unwrap().contains("[INST]"));
    let stdout = fixtures(&[
        "check-tokenizer",
        gguf.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("strings identical"), "{stdout}");
}
