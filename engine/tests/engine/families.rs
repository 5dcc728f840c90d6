//! Every architecture family against mlx-lm, on tiny random-weight models built with
//! mlx-lm's own classes (`scripts/gen_family_models.py`, fixtures in
//! `scripts/fixtures/families/`). For each family, greedy tokens equal mlx-lm's `generate_step`:
//! - through the serial reference path (one-sequence caches);
//! - through the batched runtime alone, and in a batch of 4 prompts of different lengths;
//! - on a prefix-cache hit (the batch's last prompt shares 32 tokens with the first request;
//!   a model with recurrent layers resumes from the state snapshot taken at 32);
//! - restored from the SSD tier by a new runtime;
//! - on prefix hits arriving together (each prompt's head cached, the four sent at once);
//! - with n-gram drafts (speculative decoding with rollback), or the family's documented
//!   refusal of the option;
//! - with 4-bit weights (mlx-lm's own quantization) against mlx-lm on the same directory.
//!
//! One test per family, each loading its model a few times (tiny: milliseconds).
//!
//! The family-specific suites live in `families/` as its submodules: checkpoints in Hugging Face
//! layout (DeepSeek, MoE), Gemma and gpt-oss specifics, GGUF conversions of the families, the
//! bounded sliding-window cache, and the families' chat formats through the HTTP routes.
use crate::common;

mod chat_formats;
mod deepseek_layouts;
mod gemma_gptoss;
mod gguf_families;
mod hybrid_checkpoints;
mod moe_checkpoints;
mod window_cache;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{generate_alone, generate_together, Gen, Output};
use mlx_rs::Array;
use mlxd_engine::cache::ssd::SsdConfig;
use mlxd_engine::models;
use mlxd_engine::runtime::draft::{DraftSource, NgramSizes, Speculation};
use mlxd_engine::runtime::reference::greedy;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

/// One prompt and mlx-lm's greedy tokens for it.
struct Case {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

/// `reference.json` of a generated family model.
fn reference(dir: &Path) -> (usize, Vec<Case>) {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference JSON");
    let ids = |a: &serde_json::Value| -> Vec<u32> {
        a.as_array()
            .expect("ids")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    let cases = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt"]),
            greedy: ids(&c["greedy"]),
        })
        .collect();
    (
        v["max_tokens"].as_u64().expect("max_tokens") as usize,
        cases,
    )
}

/// Saves `tensors` (a family's tiny model rewritten into a Hugging Face checkpoint layout) with
/// the family's config in a fresh directory, loads it, and checks the long prompt's greedy
/// tokens against mlx-lm's: the shared end of every checkpoint-layout test.
fn check_checkpoint(family: &str, dir: &Path, tensors: &HashMap<String, Array>) {
    assert!(
        tensors.keys().all(|k| !k.contains("switch_mlp")),
        "{family}: some expert stack was left in mlx-lm's form"
    );
    let hf = tempfile::tempdir().expect("tempdir");
    std::fs::copy(dir.join("config.json"), hf.path().join("config.json")).expect("config");
    Array::save_safetensors(
        tensors.iter().map(|(n, a)| (n.as_str(), a)),
        None,
        hf.path().join("model.safetensors"),
    )
    .expect("save");
    let (max_tokens, cases) = reference(dir);
    let case = &cases[0];
    let model = models::load(hf.path())
        .unwrap_or_else(|e| panic!("{family} in the Hugging Face layout does not load: {e}"));
    let tokens = greedy(model.as_ref(), &case.prompt, max_tokens, &[]).expect("greedy");
    assert_eq!(tokens, case.greedy, "{family}: greedy tokens differ");
}

/// Fuses each of mlx-lm's stacked expert gate and up projections (`[E, out, in]`) along the
/// output axis into the one tensor a checkpoint layout names `fused(moe)`.
fn fuse_gate_up(tensors: &mut HashMap<String, Array>, fused: impl Fn(&str) -> String) {
    let gates: Vec<String> = tensors
        .keys()
        .filter(|k| k.ends_with(".switch_mlp.gate_proj.weight"))
        .cloned()
        .collect();
    for gate_name in gates {
        let moe = gate_name.trim_end_matches(".switch_mlp.gate_proj.weight");
        let gate = tensors.remove(&gate_name).expect("gate");
        let up = tensors
            .remove(&format!("{moe}.switch_mlp.up_proj.weight"))
            .expect("up");
        let both = mlx_rs::ops::concatenate(&[gate, up], -2).expect("concatenate");
        tensors.insert(fused(moe), both);
    }
}

fn family_dir(name: &str) -> PathBuf {
    common::tiny_model(&format!("family-{name}"))
}

/// Snapshots of a recurrent state every 16 prompt tokens, so that the prompt sharing 32
/// tokens with the long one finds one (attention-only families ignore it).
fn limits(prompt_cache_bytes: u64) -> RuntimeLimits {
    RuntimeLimits {
        prompt_cache_bytes,
        state_snapshot_every: 16,
        ..Default::default()
    }
}

fn start(dir: &Path, limits: RuntimeLimits) -> Runtime {
    Runtime::start(dir.to_path_buf(), limits, None)
        .unwrap_or_else(|e| panic!("{} does not load: {e}", dir.display()))
}

fn assert_matches(family: &str, what: &str, out: &Output, case: &Case) {
    assert_eq!(
        out.tokens,
        case.greedy,
        "{family}, {what}: greedy tokens differ from mlx-lm for a prompt of {} tokens",
        case.prompt.len()
    );
}

/// Every check of the module comment for the family whose fixture is `name`.
fn check_family(name: &str) {
    let dir = family_dir(name);
    let (max_tokens, cases) = reference(&dir);
    let gen = |c: &Case| Gen::greedy(&c.prompt, max_tokens);

    // The serial reference path, on the long prompt (it crosses the fixtures' windows).
    let model = models::load(&dir).expect("load");
    let serial = greedy(model.as_ref(), &cases[0].prompt, max_tokens, &[]).expect("generate");
    assert_eq!(
        serial, cases[0].greedy,
        "{name}: the serial reference path differs from mlx-lm"
    );
    assert_last_position_alone_is_the_whole_pass(name, model.as_ref(), &cases[0].prompt);
    // A model with recurrent layers can only resume from a snapshot of its state, taken every
    // 16 prompt tokens here: the shared 32 tokens exactly. Drafts it refuses by name.
    let stateful = model.layer_kinds().iter().any(|k| k.is_state());
    let least_hit = if stateful { 32 } else { 1 };
    drop(model);

    // The batched runtime with the prefix cache and the SSD tier: the long prompt alone, then
    // four prompts of other lengths together, the last of which shares 32 tokens with it.
    let ssd = tempfile::tempdir().expect("tempdir");
    let with_ssd = RuntimeLimits {
        ssd: Some(SsdConfig {
            dir: ssd.path().to_path_buf(),
            max_bytes: None,
            demote_idle: None,
            checkpoint_every: None,
        }),
        ..limits(64 << 20)
    };
    let runtime = start(&dir, with_ssd.clone());
    let alone = generate_alone(&runtime, &[gen(&cases[0])]);
    assert_matches(name, "alone", &alone[0], &cases[0]);
    let batch: Vec<Gen> = cases[1..5].iter().map(gen).collect();
    let together = generate_together(&runtime, &batch);
    for (out, case) in together.iter().zip(&cases[1..5]) {
        assert_matches(name, "in a batch of 4", out, case);
    }
    assert!(
        together[3].cached >= least_hit,
        "{name}: the prompt sharing 32 tokens found {} in the prefix cache",
        together[3].cached
    );
    // The hit again, alone.
    let again = generate_alone(&runtime, &[gen(&cases[4])]);
    assert!(
        again[0].cached >= least_hit,
        "{name}: {} cached",
        again[0].cached
    );
    assert_matches(name, "from the prefix cache", &again[0], &cases[4]);
    let report = runtime
        .ssd
        .as_ref()
        .expect("an SSD tier")
        .flush(Duration::from_secs(60));
    assert!(report.complete && report.files > 0, "{name}: {report:?}");
    runtime.join();

    // A new runtime restores the shared prefix from the SSD tier and answers the same.
    let restored = start(&dir, with_ssd);
    let out = generate_alone(&restored, &[gen(&cases[4])]);
    assert!(
        out[0].cached >= least_hit,
        "{name}: a new runtime restored {} tokens from the SSD tier",
        out[0].cached
    );
    assert_matches(name, "restored from the SSD tier", &out[0], &cases[4]);
    restored.join();

    // Prefix hits arriving together: each prompt but its last 5 tokens cached first (one
    // token each, so the last of them is a row whose first token was its last, still in the
    // batch when the four are sent), then the four whole prompts at once (they share one pass
    // where their caches can be cut back).
    let runtime = start(&dir, limits(64 << 20));
    let cut: Vec<Gen> = cases[1..5]
        .iter()
        .filter(|c| c.prompt.len() > 6)
        .map(|c| Gen::greedy(&c.prompt[..c.prompt.len() - 5], 1))
        .collect();
    generate_alone(&runtime, &cut);
    let hits = generate_together(&runtime, &batch);
    for (out, case) in hits.iter().zip(&cases[1..5]) {
        assert_matches(name, "prefix hits together", out, case);
        if !stateful && case.prompt.len() > 6 {
            assert!(
                out.cached >= case.prompt.len() - 5,
                "{name}: a hit found {} of {} cached",
                out.cached,
                case.prompt.len() - 5
            );
        }
    }
    runtime.join();

    // N-gram drafts with rollback leave greedy output unchanged, or are refused by name.
    let speculation = RuntimeLimits {
        speculation: Some(Speculation {
            source: DraftSource::Ngram(NgramSizes::new(1, 3).expect("sizes")),
            num_draft: 3,
        }),
        ..limits(0)
    };
    match Runtime::start(dir.clone(), speculation, None) {
        Ok(spec) => {
            assert!(
                !stateful,
                "{name}: drafts were not refused for recurrent layers"
            );
            let gens: Vec<Gen> = [&cases[0], &cases[2], &cases[3]]
                .into_iter()
                .map(gen)
                .collect();
            let out = generate_together(&spec, &gens);
            for (o, case) in out.iter().zip([&cases[0], &cases[2], &cases[3]]) {
                assert_matches(name, "with n-gram drafts", o, case);
            }
            spec.join();
        }
        Err(e) => assert!(
            e.to_string().contains("draft"),
            "{name}: speculation failed without naming the option: {e}"
        ),
    }

    // 4-bit weights, quantized by mlx-lm, against mlx-lm on the same directory.
    let q4 = common::tiny_model(&format!("family-{name}-q4"));
    let (q_max, q_cases) = reference(&q4);
    let runtime = start(&q4, limits(0));
    let gens: Vec<Gen> = q_cases[..4]
        .iter()
        .map(|c| Gen::greedy(&c.prompt, q_max))
        .collect();
    let out = generate_alone(&runtime, &gens[..1]);
    assert_matches(name, "4-bit alone", &out[0], &q_cases[0]);
    let out = generate_together(&runtime, &gens);
    for (o, case) in out.iter().zip(&q_cases) {
        assert_matches(name, "4-bit in a batch", o, case);
    }
    runtime.join();
}

/// `forward_last` (the last position's logits, the generic decoder's last layer run on that
/// position alone) gives the last position of `forward`, and leaves the caches as `forward`
/// does: the next token's logits after each are the same.
fn assert_last_position_alone_is_the_whole_pass(
    name: &str,
    model: &dyn models::CausalLm,
    prompt: &[u32],
) {
    let input = Array::from_slice(prompt, &[1, prompt.len() as i32]);
    let next = Array::from_slice(&prompt[..1], &[1, 1]);
    let (mut whole, mut last) = (model.new_dense_caches(), model.new_dense_caches());
    let logits = |a: Array| -> Vec<f32> {
        let a = a.as_dtype(mlx_rs::Dtype::Float32).expect("float32");
        a.as_slice::<f32>().to_vec()
    };
    let full = model.forward(&input, &mut whole).expect("forward");
    let l = full.shape()[1];
    let expected = logits(mlx_rs::ops::indexing::IndexOp::index(
        &full,
        (.., l - 1.., ..),
    ));
    let got = logits(model.forward_last(&input, &mut last).expect("forward_last"));
    assert_close(name, "the last position's logits", &got, &expected);
    let after_whole = logits(model.forward(&next, &mut whole).expect("next"));
    let after_last = logits(model.forward(&next, &mut last).expect("next"));
    assert_close(name, "the next token's logits", &after_last, &after_whole);
}

fn assert_close(name: &str, what: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{name}: {what}");
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
    let worst = got
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-3 * scale,
        "{name}: {what} differ by {worst} (largest logit {scale})"
    );
}

macro_rules! family {
    ($test:ident, $name:literal) => {
        #[test]
        fn $test() {
            check_family($name);
        }
    };
}

family!(llama_control, "llama");
family!(qwen2_moe_matches_mlx_lm, "qwen2_moe");
family!(qwen3_moe_matches_mlx_lm, "qwen3_moe");
family!(mixtral_matches_mlx_lm, "mixtral");
family!(olmoe_matches_mlx_lm, "olmoe");
family!(granitemoe_matches_mlx_lm, "granitemoe");
family!(glm4_moe_matches_mlx_lm, "glm4_moe");
family!(phi3_matches_mlx_lm, "phi3");
family!(phi3_longrope_matches_mlx_lm, "phi3_longrope");
family!(granite_matches_mlx_lm, "granite");
family!(olmo2_matches_mlx_lm, "olmo2");
family!(smollm3_matches_mlx_lm, "smollm3");
family!(starcoder2_matches_mlx_lm, "starcoder2");
family!(glm4_matches_mlx_lm, "glm4");
family!(exaone4_matches_mlx_lm, "exaone4");
family!(cohere2_matches_mlx_lm, "cohere2");
family!(ministral3_matches_mlx_lm, "ministral3");
family!(mistral3_matches_mlx_lm, "mistral3");
family!(cohere_matches_mlx_lm, "cohere");
family!(deepseek_v3_matches_mlx_lm, "deepseek_v3");
family!(deepseek_v2_matches_mlx_lm, "deepseek_v2");
family!(kimi_k2_matches_mlx_lm, "kimi_k2");
family!(gemma2_matches_mlx_lm, "gemma2");
family!(gemma3_text_matches_mlx_lm, "gemma3_text");
family!(gemma3_matches_mlx_lm, "gemma3");
family!(gemma4_text_matches_mlx_lm, "gemma4_text");
family!(gemma4_moe_matches_mlx_lm, "gemma4_moe");
family!(gpt_oss_matches_mlx_lm, "gpt_oss");
family!(gpt_oss_mxfp4_matches_mlx_lm, "gpt_oss_mxfp4");
family!(lfm2_matches_mlx_lm, "lfm2");
family!(mamba2_matches_mlx_lm, "mamba2");
family!(nemotron_h_matches_mlx_lm, "nemotron_h");
family!(falcon_h1_matches_mlx_lm, "falcon_h1");
family!(qwen3_next_matches_mlx_lm, "qwen3_next");
family!(qwen3_5_matches_mlx_lm, "qwen3_5");
family!(qwen3_5_moe_matches_mlx_lm, "qwen3_5_moe");
