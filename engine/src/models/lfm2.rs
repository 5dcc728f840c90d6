//! LFM2 (Liquid AI): a hybrid decoder whose layers are either grouped-query attention (with
//! per-head RMS norms of queries and keys) or a gated short convolution, each followed by a
//! SwiGLU MLP (`w1`, `w3`, `w2`); the final norm is `embedding_norm` and the head is the
//! embedding matrix.
//!
//! A convolution layer keeps the last `conv_L_cache - 1` gated inputs of each sequence as its
//! state ([`LayerKind::State`] of one array): decode costs the same at any context length.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, conv1d, expand_dims, select, zeros_dtype};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttnProjections;
use super::config::{check_heads, implied_head_dim, parse_config};
use super::decoder::{Decoder, DecoderLayer, Head, NormKind, Sizes, Trunk};
use super::info::KvShape;
use super::layers::{attend_with, AttnOpts, Linear, RmsNorm};
use super::mlp::{FeedForward, GatedMlp};
use super::params::{Parameters, Params};
use super::rope::ScaledRope;
use super::switch::SwitchActivation;
use super::CausalLm;
use crate::cache::{LayerCache, LayerKind};
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `lfm2.ModelArgs` reads.
#[derive(Debug, Deserialize)]
struct Config {
    vocab_size: usize,
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    max_position_embeddings: usize,
    norm_eps: f32,
    conv_bias: bool,
    #[serde(rename = "conv_L_cache")]
    conv_l_cache: i32,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    rope_parameters: Option<Value>,
    full_attn_idxs: Option<Vec<usize>>,
    layer_types: Option<Vec<String>>,
}

fn default_rope_theta() -> f32 {
    1_000_000.0
}

impl Config {
    /// `rope_parameters.rope_theta` wins over `rope_theta`, as in mlx-lm.
    fn theta(&self) -> f32 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p["rope_theta"].as_f64())
            .map_or(self.rope_theta, |t| t as f32)
    }

    /// Which layers attend: `full_attn_idxs`, or the `full_attention` entries of
    /// `layer_types`.
    fn attention_layers(&self) -> Result<Vec<bool>, LoadError> {
        let n = self.num_hidden_layers;
        let idxs: Vec<usize> = match (&self.full_attn_idxs, &self.layer_types) {
            (Some(idxs), _) => idxs.clone(),
            (None, Some(types)) => {
                if types.len() != n {
                    return Err(LoadError::Config(format!(
                        "LFM2 layer_types lists {} layers for num_hidden_layers {n}",
                        types.len()
                    )));
                }
                types
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.as_str() == "full_attention")
                    .map(|(i, _)| i)
                    .collect()
            }
            (None, None) => {
                return Err(LoadError::Config(
                    "LFM2 config names neither full_attn_idxs nor layer_types".into(),
                ))
            }
        };
        if let Some(&bad) = idxs.iter().find(|&&i| i >= n) {
            return Err(LoadError::Config(format!(
                "LFM2 full_attn_idxs names layer {bad} of {n}"
            )));
        }
        Ok((0..n).map(|i| idxs.contains(&i)).collect())
    }
}

/// Grouped-query attention with per-head RMS norms of queries and keys and rotary positions.
struct Lfm2Attention {
    proj: AttnProjections,
    q_layernorm: RmsNorm,
    k_layernorm: RmsNorm,
    rope: ScaledRope,
    scale: f32,
}

impl Lfm2Attention {
    fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (q, k, v) = self.proj.project(x)?;
        let q = self.q_layernorm.forward(&q)?;
        let k = self.k_layernorm.forward(&k)?;
        let opts = AttnOpts::rotary(&self.rope.rope, self.scale);
        self.proj
            .o_proj
            .forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl Parameters for Lfm2Attention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.proj)
            .add(&self.q_layernorm)
            .add(&self.k_layernorm);
    }
}

/// The gated short convolution: `in_proj` gives gates `b`, `c` and input `x`; the depthwise
/// causal convolution runs over `b * x` (prefixed by the state, the last `kernel - 1` of them),
/// and `c` gates its output before `out_proj`.
struct ShortConv {
    in_proj: Linear,
    out_proj: Linear,
    /// `[hidden, kernel, 1]`, as MLX's `Conv1d` holds a depthwise kernel.
    conv_weight: Array,
    conv_bias: Option<Array>,
    kernel: i32,
    hidden: i32,
}

impl ShortConv {
    fn load(w: &mut Weights, prefix: &str, c: &Config) -> Result<Self, LoadError> {
        let name = format!("{prefix}.conv.weight");
        let mut conv_weight = w.take(&name)?;
        // Hugging Face stores `[hidden, 1, kernel]`; MLX's layout is `[hidden, kernel, 1]`
        // (mlx-lm's `sanitize`).
        let shape = conv_weight.shape().to_vec();
        if shape.len() == 3 && shape[2] > shape[1] {
            conv_weight = conv_weight.transpose_axes(&[0, 2, 1])?;
        }
        crate::loader::expect_shape(&name, &conv_weight, &[c.hidden_size, c.conv_l_cache, 1])?;
        let conv_bias = if c.conv_bias {
            Some(w.take(&format!("{prefix}.conv.bias"))?)
        } else {
            None
        };
        Ok(Self {
            in_proj: Linear::load(w, &format!("{prefix}.in_proj"), c.conv_bias)?,
            out_proj: Linear::load(w, &format!("{prefix}.out_proj"), c.conv_bias)?,
            conv_weight,
            conv_bias,
            kernel: c.conv_l_cache,
            hidden: c.hidden_size,
        })
    }

    fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let state = cache.as_state_mut()?;
        let l = x.shape()[1];
        let parts = self.in_proj.forward(x)?.split_equal(3, -1)?;
        let (b, c, input) = (&parts[0], &parts[1], &parts[2]);
        let mut bx = b.multiply(input)?;
        if let Some(mask) = state.mask(l)? {
            // Padding positions feed zeros, as a fresh state holds.
            let zero = Array::from_f32(0.0).as_dtype(bx.dtype())?;
            bx = select(&expand_dims(&mask, -1)?, &bx, &zero)?;
        }
        let keep = self.kernel - 1;
        let past = match state.slot(0) {
            Some(s) => s.clone(),
            None => zeros_dtype(&[bx.shape()[0], keep, self.hidden], bx.dtype())?,
        };
        let bx = concatenate(&[past, bx], 1)?;
        let total = bx.shape()[1];
        state.update(vec![bx.index((.., total - keep.., ..))], l as usize)?;
        let mut conv = conv1d(&bx, &self.conv_weight, 1, 0, 1, self.hidden)?;
        if let Some(bias) = &self.conv_bias {
            conv = conv.add(bias)?;
        }
        self.out_proj.forward(&c.multiply(&conv)?)
    }
}

impl Parameters for ShortConv {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.in_proj)
            .add(&self.conv_weight)
            .add(&self.conv_bias)
            .add(&self.out_proj);
    }
}

/// What mixes positions in a layer.
enum Mixer {
    /// Boxed: an attention layer's projections are several times a convolution's size.
    Attention(Box<Lfm2Attention>),
    Conv(ShortConv),
}

struct Layer {
    mixer: Mixer,
    operator_norm: RmsNorm,
    feed_forward: GatedMlp,
    ffn_norm: RmsNorm,
}

impl DecoderLayer for Layer {
    fn forward(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let x = self.operator_norm.forward(h)?;
        let r = match &self.mixer {
            Mixer::Attention(a) => a.forward(&x, cache)?,
            Mixer::Conv(c) => c.forward(&x, cache)?,
        };
        let h = h.add(&r)?;
        h.add(&self.feed_forward.forward(&self.ffn_norm.forward(&h)?)?)
    }

    fn kind(&self) -> LayerKind {
        match self.mixer {
            Mixer::Attention(_) => LayerKind::Attention { window: None },
            Mixer::Conv(_) => LayerKind::State { slots: 1 },
        }
    }
}

impl Parameters for Layer {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match &self.mixer {
            Mixer::Attention(a) => p.add(a),
            Mixer::Conv(c) => p.add(c),
        };
        p.add(&self.operator_norm)
            .add(&self.feed_forward)
            .add(&self.ffn_norm);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("LFM2", config)?;
    let heads = c.num_attention_heads;
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    check_heads(heads, kv_heads)?;
    let head_dim = implied_head_dim(c.hidden_size, heads)?;
    if c.conv_l_cache < 2 {
        return Err(LoadError::Config(format!(
            "LFM2 conv_L_cache {} leaves no state (at least 2)",
            c.conv_l_cache
        )));
    }
    let attends = c.attention_layers()?;
    let rope = ScaledRope::plain(head_dim, c.theta(), false);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (i, &attention) in attends.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mixer = if attention {
            let a = format!("{p}.self_attn");
            Mixer::Attention(Box::new(Lfm2Attention {
                proj: AttnProjections::new(
                    [
                        Linear::load(w, &format!("{a}.q_proj"), false)?,
                        Linear::load(w, &format!("{a}.k_proj"), false)?,
                        Linear::load(w, &format!("{a}.v_proj"), false)?,
                        Linear::load(w, &format!("{a}.out_proj"), false)?,
                    ],
                    heads,
                    kv_heads,
                )?,
                q_layernorm: RmsNorm::load(w, &format!("{a}.q_layernorm"), c.norm_eps)?,
                k_layernorm: RmsNorm::load(w, &format!("{a}.k_layernorm"), c.norm_eps)?,
                rope: rope.clone(),
                scale: (head_dim as f32).powf(-0.5),
            }))
        } else {
            Mixer::Conv(ShortConv::load(w, &format!("{p}.conv"), &c)?)
        };
        let f = format!("{p}.feed_forward");
        layers.push(Layer {
            mixer,
            operator_norm: RmsNorm::load(w, &format!("{p}.operator_norm"), c.norm_eps)?,
            feed_forward: GatedMlp::new(
                [
                    Linear::load(w, &format!("{f}.w1"), false)?,
                    Linear::load(w, &format!("{f}.w3"), false)?,
                    Linear::load(w, &format!("{f}.w2"), false)?,
                ],
                SwitchActivation::SwiGlu,
            )?,
            ffn_norm: RmsNorm::load(w, &format!("{p}.ffn_norm"), c.norm_eps)?,
        });
    }
    let trunk = Trunk::load_with_norm(
        w,
        "",
        "embedding_norm",
        NormKind::Rms { eps: c.norm_eps },
        Head::TiedStrict,
    )?;
    let attention_layers = attends.iter().filter(|&&a| a).count();
    let conv_layers = attends.len() - attention_layers;
    let sizes = Sizes {
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
        kv: KvShape {
            layers: c.num_hidden_layers,
            elements_per_token: attention_layers * 2 * (kv_heads * head_dim) as usize,
            head_dim,
        },
    };
    let decoder = Decoder::new(config, trunk, layers, sizes);
    let dtype_bytes = CausalLm::info(&decoder).kv_dtype_bytes;
    let state_bytes = conv_layers * ((c.conv_l_cache - 1) * c.hidden_size) as usize * dtype_bytes;
    decoder.with_state_bytes(state_bytes).finish(w)
}
