//! IBM Granite 3.x (dense): the Llama decoder with four scalar knobs that μP-style training
//! left in the architecture: the embedding is multiplied by `embedding_multiplier`, the
//! attention scale is `attention_multiplier` (not `1/sqrt(head_dim)`), each residual branch is
//! multiplied by `residual_multiplier` before it is added, and the logits are divided by
//! `logits_scaling`. Granite-MoE ([`super::granitemoe`]) is the same decoder with experts.
use serde::Deserialize;
use serde_json::Value;

use super::attention::{AttentionShape, QkNorm};
use super::config::{check_heads, default_true, implied_head_dim, parse_config};
use super::decoder::{EndScalars, Head, Stack};
use super::llama::LlamaShaped;
use super::mlp::GatedMlp;
use super::rope::{rope_from_config, ScaledRope};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `granite.ModelArgs` and `granitemoe.ModelArgs`
/// both read (all but `rope_scaling` and `tie_word_embeddings` are required there too).
#[derive(Debug, Deserialize)]
pub(crate) struct GraniteArgs {
    hidden_size: i32,
    pub num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    logits_scaling: f32,
    attention_multiplier: f32,
    embedding_multiplier: f32,
    residual_multiplier: f32,
    max_position_embeddings: usize,
    attention_bias: bool,
    rope_theta: f32,
    rope_scaling: Option<Value>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
}

impl GraniteArgs {
    /// The Granite decoder these fields describe, its feed-forward parts the family's.
    pub(crate) fn shaped<'a>(&self, config: &'a Value) -> Result<LlamaShaped<'a>, LoadError> {
        check_heads(self.num_attention_heads, self.num_key_value_heads)?;
        let head_dim = implied_head_dim(self.hidden_size, self.num_attention_heads)?;
        if self.logits_scaling == 0.0 {
            return Err(LoadError::Config(
                "Granite logits_scaling must not be 0".into(),
            ));
        }
        // mlx-lm builds Granite's rotary embedding non-traditional whatever the config says.
        let rope = rope_from_config(head_dim, self.rope_theta, false, self.rope_scaling.as_ref())?;
        let stack = Stack {
            residual_scale: Some(self.residual_multiplier),
            scalars: EndScalars {
                embedding: Some(self.embedding_multiplier),
                logits_divisor: Some(self.logits_scaling),
                logits_scale: None,
            },
            ..Stack::llama_like(
                self.num_hidden_layers,
                self.rms_norm_eps,
                Head::tied_if(self.tie_word_embeddings),
            )
        };
        Ok(LlamaShaped {
            config,
            stack,
            attention: AttentionShape {
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                qkv_bias: self.attention_bias,
                o_bias: self.attention_bias,
                qk_norm: QkNorm::None,
                eps: self.rms_norm_eps,
                scale: self.attention_multiplier,
            },
            rope: ScaledRope::unscaled(rope),
            reach: None,
            head_dim,
            vocab_size: self.vocab_size,
            context_length: self.max_position_embeddings,
        })
    }
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    granite: GraniteArgs,
    mlp_bias: bool,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Granite", config)?;
    c.granite.shaped(config)?.build(w, |w, _, p| {
        GatedMlp::load(w, &format!("{p}.mlp"), c.mlp_bias)
    })
}
