//! Gemma 2 (`Gemma2ForCausalLM`), and the blocks the Gemma family shares (Gemma 3 reuses
//! them): RMS norms that scale by `1 + weight`, a GELU-gated MLP, and an embedding scaled by
//! `sqrt(hidden_size)` in the model's dtype.
//!
//! As mlx-lm 0.32.2's `gemma2.py` computes it: sandwich norms around attention and MLP,
//! queries scaled by `query_pre_attn_scalar^-0.5`, attention logits and final logits
//! soft-capped. mlx-lm gives every Gemma 2 layer full attention (its Gemma 2 reads no
//! `sliding_window`), and so does this file: greedy outputs match mlx-lm's, which for
//! sequences longer than the checkpoint's window differ from the Hugging Face model's.
use mlx_rs::error::Exception;
use mlx_rs::ops::tanh;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttnProjections;
use super::config::{default_rope_theta, parse_config};
use super::info::{model_info, KvShape};
use super::layers::{attend_with, AttnOpts, Matrix, Rope};
use super::mlp::{FeedForward, GatedMlp};
use super::params::{Parameters, Params};
use super::scalar::{scale_by, weak_scalar};
use super::switch::SwitchActivation;
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// Refuses an activation other than the tanh-approximated GELU that mlx-lm's Gemma files
/// hard-code (the configs name it under `hidden_activation` or `hidden_act`).
pub(crate) fn check_activation(config: &Value) -> Result<(), LoadError> {
    for key in ["hidden_activation", "hidden_act"] {
        match config.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "gelu_pytorch_tanh" => {}
            Some(other) => {
                return Err(LoadError::Config(format!(
                    "Gemma: unsupported {key} {other} (only gelu_pytorch_tanh)"
                )))
            }
        }
    }
    Ok(())
}

/// Completes a multimodal checkpoint's `text_config` as mlx-lm's wrapper `ModelArgs` does:
/// the vocabulary comes from the top level (`default_vocab` without one), and the head counts
/// the text config leaves out take the wrapper's defaults (8 query heads, `default_kv_heads`).
pub(crate) fn complete_text_config(
    config: &Value,
    text: &mut Value,
    default_vocab: u64,
    default_kv_heads: u64,
) {
    text["vocab_size"] = config
        .get("vocab_size")
        .cloned()
        .unwrap_or_else(|| Value::from(default_vocab));
    for (key, default) in [
        ("num_attention_heads", 8),
        ("num_key_value_heads", default_kv_heads),
    ] {
        if text.get(key).is_none() {
            text[key] = Value::from(default);
        }
    }
}

/// Gemma's RMS norm: `rms_norm(x, 1 + weight)`. The shifted scale is computed once at load,
/// in the weight's dtype, exactly as mlx-lm computes it on every call.
#[derive(Debug)]
pub(crate) struct GemmaNorm {
    scale: Array,
    eps: f32,
}

impl GemmaNorm {
    pub(crate) fn load(w: &mut Weights, prefix: &str, eps: f32) -> Result<Self, LoadError> {
        let weight = w.take(&format!("{prefix}.weight"))?;
        let scale = weight.add(&weak_scalar(&weight, 1.0)?)?;
        Ok(Self { scale, eps })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array, Exception> {
        mlx_rs::fast::rms_norm(x, Some(&self.scale), self.eps)
    }
}

impl Parameters for GemmaNorm {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.scale);
    }
}

/// The rest of a Gemma block around its attention: the GELU MLP and the four norms that
/// sandwich both branches.
pub(crate) struct Sandwich {
    mlp: GatedMlp,
    input_layernorm: GemmaNorm,
    post_attention_layernorm: GemmaNorm,
    pre_feedforward_layernorm: GemmaNorm,
    post_feedforward_layernorm: GemmaNorm,
}

impl Sandwich {
    /// Loads `<prefix>.mlp` and the norms `<prefix>.{input,post_attention,pre_feedforward,
    /// post_feedforward}_layernorm`.
    pub(crate) fn load(w: &mut Weights, prefix: &str, eps: f32) -> Result<Self, LoadError> {
        let mut norm = |name: &str| GemmaNorm::load(w, &format!("{prefix}.{name}"), eps);
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            mlp: GatedMlp::load_with(
                w,
                &format!("{prefix}.mlp"),
                false,
                SwitchActivation::GeluGlu,
            )?,
        })
    }

    /// The block on `h`: `attend` on the normed input, its normed output added to `h`, then
    /// the MLP on that, normed before and after, added; `residual` is the family's add
    /// (Gemma 3 clips float16 sums).
    pub(crate) fn forward(
        &self,
        h: &Array,
        attend: impl FnOnce(&Array) -> Result<Array, Exception>,
        residual: impl Fn(&Array, &Array) -> Result<Array, Exception>,
    ) -> Result<Array, Exception> {
        let r = attend(&self.input_layernorm.forward(h)?)?;
        let mid = residual(h, &self.post_attention_layernorm.forward(&r)?)?;
        let r = self
            .mlp
            .forward(&self.pre_feedforward_layernorm.forward(&mid)?)?;
        residual(&mid, &self.post_feedforward_layernorm.forward(&r)?)
    }
}

impl Parameters for Sandwich {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.mlp)
            .add(&self.input_layernorm)
            .add(&self.post_attention_layernorm)
            .add(&self.pre_feedforward_layernorm)
            .add(&self.post_feedforward_layernorm);
    }
}

/// The four projections of a Gemma attention layer, none biased.
pub(crate) fn load_projections(
    w: &mut Weights,
    prefix: &str,
    heads: i32,
    kv_heads: i32,
) -> Result<AttnProjections, LoadError> {
    AttnProjections::load(w, prefix, heads, kv_heads, false, false)
}

/// mlx-lm's `ModelArgs` for Gemma 2, with its defaults.
#[derive(Debug, Clone, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    head_dim: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_attn_softcap")]
    attn_logit_softcapping: f32,
    #[serde(default = "default_final_softcap")]
    final_logit_softcapping: f32,
    #[serde(default = "default_query_pre_attn_scalar")]
    query_pre_attn_scalar: f32,
    max_position_embeddings: Option<usize>,
}

fn default_attn_softcap() -> f32 {
    50.0
}

fn default_final_softcap() -> f32 {
    30.0
}

fn default_query_pre_attn_scalar() -> f32 {
    144.0
}

struct Block {
    proj: AttnProjections,
    sandwich: Sandwich,
}

pub struct Gemma2 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: GemmaNorm,
    rope: Rope,
    /// `query_pre_attn_scalar^-0.5`.
    scale: f32,
    attn_softcap: f32,
    final_softcap: f32,
    /// `sqrt(hidden_size)`, the embedding's scale.
    embed_scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Gemma 2", config)?;
    check_activation(config)?;
    if c.rope_scaling.as_ref().is_some_and(|s| !s.is_null()) {
        return Err(LoadError::Config(
            "Gemma 2: rope_scaling is not supported (mlx-lm's Gemma 2 has none)".into(),
        ));
    }
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        layers.push(Block {
            proj: load_projections(
                w,
                &format!("{p}.self_attn"),
                c.num_attention_heads,
                c.num_key_value_heads,
            )?,
            sandwich: Sandwich::load(w, &p, c.rms_norm_eps)?,
        });
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = GemmaNorm::load(w, "model.norm", c.rms_norm_eps)?;
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings.unwrap_or(8192),
        KvShape::heads(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
        &embed_tokens,
    );
    let mut model = Gemma2 {
        embed_tokens,
        layers,
        norm,
        rope: Rope {
            dims: c.head_dim,
            traditional: c.rope_traditional,
            base: c.rope_theta,
            scale: 1.0,
            freqs: None,
        },
        scale: (1.0 / f64::from(c.query_pre_attn_scalar).sqrt()) as f32,
        attn_softcap: c.attn_logit_softcapping,
        final_softcap: c.final_logit_softcapping,
        embed_scale: f64::from(c.hidden_size).sqrt() as f32,
        info,
    };
    model.info.weight_bytes = Params::default().add(&model).materialize(w.reporter())?;
    Ok(Box::new(model))
}

impl Parameters for Gemma2 {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.embed_tokens);
        for b in &self.layers {
            p.add(&b.proj).add(&b.sandwich);
        }
        p.add(&self.norm);
    }
}

impl Gemma2 {
    fn attention(
        &self,
        p: &AttnProjections,
        x: &Array,
        cache: &mut LayerCache,
    ) -> Result<Array, Exception> {
        let (q, k, v) = p.project(x)?;
        let opts = AttnOpts {
            softcap: Some(self.attn_softcap),
            ..AttnOpts::rotary(&self.rope, self.scale)
        };
        p.o_proj.forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

/// `tanh(x / cap) * cap`, the constant in `x`'s dtype.
pub(crate) fn softcap(x: &Array, cap: f32) -> Result<Array, Exception> {
    let c = weak_scalar(x, cap)?;
    tanh(&x.divide(&c)?)?.multiply(&c)
}

impl CausalLm for Gemma2 {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let h = self.embed_tokens.rows(tokens)?;
        let mut h = scale_by(&h, self.embed_scale)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = b
                .sandwich
                .forward(&h, |x| self.attention(&b.proj, x, cache), |x, r| x.add(r))?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        let logits = self.embed_tokens.matmul_t(&self.norm.forward(hidden)?)?;
        softcap(&logits, self.final_softcap)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
