//! Phi-3 and Phi-4 (dense): the Llama decoder with queries, keys and values in one fused
//! `qkv_proj`, gate and up in one fused `gate_up_proj`, rotary embedding on only the first
//! `partial_rotary_factor` of each head (Phi-4-mini), and the long-context `su`/`longrope`
//! scaling (mlx-lm's `SuScaledRoPE`).
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense_parts::{
    check_heads, implied_head_dim, load_lm_head, logits, model_info, parse_config, scaled, KvShape,
    Params,
};
use super::layers::{attend_with, split_heads, swiglu, AttnOpts, Linear, Matrix, RmsNorm, Rope};
use super::{CausalLm, ModelInfo};
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

fn default_rope_theta() -> f32 {
    10000.0
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

/// Phi-3's rotary embedding over the first `rope.dims` of each head.
struct Phi3Rope {
    rope: Rope,
    /// SuScaledRoPE's attention factor: the rotated dimensions of queries and keys are
    /// multiplied by it before rotation (`None` for plain and linear RoPE, and when the
    /// context is not extended).
    su_scale: Option<f32>,
}

impl Phi3Rope {
    /// The embedding `rope_scaling` asks for, over `dims` of each head. mlx-lm requires
    /// `type` and `long_factor` whenever `rope_scaling` is set (even for `linear`); it ignores
    /// types other than `su`, `longrope` and `linear`, which are refused here instead.
    fn from_config(c: &Config, dims: i32) -> Result<Self, LoadError> {
        let plain = |scale: f32| Phi3Rope {
            rope: Rope {
                dims,
                traditional: c.rope_traditional,
                base: c.rope_theta,
                scale,
                freqs: None,
            },
            su_scale: None,
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
            Some("su" | "longrope") => Self::su_scaled(c, dims, scaling),
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

    /// SuScaledRoPE: frequencies `long_factor * base^(2i/dims)` (mlx-lm uses the long factors
    /// at every length; `short_factor` must be present but is unused), and the attention
    /// factor `sqrt(1 + ln(s) / ln(original))` for `s = max / original` positions when `s > 1`.
    fn su_scaled(c: &Config, dims: i32, scaling: &Value) -> Result<Self, LoadError> {
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
        let su_scale = (factor > 1.0).then(|| (1.0 + factor.ln() / original.ln()).sqrt() as f32);
        Ok(Phi3Rope {
            rope: Rope {
                dims,
                traditional: false,
                base: c.rope_theta,
                scale: 1.0,
                freqs: Some(freqs),
            },
            su_scale,
        })
    }

    /// `x` `[B, heads, L, head_dim]` with its rotated dimensions multiplied by the attention
    /// factor, as `x.at[..., :dims].multiply(scale)` does.
    fn prescale(&self, x: &Array) -> Result<Array, Exception> {
        let Some(s) = self.su_scale else {
            return Ok(x.clone());
        };
        let head_dim = x.shape()[3];
        if self.rope.dims == head_dim {
            return scaled(x, s);
        }
        let parts = x.split_at_indices(&[self.rope.dims], -1)?;
        mlx_rs::ops::concatenate(&[scaled(&parts[0], s)?, parts[1].clone()], -1)
    }
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

struct Block {
    qkv_proj: Linear,
    o_proj: Linear,
    gate_up_proj: Linear,
    down_proj: Linear,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl Block {
    fn load(w: &mut Weights, i: usize, eps: f32) -> Result<Self, LoadError> {
        let p = format!("model.layers.{i}");
        Ok(Self {
            qkv_proj: Linear::load(w, &format!("{p}.self_attn.qkv_proj"), false)?,
            o_proj: Linear::load(w, &format!("{p}.self_attn.o_proj"), false)?,
            gate_up_proj: Linear::load(w, &format!("{p}.mlp.gate_up_proj"), false)?,
            down_proj: Linear::load(w, &format!("{p}.mlp.down_proj"), false)?,
            input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{p}.post_attention_layernorm"),
                eps,
            )?,
        })
    }

    /// SwiGLU over the fused projection's two halves (gate first).
    fn mlp(&self, x: &Array) -> Result<Array, Exception> {
        let gate_up = self.gate_up_proj.forward(x)?.split_equal(2, -1)?;
        self.down_proj.forward(&swiglu(&gate_up[0], &gate_up[1])?)
    }
}

pub struct Phi3 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    rope: Phi3Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(config)?;
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
    let rope = Phi3Rope::from_config(&c, rope_dims)?;
    let layers = (0..c.num_hidden_layers)
        .map(|i| Block::load(w, i, c.rms_norm_eps))
        .collect::<Result<Vec<_>, _>>()?;
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", c.rms_norm_eps)?;
    let lm_head = load_lm_head(w, c.tie_word_embeddings)?;
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings,
        KvShape {
            layers: c.num_hidden_layers,
            kv_heads,
            head_dim,
        },
        &embed_tokens,
    );
    let mut model = Phi3 {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        heads: c.num_attention_heads,
        kv_heads,
        head_dim,
        scale: (head_dim as f32).powf(-0.5),
        info,
    };
    model.info.weight_bytes = model.params().materialize(w.reporter())?;
    Ok(Box::new(model))
}

impl Phi3 {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            for l in [&b.qkv_proj, &b.o_proj, &b.gate_up_proj, &b.down_proj] {
                p.linear(l);
            }
            p.array(&b.input_layernorm.weight);
            p.array(&b.post_attention_layernorm.weight);
        }
        p.array(&self.norm.weight);
        if let Some(h) = &self.lm_head {
            p.matrix(h);
        }
        p
    }

    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let q_end = self.heads * self.head_dim;
        let k_end = q_end + self.kv_heads * self.head_dim;
        let qkv = b
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
        b.o_proj.forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl CausalLm for Phi3 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = self.attention(b, &b.input_layernorm.forward(&h)?, cache)?;
            let hh = h.add(&r)?;
            let r = b.mlp(&b.post_attention_layernorm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        let h = self.norm.forward(&h)?;
        logits(&h, self.lm_head.as_ref(), &self.embed_tokens)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rope_scaling: Value) -> Config {
        parse_config(&serde_json::json!({
            "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "rms_norm_eps": 1e-5, "vocab_size": 10, "rope_scaling": rope_scaling,
        }))
        .expect("config")
    }

    #[test]
    fn longrope_scales_attention_when_the_context_is_extended() {
        let c = config(serde_json::json!({
            "type": "longrope", "short_factor": 1.0, "long_factor": [1.0, 2.0, 3.0, 4.0],
        }));
        let rope = Phi3Rope::from_config(&c, 8).expect("rope");
        // 131072 / 4096 = 32 positions per original one.
        let expected = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32;
        assert_eq!(rope.su_scale, Some(expected));
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
                Phi3Rope::from_config(&config(scaling.clone()), 8).is_err(),
                "{scaling} was accepted"
            );
        }
    }
}
