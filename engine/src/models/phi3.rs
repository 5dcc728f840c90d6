//! Phi-3 and Phi-4 (dense): the Llama decoder with queries, keys and values in one fused
//! `qkv_proj`, gate and up in one fused `gate_up_proj`, rotary embedding on only the first
//! `partial_rotary_factor` of each head (Phi-4-mini), and the long-context `su`/`longrope`
//! scaling (mlx-lm's `SuScaledRoPE`).
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::SelfAttention;
use super::config::{check_heads, default_rope_theta, implied_head_dim, parse_config};
use super::decoder::{load_stack, Decoder, Head, NormKind, Sizes, Stack};
use super::info::KvShape;
use super::layers::{attend_queries, split_heads, AttnOpts, Linear, Queries, Rope};
use super::mlp::FusedGatedMlp;
use super::params::{Parameters, Params};
use super::rope::ScaledRope;
use super::CausalLm;
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `phi3.ModelArgs` reads.
#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    rms_norm_eps: f32,
    vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_partial_rotary_factor")]
    partial_rotary_factor: f64,
    #[serde(default = "default_max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default = "default_original_max_position_embeddings")]
    original_max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
}

fn default_partial_rotary_factor() -> f64 {
    1.0
}

fn default_max_position_embeddings() -> usize {
    131072
}

fn default_original_max_position_embeddings() -> usize {
    4096
}

/// Phi-3's rotary embedding over the first `dims` of each head, as `rope_scaling` asks.
/// mlx-lm requires `type` and `long_factor` whenever `rope_scaling` is set (even for
/// `linear`); it ignores types other than `su`, `longrope` and `linear`, which are refused
/// here instead.
fn phi3_rope(c: &Config, dims: i32) -> Result<ScaledRope, LoadError> {
    let plain = |scale: f32| {
        ScaledRope::unscaled(Rope {
            dims,
            traditional: c.rope_traditional,
            base: c.rope_theta,
            scale,
            freqs: None,
        })
    };
    let scaling = match &c.rope_scaling {
        None | Some(Value::Null) => return Ok(plain(1.0)),
        Some(Value::Object(map)) if map.is_empty() => return Ok(plain(1.0)),
        Some(s) => s,
    };
    if scaling.get("long_factor").is_none() {
        return Err(LoadError::Config(
            "Phi-3 rope_scaling must contain long_factor".into(),
        ));
    }
    match scaling.get("type").and_then(Value::as_str) {
        Some("su" | "longrope") => su_scaled_rope(c, dims, scaling),
        Some("linear") => match scaling.get("factor") {
            Some(Value::Number(n)) if n.is_f64() && n.as_f64() != Some(0.0) => {
                Ok(plain((1.0 / n.as_f64().unwrap_or(1.0)) as f32))
            }
            other => Err(LoadError::Config(format!(
                "Phi-3 linear rope_scaling needs a float factor, got {other:?}"
            ))),
        },
        other => Err(LoadError::Config(format!(
            "unsupported Phi-3 rope_scaling type {other:?} (supported: su, longrope, linear)"
        ))),
    }
}

/// mlx-lm's `SuScaledRoPE`: frequencies `long_factor * base^(2i/dims)` (mlx-lm uses the long
/// factors at every length; `short_factor` must be present but is unused), and the input
/// scale `sqrt(1 + ln(s) / ln(original))` for `s = max / original` positions when `s > 1`
/// (queries' and keys' rotated dimensions are multiplied by it before rotation).
fn su_scaled_rope(c: &Config, dims: i32, scaling: &Value) -> Result<ScaledRope, LoadError> {
    if scaling.get("short_factor").is_none() {
        return Err(LoadError::Config(
            "Phi-3 su/longrope rope_scaling must contain short_factor".into(),
        ));
    }
    let long_factor = factor_array(&scaling["long_factor"], dims)?;
    let exponents =
        Array::arange::<_, f32>(0.0, dims as f32, 2.0)?.divide(Array::from_f32(dims as f32))?;
    let freqs = long_factor.multiply(Array::from_f32(c.rope_theta).power(&exponents)?)?;
    freqs.eval()?;
    let original = c.original_max_position_embeddings as f64;
    let factor = c.max_position_embeddings as f64 / original;
    let input_scale = (factor > 1.0).then(|| (1.0 + factor.ln() / original.ln()).sqrt() as f32);
    Ok(ScaledRope {
        rope: Rope {
            dims,
            traditional: false,
            base: c.rope_theta,
            scale: 1.0,
            freqs: Some(freqs),
        },
        input_scale,
    })
}

/// A `long_factor` entry as float32 `[dims / 2]`: a list of that many numbers, or one number
/// for every frequency.
fn factor_array(value: &Value, dims: i32) -> Result<Array, LoadError> {
    let bad = || {
        LoadError::Config(format!(
            "Phi-3 long_factor must be a number or {} numbers",
            dims / 2
        ))
    };
    match value {
        Value::Number(n) => Ok(Array::from_f32(n.as_f64().ok_or_else(bad)? as f32)),
        Value::Array(items) if items.len() == (dims / 2) as usize => {
            let factors = items
                .iter()
                .map(|v| v.as_f64().map(|f| f as f32))
                .collect::<Option<Vec<f32>>>()
                .ok_or_else(bad)?;
            Ok(Array::from_slice(&factors, &[dims / 2]))
        }
        _ => Err(bad()),
    }
}

/// Attention with queries, keys and values from one fused `qkv_proj`.
struct FusedAttention {
    qkv_proj: Linear,
    o_proj: Linear,
    rope: ScaledRope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

impl SelfAttention for FusedAttention {
    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        let q_end = self.heads * self.head_dim;
        let k_end = q_end + self.kv_heads * self.head_dim;
        let qkv = self
            .qkv_proj
            .forward(x)?
            .split_at_indices(&[q_end, k_end], -1)?;
        let q = self.rope.prescale(&split_heads(&qkv[0], self.heads)?)?;
        let k = self.rope.prescale(&split_heads(&qkv[1], self.kv_heads)?)?;
        let v = split_heads(&qkv[2], self.kv_heads)?;
        let opts = AttnOpts {
            rope: Some(&self.rope.rope),
            scale: self.scale,
            window: None,
            sinks: None,
            softcap: None,
        };
        self.o_proj
            .forward(&attend_queries(&q, &k, &v, &opts, cache, which)?)
    }
}

impl Parameters for FusedAttention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.qkv_proj).add(&self.o_proj);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Phi-3", config)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
    check_heads(c.num_attention_heads, kv_heads)?;
    // mlx-lm derives the head size from the hidden size, ignoring any `head_dim` entry.
    let head_dim = implied_head_dim(c.hidden_size, c.num_attention_heads)?;
    let rope_dims = (head_dim as f64 * c.partial_rotary_factor) as i32;
    if rope_dims <= 0 || rope_dims > head_dim || rope_dims % 2 != 0 {
        return Err(LoadError::Config(format!(
            "partial_rotary_factor {} gives {rope_dims} rotary dimensions of {head_dim}",
            c.partial_rotary_factor
        )));
    }
    let rope = phi3_rope(&c, rope_dims)?;
    let stack = Stack::pre_norm(
        c.num_hidden_layers,
        NormKind::Rms {
            eps: c.rms_norm_eps,
        },
        Head::tied_if(c.tie_word_embeddings),
    );
    let (trunk, layers) = load_stack(
        w,
        &stack,
        |w, _, p| {
            Ok(FusedAttention {
                qkv_proj: Linear::load(w, &format!("{p}.self_attn.qkv_proj"), false)?,
                o_proj: Linear::load(w, &format!("{p}.self_attn.o_proj"), false)?,
                rope: rope.clone(),
                heads: c.num_attention_heads,
                kv_heads,
                head_dim,
                scale: (head_dim as f32).powf(-0.5),
            })
        },
        |w, _, p| FusedGatedMlp::load(w, &format!("{p}.mlp")),
    )?;
    let sizes = Sizes {
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
        kv: KvShape::heads(c.num_hidden_layers, kv_heads, head_dim),
    };
    Decoder::new(config, trunk, layers, sizes).finish(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rope_scaling: Value) -> Config {
        parse_config(
            "Phi-3",
            &serde_json::json!({
                "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                "rms_norm_eps": 1e-5, "vocab_size": 10, "rope_scaling": rope_scaling,
            }),
        )
        .expect("config")
    }

    #[test]
    fn longrope_scales_attention_when_the_context_is_extended() {
        let c = config(serde_json::json!({
            "type": "longrope", "short_factor": 1.0, "long_factor": [1.0, 2.0, 3.0, 4.0],
        }));
        let rope = phi3_rope(&c, 8).expect("rope");
        // 131072 / 4096 = 32 positions per original one.
        let expected = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32;
        assert_eq!(rope.input_scale, Some(expected));
        assert_eq!(
            rope.rope.freqs.as_ref().map(|f| f.shape().to_vec()),
            Some(vec![4])
        );
    }

    #[test]
    fn unknown_or_incomplete_scalings_are_refused() {
        for scaling in [
            serde_json::json!({"type": "yarn", "long_factor": 1.0, "short_factor": 1.0}),
            serde_json::json!({"type": "longrope", "short_factor": 1.0}),
            serde_json::json!({"type": "longrope", "long_factor": [1.0], "short_factor": 1.0}),
            serde_json::json!({"type": "linear", "long_factor": 1.0, "factor": 2}),
        ] {
            assert!(
                phi3_rope(&config(scaling.clone()), 8).is_err(),
                "{scaling} was accepted"
            );
        }
    }
}
