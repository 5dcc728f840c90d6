//! Mixtral (`MixtralForCausalLM`): Mistral's attention and in every layer a router that picks
//! the top-k experts by raw logit and softmaxes over those k only.
use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttentionShape;
use super::config::{floored_head_dim, parse_config};
use super::decoder::{Head, Stack};
use super::layers::Linear;
use super::llama::LlamaShaped;
use super::moe::{RoutedExperts, Router};
use super::params::{Parameters, Params};
use super::rope::{refuse_rope_scaling, ScaledRope};
use super::switch::{stack_experts, top_k_of_negated, MIXTRAL_EXPERT_PROJECTIONS};
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

/// The router: the k largest logits, softmaxed among themselves.
struct TopKSoftmax {
    gate: Linear,
    top_k: i32,
}

impl Router for TopKSoftmax {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let gates = self.gate.forward(x)?;
        let inds = top_k_of_negated(&gates, self.top_k)?;
        let scores = softmax_axis(gates.take_along_axis(&inds, -1)?, -1, true)?;
        Ok((inds, scores))
    }
}

impl Parameters for TopKSoftmax {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.gate);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    refuse_rope_scaling(FAMILY, config)?;
    for layer in 0..c.num_hidden_layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.block_sparse_moe"),
            c.num_local_experts,
            &MIXTRAL_EXPERT_PROJECTIONS,
        )?;
    }
    // mlx-lm derives the head size from the hidden size, whatever `head_dim` says.
    let head_dim = floored_head_dim(c.hidden_size, c.num_attention_heads)?;
    LlamaShaped {
        config,
        stack: Stack::llama_like(
            c.num_hidden_layers,
            c.rms_norm_eps,
            Head::tied_if(c.tie_word_embeddings),
        ),
        attention: AttentionShape::new(
            c.num_attention_heads,
            c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim,
            c.rms_norm_eps,
        ),
        rope: ScaledRope::plain(head_dim, c.rope_theta, c.rope_traditional),
        reach: None,
        head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings.unwrap_or(32768),
    }
    .build(w, |w, _, p| {
        let moe = format!("{p}.block_sparse_moe");
        let router = TopKSoftmax {
            gate: Linear::load(w, &format!("{moe}.gate"), false)?,
            top_k: c.num_experts_per_tok,
        };
        RoutedExperts::load(w, &moe, router, false)
    })
}
