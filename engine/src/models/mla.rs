//! What DeepSeek-V2 and DeepSeek-V3 (and Kimi K2, which is DeepSeek-V3) share: the config,
//! the low-rank query projection, DeepSeek's YaRN rotary embedding, the per-head matrices of
//! the absorbed multi-head latent attention (mlx-lm's `MultiLinear`), the MoE block with shared
//! experts, the checkpoint clean-up (`sanitize`) and the decoder around a family's attention
//! and router. Each family file supplies its attention and its router; everything here follows
//! mlx-lm 0.32.2's `deepseek_v2.py` / `deepseek_v3.py` / `mla.py` op for op.
use mlx_rs::error::Exception;
use mlx_rs::ops::argpartition_axis;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense_parts::{self, scaled, GatedMlp, KvShape, Params};
use super::layers::{Linear, Matrix, RmsNorm, Rope};
use super::quant;
use super::switch::{top_k_of_negated, weighted_sum, SwitchActivation, SwitchGlu};
use super::{CausalLm, Feature, ModelInfo};
use crate::cache::{LayerCache, Mask};
use crate::loader::{LoadError, Weights};

/// The config fields both DeepSeek generations read, with mlx-lm's defaults where it has them.
/// The sizes that fix the weights' shapes have no default: a config without them is refused.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct DeepseekConfig {
    pub vocab_size: usize,
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub n_shared_experts: Option<i32>,
    pub n_routed_experts: Option<i32>,
    #[serde(default = "one")]
    pub routed_scaling_factor: f32,
    #[serde(default = "default_kv_lora_rank")]
    pub kv_lora_rank: i32,
    /// Read separately ([`q_lora_rank`]): absent means mlx-lm's default, `null` no low rank.
    #[serde(skip)]
    pub q_lora_rank: Option<i32>,
    #[serde(default = "default_rope_head_dim")]
    pub qk_rope_head_dim: i32,
    #[serde(default = "default_head_dim")]
    pub v_head_dim: i32,
    #[serde(default = "default_head_dim")]
    pub qk_nope_head_dim: i32,
    pub topk_method: Option<String>,
    pub scoring_func: Option<String>,
    pub norm_topk_prob: Option<bool>,
    pub n_group: Option<i32>,
    pub topk_group: Option<i32>,
    pub num_experts_per_tok: Option<i32>,
    #[serde(default = "one_usize")]
    pub moe_layer_freq: usize,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub attention_bias: bool,
}

fn one() -> f32 {
    1.0
}
fn one_usize() -> usize {
    1
}
fn default_kv_lora_rank() -> i32 {
    512
}
fn default_rope_head_dim() -> i32 {
    64
}
fn default_head_dim() -> i32 {
    128
}
fn default_max_position_embeddings() -> usize {
    2048
}
fn default_eps() -> f32 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10000.0
}

/// mlx-lm's default `q_lora_rank` when the config does not mention it.
const DEFAULT_Q_LORA_RANK: i32 = 1536;

/// The epsilon mlx-lm gives the query and KV latent norms, whatever `rms_norm_eps` says.
const LATENT_NORM_EPS: f32 = 1e-6;

impl DeepseekConfig {
    pub fn from_json(config: &Value) -> Result<Self, LoadError> {
        let mut c: Self = dense_parts::parse_config(config)?;
        c.q_lora_rank = q_lora_rank(config)?;
        c.validate()?;
        Ok(c)
    }

    /// Refuses sizes that would make the model's shapes meaningless (or divide by zero).
    fn validate(&self) -> Result<(), LoadError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("v_head_dim", self.v_head_dim),
        ];
        for (name, v) in positive {
            if v <= 0 {
                return Err(LoadError::Config(format!(
                    "{name} must be positive, got {v}"
                )));
            }
        }
        if self.qk_rope_head_dim % 2 != 0 {
            return Err(LoadError::Config(format!(
                "qk_rope_head_dim must be even, got {}",
                self.qk_rope_head_dim
            )));
        }
        if self.moe_layer_freq == 0 {
            return Err(LoadError::Config(
                "moe_layer_freq must be at least 1".into(),
            ));
        }
        if let Some(r) = self.q_lora_rank.filter(|&r| r <= 0) {
            return Err(LoadError::Config(format!(
                "q_lora_rank must be positive, got {r}"
            )));
        }
        Ok(())
    }

    /// Query and key head size: the part without position plus the rotary part.
    pub fn q_head_dim(&self) -> i32 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether layer `i` is a mixture of experts (mlx-lm's rule), else a dense MLP.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.n_routed_experts.is_some()
            && i >= self.first_k_dense_replace
            && i.is_multiple_of(self.moe_layer_freq)
    }

    /// `num_experts_per_tok`, required once a layer routes.
    pub fn experts_per_token(&self, default: Option<i32>) -> Result<i32, LoadError> {
        let k = self
            .num_experts_per_tok
            .or(default)
            .ok_or_else(|| LoadError::Config("MoE config has no num_experts_per_tok".into()))?;
        let experts = self.n_routed_experts.unwrap_or(0);
        if k < 1 || k > experts {
            return Err(LoadError::Config(format!(
                "num_experts_per_tok {k} is not between 1 and n_routed_experts {experts}"
            )));
        }
        Ok(k)
    }

    /// The softmax scale of the attention: `q_head_dim^-0.5`, times `mscale_all_dim`'s YaRN
    /// factor squared when the rope scaling has one and stretches the context (`factor > 1`).
    /// Kept in f64, as mlx-lm's Python float, until it meets an array.
    pub fn softmax_scale(&self) -> Result<f64, LoadError> {
        let scale = (self.q_head_dim() as f64).powf(-0.5);
        let Some(scaling) = self.rope_scaling.as_ref().filter(|s| !s.is_null()) else {
            return Ok(scale);
        };
        let mscale_all_dim = number(scaling, "mscale_all_dim")?.unwrap_or(0.0);
        if mscale_all_dim == 0.0 {
            return Ok(scale);
        }
        let factor = number(scaling, "factor")?
            .ok_or_else(|| LoadError::Config("rope_scaling has no factor".into()))?;
        let s = yarn_mscale(factor, mscale_all_dim);
        Ok(scale * s * s)
    }
}

/// `q_lora_rank`: a missing key takes mlx-lm's default, `null` means the queries are projected
/// at full rank.
fn q_lora_rank(config: &Value) -> Result<Option<i32>, LoadError> {
    match config.get("q_lora_rank") {
        None => Ok(Some(DEFAULT_Q_LORA_RANK)),
        Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(|r| Some(r as i32))
            .ok_or_else(|| LoadError::Config(format!("q_lora_rank {v} is not an integer"))),
    }
}

/// A numeric field of `rope_scaling`; a non-number is refused.
fn number(scaling: &Value, key: &str) -> Result<Option<f64>, LoadError> {
    match scaling.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| LoadError::Config(format!("rope_scaling.{key} {v} is not a number"))),
    }
}

/// YaRN's attention-magnitude correction `0.1 * m * ln(scale) + 1` (1 without stretching).
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// A rotary embedding, with DeepSeek's YaRN input scaling: the rotated features are first
/// multiplied by `mscale / mscale_all_dim`'s correction ratio when it is not 1.
#[derive(Debug)]
pub(crate) struct DeepseekRope {
    rope: Rope,
    input_scale: Option<f32>,
}

impl DeepseekRope {
    /// Plain (or linearly scaled) rotary embedding of `dims` features, in the traditional
    /// (interleaved) layout DeepSeek uses.
    pub fn plain(dims: i32, base: f64, scale: f32) -> Self {
        Self {
            rope: Rope {
                dims,
                traditional: true,
                base: base as f32,
                scale,
                freqs: None,
            },
            input_scale: None,
        }
    }

    /// DeepSeek's YaRN (mlx-lm's `YarnRoPE` / `DeepseekV2YarnRotaryEmbedding`, which compute the
    /// same): the frequencies blend interpolated and original ones over a ramp between the
    /// correction dimensions of `beta_fast` and `beta_slow`. Computed with MLX ops in float32,
    /// as mlx-lm does, so the frequencies are bit-identical.
    pub fn yarn(dims: i32, base: f64, scaling: &Value) -> Result<Self, LoadError> {
        let get = |key: &str, default: f64| number(scaling, key).map(|v| v.unwrap_or(default));
        let factor = number(scaling, "factor")?
            .ok_or_else(|| LoadError::Config("YaRN rope_scaling has no factor".into()))?;
        let original_len = get("original_max_position_embeddings", 4096.0)?;
        let beta_fast = get("beta_fast", 32.0)?;
        let beta_slow = get("beta_slow", 1.0)?;
        let mscale = get("mscale", 1.0)?;
        let mscale_all_dim = get("mscale_all_dim", 0.0)?;
        let correction_dim = |rotations: f64| {
            (dims as f64 * (original_len / (rotations * 2.0 * std::f64::consts::PI)).ln())
                / (2.0 * base.ln())
        };
        let low = correction_dim(beta_fast).floor().max(0.0);
        let high = correction_dim(beta_slow).ceil().min((dims - 1) as f64);
        let freqs = yarn_freqs(dims, base, factor, low, high)?;
        let ratio = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
        Ok(Self {
            rope: Rope {
                dims,
                traditional: true,
                base: base as f32,
                scale: 1.0,
                freqs: Some(freqs),
            },
            input_scale: (ratio != 1.0).then_some(ratio as f32),
        })
    }

    /// Rotates `x` `[B, heads, L, dims]` at the positions the cache gives the new tokens.
    pub fn apply(&self, cache: &LayerCache, x: &Array) -> Result<Array, Exception> {
        match self.input_scale {
            Some(s) => cache.rope(&self.rope, &scaled(x, s)?),
            None => cache.rope(&self.rope, x),
        }
    }
}

/// YaRN's blended frequencies over `dims / 2` rotation pairs, op for op as mlx-lm.
fn yarn_freqs(dims: i32, base: f64, factor: f64, low: f64, high: f64) -> Result<Array, LoadError> {
    let f32_scalar = |v: f64| Array::from_f32(v as f32);
    let exponents = Array::arange::<_, f32>(0, dims, 2)?.divide(f32_scalar(dims as f64))?;
    let freq_extra = mlx_rs::ops::power(f32_scalar(base), &exponents)?;
    let freq_inter = f32_scalar(factor).multiply(&freq_extra)?;
    let high = if low == high { high + 0.001 } else { high };
    let ramp = Array::arange::<_, f32>(None, dims / 2, None)?
        .subtract(f32_scalar(low))?
        .divide(f32_scalar(high - low))?;
    let ramp = mlx_rs::ops::clip(&ramp, (&f32_scalar(0.0), &f32_scalar(1.0)))?;
    let freq_mask = f32_scalar(1.0).subtract(&ramp)?;
    let numerator = freq_inter.multiply(&freq_extra)?;
    let denominator = freq_inter
        .multiply(&freq_mask)?
        .add(freq_extra.multiply(f32_scalar(1.0).subtract(&freq_mask)?)?)?;
    Ok(numerator.divide(&denominator)?)
}

/// The rope scaling kind a config names (`type`, else `rope_type`, else `default`).
pub(crate) fn rope_kind(scaling: &Value) -> &str {
    scaling
        .get("type")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .or_else(|| scaling.get("rope_type").and_then(Value::as_str))
        .unwrap_or("default")
}

/// The query projection: at full rank (`q_proj`), or through a normalised low-rank bottleneck
/// (`q_a_proj` → `q_a_layernorm` → `q_b_proj`) when the config gives `q_lora_rank`.
pub(crate) enum QueryProjection {
    Full(Linear),
    LowRank {
        q_a_proj: Linear,
        q_a_layernorm: RmsNorm,
        q_b_proj: Linear,
    },
}

impl QueryProjection {
    pub fn load(w: &mut Weights, prefix: &str, c: &DeepseekConfig) -> Result<Self, LoadError> {
        Ok(match c.q_lora_rank {
            None => QueryProjection::Full(Linear::load(w, &format!("{prefix}.q_proj"), false)?),
            Some(_) => QueryProjection::LowRank {
                q_a_proj: Linear::load(w, &format!("{prefix}.q_a_proj"), c.attention_bias)?,
                q_a_layernorm: RmsNorm::load(
                    w,
                    &format!("{prefix}.q_a_layernorm"),
                    LATENT_NORM_EPS,
                )?,
                q_b_proj: Linear::load(w, &format!("{prefix}.q_b_proj"), false)?,
            },
        })
    }

    /// Queries `[B, L, heads * q_head_dim]`.
    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        match self {
            QueryProjection::Full(q) => q.forward(x),
            QueryProjection::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => q_b_proj.forward(&q_a_layernorm.forward(&q_a_proj.forward(x)?)?),
        }
    }

    pub fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match self {
            QueryProjection::Full(q) => p.linear(q),
            QueryProjection::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                p.linear(q_a_proj);
                p.array(&q_a_layernorm.weight);
                p.linear(q_b_proj);
            }
        }
    }
}

/// The projections both attentions start with: queries split into their position-free and
/// rotary parts `[B, heads, L, ·]`, and the compressed KV `[B, L, kv_lora_rank]` with the shared
/// rotary key `[B, 1, L, qk_rope_head_dim]` (both before normalisation / rotation).
pub(crate) struct LatentInputs {
    pub q_nope: Array,
    pub q_pe: Array,
    pub compressed_kv: Array,
    pub k_pe: Array,
}

/// The shared first half of both attentions: `q`, `kv_a_proj_with_mqa` and `kv_a_layernorm`.
pub(crate) struct LatentProjections {
    pub q: QueryProjection,
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: RmsNorm,
    pub heads: i32,
    pub qk_nope_head_dim: i32,
    pub qk_rope_head_dim: i32,
    pub kv_lora_rank: i32,
}

impl LatentProjections {
    pub fn load(w: &mut Weights, prefix: &str, c: &DeepseekConfig) -> Result<Self, LoadError> {
        Ok(Self {
            q: QueryProjection::load(w, prefix, c)?,
            kv_a_proj_with_mqa: Linear::load(
                w,
                &format!("{prefix}.kv_a_proj_with_mqa"),
                c.attention_bias,
            )?,
            kv_a_layernorm: RmsNorm::load(w, &format!("{prefix}.kv_a_layernorm"), LATENT_NORM_EPS)?,
            heads: c.num_attention_heads,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            kv_lora_rank: c.kv_lora_rank,
        })
    }

    /// `x` `[B, L, hidden]` → the attention's inputs (see [`LatentInputs`]).
    pub fn forward(&self, x: &Array) -> Result<LatentInputs, Exception> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = self
            .q
            .forward(x)?
            .reshape(&[b, l, self.heads, -1])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let mut q = q
            .split_at_indices(&[self.qk_nope_head_dim], -1)?
            .into_iter();
        let mut kv = self
            .kv_a_proj_with_mqa
            .forward(x)?
            .split_at_indices(&[self.kv_lora_rank], -1)?
            .into_iter();
        let missing = || Exception::custom("split gave fewer parts than asked");
        let (q_nope, q_pe) = (q.next().ok_or_else(missing)?, q.next().ok_or_else(missing)?);
        let (compressed_kv, k_pe) = (
            kv.next().ok_or_else(missing)?,
            kv.next().ok_or_else(missing)?,
        );
        let k_pe = k_pe
            .reshape(&[b, l, 1, self.qk_rope_head_dim])?
            .transpose_axes(&[0, 2, 1, 3])?;
        Ok(LatentInputs {
            q_nope,
            q_pe,
            compressed_kv,
            k_pe,
        })
    }

    pub fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        self.q.push_params(p);
        p.linear(&self.kv_a_proj_with_mqa);
        p.array(&self.kv_a_layernorm.weight);
    }
}

/// mlx-lm's `MultiLinear` / `QuantizedMultiLinear`: one `[out, in]` matrix per head, stacked
/// `[heads, out, in]`, applied to each head's slice of `[B, heads, L, ·]` (or broadcast over a
/// single latent head).
pub(crate) struct MultiLinear {
    pub weight: Matrix,
}

impl MultiLinear {
    pub fn load(w: &mut Weights, prefix: &str) -> Result<Self, LoadError> {
        Ok(Self {
            weight: Matrix::load(w, prefix)?,
        })
    }

    /// `x @ W.T` per head with `transpose` (in → out), else `x @ W` (out → in).
    pub fn forward(&self, x: &Array, transpose: bool) -> Result<Array, Exception> {
        if let Some(packed) = self.weight.quantized_parts() {
            return quant::quantized_matmul(x, packed, transpose);
        }
        match &self.weight {
            Matrix::Dense(w) if transpose => x.matmul(w.swap_axes(-1, -2)?),
            Matrix::Dense(w) => x.matmul(w),
            _ => Err(Exception::custom(
                "a quantized per-head matrix without parts",
            )),
        }
    }
}

/// The attention of one DeepSeek generation: from normalised hidden states to the output
/// projection, through the layer's cache.
pub(crate) trait DeepseekAttention: Send {
    fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception>;
    fn push_params<'a>(&'a self, p: &mut Params<'a>);
}

/// The router of one DeepSeek generation: hidden states `[B, L, hidden]` → expert ids
/// `[B, L, k]` (uint32) and their weights `[B, L, k]`.
pub(crate) trait Router: Send {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception>;
    fn push_params<'a>(&'a self, p: &mut Params<'a>);
    /// Whether the weighted sum over experts is cast back to the experts' dtype (V3 routes in
    /// float32 and casts back; V2 leaves the promotion).
    fn cast_back(&self) -> bool;
}

/// Routed experts plus optional always-on shared experts.
pub(crate) struct Moe<R> {
    gate: R,
    switch_mlp: SwitchGlu,
    shared_experts: Option<GatedMlp>,
}

impl<R: Router> Moe<R> {
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        c: &DeepseekConfig,
        gate: R,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            gate,
            switch_mlp: SwitchGlu::load(
                w,
                &format!("{prefix}.switch_mlp"),
                false,
                SwitchActivation::SwiGlu,
            )?,
            shared_experts: c
                .n_shared_experts
                .map(|_| GatedMlp::load(w, &format!("{prefix}.shared_experts"), false))
                .transpose()?,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let (inds, scores) = self.gate.route(x)?;
        let y = self.switch_mlp.forward(x, &inds)?;
        let mut out = weighted_sum(&y, &scores)?;
        if self.gate.cast_back() {
            out = out.as_dtype(y.dtype())?;
        }
        match &self.shared_experts {
            Some(shared) => out.add(shared.forward(x)?),
            None => Ok(out),
        }
    }

    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        self.gate.push_params(p);
        for a in self.switch_mlp.parameters() {
            p.array(a);
        }
        if let Some(shared) = &self.shared_experts {
            p.mlp(shared);
        }
    }
}

/// `argpartition(x, kth, axis)[..., :n, :]` along the second-to-last axis: the ids of the `n`
/// groups with the lowest scores (`x` `[..., groups, 1]`), the ones a group-limited router
/// zeroes.
pub(crate) fn lowest_groups(group_scores: &Array, n: i32) -> Result<Array, Exception> {
    Ok(argpartition_axis(group_scores, n - 1, -2)?.index((Ellipsis, ..n, ..)))
}

/// Ids of the `k` experts with the highest scores, as mlx-lm's DeepSeek routers take them.
pub(crate) fn top_experts(scores: &Array, k: i32) -> Result<Array, Exception> {
    top_k_of_negated(scores, k)
}

/// The feed-forward half of a block: a SwiGLU MLP or a mixture of experts.
enum FeedForward<R> {
    Dense(GatedMlp),
    Moe(Box<Moe<R>>),
}

struct Block<A, R> {
    attn: A,
    mlp: FeedForward<R>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

/// A DeepSeek decoder: embedding, pre-norm blocks of the family's attention and MLP or MoE,
/// final norm and an untied output head.
pub(crate) struct Deepseek<A, R> {
    embed_tokens: Matrix,
    layers: Vec<Block<A, R>>,
    norm: RmsNorm,
    lm_head: Matrix,
    info: ModelInfo,
    /// The family's reasons to refuse a feature.
    refusals: Vec<(Feature, String)>,
}

/// How a family builds the parts that differ: attention and router of layer `i`.
pub(crate) struct FamilyParts<'f, A, R> {
    pub attention: &'f dyn Fn(&mut Weights, usize) -> Result<A, LoadError>,
    pub router: &'f dyn Fn(&mut Weights, usize) -> Result<R, LoadError>,
    /// Elements one layer caches per token (the activation dtype's size and the layer count
    /// multiply it into `kv_bytes_per_token`).
    pub kv_elements_per_token_per_layer: usize,
    /// The head size a KV quantization group would have to divide.
    pub head_dim: i32,
    pub refusals: Vec<(Feature, String)>,
}

impl<A: DeepseekAttention + 'static, R: Router + 'static> Deepseek<A, R> {
    /// Builds the decoder from the (sanitized) checkpoint.
    pub fn build(
        config: &Value,
        c: &DeepseekConfig,
        w: &mut Weights,
        parts: FamilyParts<'_, A, R>,
    ) -> Result<Box<dyn CausalLm>, LoadError> {
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mlp = if c.is_moe_layer(i) {
                let gate = (parts.router)(w, i)?;
                FeedForward::Moe(Box::new(Moe::load(w, &format!("{p}.mlp"), c, gate)?))
            } else {
                FeedForward::Dense(GatedMlp::load(w, &format!("{p}.mlp"), false)?)
            };
            layers.push(Block {
                attn: (parts.attention)(w, i)?,
                mlp,
                input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), c.rms_norm_eps)?,
                post_attention_layernorm: RmsNorm::load(
                    w,
                    &format!("{p}.post_attention_layernorm"),
                    c.rms_norm_eps,
                )?,
            });
        }
        let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
        let norm = RmsNorm::load(w, "model.norm", c.rms_norm_eps)?;
        let lm_head = Matrix::load(w, "lm_head")?;
        let mut info = dense_parts::model_info(
            config,
            c.vocab_size,
            c.max_position_embeddings,
            KvShape {
                layers: c.num_hidden_layers,
                kv_heads: 1,
                head_dim: parts.head_dim,
            },
            &embed_tokens,
        );
        info.kv_bytes_per_token =
            c.num_hidden_layers * parts.kv_elements_per_token_per_layer * info.kv_dtype_bytes;
        let mut model = Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            info,
            refusals: parts.refusals,
        };
        model.info.weight_bytes = model.params().materialize(w.reporter())?;
        Ok(Box::new(model))
    }

    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            b.attn.push_params(&mut p);
            match &b.mlp {
                FeedForward::Dense(m) => p.mlp(m),
                FeedForward::Moe(m) => m.push_params(&mut p),
            }
            p.array(&b.input_layernorm.weight);
            p.array(&b.post_attention_layernorm.weight);
        }
        p.array(&self.norm.weight);
        p.matrix(&self.lm_head);
        p
    }
}

impl<A: DeepseekAttention, R: Router> CausalLm for Deepseek<A, R> {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (block, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = block
                .attn
                .forward(&block.input_layernorm.forward(&h)?, cache)?;
            let hh = h.add(&r)?;
            let normed = block.post_attention_layernorm.forward(&hh)?;
            let r = match &block.mlp {
                FeedForward::Dense(m) => m.forward(&normed)?,
                FeedForward::Moe(m) => m.forward(&normed)?,
            };
            h = hh.add(&r)?;
        }
        self.lm_head.matmul_t(&self.norm.forward(&h)?)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn refuses(&self, feature: Feature) -> Option<String> {
        self.refusals
            .iter()
            .find(|(f, _)| *f == feature)
            .map(|(_, reason)| reason.clone())
    }
}

/// Stacks Hugging Face's per-expert matrices (`mlp.experts.{e}.{gate,up,down}_proj`) into
/// mlx-lm's `mlp.switch_mlp.*` `[experts, out, in]` form, as both families' `sanitize` do.
pub(crate) fn stack_experts(w: &mut Weights, c: &DeepseekConfig) -> Result<(), LoadError> {
    let Some(experts) = c.n_routed_experts else {
        return Ok(());
    };
    for l in 0..c.num_hidden_layers {
        let prefix = format!("model.layers.{l}.mlp");
        for proj in ["gate_proj", "down_proj", "up_proj"] {
            for part in ["weight", "scales", "biases"] {
                if !w.contains(&format!("{prefix}.experts.0.{proj}.{part}")) {
                    continue;
                }
                let mut missing = Vec::new();
                let mut stack = Vec::with_capacity(experts as usize);
                for e in 0..experts {
                    let name = format!("{prefix}.experts.{e}.{proj}.{part}");
                    match w.remove_raw(&name) {
                        Some(a) => stack.push(a),
                        None => missing.push(name),
                    }
                }
                if !missing.is_empty() {
                    return Err(LoadError::MissingTensors(missing));
                }
                let stacked = mlx_rs::ops::stack(&stack, 0)?;
                w.insert(format!("{prefix}.switch_mlp.{proj}.{part}"), stacked);
            }
        }
    }
    Ok(())
}

/// Drops what mlx-lm recomputes or does not run: precomputed rotary frequencies, and the
/// multi-token-prediction layers DeepSeek-V3 checkpoints append after the last decoder layer.
pub(crate) fn drop_unused(w: &mut Weights, c: &DeepseekConfig, drop_extra_layers: bool) {
    for name in w.names() {
        let extra_layer = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i >= c.num_hidden_layers);
        if name.contains("rotary_emb.inv_freq") || (drop_extra_layers && extra_layer) {
            w.discard(&name);
        }
    }
}

/// The causal mask of `queries` new positions over `keys` positions as a boolean array
/// (`[L, T]`), for attentions that need it as an array: mlx-lm's `create_causal_mask`.
pub(crate) fn causal_mask_array(queries: i32, keys: i32) -> Result<Array, Exception> {
    let query_pos = Array::arange::<_, i32>(keys - queries, keys, None)?.reshape(&[queries, 1])?;
    let key_pos = Array::arange::<_, i32>(None, keys, None)?.reshape(&[1, keys])?;
    query_pos.ge(&key_pos)
}

/// The mask as a boolean array, or `None` when every query sees every key.
pub(crate) fn mask_array(mask: Mask, queries: i32, keys: i32) -> Result<Option<Array>, Exception> {
    match mask {
        Mask::None => Ok(None),
        Mask::Causal => causal_mask_array(queries, keys).map(Some),
        Mask::Array(a) => Ok(Some(a)),
    }
}
