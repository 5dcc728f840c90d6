//! GLM-4 (`Glm4ForCausalLM`, GLM-4-0414): a Llama-like decoder with a fused gate/up
//! projection, "sandwich" norms (each sub-layer's output is normalised again before the
//! residual add), biased q/k/v, and rotary embedding on only part of each head (traditional
//! pairing by default), as mlx-lm's `glm4.py`.
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttentionShape;
use super::config::{default_true, parse_config};
use super::decoder::{Head, NormKind, NormPlacement, Stack};
use super::llama::LlamaShaped;
use super::mlp::FusedGatedMlp;
use super::rope::ScaledRope;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

/// The fields mlx-lm's `glm4.ModelArgs` reads, with its defaults.
#[derive(Debug, Deserialize)]
struct Config {
    num_hidden_layers: usize,
    num_attention_heads: i32,
    attention_bias: bool,
    head_dim: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: i32,
    partial_rotary_factor: f32,
    rope_theta: f32,
    #[serde(default = "default_true")]
    rope_traditional: bool,
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
}

fn default_context() -> usize {
    32768
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("GLM-4", config)?;
    // `int(head_dim * partial_rotary_factor)`: Python truncates toward zero.
    let rotary_dims = (c.head_dim as f32 * c.partial_rotary_factor) as i32;
    if rotary_dims <= 0 || rotary_dims > c.head_dim || rotary_dims % 2 != 0 {
        return Err(LoadError::Config(format!(
            "GLM-4 partial_rotary_factor {} gives {rotary_dims} rotary dimensions of a {}-wide head",
            c.partial_rotary_factor, c.head_dim
        )));
    }
    LlamaShaped {
        config,
        // Norms before and after each branch; mlx-lm's GLM-4 always has its own output matrix.
        stack: Stack {
            placement: NormPlacement::Sandwich,
            ..Stack::pre_norm(
                c.num_hidden_layers,
                NormKind::Rms {
                    eps: c.rms_norm_eps,
                },
                Head::Own,
            )
        },
        attention: AttentionShape {
            qkv_bias: c.attention_bias,
            ..AttentionShape::new(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.rms_norm_eps,
            )
        },
        rope: ScaledRope::plain(rotary_dims, c.rope_theta, c.rope_traditional),
        reach: None,
        head_dim: c.head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
    }
    .build(w, |w, _, p| FusedGatedMlp::load(w, &format!("{p}.mlp")))
}
