//! EXAONE 4 (`Exaone4ForCausalLM`), as mlx-lm's `exaone4.py`: RMS-normalised query and key
//! heads, norms after each sub-layer only (no pre-norm), and with a `sliding_window_pattern`
//! such as `"LLLG"` a hybrid stack: `L` layers attend within a sliding window with RoPE,
//! `G` layers attend to everything with no positional embedding. Without a pattern every
//! layer is global and rotary.
use serde::Deserialize;
use serde_json::Value;

use super::attention::{AttentionShape, QkNorm, Reach};
use super::config::parse_config;
use super::decoder::{Head, NormKind, NormPlacement, Stack};
use super::llama::LlamaShaped;
use super::mlp::GatedMlp;
use super::rope::initialize_rope;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

/// The fields mlx-lm's `exaone4.ModelArgs` reads.
#[derive(Debug, Deserialize)]
struct Config {
    num_hidden_layers: usize,
    num_attention_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: i32,
    max_position_embeddings: usize,
    rope_theta: f32,
    head_dim: i32,
    tie_word_embeddings: bool,
    rope_scaling: Option<Value>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<Value>,
}

/// Each layer's reach from `sliding_window_pattern`, repeated over the layers as mlx-lm does.
fn layer_reach(c: &Config) -> Result<Vec<Reach>, LoadError> {
    let pattern = match &c.sliding_window_pattern {
        None | Some(Value::Null) => return Ok(vec![Reach::GlobalRope; c.num_hidden_layers]),
        Some(Value::String(p)) if !p.is_empty() => p.as_bytes(),
        Some(other) => {
            return Err(LoadError::Config(format!(
                "EXAONE 4 sliding_window_pattern {other} is not a string of L and G"
            )))
        }
    };
    // mlx-lm needs at least one layer of each kind to build its two masks.
    if !pattern.contains(&b'L') || !pattern.contains(&b'G') {
        return Err(LoadError::Config(format!(
            "EXAONE 4 sliding_window_pattern {:?} needs both an L and a G layer",
            String::from_utf8_lossy(pattern)
        )));
    }
    let window = c.sliding_window.filter(|&w| w > 0).ok_or_else(|| {
        LoadError::Config("EXAONE 4 has local layers but no sliding_window".into())
    })?;
    Ok((0..c.num_hidden_layers)
        .map(|i| match pattern[i % pattern.len()] {
            b'L' => Reach::Local(window),
            _ => Reach::GlobalNoPe,
        })
        .collect())
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("EXAONE 4", config)?;
    let reach = layer_reach(&c)?;
    // mlx-lm's EXAONE 4 has no `sanitize`: a tied checkpoint must not carry an `lm_head`.
    let head = if c.tie_word_embeddings {
        Head::TiedStrict
    } else {
        Head::Own
    };
    let norm = NormKind::Rms {
        eps: c.rms_norm_eps,
    };
    LlamaShaped {
        config,
        stack: Stack {
            placement: NormPlacement::Post,
            ..Stack::pre_norm(c.num_hidden_layers, norm, head)
        },
        attention: AttentionShape {
            qk_norm: QkNorm::PerHead,
            ..AttentionShape::new(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.rms_norm_eps,
            )
        },
        rope: initialize_rope(c.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?,
        reach: Some(reach),
        head_dim: c.head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
    }
    .build(w, |w, _, p| GatedMlp::load(w, &format!("{p}.mlp"), false))
}
