//! OLMoE (`OlmoeForCausalLM`): attention with queries and keys RMS-normalised over the whole
//! projection (before the split into heads), and in every layer a softmax router over the
//! experts, optionally renormalising the top-k weights.
use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::layers::Linear;
use super::llama::rope_from_config;
use super::moe_decoder::{
    self, linear_parameters, parse_config, AttentionSpec, DecoderSpec, FeedForward, Multipliers,
    QkNorm,
};
use super::switch::{
    stack_experts, top_k_of_negated, weighted_sum, SwitchActivation, SwitchGlu,
    HF_EXPERT_PROJECTIONS,
};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "OLMoE";

#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_experts: usize,
    num_experts_per_tok: i32,
    #[serde(default)]
    norm_topk_prob: bool,
    head_dim: Option<i32>,
    max_position_embeddings: Option<usize>,
    num_key_value_heads: Option<i32>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
}

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_true() -> bool {
    true
}

/// The sparse block, over the tokens flattened to `[N, D]` as mlx-lm computes it.
struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: i32,
    norm_topk_prob: bool,
}

impl FeedForward for SparseMoe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let shape = x.shape().to_vec();
        let x_flat = x.reshape(&[-1, shape[shape.len() - 1]])?;
        let probs = softmax_axis(self.gate.forward(&x_flat)?, 1, true)?;
        let inds = top_k_of_negated(&probs, self.top_k)?;
        let mut scores = probs.take_along_axis(&inds, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        weighted_sum(&self.switch_mlp.forward(&x_flat, &inds)?, &scores)?.reshape(&shape)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = linear_parameters(&self.gate);
        out.extend(self.switch_mlp.parameters());
        out
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    for layer in 0..c.num_hidden_layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.mlp"),
            c.num_experts,
            &HF_EXPERT_PROJECTIONS,
        )?;
    }
    let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
    let rope = rope_from_config(
        head_dim,
        c.rope_theta,
        c.rope_traditional,
        c.rope_scaling.as_ref(),
    )?;
    let spec = DecoderSpec {
        config,
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings.unwrap_or(4096),
        eps: c.rms_norm_eps,
        tied_embeddings: c.tie_word_embeddings,
        rope,
        attention: AttentionSpec {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim,
            qkv_bias: c.attention_bias,
            o_bias: c.attention_bias,
            qk_norm: QkNorm::Full,
            scale: (head_dim as f32).powf(-0.5),
            eps: c.rms_norm_eps,
        },
        multipliers: Multipliers::default(),
    };
    moe_decoder::build(w, spec, |w, _, p| {
        let mlp = format!("{p}.mlp");
        Ok(Box::new(SparseMoe {
            gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
            switch_mlp: SwitchGlu::load(
                w,
                &format!("{mlp}.switch_mlp"),
                c.mlp_bias,
                SwitchActivation::SwiGlu,
            )?,
            top_k: c.num_experts_per_tok,
            norm_topk_prob: c.norm_topk_prob,
        }) as Box<dyn FeedForward>)
    })
}
