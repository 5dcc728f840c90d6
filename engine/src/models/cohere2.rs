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

use super::dense2_blocks::{
    decoder_info, parse_config, scale_by, AttnProjections, GatedMlp, Params,
};
use super::layers::{attend_with, AttnOpts, LayerNorm, Matrix, Rope};
use super::{CausalLm, ModelInfo};
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

/// How one layer attends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Reach {
    /// Within the last `window` positions, with RoPE.
    Local(usize),
    /// Everything, without positional embedding.
    GlobalNoPe,
    /// Everything, with RoPE (Cohere 1).
    GlobalRope,
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

pub(crate) struct Block {
    pub reach: Reach,
    pub attn: AttnProjections,
    pub q_norm: Option<HeadNorm>,
    pub k_norm: Option<HeadNorm>,
    pub mlp: GatedMlp,
    pub input_layernorm: LayerNorm,
}

/// The Cohere decoder: parallel attention and MLP, tied and scaled logits.
pub(crate) struct Cohere {
    pub embed_tokens: Matrix,
    pub layers: Vec<Block>,
    pub norm: LayerNorm,
    pub rope: Rope,
    pub scale: f32,
    pub logit_scale: f32,
    /// Cohere 2 attends in float32 when activations are float16.
    pub f16_attention_in_f32: bool,
    pub info: ModelInfo,
}

/// What the Cohere generations share at load: the shapes and the per-layer reach.
pub(crate) struct Shape {
    pub heads: i32,
    pub kv_heads: i32,
    pub attention_bias: bool,
    pub layer_norm_eps: f32,
    pub layer_norm_bias: bool,
    pub qk_norm: bool,
}

/// Loads the layers at `model.layers.{i}` with the given reaches, and the embedding and norm.
pub(crate) fn load_layers(
    w: &mut Weights,
    shape: &Shape,
    reach: &[Reach],
) -> Result<(Vec<Block>, Matrix, LayerNorm), LoadError> {
    let mut layers = Vec::with_capacity(reach.len());
    for (i, &reach) in reach.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let head_norm = |w: &mut Weights, name: &str| -> Result<Option<HeadNorm>, LoadError> {
            if !shape.qk_norm {
                return Ok(None);
            }
            Ok(Some(HeadNorm {
                weight: w.take(&format!("{p}.self_attn.{name}.weight"))?,
                eps: shape.layer_norm_eps,
            }))
        };
        layers.push(Block {
            reach,
            attn: AttnProjections::load(
                w,
                &format!("{p}.self_attn"),
                shape.heads,
                shape.kv_heads,
                shape.attention_bias,
                shape.attention_bias,
            )?,
            q_norm: head_norm(w, "q_norm")?,
            k_norm: head_norm(w, "k_norm")?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), false)?,
            input_layernorm: LayerNorm::load(
                w,
                &format!("{p}.input_layernorm"),
                shape.layer_norm_eps,
                shape.layer_norm_bias,
            )?,
        });
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = LayerNorm::load(w, "model.norm", shape.layer_norm_eps, shape.layer_norm_bias)?;
    Ok((layers, embed_tokens, norm))
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
        attention_bias: c.attention_bias,
        layer_norm_eps: c.layer_norm_eps,
        layer_norm_bias: c.layer_norm_bias,
        qk_norm: false,
    };
    let (layers, embed_tokens, norm) = load_layers(w, &shape, &reach)?;
    let info = decoder_info(
        config,
        c.vocab_size,
        c.num_hidden_layers,
        c.max_position_embeddings.unwrap_or(4096),
        c.num_key_value_heads,
        c.head_dim,
        &embed_tokens,
    );
    let model = Cohere {
        embed_tokens,
        layers,
        norm,
        rope: traditional_rope(c.head_dim, c.rope_theta),
        scale: (c.head_dim as f32).powf(-0.5),
        logit_scale: c.logit_scale,
        f16_attention_in_f32: true,
        info,
    };
    model.finish(w)
}

/// `nn.RoPE(head_dim, traditional=True, base)`.
pub(crate) fn traditional_rope(head_dim: i32, base: f32) -> Rope {
    Rope {
        dims: head_dim,
        traditional: true,
        base,
        scale: 1.0,
        freqs: None,
    }
}

impl Cohere {
    /// Materializes the parameters and boxes the model.
    pub(crate) fn finish(mut self, w: &Weights) -> Result<Box<dyn CausalLm>, LoadError> {
        self.info.weight_bytes = self.params().materialize(w.reporter())?;
        Ok(Box::new(self))
    }

    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            p.attention(&b.attn);
            for n in b.q_norm.iter().chain(b.k_norm.iter()) {
                p.array(&n.weight);
            }
            p.gated_mlp(&b.mlp);
            p.layer_norm(&b.input_layernorm);
        }
        p.layer_norm(&self.norm);
        p
    }

    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (mut q, mut k, v) = b.attn.project(x)?;
        if let Some(n) = &b.q_norm {
            q = n.forward(&q)?;
        }
        if let Some(n) = &b.k_norm {
            k = n.forward(&k)?;
        }
        let window = match b.reach {
            Reach::Local(window) => Some(window),
            Reach::GlobalNoPe | Reach::GlobalRope => None,
        };
        if b.reach != Reach::GlobalNoPe {
            // Rotated here rather than inside the attention: a float16 model rotates in
            // float16 and only then moves the queries to float32.
            q = cache.rope(&self.rope, &q)?;
            k = cache.rope(&self.rope, &k)?;
        }
        let dtype = q.dtype();
        let in_f32 = self.f16_attention_in_f32 && dtype == Dtype::Float16;
        if in_f32 {
            q = q.as_dtype(Dtype::Float32)?;
        }
        let opts = AttnOpts {
            rope: None,
            scale: self.scale,
            window,
            sinks: None,
            softcap: None,
        };
        let mut out = attend_with(&q, &k, &v, &opts, cache)?;
        if in_f32 {
            out = out.as_dtype(dtype)?;
        }
        b.attn.o_proj.forward(&out)
    }
}

impl CausalLm for Cohere {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let normed = b.input_layernorm.forward(&h)?;
            let attended = self.attention(b, &normed, cache)?;
            let mlp = b.mlp.forward(&normed)?;
            h = attended.add(&mlp)?.add(&h)?;
        }
        let logits = self.embed_tokens.matmul_t(&self.norm.forward(&h)?)?;
        scale_by(&logits, self.logit_scale)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
