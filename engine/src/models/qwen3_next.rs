//! Qwen3-Next (`Qwen3NextForCausalLM`), as mlx-lm's `qwen3_next.py`: a hybrid decoder whose
//! layers are gated delta-nets ([`GatedDeltaNet`], a recurrent state per sequence) except every
//! `full_attention_interval`-th, which is gated full attention (queries projected with a gate
//! that scales the attention output through a sigmoid, per-head RMS norms of queries and
//! keys, partial rotary embedding). The feed-forward half is a sparse mixture of experts with a
//! sigmoid-gated shared expert, or a dense SwiGLU MLP on `mlp_only_layers` and off the
//! `decoder_sparse_step` stride.
//!
//! The hybrid skeleton ([`Hybrid`]), the gated attention and the sparse block are Qwen3.5's
//! too (`qwen3_5.rs`), as mlx-lm's `qwen3_5.py` imports them from here.
use mlx_rs::error::Exception;
use mlx_rs::ops::sigmoid;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::{AttnProjections, SelfAttention};
use super::config::{check_heads, parse_config};
use super::decoder::{Block, Decoder, DecoderLayer, Head, NormKind, NormPlacement, Sizes, Trunk};
use super::gated_delta::{self, DeltaShape, GatedDeltaNet, ProjectionLayout};
use super::info::{dtype_bytes, KvShape};
use super::layers::{attend_with, AttnOpts, Linear, Queries, RmsNorm};
use super::mlp::{FeedForward, GatedMlp};
use super::moe::{RoutedExperts, SharedExperts, SoftmaxRouter};
use super::params::{Parameters, Params};
use super::rope::{initialize_rope, ScaledRope};
use super::scalar::weak_scalar;
use super::switch::{stack_layer_experts, top_k_tail};
use super::CausalLm;
use crate::cache::{LayerCache, LayerKind};
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Qwen3-Next";

#[derive(Debug, Deserialize)]
struct Config {
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    head_dim: i32,
    linear_num_value_heads: i32,
    linear_num_key_heads: i32,
    linear_key_head_dim: i32,
    linear_value_head_dim: i32,
    linear_conv_kernel_dim: i32,
    num_experts: i32,
    num_experts_per_tok: i32,
    decoder_sparse_step: usize,
    mlp_only_layers: Vec<usize>,
    rms_norm_eps: f32,
    vocab_size: usize,
    rope_theta: f32,
    partial_rotary_factor: f32,
    max_position_embeddings: usize,
    #[serde(default)]
    norm_topk_prob: bool,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    rope_scaling: Option<Value>,
    #[serde(default = "default_full_attention_interval")]
    full_attention_interval: usize,
}

/// mlx-lm's default `full_attention_interval` (both families).
pub(crate) fn default_full_attention_interval() -> usize {
    4
}

impl Config {
    /// mlx-lm's rule: a sparse block where the layer is not MLP-only, experts exist and the
    /// layer falls on the stride.
    fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// The gated attention of both families (`Qwen3NextAttention`).
pub(crate) struct GatedAttention {
    proj: AttnProjections,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    rope: ScaledRope,
    scale: f32,
}

/// The sizes of the gated attention layers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatedAttentionShape {
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    /// `attention_bias`: all four projections biased.
    pub bias: bool,
    /// The epsilon of the query and key norms.
    pub eps: f32,
}

impl GatedAttention {
    fn load(
        w: &mut Weights,
        prefix: &str,
        shape: &GatedAttentionShape,
        rope: &ScaledRope,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            proj: AttnProjections::load(
                w,
                prefix,
                shape.heads,
                shape.kv_heads,
                shape.bias,
                shape.bias,
            )?,
            q_norm: RmsNorm::load(w, &format!("{prefix}.q_norm"), shape.eps)?,
            k_norm: RmsNorm::load(w, &format!("{prefix}.k_norm"), shape.eps)?,
            rope: rope.clone(),
            scale: (shape.head_dim as f32).powf(-0.5),
        })
    }

    fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let p = &self.proj;
        // One stacked product where the projections stack (`AttnProjections::qkv`).
        let (q, k, v) = p.qkv(x)?;
        let halves = q.reshape(&[b, l, p.heads, -1])?.split_equal(2, -1)?;
        let gate = halves[1].reshape(&[b, l, -1])?;
        let heads_first = [0, 2, 1, 3];
        let queries = self
            .q_norm
            .forward(&halves[0])?
            .transpose_axes(&heads_first)?;
        let keys = self
            .k_norm
            .forward(&k.reshape(&[b, l, p.kv_heads, -1])?)?
            .transpose_axes(&heads_first)?;
        let values = v
            .reshape(&[b, l, p.kv_heads, -1])?
            .transpose_axes(&heads_first)?;
        let (queries, keys) = (self.rope.prescale(&queries)?, self.rope.prescale(&keys)?);
        let out = attend_with(
            &queries,
            &keys,
            &values,
            &AttnOpts::rotary(&self.rope.rope, self.scale),
            cache,
        )?;
        p.o_proj.forward(&out.multiply(sigmoid(&gate)?)?)
    }
}

impl Parameters for GatedAttention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.proj).add(&self.q_norm).add(&self.k_norm);
    }
}

/// A hybrid layer's token mixer: a delta-net or gated attention.
pub(crate) enum Mixer {
    Delta(GatedDeltaNet),
    Attention(GatedAttention),
}

impl SelfAttention for Mixer {
    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        let out = match self {
            Mixer::Delta(d) => d.forward(x, cache)?,
            Mixer::Attention(a) => a.forward(x, cache)?,
        };
        Ok(which.pick(out))
    }
}

impl Parameters for Mixer {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match self {
            Mixer::Delta(d) => p.add(d),
            Mixer::Attention(a) => p.add(a),
        };
    }
}

/// A pre-norm block around a [`Mixer`], reporting a state for a delta-net layer.
pub(crate) struct HybridLayer(Block<Mixer, Box<dyn FeedForward>>);

impl DecoderLayer for HybridLayer {
    fn forward(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        self.0.forward_with(h, cache, |mixer, x, cache| {
            mixer.attend(x, cache, Queries::All)
        })
    }

    fn kind(&self) -> LayerKind {
        match self.0.attn {
            Mixer::Delta(_) => gated_delta::KIND,
            Mixer::Attention(_) => LayerKind::Attention { window: None },
        }
    }
}

impl Parameters for HybridLayer {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.0);
    }
}

/// What Qwen3-Next and Qwen3.5 build their decoder from.
pub(crate) struct Hybrid<'a> {
    pub family: &'static str,
    /// The whole `config.json` (architecture and end-of-sequence ids).
    pub config: &'a Value,
    /// The prefix of every weight name (`language_model.` for Qwen3.5).
    pub prefix: &'a str,
    pub num_layers: usize,
    pub full_attention_interval: usize,
    pub rms_norm_eps: f32,
    pub attention: GatedAttentionShape,
    pub rope: ScaledRope,
    pub delta: DeltaShape,
    pub layout: ProjectionLayout,
    pub tie_word_embeddings: bool,
    pub vocab_size: usize,
    pub context_length: usize,
}

impl Hybrid<'_> {
    /// mlx-lm's rule: every layer is linear except each `full_attention_interval`-th.
    fn is_linear(&self, layer: usize) -> bool {
        !(layer + 1).is_multiple_of(self.full_attention_interval)
    }

    /// Loads the decoder; layer `i`'s feed-forward part is `feed_forward(w, i, prefix)`.
    pub fn build(
        self,
        w: &mut Weights,
        mut feed_forward: impl FnMut(
            &mut Weights,
            usize,
            &str,
        ) -> Result<Box<dyn FeedForward>, LoadError>,
    ) -> Result<Box<dyn CausalLm>, LoadError> {
        let family = self.family;
        if self.full_attention_interval == 0 {
            return Err(LoadError::Config(format!(
                "{family}: full_attention_interval must be at least 1"
            )));
        }
        let a = self.attention;
        check_heads(a.heads, a.kv_heads)?;
        self.delta.check(family)?;
        let eps = self.rms_norm_eps;
        let mut layers = Vec::with_capacity(self.num_layers);
        for i in 0..self.num_layers {
            let p = format!("{}model.layers.{i}", self.prefix);
            let mixer = if self.is_linear(i) {
                Mixer::Delta(GatedDeltaNet::load(
                    w,
                    &format!("{p}.linear_attn"),
                    self.delta,
                    self.layout,
                )?)
            } else {
                Mixer::Attention(GatedAttention::load(
                    w,
                    &format!("{p}.self_attn"),
                    &a,
                    &self.rope,
                )?)
            };
            let mlp = feed_forward(w, i, &p)?;
            layers.push(HybridLayer(Block::load(
                w,
                &p,
                NormPlacement::Pre,
                NormKind::Rms { eps },
                mixer,
                mlp,
            )?));
        }
        let trunk = Trunk::load(
            w,
            self.prefix,
            NormKind::Rms { eps },
            Head::tied_if(self.tie_word_embeddings),
        )?;
        let linear = (0..self.num_layers).filter(|&i| self.is_linear(i)).count();
        let full = self.num_layers - linear;
        let kv = KvShape {
            layers: self.num_layers,
            elements_per_token: full * 2 * (a.kv_heads * a.head_dim) as usize,
            head_dim: a.head_dim,
        };
        let state_bytes = linear
            * self
                .delta
                .state_bytes(dtype_bytes(trunk.activation_dtype()));
        let sizes = Sizes {
            vocab_size: self.vocab_size,
            context_length: self.context_length,
            kv,
        };
        Decoder::new(self.config, trunk, layers, sizes)
            .with_state_bytes(state_bytes)
            .finish(w)
    }
}

/// The sparse block of both families: a precise softmax router whose top-k ids are
/// `argpartition(g, -k)[..., -k:]` (weights renormalised with `norm_topk_prob`), SwiGLU
/// experts at `<mlp>.switch_mlp`, and `<mlp>.shared_expert` scaled by
/// `sigmoid(<mlp>.shared_expert_gate(x))`. The weighted sum is left as the product promotes
/// it, as mlx-lm leaves it.
pub(crate) fn sparse_block(
    w: &mut Weights,
    mlp: &str,
    top_k: i32,
    norm_topk_prob: bool,
) -> Result<Box<dyn FeedForward>, LoadError> {
    let router = SoftmaxRouter {
        gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
        top_k,
        select: top_k_tail,
        renormalize: norm_topk_prob,
    };
    let shared = SharedExperts::Gated {
        mlp: GatedMlp::load(w, &format!("{mlp}.shared_expert"), false)?,
        gate: Linear::load(w, &format!("{mlp}.shared_expert_gate"), false)?,
    };
    Ok(Box::new(
        RoutedExperts::load(w, mlp, router, false)?.with_shared(shared),
    ))
}

/// The norm weights a Hugging Face checkpoint stores as offsets from 1 (mlx-lm adds 1 when it
/// converts).
const SHIFTED_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// Whether any convolution weight is in the Hugging Face layout `[C, 1, K]` (mlx-lm's test
/// for an unconverted Qwen3.5 checkpoint).
pub(crate) fn has_unconverted_conv(w: &mut Weights) -> bool {
    w.names()
        .into_iter()
        .filter(|n| n.contains("conv1d.weight"))
        .any(|n| match w.remove_raw(&n) {
            Some(a) => {
                let last = a.shape().last().copied();
                w.insert(n, a);
                last != Some(1)
            }
            None => false,
        })
}

/// The conversion mlx-lm's `sanitize` applies to a Hugging Face checkpoint: multi-token
/// prediction weights dropped, convolution weights moved to `[C, K, 1]`, and (with
/// `shift_norms`) 1 added to the norms of [`SHIFTED_NORMS`].
pub(crate) fn convert_hf_layout(w: &mut Weights, shift_norms: bool) -> Result<(), LoadError> {
    for name in w.names() {
        if name.contains("mtp.") {
            w.discard(&name);
            continue;
        }
        let conv = name.contains("conv1d.weight");
        let norm = shift_norms && SHIFTED_NORMS.iter().any(|s| name.ends_with(s));
        if !(conv || norm) {
            continue;
        }
        let Some(mut a) = w.remove_raw(&name) else {
            continue;
        };
        if conv && a.ndim() == 3 && a.shape()[2] != 1 {
            a = a.swap_axes(1, 2)?;
        }
        if norm && a.ndim() == 1 {
            a = a.add(weak_scalar(&a, 1.0)?)?;
        }
        w.insert(name, a);
    }
    Ok(())
}

/// mlx-lm's `int(head_dim * partial_rotary_factor)`: the rotated width of a head.
pub(crate) fn rotary_dims(head_dim: i32, partial_rotary_factor: f32) -> i32 {
    (f64::from(head_dim) * f64::from(partial_rotary_factor)) as i32
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    if c.decoder_sparse_step == 0 {
        return Err(LoadError::Config(format!(
            "{FAMILY}: decoder_sparse_step must be at least 1"
        )));
    }
    // A Hugging Face checkpoint (one tensor per expert) is converted as mlx-lm's `sanitize`
    // converts it; a converted one is taken as it is.
    let unconverted = (0..c.num_hidden_layers)
        .any(|l| w.contains(&format!("model.layers.{l}.mlp.experts.0.up_proj.weight")));
    if unconverted {
        stack_layer_experts(
            w,
            (0..c.num_hidden_layers).filter(|&l| c.is_sparse(l)),
            c.num_experts as usize,
        )?;
        convert_hf_layout(w, true)?;
    }
    let rope = initialize_rope(
        rotary_dims(c.head_dim, c.partial_rotary_factor),
        c.rope_theta,
        false,
        c.rope_scaling.as_ref(),
    )?;
    Hybrid {
        family: FAMILY,
        config,
        prefix: "",
        num_layers: c.num_hidden_layers,
        full_attention_interval: c.full_attention_interval,
        rms_norm_eps: c.rms_norm_eps,
        attention: GatedAttentionShape {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            bias: c.attention_bias,
            eps: c.rms_norm_eps,
        },
        rope,
        delta: DeltaShape {
            key_heads: c.linear_num_key_heads,
            value_heads: c.linear_num_value_heads,
            key_dim: c.linear_key_head_dim,
            value_dim: c.linear_value_head_dim,
            conv_kernel: c.linear_conv_kernel_dim,
            eps: c.rms_norm_eps,
        },
        layout: ProjectionLayout::Interleaved,
        tie_word_embeddings: c.tie_word_embeddings,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
    }
    .build(w, |w, layer, p| {
        let mlp = format!("{p}.mlp");
        if c.is_sparse(layer) {
            sparse_block(w, &mlp, c.num_experts_per_tok, c.norm_topk_prob)
        } else {
            Ok(Box::new(GatedMlp::load(w, &mlp, false)?))
        }
    })
    .map_err(|e| match e {
        LoadError::Config(m) if !m.starts_with(FAMILY) => {
            LoadError::Config(format!("{FAMILY}: {m}"))
        }
        other => other,
    })
}
