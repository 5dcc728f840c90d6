//! Cohere (`CohereForCausalLM`, Command R / R+), as mlx-lm's `cohere.py`: the Cohere 2
//! decoder ([`super::cohere2`]) with every layer global and rotary, heads of
//! `hidden_size / num_attention_heads`, and optionally layer-normalised query and key heads
//! (`use_qk_norm`, Command R+).
use serde::Deserialize;
use serde_json::Value;

use super::cohere2::{load_layers, traditional_rope, Cohere, Reach, Shape};
use super::dense2_blocks::{decoder_info, parse_config};
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
    if c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0 {
        return Err(LoadError::Config(format!(
            "Cohere hidden_size {} is not a multiple of num_attention_heads {}",
            c.hidden_size, c.num_attention_heads
        )));
    }
    let head_dim = c.hidden_size / c.num_attention_heads;
    let shape = Shape {
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        attention_bias: c.attention_bias,
        layer_norm_eps: c.layer_norm_eps,
        layer_norm_bias: c.layer_norm_bias,
        qk_norm: c.use_qk_norm,
    };
    let reach = vec![Reach::GlobalRope; c.num_hidden_layers];
    let (layers, embed_tokens, norm) = load_layers(w, &shape, &reach)?;
    let info = decoder_info(
        config,
        c.vocab_size,
        c.num_hidden_layers,
        c.max_position_embeddings.unwrap_or(4096),
        c.num_key_value_heads,
        head_dim,
        &embed_tokens,
    );
    Cohere {
        embed_tokens,
        layers,
        norm,
        rope: traditional_rope(head_dim, c.rope_theta),
        scale: (head_dim as f32).powf(-0.5),
        logit_scale: c.logit_scale,
        f16_attention_in_f32: false,
        info,
    }
    .finish(w)
}
