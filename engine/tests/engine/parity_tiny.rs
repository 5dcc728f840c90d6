//! Greedy tokens from our models equal mlx-lm's on the same random-weight checkpoints, for each
//! architecture family (Llama, Llama 3, Qwen2, Qwen3, Mistral) and weight format (f32, f16,
//! bf16, 4-bit quantized): through the serial reference path, and through the batched runtime
//! with each prompt alone; and for a prompt longer than two prefill chunks.
use crate::common;

use common::Gen;
use mlxd_engine::models;
use mlxd_engine::runtime::reference::greedy;

const PROMPTS: &[&[u32]] = &[
    &[5, 17, 42, 99, 7, 8, 9, 100, 101, 200],
    &[1],
    &[300, 2, 250, 250, 250, 13, 14],
];

fn check(shape: &str) {
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    check_prompts(shape, &prompts);
}

fn check_prompts(shape: &str, prompts: &[Vec<u32>]) {
    let dir = common::tiny_model(shape);
    let model = models::load(&dir).expect("load");
    let runtime = common::start_runtime(&dir, 0);
    let gens: Vec<Gen> = prompts.iter().map(|p| Gen::greedy(p, 24)).collect();
    let alone = common::generate_alone(&runtime, &gens);
    let references = common::mlx_lm_greedy_many(&dir, 24, prompts);
    for ((prompt, served), reference) in prompts.iter().zip(alone).zip(references) {
        let ours = greedy(model.as_ref(), prompt, 24, &[]).expect("generate");
        assert_eq!(
            ours,
            reference,
            "{shape}: greedy tokens differ from mlx-lm for a prompt of {} tokens",
            prompt.len()
        );
        assert_eq!(
            served.tokens,
            reference,
            "{shape}: the runtime's greedy tokens differ from mlx-lm for a prompt of {} tokens",
            prompt.len()
        );
    }
    runtime.join();
}

#[test]
fn llama_f32_matches_mlx_lm() {
    check("tiny-llama");
}

#[test]
fn llama3_rope_scaling_matches_mlx_lm() {
    check("tiny-llama3");
}

#[test]
fn qwen2_with_biases_and_untied_head_matches_mlx_lm() {
    check("tiny-qwen2");
}

#[test]
fn qwen3_matches_mlx_lm() {
    check("tiny-qwen3");
}

#[test]
fn qwen3_bf16_matches_mlx_lm() {
    check("tiny-qwen3-bf16");
}

#[test]
fn llama_4bit_quantized_matches_mlx_lm() {
    check("tiny-llama-q4");
}

#[test]
fn llama_f16_matches_mlx_lm() {
    check("tiny-llama-f16");
}

#[test]
fn mistral_matches_mlx_lm() {
    check("tiny-mistral");
}

/// A prompt of two prefill chunks and 404 tokens (4 500) is prefilled in three passes by
/// mlx-lm, by our reference path and by the runtime; the greedy tokens agree.
#[test]
fn prompt_longer_than_two_prefill_chunks_matches_mlx_lm() {
    let len = 2 * mlxd_engine::runtime::PREFILL_CHUNK + 404;
    // A fixed pseudo-random sequence over the tiny vocabulary (397 ids), so the model attends
    // over varied content rather than one repeated token.
    let mut state = 12_345u32;
    let prompt: Vec<u32> = (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (state >> 16) % 390
        })
        .collect();
    check_prompts("tiny-mistral", &[prompt]);
}
