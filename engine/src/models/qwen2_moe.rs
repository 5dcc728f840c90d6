//! Qwen2-MoE (`Qwen2MoeForCausalLM`, Qwen1.5-MoE): Qwen2's attention (biases on q/k/v) and in
//! every layer a softmax router over the experts plus a shared expert whose output is gated by
//! `sigmoid(shared_expert_gate(x))`. As in mlx-lm, every layer is sparse and the model always
//! has its own `lm_head`.
use mlx_rs::error::Exception;
use mlx_rs::ops::{sigmoid, softmax_axis};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::layers::{Linear, Rope};
use super::moe_decoder::{
    self, linear_parameters, parse_config, refuse_rope_scaling, AttentionSpec, DecoderSpec,
    FeedForward, Mlp, Multipliers, QkNorm,
};
use super::switch::{
    stack_experts, top_k_of_negated, weighted_sum, SwitchActivation, SwitchGlu,
    HF_EXPERT_PROJECTIONS,
};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Qwen2-MoE";

#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_experts_per_tok: i32,
    num_experts: usize,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: Option<i32>,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    max_position_embeddings: Option<usize>,
}

fn default_rope_theta() -> f32 {
    1_000_000.0
}

/// The sparse block: softmax router, top-k experts with their (unnormalised) probabilities,
/// plus the sigmoid-gated shared expert.
struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    shared_expert: Mlp,
    shared_expert_gate: Linear,
    top_k: i32,
}

impl FeedForward for SparseMoe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let gates = softmax_axis(self.gate.forward(x)?, -1, true)?;
        let inds = top_k_of_negated(&gates, self.top_k)?;
        let scores = gates.take_along_axis(&inds, -1)?;
        let y = weighted_sum(&self.switch_mlp.forward(x, &inds)?, &scores)?;
        let shared = self.shared_expert.forward(x)?;
        let shared = sigmoid(self.shared_expert_gate.forward(x)?)?.multiply(shared)?;
        y.add(shared)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = linear_parameters(&self.gate);
        out.extend(self.switch_mlp.parameters());
        out.extend(self.shared_expert.parameters());
        out.extend(linear_parameters(&self.shared_expert_gate));
        out
    }
}

fn load_sparse(w: &mut Weights, mlp: &str, top_k: i32) -> Result<SparseMoe, LoadError> {
    Ok(SparseMoe {
        gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
        switch_mlp: SwitchGlu::load(
            w,
            &format!("{mlp}.switch_mlp"),
            false,
            SwitchActivation::SwiGlu,
        )?,
        shared_expert: Mlp::load(w, &format!("{mlp}.shared_expert"))?,
        shared_expert_gate: Linear::load(w, &format!("{mlp}.shared_expert_gate"), false)?,
        top_k,
    })
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    refuse_rope_scaling(FAMILY, config)?;
    for layer in 0..c.num_hidden_layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.mlp"),
            c.num_experts,
            &HF_EXPERT_PROJECTIONS,
        )?;
    }
    let head_dim = c.hidden_size / c.num_attention_heads;
    let spec = DecoderSpec {
        config,
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings.unwrap_or(4096),
        eps: c.rms_norm_eps,
        tied_embeddings: false,
        rope: Rope {
            dims: head_dim,
            traditional: c.rope_traditional,
            base: c.rope_theta,
            scale: 1.0,
            freqs: None,
        },
        attention: AttentionSpec {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim,
            qkv_bias: true,
            o_bias: false,
            qk_norm: QkNorm::None,
            scale: (head_dim as f32).powf(-0.5),
            eps: c.rms_norm_eps,
        },
        multipliers: Multipliers::default(),
    };
    moe_decoder::build(w, spec, |w, _, p| {
        Ok(
            Box::new(load_sparse(w, &format!("{p}.mlp"), c.num_experts_per_tok)?)
                as Box<dyn FeedForward>,
        )
    })
}
