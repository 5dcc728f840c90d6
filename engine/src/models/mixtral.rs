//! Mixtral (`MixtralForCausalLM`): Mistral's attention and in every layer a router that picks
//! the top-k experts by raw logit and softmaxes over those k only.
use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::layers::{Linear, Rope};
use super::moe_decoder::{
    self, linear_parameters, parse_config, refuse_rope_scaling, AttentionSpec, DecoderSpec,
    FeedForward, Multipliers, QkNorm,
};
use super::switch::{
    stack_experts, top_k_of_negated, weighted_sum, SwitchActivation, SwitchGlu,
    MIXTRAL_EXPERT_PROJECTIONS,
};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Mixtral";

/// mlx-lm's `ModelArgs` defaults (Mixtral-8x7B).
#[derive(Debug, Deserialize)]
#[serde(default)]
struct Config {
    vocab_size: usize,
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_experts_per_tok: i32,
    num_key_value_heads: Option<i32>,
    num_local_experts: usize,
    rms_norm_eps: f32,
    rope_theta: f32,
    rope_traditional: bool,
    tie_word_embeddings: bool,
    max_position_embeddings: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            vocab_size: 32000,
            hidden_size: 4096,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_experts_per_tok: 2,
            num_key_value_heads: Some(8),
            num_local_experts: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            rope_traditional: false,
            tie_word_embeddings: false,
            max_position_embeddings: None,
        }
    }
}

/// The sparse block: the k largest router logits, softmaxed among themselves.
struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: i32,
}

impl FeedForward for SparseMoe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let gates = self.gate.forward(x)?;
        let inds = top_k_of_negated(&gates, self.top_k)?;
        let scores = softmax_axis(gates.take_along_axis(&inds, -1)?, -1, true)?;
        weighted_sum(&self.switch_mlp.forward(x, &inds)?, &scores)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = linear_parameters(&self.gate);
        out.extend(self.switch_mlp.parameters());
        out
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    refuse_rope_scaling(FAMILY, config)?;
    if c.tie_word_embeddings {
        w.discard("lm_head.weight");
    }
    for layer in 0..c.num_hidden_layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.block_sparse_moe"),
            c.num_local_experts,
            &MIXTRAL_EXPERT_PROJECTIONS,
        )?;
    }
    // mlx-lm derives the head size from the hidden size, whatever `head_dim` says.
    let head_dim = c.hidden_size / c.num_attention_heads;
    let spec = DecoderSpec {
        config,
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings.unwrap_or(32768),
        eps: c.rms_norm_eps,
        tied_embeddings: c.tie_word_embeddings,
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
            qkv_bias: false,
            o_bias: false,
            qk_norm: QkNorm::None,
            scale: (head_dim as f32).powf(-0.5),
            eps: c.rms_norm_eps,
        },
        multipliers: Multipliers::default(),
    };
    moe_decoder::build(w, spec, |w, _, p| {
        let moe = format!("{p}.block_sparse_moe");
        Ok(Box::new(SparseMoe {
            gate: Linear::load(w, &format!("{moe}.gate"), false)?,
            switch_mlp: SwitchGlu::load(
                w,
                &format!("{moe}.switch_mlp"),
                false,
                SwitchActivation::SwiGlu,
            )?,
            top_k: c.num_experts_per_tok,
        }) as Box<dyn FeedForward>)
    })
}
