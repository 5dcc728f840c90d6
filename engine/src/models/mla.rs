//! What DeepSeek-V2 and DeepSeek-V3 (and Kimi K2, which is DeepSeek-V3) share: the config,
//! the low-rank query projection, the per-head matrices of the absorbed multi-head latent
//! attention (mlx-lm's `MultiLinear`), the checkpoint clean-up (`sanitize`) and the decoder
//! around a family's attention and router (routed plus shared experts). Each family file
//! supplies its attention and its router; everything here follows mlx-lm 0.32.2's
//! `deepseek_v2.py` / `deepseek_v3.py` / `mla.py` op for op (YaRN is [`super::rope::yarn`]).
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::SelfAttention;
use super::config::parse_config;
use super::decoder::{load_stack, Decoder, Head, NormKind, Sizes, Stack};
use super::info::KvShape;
use super::layers::{Linear, Matrix, RmsNorm, Rope};
use super::mlp::{FeedForward, GatedMlp};
use super::moe::{RoutedExperts, Router, SharedExperts};
use super::params::{Parameters, Params};
use super::quant;
use super::rope::{scaling_number, yarn_mscale, ScaledRope};
use super::switch::HF_EXPERT_PROJECTIONS;
use super::{CausalLm, Feature};
use crate::cache::{Mask, Stored};
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
        let mut c: Self = parse_config("DeepSeek", config)?;
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
        let mscale_all_dim = scaling_number(scaling, "mscale_all_dim")?.unwrap_or(0.0);
        if mscale_all_dim == 0.0 {
            return Ok(scale);
        }
        let factor = scaling_number(scaling, "factor")?
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

/// DeepSeek's plain (or linearly scaled) rotary embedding of `dims` features, in the
/// traditional (interleaved) layout DeepSeek uses.
pub(crate) fn plain_deepseek_rope(dims: i32, base: f64, scale: f32) -> ScaledRope {
    ScaledRope::unscaled(Rope {
        dims,
        traditional: true,
        base: base as f32,
        scale,
        freqs: None,
    })
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
}

impl Parameters for QueryProjection {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match self {
            QueryProjection::Full(q) => p.add(q),
            QueryProjection::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => p.add(q_a_proj).add(q_a_layernorm).add(q_b_proj),
        };
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
}

impl Parameters for LatentProjections {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.q)
            .add(&self.kv_a_proj_with_mqa)
            .add(&self.kv_a_layernorm);
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

impl Parameters for MultiLinear {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight);
    }
}

/// How a family builds the parts that differ: attention and router of layer `i`.
pub(crate) struct FamilyParts<'f, A, R> {
    pub attention: &'f dyn Fn(&mut Weights, usize) -> Result<A, LoadError>,
    pub router: &'f dyn Fn(&mut Weights, usize) -> Result<R, LoadError>,
    /// Whether the weighted sum over experts is cast back to the experts' dtype (V3 routes in
    /// float32 and casts back; V2 leaves the promotion).
    pub cast_back: bool,
    /// Elements one layer caches per token (the activation dtype's size and the layer count
    /// multiply it into `kv_bytes_per_token`).
    pub kv_elements_per_token_per_layer: usize,
    /// The head size a KV quantization group would have to divide.
    pub head_dim: i32,
    pub refusals: Vec<(Feature, String)>,
}

/// Builds a DeepSeek decoder from the (sanitized) checkpoint: embedding, pre-norm blocks of
/// the family's attention and a SwiGLU MLP or (mlx-lm's rule, [`DeepseekConfig::is_moe_layer`])
/// routed experts plus shared experts, final norm and an untied output head.
pub(crate) fn build_deepseek<A, R>(
    config: &Value,
    c: &DeepseekConfig,
    w: &mut Weights,
    parts: FamilyParts<'_, A, R>,
) -> Result<Box<dyn CausalLm>, LoadError>
where
    A: SelfAttention + 'static,
    R: Router + 'static,
{
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
        |w, i, _| (parts.attention)(w, i),
        |w, i, p| -> Result<Box<dyn FeedForward>, LoadError> {
            let mlp = format!("{p}.mlp");
            if !c.is_moe_layer(i) {
                return Ok(Box::new(GatedMlp::load(w, &mlp, false)?));
            }
            let router = (parts.router)(w, i)?;
            let mut moe = RoutedExperts::load(w, &mlp, router, false)?;
            if c.n_shared_experts.is_some() {
                let shared = GatedMlp::load(w, &format!("{mlp}.shared_experts"), false)?;
                moe = moe.with_shared(SharedExperts::Plain(shared));
            }
            if parts.cast_back {
                moe = moe.cast_back();
            }
            Ok(Box::new(moe))
        },
    )?;
    let sizes = Sizes {
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
        kv: KvShape::uniform(
            c.num_hidden_layers,
            parts.kv_elements_per_token_per_layer,
            parts.head_dim,
        ),
    };
    let decoder = Decoder::new(config, trunk, layers, sizes);
    parts
        .refusals
        .into_iter()
        .fold(decoder, |d, (feature, reason)| d.refusing(feature, reason))
        .finish(w)
}

/// Stacks Hugging Face's per-expert matrices (`mlp.experts.{e}.{gate,up,down}_proj`) into
/// mlx-lm's `mlp.switch_mlp.*` `[experts, out, in]` form, as both families' `sanitize` do.
pub(crate) fn stack_experts(w: &mut Weights, c: &DeepseekConfig) -> Result<(), LoadError> {
    let Some(experts) = c.n_routed_experts else {
        return Ok(());
    };
    let experts = usize::try_from(experts)
        .map_err(|_| LoadError::Config(format!("n_routed_experts {experts} is negative")))?;
    for l in 0..c.num_hidden_layers {
        super::switch::stack_experts(
            w,
            &format!("model.layers.{l}.mlp"),
            experts,
            &HF_EXPERT_PROJECTIONS,
        )?;
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

/// One side of the cache as a plain array: both families refuse KV quantization at load, so
/// a quantized side is an error naming `family`.
pub(crate) fn unquantized(s: Stored, family: &str) -> Result<Array, Exception> {
    match s {
        Stored::Plain(a) => Ok(a),
        _ => Err(Exception::custom(format!(
            "{family}'s cache cannot be stored quantized"
        ))),
    }
}
