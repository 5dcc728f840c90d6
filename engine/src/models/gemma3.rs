//! Gemma 3's text decoder: `Gemma3ForCausalLM` (model_type `gemma3_text`) and the text half
//! of `Gemma3ForConditionalGeneration` (model_type `gemma3`, weights under `language_model.`,
//! the vision tower and projector dropped as mlx-lm drops them).
//!
//! As mlx-lm 0.32.2's `gemma3_text.py`: Gemma 2's sandwich-normed blocks without soft-capping,
//! RMS-normalised query and key heads, and layers that attend locally (a sliding window, RoPE
//! base `rope_local_base_freq`) except every `sliding_window_pattern`-th, which attends
//! globally (RoPE base `rope_theta` with the config's scaling).
use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttnProjections;
use super::config::parse_config;
use super::gemma2::{
    check_activation, complete_text_config, load_projections, GemmaNorm, Sandwich,
};
use super::info::{model_info, KvShape};
use super::layers::{attend_with, AttnOpts, Matrix, Rope};
use super::llama::rope_from_config;
use super::params::{Parameters, Params};
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// mlx-lm's `gemma3_text.ModelArgs`, with its defaults (a multimodal checkpoint's
/// `text_config` often lists only what differs from them).
#[derive(Debug, Clone, Deserialize)]
struct Config {
    #[serde(default = "defaults::hidden_size")]
    hidden_size: i32,
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::num_attention_heads")]
    num_attention_heads: i32,
    #[serde(default = "defaults::head_dim")]
    head_dim: i32,
    #[serde(default = "defaults::rms_norm_eps")]
    rms_norm_eps: f32,
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::num_key_value_heads")]
    num_key_value_heads: i32,
    #[serde(default = "defaults::rope_theta")]
    rope_theta: f32,
    #[serde(default = "defaults::rope_local_base_freq")]
    rope_local_base_freq: f32,
    #[serde(default = "defaults::query_pre_attn_scalar")]
    query_pre_attn_scalar: f32,
    #[serde(default = "defaults::sliding_window")]
    sliding_window: usize,
    #[serde(default = "defaults::sliding_window_pattern")]
    sliding_window_pattern: usize,
    #[serde(default = "defaults::max_position_embeddings")]
    max_position_embeddings: usize,
    rope_scaling: Option<Value>,
}

/// The defaults of mlx-lm's `gemma3_text.ModelArgs`.
mod defaults {
    pub fn hidden_size() -> i32 {
        1152
    }
    pub fn num_hidden_layers() -> usize {
        26
    }
    pub fn num_attention_heads() -> i32 {
        4
    }
    pub fn head_dim() -> i32 {
        256
    }
    pub fn rms_norm_eps() -> f32 {
        1.0e-6
    }
    pub fn vocab_size() -> usize {
        262144
    }
    pub fn num_key_value_heads() -> i32 {
        1
    }
    pub fn rope_theta() -> f32 {
        1_000_000.0
    }
    pub fn rope_local_base_freq() -> f32 {
        10_000.0
    }
    pub fn query_pre_attn_scalar() -> f32 {
        256.0
    }
    pub fn sliding_window() -> usize {
        512
    }
    pub fn sliding_window_pattern() -> usize {
        6
    }
    pub fn max_position_embeddings() -> usize {
        32768
    }
}

impl Config {
    fn from_json(text: &Value) -> Result<Self, LoadError> {
        let c: Config = parse_config("Gemma 3", text)?;
        if c.sliding_window_pattern == 0 {
            return Err(LoadError::Config(
                "Gemma 3: sliding_window_pattern must be at least 1".into(),
            ));
        }
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if text.get(key).is_some_and(|v| !v.is_null()) {
                return Err(LoadError::Config(format!(
                    "Gemma 3: {key} is not supported (mlx-lm's Gemma 3 applies none)"
                )));
            }
        }
        // A transformers v5 config keeps the RoPE settings only under `rope_parameters`, which
        // mlx-lm 0.32.2 does not read (it would fall back to its defaults).
        if text.get("rope_parameters").is_some() && text.get("rope_theta").is_none() {
            return Err(LoadError::Config(
                "Gemma 3: rope_parameters without rope_theta is not supported".into(),
            ));
        }
        c.check_layer_types(text)?;
        Ok(c)
    }

    /// Whether layer `i` attends within the sliding window (mlx-lm's pattern rule).
    fn is_sliding(&self, i: usize) -> bool {
        !(i + 1).is_multiple_of(self.sliding_window_pattern)
    }

    /// mlx-lm places the global layers by `sliding_window_pattern` alone; a `layer_types`
    /// list that says otherwise is refused rather than silently overridden.
    fn check_layer_types(&self, text: &Value) -> Result<(), LoadError> {
        let Some(types) = text.get("layer_types").and_then(Value::as_array) else {
            return Ok(());
        };
        let expected = (0..self.num_hidden_layers).map(|i| {
            if self.is_sliding(i) {
                "sliding_attention"
            } else {
                "full_attention"
            }
        });
        let agrees = types.len() == self.num_hidden_layers
            && types
                .iter()
                .zip(expected)
                .all(|(t, e)| t.as_str() == Some(e));
        if agrees {
            Ok(())
        } else {
            Err(LoadError::Config(format!(
                "Gemma 3: layer_types disagree with sliding_window_pattern {}",
                self.sliding_window_pattern
            )))
        }
    }
}

struct Block {
    proj: AttnProjections,
    q_norm: GemmaNorm,
    k_norm: GemmaNorm,
    /// `Some(sliding_window)` on local layers.
    window: Option<usize>,
    /// Index into [`Gemma3::ropes`]: local or global RoPE.
    rope: usize,
    sandwich: Sandwich,
}

pub struct Gemma3 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: GemmaNorm,
    /// `None` when the output projection is tied to the embedding.
    lm_head: Option<Matrix>,
    /// `[local, global]`.
    ropes: [Rope; 2],
    /// `query_pre_attn_scalar^-0.5`.
    scale: f32,
    /// `sqrt(hidden_size)` as a bfloat16 scalar, as mlx-lm rounds it.
    embed_scale: Array,
    info: ModelInfo,
}

const LOCAL: usize = 0;
const GLOBAL: usize = 1;

/// `Gemma3ForCausalLM`: the text model on its own.
pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    check_activation(config)?;
    let c = Config::from_json(config)?;
    build_text(config, &c, w, "")
}

/// `Gemma3ForConditionalGeneration`: the text model of a multimodal checkpoint, configured by
/// its `text_config` (with mlx-lm's `gemma3.ModelArgs` overrides) and weighted by the tensors
/// under `language_model.`; the vision tower and the projector are dropped unused.
pub fn build_conditional(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let mut text = config
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| LoadError::Config("Gemma 3: missing text_config object".into()))?;
    complete_text_config(config, &mut text, 262_208, 4);
    check_activation(&text)?;
    let c = Config::from_json(&text)?;
    for name in w.names() {
        if name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.") {
            w.discard(&name);
        }
    }
    build_text(config, &c, w, "language_model.")
}

fn build_text(
    config: &Value,
    c: &Config,
    w: &mut Weights,
    prefix: &str,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let eps = c.rms_norm_eps;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("{prefix}model.layers.{i}");
        let norm = |w: &mut Weights, name: &str| GemmaNorm::load(w, &format!("{p}.{name}"), eps);
        let sliding = c.is_sliding(i);
        layers.push(Block {
            proj: load_projections(
                w,
                &format!("{p}.self_attn"),
                c.num_attention_heads,
                c.num_key_value_heads,
            )?,
            q_norm: norm(w, "self_attn.q_norm")?,
            k_norm: norm(w, "self_attn.k_norm")?,
            window: sliding.then_some(c.sliding_window),
            rope: if sliding { LOCAL } else { GLOBAL },
            sandwich: Sandwich::load(w, &p, eps)?,
        });
    }
    let embed_tokens = Matrix::load(w, &format!("{prefix}model.embed_tokens"))?;
    let norm = GemmaNorm::load(w, &format!("{prefix}model.norm"), eps)?;
    // mlx-lm ties the output projection exactly when the checkpoint has no lm_head.
    let head = format!("{prefix}lm_head");
    let lm_head = if w.contains(&format!("{head}.weight")) {
        Some(Matrix::load(w, &head)?)
    } else {
        None
    };
    let ropes = [
        Rope {
            dims: c.head_dim,
            traditional: false,
            base: c.rope_local_base_freq,
            scale: 1.0,
            freqs: None,
        },
        rope_from_config(c.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?,
    ];
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings,
        KvShape::heads(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
        &embed_tokens,
    );
    let embed_scale =
        Array::from_f32(f64::from(c.hidden_size).sqrt() as f32).as_dtype(Dtype::Bfloat16)?;
    let mut model = Gemma3 {
        embed_tokens,
        layers,
        norm,
        lm_head,
        ropes,
        scale: (1.0 / f64::from(c.query_pre_attn_scalar).sqrt()) as f32,
        embed_scale,
        info,
    };
    model.info.weight_bytes = Params::default().add(&model).materialize(w.reporter())?;
    Ok(Box::new(model))
}

/// The largest finite float16.
const F16_MAX: f32 = 65504.0;

/// `x + y`; in float16, summed in float32 and clipped to float16's range first (mlx-lm's
/// `clip_residual`, which keeps Gemma 3's large activations finite).
fn clip_residual(x: &Array, y: &Array) -> Result<Array, Exception> {
    if x.dtype() != Dtype::Float16 {
        return x.add(y);
    }
    let bound = F16_MAX;
    let sum = x
        .as_dtype(Dtype::Float32)?
        .add(&y.as_dtype(Dtype::Float32)?)?;
    mlx_rs::ops::clip(&sum, (&Array::from_f32(-bound), &Array::from_f32(bound)))?
        .as_dtype(Dtype::Float16)
}

impl Parameters for Gemma3 {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.embed_tokens);
        for b in &self.layers {
            p.add(&b.proj)
                .add(&b.q_norm)
                .add(&b.k_norm)
                .add(&b.sandwich);
        }
        p.add(&self.norm).add(&self.lm_head);
    }
}

impl Gemma3 {
    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let p = &b.proj;
        let (q, k, v) = p.project(x)?;
        let (q, k) = (b.q_norm.forward(&q)?, b.k_norm.forward(&k)?);
        let opts = AttnOpts {
            window: b.window,
            ..AttnOpts::rotary(&self.ropes[b.rope], self.scale)
        };
        p.o_proj.forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl CausalLm for Gemma3 {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let h = self.embed_tokens.rows(tokens)?;
        let mut h = h.multiply(&self.embed_scale.as_dtype(h.dtype())?)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = b
                .sandwich
                .forward(&h, |x| self.attention(b, x, cache), clip_residual)?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        let h = self.norm.forward(hidden)?;
        match &self.lm_head {
            Some(head) => head.matmul_t(&h),
            None => self.embed_tokens.matmul_t(&h),
        }
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|b| b.window).collect()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
