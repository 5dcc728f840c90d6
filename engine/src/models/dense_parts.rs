//! Pieces shared by the dense decoder families that follow mlx-lm's Llama layout with small
//! twists (Phi-3, Granite, OLMo 2, SmolLM3, StarCoder2): separate or fused projections, the
//! SwiGLU MLP, scalar multipliers with MLX's weak-scalar typing, the parameter list that
//! `materialize` evaluates, and the [`ModelInfo`] they all fill the same way.
use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use super::layers::{swiglu, Linear, Matrix, RmsNorm};
use super::{eos_ids, ModelInfo};
use crate::loader::{LoadError, LoadReporter, Weights};

/// `x * factor` as MLX computes `array * python_float`: the scalar takes the array's dtype
/// (a weak scalar), so a bfloat16 activation stays bfloat16 instead of promoting to float32.
pub(crate) fn scaled(x: &Array, factor: f32) -> Result<Array, Exception> {
    x.multiply(Array::from_f32(factor).as_dtype(x.dtype())?)
}

/// `x / divisor` with the divisor a weak scalar, as [`scaled`].
pub(crate) fn divided(x: &Array, divisor: f32) -> Result<Array, Exception> {
    x.divide(Array::from_f32(divisor).as_dtype(x.dtype())?)
}

/// `nn.gelu`, the exact GELU `x * (1 + erf(x / sqrt(2))) / 2`, op for op with weak scalars
/// (so bfloat16 stays bfloat16). `mlx_rs::nn::gelu` (and so `layers::gelu`) divides by a
/// float32 scalar array, which promotes a bfloat16 activation to float32: mlx-lm's
/// bfloat16 StarCoder2 tokens then differ.
pub(crate) fn gelu_exact(x: &Array) -> Result<Array, Exception> {
    let weak = |v: f32| Array::from_f32(v).as_dtype(x.dtype());
    let erf = mlx_rs::ops::erf(x.divide(weak(std::f32::consts::SQRT_2)?)?)?;
    x.multiply(weak(1.0)?.add(&erf)?)?.divide(weak(2.0)?)
}

/// Query, key, value and output projections (`self_attn.{q,k,v,o}_proj`).
pub(crate) struct Projections {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
}

impl Projections {
    /// Loads the four projections under `prefix`; `qkv_bias` and `o_bias` say which carry a
    /// bias (Qwen-style checkpoints bias q/k/v only, most bias all four or none).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        qkv_bias: bool,
        o_bias: bool,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), qkv_bias)?,
            k_proj: Linear::load(w, &format!("{prefix}.k_proj"), qkv_bias)?,
            v_proj: Linear::load(w, &format!("{prefix}.v_proj"), qkv_bias)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), o_bias)?,
        })
    }

    /// Queries, keys and values `[B, L, heads * head_dim]`, before heads are split.
    pub fn qkv(&self, x: &Array) -> Result<(Array, Array, Array), Exception> {
        Ok((
            self.q_proj.forward(x)?,
            self.k_proj.forward(x)?,
            self.v_proj.forward(x)?,
        ))
    }

    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        for l in [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj] {
            p.linear(l);
        }
    }
}

/// The SwiGLU MLP with separate gate and up projections (`mlp.{gate,up,down}_proj`).
pub(crate) struct GatedMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl GatedMlp {
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> Result<Self, LoadError> {
        Ok(Self {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), bias)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), bias)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), bias)?,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        self.down_proj.forward(&swiglu(
            &self.gate_proj.forward(x)?,
            &self.up_proj.forward(x)?,
        )?)
    }

    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        for l in [&self.gate_proj, &self.up_proj, &self.down_proj] {
            p.linear(l);
        }
    }
}

/// The attention and MLP of a pre-norm Llama-style block (Granite, SmolLM3): the norms and
/// how the residuals combine are the family's.
pub(crate) struct LlamaStyleBlock {
    pub attn: Projections,
    pub mlp: GatedMlp,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
}

impl LlamaStyleBlock {
    /// Loads layer `i` (`model.layers.{i}`).
    pub fn load(
        w: &mut Weights,
        i: usize,
        attention_bias: bool,
        mlp_bias: bool,
        eps: f32,
    ) -> Result<Self, LoadError> {
        let p = format!("model.layers.{i}");
        Ok(Self {
            attn: Projections::load(w, &format!("{p}.self_attn"), attention_bias, attention_bias)?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), mlp_bias)?,
            input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{p}.post_attention_layernorm"),
                eps,
            )?,
        })
    }

    pub fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        self.attn.push_params(p);
        self.mlp.push_params(p);
        p.array(&self.input_layernorm.weight);
        p.array(&self.post_attention_layernorm.weight);
    }
}

/// The parameter arrays of a model, in the order they are evaluated at load.
#[derive(Default)]
pub(crate) struct Params<'a>(Vec<&'a Array>);

impl<'a> Params<'a> {
    pub fn array(&mut self, a: &'a Array) {
        self.0.push(a);
    }

    pub fn matrix(&mut self, m: &'a Matrix) {
        match m {
            Matrix::Dense(w) => self.0.push(w),
            Matrix::Quantized {
                weight,
                scales,
                biases,
                ..
            } => {
                self.0.push(weight);
                self.0.push(scales);
                self.0.extend(biases.iter());
            }
        }
    }

    pub fn linear(&mut self, l: &'a Linear) {
        self.matrix(&l.matrix);
        self.0.extend(l.bias.iter());
    }

    pub fn projections(&mut self, p: &'a Projections) {
        p.push_params(self);
    }

    pub fn mlp(&mut self, m: &'a GatedMlp) {
        m.push_params(self);
    }

    /// Evaluates every parameter (reading it from disk now), reporting the bytes read;
    /// returns the bytes held.
    pub fn materialize(self, reporter: Option<&LoadReporter>) -> Result<usize, LoadError> {
        crate::loader::materialize(&self.0, reporter)
    }
}

/// The output head: `lm_head` when the config unties it, else `None` (the embedding serves).
/// A tied checkpoint may still carry a copy of the embedding as `lm_head`; it is unused, as
/// mlx-lm's `sanitize` drops it.
pub(crate) fn load_lm_head(w: &mut Weights, tied: bool) -> Result<Option<Matrix>, LoadError> {
    if tied {
        for suffix in ["weight", "scales", "biases"] {
            w.discard(&format!("lm_head.{suffix}"));
        }
        Ok(None)
    } else {
        Matrix::load(w, "lm_head").map(Some)
    }
}

/// Drops the precomputed rotary frequencies of layer `i`: mlx-lm recomputes them from the
/// config.
pub(crate) fn discard_rotary_inv_freq(w: &mut Weights, i: usize) {
    w.discard(&format!("model.layers.{i}.self_attn.rotary_emb.inv_freq"));
}

/// Logits `[B, L, vocab]` from the final hidden state: through `lm_head` or the tied embedding.
pub(crate) fn logits(
    h: &Array,
    lm_head: Option<&Matrix>,
    embed_tokens: &Matrix,
) -> Result<Array, Exception> {
    lm_head.unwrap_or(embed_tokens).matmul_t(h)
}

/// The attention geometry a model's KV cache stores.
pub(crate) struct KvShape {
    pub layers: usize,
    pub kv_heads: i32,
    pub head_dim: i32,
}

/// [`ModelInfo`] for a model whose every layer caches keys and values of `head_dim` for
/// `kv_heads` heads, in the dtype of the activations; `weight_bytes` is filled after
/// materializing.
pub(crate) fn model_info(
    config: &Value,
    vocab_size: usize,
    context_length: usize,
    kv: KvShape,
    embed_tokens: &Matrix,
) -> ModelInfo {
    let dtype_bytes = activation_bytes(embed_tokens);
    ModelInfo {
        architecture: config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size,
        num_layers: kv.layers,
        context_length,
        weight_bytes: 0,
        kv_bytes_per_token: 2 * kv.layers * (kv.kv_heads * kv.head_dim) as usize * dtype_bytes,
        kv_dtype_bytes: dtype_bytes,
        head_dim: kv.head_dim as usize,
        eos_token_ids: eos_ids(config),
    }
}

/// Bytes per element of activations (and so of the KV cache): the embedding's dtype, or its
/// scales' when it is quantized.
fn activation_bytes(embed: &Matrix) -> usize {
    let dtype = match embed {
        Matrix::Dense(w) => w.dtype(),
        Matrix::Quantized { scales, .. } => scales.dtype(),
    };
    match dtype {
        Dtype::Float32 => 4,
        _ => 2,
    }
}

/// Checks the head counts a config gives: both positive, and the query heads a multiple of
/// the KV heads (grouped-query attention shares each KV head among whole groups).
pub(crate) fn check_heads(heads: i32, kv_heads: i32) -> Result<(), LoadError> {
    if heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 {
        return Err(LoadError::Config(format!(
            "num_attention_heads {heads} must be a positive multiple of num_key_value_heads \
             {kv_heads}"
        )));
    }
    Ok(())
}

/// `hidden_size / num_attention_heads`, the head size when the config gives none, refused
/// when it does not divide.
pub(crate) fn implied_head_dim(hidden: i32, heads: i32) -> Result<i32, LoadError> {
    if heads <= 0 || hidden % heads != 0 {
        return Err(LoadError::Config(format!(
            "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )));
    }
    Ok(hidden / heads)
}

/// Deserializes a family's config struct, naming the field serde rejects.
pub(crate) fn parse_config<T: serde::de::DeserializeOwned>(config: &Value) -> Result<T, LoadError> {
    serde_json::from_value(config.clone()).map_err(|e| LoadError::Config(e.to_string()))
}
