//! gpt-oss (`GptOssForCausalLM`), as mlx-lm 0.32.2's `gpt_oss.py` computes it: attention with
//! biases and learned per-head sinks, layers alternating between a sliding window and full
//! attention (`layer_types`), YaRN-scaled RoPE, and a mixture-of-experts MLP (a biased router,
//! softmax over the top-k logits, experts with gpt-oss's clamped SwiGLU).
//!
//! Weights are read as mlx-community ships them (MLX layout: experts split into
//! `gate_proj`/`up_proj`/`down_proj` stacks, quantized in `affine` or `mxfp4` mode).
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::ops::{clip, softmax_axis};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::gemma2::{full_kv_bytes_per_token, linear_parameters, scalar_like};
use super::layers::{attend_with, split_heads, AttnOpts, Linear, Matrix, RmsNorm, Rope};
use super::llama::kv_dtype_bytes;
use super::switch::{matrix_parameters, top_k_tail, weighted_sum, SwitchActivation, SwitchGlu};
use super::{eos_ids, CausalLm, ModelInfo};
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
        let c: Config =
            serde_json::from_value(config.clone()).map_err(|e| LoadError::Config(e.to_string()))?;
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
        if types.len() != self.num_hidden_layers {
            return Err(LoadError::Config(format!(
                "gpt-oss: {} layer_types for {} layers",
                types.len(),
                self.num_hidden_layers
            )));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(LoadError::Config(format!(
                    "gpt-oss: unsupported layer type {other:?}"
                ))),
            })
            .collect()
    }
}

/// The rotary embedding of a config, and the factor queries and keys are multiplied by before
/// it (YaRN's attention scaling; 1 otherwise). Plain, linear and YaRN scaling, as mlx-lm's
/// `initialize_rope` builds them for gpt-oss; others are refused.
pub(crate) fn rope_with_yarn(
    dims: i32,
    base: f64,
    scaling: Option<&Value>,
) -> Result<(Rope, f32), LoadError> {
    let plain = |scale: f32| Rope {
        dims,
        traditional: false,
        base: base as f32,
        scale,
        freqs: None,
    };
    let Some(scaling) = scaling.filter(|s| !s.is_null()) else {
        return Ok((plain(1.0), 1.0));
    };
    let kind = scaling
        .get("type")
        .or_else(|| scaling.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| scaling.get(key).and_then(Value::as_f64);
    let factor = || {
        number("factor").ok_or_else(|| {
            LoadError::Config(format!(
                "rope_scaling of type {kind:?} has no numeric factor"
            ))
        })
    };
    match kind {
        "default" => Ok((plain(1.0), 1.0)),
        "linear" => Ok((plain((1.0 / factor()?) as f32), 1.0)),
        "yarn" => {
            let yarn = Yarn {
                dims,
                base,
                factor: factor()?,
                original_max_positions: number("original_max_position_embeddings")
                    .unwrap_or(4096.0),
                beta_fast: number("beta_fast").unwrap_or(32.0),
                beta_slow: number("beta_slow").unwrap_or(1.0),
                mscale: number("mscale").unwrap_or(1.0),
                mscale_all_dim: number("mscale_all_dim").unwrap_or(0.0),
            };
            let freqs = yarn.freqs()?;
            mlx_rs::transforms::eval([&freqs])?;
            let rope = Rope {
                freqs: Some(freqs),
                ..plain(1.0)
            };
            Ok((rope, yarn.attention_factor() as f32))
        }
        other => Err(LoadError::Config(format!(
            "gpt-oss: unsupported rope_scaling type {other:?}"
        ))),
    }
}

/// The parameters of mlx-lm's `YarnRoPE`.
struct Yarn {
    dims: i32,
    base: f64,
    factor: f64,
    original_max_positions: f64,
    beta_fast: f64,
    beta_slow: f64,
    mscale: f64,
    mscale_all_dim: f64,
}

impl Yarn {
    /// The dimension index at which a frequency completes `rotations` turns over the original
    /// context.
    fn correction_dim(&self, rotations: f64) -> f64 {
        let dims = f64::from(self.dims);
        dims * (self.original_max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * self.base.ln())
    }

    /// The dimension range over which frequencies blend from interpolated to extrapolated.
    fn correction_range(&self) -> (f64, f64) {
        let low = self.correction_dim(self.beta_fast).floor();
        let high = self.correction_dim(self.beta_slow).ceil();
        (low.max(0.0), high.min(f64::from(self.dims - 1)))
    }

    fn mscale_of(&self, m: f64) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * m * self.factor.ln() + 1.0
        }
    }

    /// The factor queries and keys take before the rotation.
    fn attention_factor(&self) -> f64 {
        self.mscale_of(self.mscale) / self.mscale_of(self.mscale_all_dim)
    }

    /// The blended frequencies `[dims / 2]`, in float32 MLX ops as mlx-lm computes them.
    fn freqs(&self) -> Result<Array, Exception> {
        let f = |v: f64| Array::from_f32(v as f32);
        let exponents =
            Array::arange::<_, f32>(0, self.dims, 2)?.divide(f(f64::from(self.dims)))?;
        let freq_extra = f(self.base).power(&exponents)?;
        let freq_inter = f(self.factor).multiply(&freq_extra)?;
        let (low, mut high) = self.correction_range();
        if low == high {
            high += 0.001;
        }
        let ramp = Array::arange::<_, f32>(None, self.dims / 2, None)?
            .subtract(f(low))?
            .divide(f(high - low))?;
        let ramp = clip(&ramp, (&f(0.0), &f(1.0)))?;
        let extrapolated = f(1.0).subtract(&ramp)?;
        let numerator = freq_inter.multiply(&freq_extra)?;
        let denominator = freq_inter
            .multiply(&extrapolated)?
            .add(&freq_extra.multiply(&f(1.0).subtract(&extrapolated)?)?)?;
        numerator.divide(&denominator)
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// One learned logit per query head that takes a share of each softmax.
    sinks: Array,
    /// `Some(sliding_window)` on sliding layers.
    window: Option<usize>,
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

    /// Each token's top-k experts by router logit, weighted by the softmax of those logits.
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let logits = self.router.forward(x)?;
        let indices = top_k_tail(&logits, self.top_k)?;
        let weights = softmax_axis(&take_along_axis(&logits, &indices, -1)?, -1, true)?;
        weighted_sum(&self.experts.forward(x, &indices)?, &weights)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = linear_parameters(&self.router);
        out.extend(self.experts.parameters());
        out
    }
}

struct Block {
    attn: Attention,
    mlp: Moe,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

pub struct GptOss {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Matrix,
    rope: Rope,
    /// YaRN's factor on queries and keys before the rotation (1: none).
    rope_input_scale: f32,
    heads: i32,
    kv_heads: i32,
    /// `head_dim^-0.5`.
    scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c = Config::from_json(config)?;
    refuse_unsanitized(w)?;
    let sliding = c.sliding_layers()?;
    let (rope, rope_input_scale) =
        rope_with_yarn(c.head_dim, c.rope_theta, c.rope_scaling.as_ref())?;
    let eps = c.rms_norm_eps;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (i, &is_sliding) in sliding.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        layers.push(Block {
            attn: Attention {
                q_proj: Linear::load(w, &format!("{a}.q_proj"), true)?,
                k_proj: Linear::load(w, &format!("{a}.k_proj"), true)?,
                v_proj: Linear::load(w, &format!("{a}.v_proj"), true)?,
                o_proj: Linear::load(w, &format!("{a}.o_proj"), true)?,
                sinks: w.take(&format!("{a}.sinks"))?,
                window: is_sliding.then_some(c.sliding_window),
            },
            mlp: Moe::load(w, &format!("{p}.mlp"), c.num_experts_per_tok)?,
            input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{p}.post_attention_layernorm"),
                eps,
            )?,
        });
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", eps)?;
    let lm_head = Matrix::load(w, "lm_head")?;
    let dtype_bytes = kv_dtype_bytes(&embed_tokens);
    let info = ModelInfo {
        architecture: config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings.unwrap_or(131072),
        weight_bytes: 0,
        // Counted as if sliding layers kept every position: an upper bound (the batch keeps a
        // sliding layer's last window and a little more), so admission never over-commits.
        kv_bytes_per_token: full_kv_bytes_per_token(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            dtype_bytes,
        ),
        kv_dtype_bytes: dtype_bytes,
        head_dim: c.head_dim as usize,
        eos_token_ids: eos_ids(config),
    };
    let mut model = GptOss {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        rope_input_scale,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        scale: (1.0 / f64::from(c.head_dim).sqrt()) as f32,
        info,
    };
    model.info.weight_bytes = crate::loader::materialize(&model.parameters(), w.reporter())?;
    Ok(Box::new(model))
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

impl GptOss {
    fn parameters(&self) -> Vec<&Array> {
        let mut out = matrix_parameters(&self.embed_tokens);
        for b in &self.layers {
            let a = &b.attn;
            for l in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj] {
                out.extend(linear_parameters(l));
            }
            out.push(&a.sinks);
            out.extend(b.mlp.parameters());
            out.push(&b.input_layernorm.weight);
            out.push(&b.post_attention_layernorm.weight);
        }
        out.push(&self.norm.weight);
        out.extend(matrix_parameters(&self.lm_head));
        out
    }

    /// YaRN's pre-rotation factor on queries or keys, in their dtype.
    fn scale_for_rope(&self, x: Array) -> Result<Array, Exception> {
        if self.rope_input_scale == 1.0 {
            return Ok(x);
        }
        x.multiply(&scalar_like(&x, self.rope_input_scale)?)
    }

    fn attention(
        &self,
        a: &Attention,
        x: &Array,
        cache: &mut LayerCache,
    ) -> Result<Array, Exception> {
        let q = self.scale_for_rope(split_heads(&a.q_proj.forward(x)?, self.heads)?)?;
        let k = self.scale_for_rope(split_heads(&a.k_proj.forward(x)?, self.kv_heads)?)?;
        let v = split_heads(&a.v_proj.forward(x)?, self.kv_heads)?;
        let opts = AttnOpts {
            window: a.window,
            sinks: Some(&a.sinks),
            ..AttnOpts::rotary(&self.rope, self.scale)
        };
        a.o_proj.forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl CausalLm for GptOss {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = self.attention(&b.attn, &b.input_layernorm.forward(&h)?, cache)?;
            let mid = h.add(&r)?;
            let r = b.mlp.forward(&b.post_attention_layernorm.forward(&mid)?)?;
            h = mid.add(&r)?;
        }
        self.lm_head.matmul_t(&self.norm.forward(&h)?)
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|b| b.attn.window).collect()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
