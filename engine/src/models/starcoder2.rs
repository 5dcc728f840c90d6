//! StarCoder2: a pre-norm decoder with LayerNorms (weight and bias), biases on every
//! projection, and a two-matrix GELU MLP (`c_fc` then `c_proj`).
//!
//! Two config fields are read the way mlx-lm 0.32.2 reads them, which is what greedy parity
//! means here: the MLP uses the exact (erf) GELU whatever `hidden_act` names among the GELU
//! variants (checkpoints say `gelu_pytorch_tanh`), and `sliding_window` is not applied —
//! mlx-lm attends over the whole context, so a window here would change outputs past it.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttentionShape;
use super::config::{check_heads, default_true, implied_head_dim, parse_config};
use super::decoder::{Head, NormKind, Stack};
use super::layers::{gelu, Linear};
use super::llama::LlamaShaped;
use super::mlp::FeedForward;
use super::params::{Parameters, Params};
use super::rope::ScaledRope;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `starcoder2.ModelArgs` reads, plus those checked
/// for values it would not honour.
#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    #[serde(default = "default_norm_epsilon")]
    norm_epsilon: f32,
    #[serde(default = "default_vocab_size")]
    vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
    max_position_embeddings: Option<usize>,
    /// mlx-lm always builds the biases; a checkpoint without them is refused.
    #[serde(default = "default_true")]
    use_bias: bool,
    hidden_act: Option<String>,
}

fn default_norm_epsilon() -> f32 {
    1e-5
}

fn default_vocab_size() -> usize {
    49152
}

fn default_rope_theta() -> f32 {
    100000.0
}

impl Config {
    fn check_supported(&self) -> Result<(), LoadError> {
        if !self.use_bias {
            return Err(LoadError::Config(
                "StarCoder2 with use_bias=false is not supported".into(),
            ));
        }
        match self.hidden_act.as_deref() {
            None => Ok(()),
            Some(act) if act.starts_with("gelu") => Ok(()),
            Some(act) => Err(LoadError::Config(format!(
                "StarCoder2 hidden_act {act:?} is not supported (GELU only)"
            ))),
        }
    }
}

/// `c_proj(gelu(c_fc(x)))`, both biased.
struct GeluMlp {
    c_fc: Linear,
    c_proj: Linear,
}

impl GeluMlp {
    fn load(w: &mut Weights, prefix: &str) -> Result<Self, LoadError> {
        Ok(Self {
            c_fc: Linear::load(w, &format!("{prefix}.c_fc"), true)?,
            c_proj: Linear::load(w, &format!("{prefix}.c_proj"), true)?,
        })
    }
}

impl FeedForward for GeluMlp {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        self.c_proj.forward(&gelu(&self.c_fc.forward(x)?)?)
    }
}

impl Parameters for GeluMlp {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.c_fc).add(&self.c_proj);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("StarCoder2", config)?;
    c.check_supported()?;
    check_heads(c.num_attention_heads, c.num_key_value_heads)?;
    let head_dim = implied_head_dim(c.hidden_size, c.num_attention_heads)?;
    let norm = NormKind::Layer {
        eps: c.norm_epsilon,
        bias: true,
    };
    LlamaShaped {
        config,
        stack: Stack::pre_norm(
            c.num_hidden_layers,
            norm,
            Head::tied_if(c.tie_word_embeddings),
        ),
        attention: AttentionShape {
            qkv_bias: true,
            o_bias: true,
            ..AttentionShape::new(
                c.num_attention_heads,
                c.num_key_value_heads,
                head_dim,
                c.norm_epsilon,
            )
        },
        rope: ScaledRope::plain(head_dim, c.rope_theta, false),
        reach: None,
        head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings.unwrap_or(4096),
    }
    .build(w, |w, _, p| GeluMlp::load(w, &format!("{p}.mlp")))
}
