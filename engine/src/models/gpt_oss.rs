//! gpt-oss (`GptOssForCausalLM`), as mlx-lm 0.32.2's `gpt_oss.py` computes it: attention with
//! biases and learned per-head sinks, layers alternating between a sliding window and full
//! attention (`layer_types`), YaRN-scaled RoPE, and a mixture-of-experts MLP (a biased router,
//! softmax over the top-k logits, experts with gpt-oss's clamped SwiGLU).
//!
//! Weights are read as mlx-community ships them (MLX layout: experts split into
//! `gate_proj`/`up_proj`/`down_proj` stacks, quantized in `affine` or `mxfp4` mode).
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::ops::softmax_axis;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::{AttnProjections, SelfAttention};
use super::config::{parse_config, sliding_layers};
use super::decoder::{load_stack, Decoder, Head, NormKind, Sizes, Stack};
use super::info::KvShape;
use super::layers::{attend_queries, AttnOpts, Linear, Queries};
use super::mlp::FeedForward;
use super::params::{Parameters, Params};
use super::rope::{initialize_rope, ScaledRope};
use super::switch::{top_k_tail, weighted_sum, SwitchActivation, SwitchGlu};
use super::CausalLm;
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// mlx-lm's `gpt_oss.ModelArgs`, with its defaults.
#[derive(Debug, Clone, Deserialize)]
struct Config {
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::num_local_experts")]
    num_local_experts: i32,
    #[serde(default = "defaults::num_experts_per_tok")]
    num_experts_per_tok: i32,
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::rms_norm_eps")]
    rms_norm_eps: f32,
    #[serde(default = "defaults::head_dim")]
    head_dim: i32,
    #[serde(default = "defaults::num_attention_heads")]
    num_attention_heads: i32,
    #[serde(default = "defaults::num_key_value_heads")]
    num_key_value_heads: i32,
    #[serde(default = "defaults::sliding_window")]
    sliding_window: usize,
    #[serde(default = "defaults::rope_theta")]
    rope_theta: f64,
    rope_scaling: Option<Value>,
    layer_types: Option<Vec<String>>,
    max_position_embeddings: Option<usize>,
    /// The clamp of the experts' SwiGLU; mlx-lm hard-codes 7.
    swiglu_limit: Option<f32>,
}

/// The defaults of mlx-lm's `gpt_oss.ModelArgs`.
mod defaults {
    pub fn num_hidden_layers() -> usize {
        36
    }
    pub fn num_local_experts() -> i32 {
        128
    }
    pub fn num_experts_per_tok() -> i32 {
        4
    }
    pub fn vocab_size() -> usize {
        201088
    }
    pub fn rms_norm_eps() -> f32 {
        1e-5
    }
    pub fn head_dim() -> i32 {
        64
    }
    pub fn num_attention_heads() -> i32 {
        64
    }
    pub fn num_key_value_heads() -> i32 {
        8
    }
    pub fn sliding_window() -> usize {
        128
    }
    pub fn rope_theta() -> f64 {
        150000.0
    }
}

/// The experts' activation as mlx-lm's `SwigluOAI` fixes it.
const SWIGLU: SwitchActivation = SwitchActivation::ClampedSwiGlu {
    alpha: 1.702,
    limit: 7.0,
};

impl Config {
    fn from_json(config: &Value) -> Result<Self, LoadError> {
        let c: Config = parse_config("gpt-oss", config)?;
        if c.swiglu_limit.is_some_and(|l| l != 7.0) {
            return Err(LoadError::Config(format!(
                "gpt-oss: swiglu_limit {:?} is not supported (mlx-lm uses 7.0)",
                c.swiglu_limit
            )));
        }
        if c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts {
            return Err(LoadError::Config(format!(
                "gpt-oss: num_experts_per_tok {} outside 1..={}",
                c.num_experts_per_tok, c.num_local_experts
            )));
        }
        if c.num_key_value_heads < 1 || c.num_attention_heads % c.num_key_value_heads != 0 {
            return Err(LoadError::Config(format!(
                "gpt-oss: {} attention heads cannot share {} KV heads",
                c.num_attention_heads, c.num_key_value_heads
            )));
        }
        Ok(c)
    }

    /// Per layer, whether it attends within the sliding window. mlx-lm's default alternates,
    /// starting with a sliding layer; it pairs layers with `layer_types` by `zip`, so a list
    /// of another length is refused (it would silently drop layers).
    fn sliding_layers(&self) -> Result<Vec<bool>, LoadError> {
        let types: Vec<String> = match &self.layer_types {
            Some(t) => t.clone(),
            None => ["sliding_attention", "full_attention"]
                .iter()
                .cycle()
                .take(self.num_hidden_layers / 2 * 2)
                .map(|s| s.to_string())
                .collect(),
        };
        sliding_layers("gpt-oss", &types, self.num_hidden_layers)
    }
}

/// gpt-oss's attention: biased projections, a learned sink per query head, and a sliding
/// window on the sliding layers.
struct Attention {
    proj: AttnProjections,
    /// One learned logit per query head that takes a share of each softmax.
    sinks: Array,
    /// `Some(sliding_window)` on sliding layers.
    window: Option<usize>,
    /// The rotation, with YaRN's factor on queries and keys before it.
    rope: ScaledRope,
    /// `head_dim^-0.5`.
    scale: f32,
}

impl SelfAttention for Attention {
    fn window(&self) -> Option<usize> {
        self.window
    }

    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        let (q, k, v) = self.proj.project(x)?;
        let (q, k) = (self.rope.prescale(&q)?, self.rope.prescale(&k)?);
        let opts = AttnOpts {
            window: self.window,
            sinks: Some(&self.sinks),
            ..AttnOpts::rotary(&self.rope.rope, self.scale)
        };
        self.proj
            .o_proj
            .forward(&attend_queries(&q, &k, &v, &opts, cache, which)?)
    }
}

impl Parameters for Attention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.proj).add(&self.sinks);
    }
}

struct Moe {
    router: Linear,
    experts: SwitchGlu,
    top_k: i32,
}

impl Moe {
    fn load(w: &mut Weights, prefix: &str, top_k: i32) -> Result<Self, LoadError> {
        Ok(Self {
            router: Linear::load(w, &format!("{prefix}.router"), true)?,
            experts: SwitchGlu::load(w, &format!("{prefix}.experts"), true, SWIGLU)?,
            top_k,
        })
    }
}

impl FeedForward for Moe {
    /// Each token's top-k experts by router logit, weighted by the softmax of those logits.
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let logits = self.router.forward(x)?;
        let indices = top_k_tail(&logits, self.top_k)?;
        let weights = softmax_axis(&take_along_axis(&logits, &indices, -1)?, -1, true)?;
        weighted_sum(&self.experts.forward(x, &indices)?, &weights)
    }
}

impl Parameters for Moe {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.router).add(&self.experts);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c = Config::from_json(config)?;
    refuse_unsanitized(w)?;
    let sliding = c.sliding_layers()?;
    let rope = initialize_rope(
        c.head_dim,
        c.rope_theta as f32,
        false,
        c.rope_scaling.as_ref(),
    )?;
    let stack = Stack::pre_norm(
        c.num_hidden_layers,
        NormKind::Rms {
            eps: c.rms_norm_eps,
        },
        Head::Own,
    );
    let (trunk, layers) = load_stack(
        w,
        &stack,
        |w, i, p| {
            let a = format!("{p}.self_attn");
            Ok(Attention {
                proj: AttnProjections::load(
                    w,
                    &a,
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    true,
                    true,
                )?,
                sinks: w.take(&format!("{a}.sinks"))?,
                window: sliding[i].then_some(c.sliding_window),
                rope: rope.clone(),
                scale: (1.0 / f64::from(c.head_dim).sqrt()) as f32,
            })
        },
        |w, _, p| Moe::load(w, &format!("{p}.mlp"), c.num_experts_per_tok),
    )?;
    let sizes = Sizes {
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings.unwrap_or(131072),
        kv: KvShape::heads(c.num_hidden_layers, c.num_key_value_heads, c.head_dim),
    };
    Decoder::new(config, trunk, layers, sizes).finish(w)
}

/// A Hugging Face checkpoint keeps each layer's experts as one interleaved `gate_up_proj`
/// (MXFP4 blocks in uint8); mlx-lm converts it when it loads it. Served here is the converted
/// form that mlx-community ships, so the raw one is refused by name.
fn refuse_unsanitized(w: &Weights) -> Result<(), LoadError> {
    match w.names().into_iter().find(|n| n.contains("gate_up_proj")) {
        Some(name) => Err(LoadError::Config(format!(
            "gpt-oss: {name} is in Hugging Face's layout; convert the checkpoint with \
             mlx_lm.convert (experts as gate_proj/up_proj/down_proj)"
        ))),
        None => Ok(()),
    }
}
