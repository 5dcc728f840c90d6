//! Cohere (`CohereForCausalLM`, Command R / R+), as mlx-lm's `cohere.py`: the Cohere 2
//! decoder ([`super::cohere2`]) with every layer global and rotary, heads of
//! `hidden_size / num_attention_heads`, and optionally layer-normalised query and key heads
//! (`use_qk_norm`, Command R+).
use serde::Deserialize;
use serde_json::Value;

use super::attention::Reach;
use super::cohere2::{build_decoder, Shape};
use super::config::{implied_head_dim, parse_config};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

/// The fields mlx-lm's `cohere.ModelArgs` reads, with its defaults.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(default = "defaults::hidden_size")]
    hidden_size: i32,
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::heads")]
    num_attention_heads: i32,
    #[serde(default = "defaults::heads")]
    num_key_value_heads: i32,
    #[serde(default = "defaults::rope_theta")]
    rope_theta: f32,
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::layer_norm_eps")]
    layer_norm_eps: f32,
    #[serde(default = "defaults::logit_scale")]
    logit_scale: f32,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    layer_norm_bias: bool,
    #[serde(default)]
    use_qk_norm: bool,
    max_position_embeddings: Option<usize>,
}

mod defaults {
    pub fn hidden_size() -> i32 {
        8192
    }
    pub fn num_hidden_layers() -> usize {
        40
    }
    pub fn heads() -> i32 {
        64
    }
    pub fn rope_theta() -> f32 {
        8_000_000.0
    }
    pub fn vocab_size() -> usize {
        256000
    }
    pub fn layer_norm_eps() -> f32 {
        1e-5
    }
    pub fn logit_scale() -> f32 {
        0.0625
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Cohere", config)?;
    let head_dim = implied_head_dim(c.hidden_size, c.num_attention_heads)?;
    let shape = Shape {
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim,
        rope_theta: c.rope_theta,
        attention_bias: c.attention_bias,
        layer_norm_eps: c.layer_norm_eps,
        layer_norm_bias: c.layer_norm_bias,
        qk_norm: c.use_qk_norm,
        f16_attention_in_f32: false,
        logit_scale: c.logit_scale,
    };
    let reach = vec![Reach::GlobalRope; c.num_hidden_layers];
    build_decoder(
        config,
        w,
        &shape,
        &reach,
        c.vocab_size,
        c.max_position_embeddings.unwrap_or(4096),
    )
}
