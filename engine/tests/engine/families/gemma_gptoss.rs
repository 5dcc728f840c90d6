//! Gemma 2, Gemma 3 and gpt-oss beyond the shared family checks (`families.rs`): a quantized
//! KV cache through soft-capped, windowed and sink attention, and the config values these
//! families refuse by name. Uses the tiny models of `scripts/gen_family_models.py`.
use crate::common;

use std::path::Path;

use common::{generate_alone, generate_together, Gen};
use mlxd_engine::cache::KvQuant;
use mlxd_engine::models;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};
use serde_json::Value;

/// Each family, and whether its greedy tokens under an 8-bit KV cache stay with mlx-lm's
/// plain-cache tokens for at least half of their length. The tiny Gemma 4 models do not: their
/// unscaled, value-normalised attention makes greedy choices so sensitive that mlx-lm itself,
/// with its keys and values rounded through the same 8-bit quantization, leaves its plain
/// tokens as early (measured: the same first-difference positions, prompt by prompt).
const FAMILIES: [(&str, bool); 6] = [
    ("gemma2", true),
    ("gemma3_text", true),
    ("gemma3", true),
    ("gemma4_text", false),
    ("gemma4_moe", false),
    ("gpt_oss", true),
];

/// The prompts and mlx-lm's greedy tokens of a generated family model.
fn reference(dir: &Path) -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let v: Value = serde_json::from_str(&text).expect("reference JSON");
    let ids = |a: &Value| -> Vec<u32> {
        a.as_array()
            .expect("ids")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| (ids(&c["prompt"]), ids(&c["greedy"])))
        .collect()
}

#[test]
fn an_8_bit_kv_cache_serves_each_family_alone_and_batched_close_to_mlx_lm() {
    for (family, stays_close) in FAMILIES {
        let dir = common::tiny_model(&format!("family-{family}"));
        let cases = reference(&dir);
        let runtime = Runtime::start(
            dir.clone(),
            RuntimeLimits {
                kv_quant: Some(KvQuant {
                    bits: 8,
                    group_size: 32,
                }),
                prompt_cache_bytes: 64 << 20,
                ..Default::default()
            },
            None,
        )
        .unwrap_or_else(|e| panic!("{family} with an 8-bit KV cache does not start: {e}"));
        let gens: Vec<Gen> = cases
            .iter()
            .map(|(prompt, greedy)| Gen::greedy(prompt, greedy.len()))
            .collect();
        let alone: Vec<Vec<u32>> = generate_alone(&runtime, &gens)
            .into_iter()
            .map(|o| o.tokens)
            .collect();
        let together: Vec<Vec<u32>> = generate_together(&runtime, &gens)
            .into_iter()
            .map(|o| o.tokens)
            .collect();
        assert_eq!(together, alone, "{family}: batched 8-bit KV tokens differ");
        let agreeing: Vec<usize> = cases
            .iter()
            .zip(&alone)
            .map(|((_, greedy), ours)| greedy.iter().zip(ours).take_while(|(a, b)| a == b).count())
            .collect();
        let same: usize = agreeing.iter().sum();
        let total: usize = cases.iter().map(|(_, g)| g.len()).sum();
        eprintln!(
            "{family}, 8-bit KV: {same} of {total} tokens agree with mlx-lm's plain cache \
             (per prompt, before the first difference: {agreeing:?})"
        );
        assert!(
            !stays_close || same * 2 >= total,
            "{family}: 8-bit KV diverged early ({same} of {total})"
        );
        runtime.join();
    }
}

#[test]
fn every_layer_keeps_every_position_in_the_kv_budget() {
    // Windowed layers keep every position too (the window is a mask), so the budget counts
    // all layers: 2 (keys, values) × layers × 2 KV heads × 32 × 4 bytes (float32).
    for (family, layers) in [
        ("gemma2", 4),
        ("gemma3_text", 4),
        ("gemma3", 3),
        ("gpt_oss", 4),
    ] {
        let model = models::load(&common::tiny_model(&format!("family-{family}"))).expect("load");
        assert_eq!(
            model.info().kv_bytes_per_token,
            2 * layers * 2 * 32 * 4,
            "{family}"
        );
    }
    // Gemma 4: 32-wide sliding heads, 64-wide global heads. gemma4_text's two KV-shared layers
    // (one of each kind) store their source's KV again; gemma4_moe's global layers share one
    // KV head between keys and values but store both.
    for (family, bytes) in [
        ("gemma4_text", 4 * (2 * 2 * 32 * 4) + 2 * (2 * 2 * 64 * 4)),
        ("gemma4_moe", 2 * (2 * 2 * 32 * 4) + 2 * (2 * 64 * 4)),
    ] {
        let model = models::load(&common::tiny_model(&format!("family-{family}"))).expect("load");
        assert_eq!(model.info().kv_bytes_per_token, bytes, "{family}");
        assert_eq!(model.info().head_dim, 32, "{family}");
    }
}

/// Loads a copy of the family's tiny model with `edit` applied to its config; returns the
/// load error's message.
fn load_error(family: &str, edit: impl FnOnce(&mut Value)) -> String {
    let src = common::tiny_model(&format!("family-{family}"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config"))
            .expect("config JSON");
    edit(&mut config);
    std::fs::write(tmp.path().join("config.json"), config.to_string()).expect("write config");
    std::fs::copy(
        src.join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .expect("copy weights");
    match models::load(tmp.path()) {
        Ok(_) => panic!("{family}: the edited config loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_config_values_are_refused_by_name() {
    let e = load_error("gemma2", |c| c["hidden_activation"] = "relu".into());
    assert!(e.contains("hidden_activation"), "{e}");
    let e = load_error("gemma2", |c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0})
    });
    assert!(e.contains("rope_scaling"), "{e}");
    let e = load_error("gemma3_text", |c| {
        c["layer_types"] = serde_json::json!(vec!["full_attention"; 4])
    });
    assert!(e.contains("layer_types"), "{e}");
    let e = load_error("gemma3_text", |c| {
        c["final_logit_softcapping"] = 30.0.into()
    });
    assert!(e.contains("final_logit_softcapping"), "{e}");
    let e = load_error("gemma3", |c| {
        c["text_config"]["rope_scaling"] =
            serde_json::json!({"rope_type": "dynamic", "factor": 2.0})
    });
    assert!(e.contains("dynamic"), "{e}");
    let e = load_error("gpt_oss", |c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 2.0})
    });
    assert!(e.contains("longrope"), "{e}");
    let e = load_error("gpt_oss", |c| {
        c["layer_types"] = serde_json::json!(["sliding_attention", "full_attention"])
    });
    assert!(e.contains("layer_types"), "{e}");
    let e = load_error("gemma4_text", |c| {
        c["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into()
    });
    assert!(e.contains("yarn"), "{e}");
    let e = load_error("gemma4_text", |c| c["num_kv_shared_layers"] = 5.into());
    assert!(e.contains("no earlier layer of its type"), "{e}");
    let e = load_error("gpt_oss", |c| c["swiglu_limit"] = 9.0.into());
    assert!(e.contains("swiglu_limit"), "{e}");
}

/// A copy of the family's tiny model with its tensors renamed or regrouped by `edit`.
fn with_tensors(
    family: &str,
    edit: impl FnOnce(&mut std::collections::HashMap<String, mlx_rs::Array>),
) -> tempfile::TempDir {
    let src = common::tiny_model(&format!("family-{family}"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut tensors =
        mlx_rs::Array::load_safetensors(src.join("model.safetensors")).expect("weights");
    edit(&mut tensors);
    mlx_rs::Array::save_safetensors(&tensors, None, tmp.path().join("model.safetensors"))
        .expect("save");
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).expect("config");
    tmp
}

/// The serial greedy tokens of a model directory for the family's first reference prompt
/// equal mlx-lm's.
fn assert_greedy_matches(family: &str, dir: &Path) {
    let cases = reference(&common::tiny_model(&format!("family-{family}")));
    let (prompt, expected) = &cases[0];
    let model = models::load(dir).unwrap_or_else(|e| panic!("{family}: {e}"));
    let tokens =
        mlxd_engine::runtime::reference::greedy(model.as_ref(), prompt, expected.len(), &[])
            .expect("generate");
    assert_eq!(&tokens, expected, "{family}");
}

#[test]
fn hugging_face_gemma4_checkpoints_load_as_mlx_lm_sanitizes_them() {
    let dummy = || mlx_rs::Array::from_slice(&[0.0f32; 4], &[4]);
    // Multimodal: `model.language_model.*`, other towers, one stacked `gate_up_proj` and a
    // bare `down_proj` per layer's experts, rotary tables and activation statistics.
    let raw = with_tensors("gemma4_moe", |t| {
        let names: Vec<String> = t.keys().cloned().collect();
        for name in names {
            let a = t.remove(&name).expect("tensor");
            let inner = name.strip_prefix("language_model.model.").expect("prefix");
            t.insert(format!("model.language_model.{inner}"), a);
        }
        for i in 0..4 {
            let p = format!("model.language_model.layers.{i}.experts");
            let gate = t
                .remove(&format!("{p}.switch_glu.gate_proj.weight"))
                .expect("gate");
            let up = t
                .remove(&format!("{p}.switch_glu.up_proj.weight"))
                .expect("up");
            let down = t
                .remove(&format!("{p}.switch_glu.down_proj.weight"))
                .expect("down");
            let stacked = mlx_rs::ops::concatenate(&[gate, up], -2).expect("stack");
            t.insert(format!("{p}.gate_up_proj"), stacked);
            t.insert(format!("{p}.down_proj"), down);
        }
        t.insert("model.vision_tower.patch.weight".into(), dummy());
        t.insert("model.embed_audio.weight".into(), dummy());
        t.insert(
            "model.language_model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            dummy(),
        );
        t.insert(
            "model.language_model.layers.1.mlp.down_proj.input_max".into(),
            dummy(),
        );
    });
    assert_greedy_matches("gemma4_moe", raw.path());
    // KV-shared layers' own key/value projections, which mlx-lm drops.
    let raw = with_tensors("gemma4_text", |t| {
        for name in [
            "4.self_attn.k_proj.weight",
            "5.self_attn.v_proj.weight",
            "5.self_attn.k_norm.weight",
        ] {
            t.insert(format!("model.layers.{name}"), dummy());
        }
    });
    assert_greedy_matches("gemma4_text", raw.path());
}
