//! Cohere 2 (`Cohere2ForCausalLM`, Command R7B / Command A), as mlx-lm's `cohere2.py`: one
//! LayerNorm (no bias by default) feeds attention and the MLP in parallel, and both add to the
//! residual; every `sliding_window_pattern`-th layer attends globally without positional
//! embedding, the others within a sliding window with (traditional) RoPE; the embedding is
//! tied and the logits are multiplied by `logit_scale`.
//!
//! The decoder is shared with Cohere (Command R, [`super::cohere`]), whose layers are all
//! global and rotary and whose query and key heads may be layer-normalised.
use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::attention::{prerotated_opts, AttnProjections, Reach};
use super::config::parse_config;
use super::decoder::{Decoder, DecoderLayer, EndScalars, Head, NormKind, Sizes, Trunk};
use super::info::KvShape;
use super::layers::{attend_with, LayerNorm, Rope};
use super::mlp::{FeedForward, GatedMlp};
use super::params::{Parameters, Params};
use super::rope::plain_rope;
use super::CausalLm;
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields mlx-lm's `cohere2.ModelArgs` reads, with its defaults.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(default = "defaults::hidden_size")]
    hidden_size: i32,
    #[serde(default = "defaults::head_dim")]
    head_dim: i32,
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::num_attention_heads")]
    num_attention_heads: i32,
    #[serde(default = "defaults::num_key_value_heads")]
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
    #[serde(default = "defaults::sliding_window")]
    sliding_window: usize,
    #[serde(default = "defaults::sliding_window_pattern")]
    sliding_window_pattern: usize,
    max_position_embeddings: Option<usize>,
}

mod defaults {
    pub fn hidden_size() -> i32 {
        4096
    }
    pub fn head_dim() -> i32 {
        128
    }
    pub fn num_hidden_layers() -> usize {
        32
    }
    pub fn num_attention_heads() -> i32 {
        32
    }
    pub fn num_key_value_heads() -> i32 {
        8
    }
    pub fn rope_theta() -> f32 {
        50000.0
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
    pub fn sliding_window() -> usize {
        4096
    }
    pub fn sliding_window_pattern() -> usize {
        4
    }
}

/// Cohere 1's per-head LayerNorm of queries or keys: `weight [heads, head_dim]` times a
/// LayerNorm without affine parameters.
pub(crate) struct HeadNorm {
    pub weight: Array,
    pub eps: f32,
}

impl HeadNorm {
    /// `x` `[B, heads, L, head_dim]`.
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let normed = mlx_rs::fast::layer_norm(x, None, None, self.eps)?;
        // The weight is per (head, feature): `[heads, 1, head_dim]` against `[B, heads, L, D]`.
        let s = self.weight.shape();
        self.weight.reshape(&[s[0], 1, s[1]])?.multiply(&normed)
    }
}

impl Parameters for HeadNorm {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight);
    }
}

/// One Cohere layer: a single LayerNorm feeds attention and the MLP in parallel, and both
/// add to the residual.
pub(crate) struct Block {
    attn: AttnProjections,
    q_norm: Option<HeadNorm>,
    k_norm: Option<HeadNorm>,
    mlp: GatedMlp,
    input_layernorm: LayerNorm,
    /// `nn.RoPE(head_dim, traditional=True, base)`, `None` for a layer without positional
    /// embedding.
    rope: Option<Rope>,
    window: Option<usize>,
    scale: f32,
    /// Cohere 2 attends in float32 when activations are float16.
    f16_attention_in_f32: bool,
}

/// What the Cohere generations share at load: the shapes and the attention settings.
pub(crate) struct Shape {
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub rope_theta: f32,
    pub attention_bias: bool,
    pub layer_norm_eps: f32,
    pub layer_norm_bias: bool,
    pub qk_norm: bool,
    pub f16_attention_in_f32: bool,
    pub logit_scale: f32,
}

impl Block {
    /// Loads the layer at `prefix` with the given reach.
    fn load(w: &mut Weights, prefix: &str, shape: &Shape, reach: Reach) -> Result<Self, LoadError> {
        let head_norm = |w: &mut Weights, name: &str| -> Result<Option<HeadNorm>, LoadError> {
            if !shape.qk_norm {
                return Ok(None);
            }
            Ok(Some(HeadNorm {
                weight: w.take(&format!("{prefix}.self_attn.{name}.weight"))?,
                eps: shape.layer_norm_eps,
            }))
        };
        Ok(Self {
            attn: AttnProjections::load(
                w,
                &format!("{prefix}.self_attn"),
                shape.heads,
                shape.kv_heads,
                shape.attention_bias,
                shape.attention_bias,
            )?,
            q_norm: head_norm(w, "q_norm")?,
            k_norm: head_norm(w, "k_norm")?,
            mlp: GatedMlp::load(w, &format!("{prefix}.mlp"), false)?,
            input_layernorm: LayerNorm::load(
                w,
                &format!("{prefix}.input_layernorm"),
                shape.layer_norm_eps,
                shape.layer_norm_bias,
            )?,
            rope: reach
                .rotary()
                .then(|| plain_rope(shape.head_dim, shape.rope_theta, true)),
            window: reach.window(),
            scale: (shape.head_dim as f32).powf(-0.5),
            f16_attention_in_f32: shape.f16_attention_in_f32,
        })
    }

    fn attention(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (mut q, mut k, v) = self.attn.project(x)?;
        if let Some(n) = &self.q_norm {
            q = n.forward(&q)?;
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(&k)?;
        }
        if let Some(rope) = &self.rope {
            // Rotated here rather than inside the attention: a float16 model rotates in
            // float16 and only then moves the queries to float32.
            q = cache.rope(rope, &q)?;
            k = cache.rope(rope, &k)?;
        }
        let dtype = q.dtype();
        let in_f32 = self.f16_attention_in_f32 && dtype == Dtype::Float16;
        if in_f32 {
            q = q.as_dtype(Dtype::Float32)?;
        }
        let opts = prerotated_opts(self.scale, self.window);
        let mut out = attend_with(&q, &k, &v, &opts, cache)?;
        if in_f32 {
            out = out.as_dtype(dtype)?;
        }
        self.attn.o_proj.forward(&out)
    }
}

impl DecoderLayer for Block {
    fn window(&self) -> Option<usize> {
        self.window
    }

    fn forward(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let normed = self.input_layernorm.forward(h)?;
        let attended = self.attention(&normed, cache)?;
        let mlp = self.mlp.forward(&normed)?;
        attended.add(&mlp)?.add(h)
    }
}

impl Parameters for Block {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.attn)
            .add(&self.q_norm)
            .add(&self.k_norm)
            .add(&self.mlp)
            .add(&self.input_layernorm);
    }
}

/// Builds the Cohere decoder: layers at `model.layers.{i}` with the given reaches, the tied
/// embedding, the final LayerNorm, logits scaled by `logit_scale`.
pub(crate) fn build_decoder(
    config: &Value,
    w: &mut Weights,
    shape: &Shape,
    reach: &[Reach],
    vocab_size: usize,
    context_length: usize,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let layers = reach
        .iter()
        .enumerate()
        .map(|(i, &reach)| Block::load(w, &format!("model.layers.{i}"), shape, reach))
        .collect::<Result<Vec<_>, _>>()?;
    let norm = NormKind::Layer {
        eps: shape.layer_norm_eps,
        bias: shape.layer_norm_bias,
    };
    // The logits come from the embedding; mlx-lm's Cohere files drop no `lm_head`.
    let trunk = Trunk::load(w, "", norm, Head::TiedStrict)?.with_scalars(EndScalars {
        logits_scale: Some(shape.logit_scale),
        ..EndScalars::default()
    });
    let sizes = Sizes {
        vocab_size,
        context_length,
        kv: KvShape::heads(reach.len(), shape.kv_heads, shape.head_dim),
    };
    Decoder::new(config, trunk, layers, sizes).finish(w)
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Cohere 2", config)?;
    if c.head_dim * c.num_attention_heads != c.hidden_size {
        return Err(LoadError::Config(format!(
            "Cohere 2 needs head_dim × num_attention_heads = hidden_size (got {} × {} and {})",
            c.head_dim, c.num_attention_heads, c.hidden_size
        )));
    }
    if c.sliding_window_pattern == 0 || c.sliding_window == 0 {
        return Err(LoadError::Config(
            "Cohere 2 sliding_window and sliding_window_pattern must be positive".into(),
        ));
    }
    let pattern = c.sliding_window_pattern;
    let reach: Vec<Reach> = (0..c.num_hidden_layers)
        .map(|i| {
            if i % pattern == pattern - 1 {
                Reach::GlobalNoPe
            } else {
                Reach::Local(c.sliding_window)
            }
        })
        .collect();
    let shape = Shape {
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        rope_theta: c.rope_theta,
        attention_bias: c.attention_bias,
        layer_norm_eps: c.layer_norm_eps,
        layer_norm_bias: c.layer_norm_bias,
        qk_norm: false,
        f16_attention_in_f32: true,
        logit_scale: c.logit_scale,
    };
    build_decoder(
        config,
        w,
        &shape,
        &reach,
        c.vocab_size,
        c.max_position_embeddings.unwrap_or(4096),
    )
}
