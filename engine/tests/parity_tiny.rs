//! Greedy tokens from our models equal mlx-lm's on the same random-weight checkpoints, for each
//! architecture family and weight format (f32, bf16, 4-bit quantized): through the serial
//! reference path, and through the batched runtime with each prompt alone.
mod common;

use common::Gen;
use mlxd_engine::models;
use mlxd_engine::runtime::reference::greedy;

const PROMPTS: &[&[u32]] = &[
    &[5, 17, 42, 99, 7, 8, 9, 100, 101, 200],
    &[1],
    &[300, 2, 250, 250, 250, 13, 14],
];

fn check(shape: &str) {
    let dir = common::tiny_model(shape);
    let model = models::load(&dir).expect("load");
    let runtime = common::start_runtime(&dir, 0);
    let gens: Vec<Gen> = PROMPTS.iter().map(|p| Gen::greedy(p, 24)).collect();
    let alone = common::generate_alone(&runtime, &gens);
    for (prompt, served) in PROMPTS.iter().zip(alone) {
        let ours = greedy(model.as_ref(), prompt, 24, &[]).expect("generate");
        let reference = common::mlx_lm_greedy(&dir, 24, prompt);
        assert_eq!(
            ours, reference,
            "{shape}: greedy tokens differ from mlx-lm for prompt {prompt:?}"
        );
        assert_eq!(
            served.tokens, reference,
            "{shape}: the runtime's greedy tokens differ from mlx-lm for prompt {prompt:?}"
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
