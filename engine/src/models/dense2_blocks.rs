//! Pieces shared by the GLM-4, EXAONE 4, Cohere and Ministral 3 families: the four attention
//! projections, the gated MLP, mlx-lm's `initialize_rope` (with YaRN), the hybrid
//! sliding-window layout, and the bookkeeping every family repeats (parameter lists for
//! `materialize`, the `ModelInfo`).
use mlx_rs::error::Exception;
use mlx_rs::ops::{clip, concatenate};
use mlx_rs::Array;
use serde_json::Value;

use super::layers::{split_heads, swiglu, LayerNorm, Linear, Matrix, RmsNorm, Rope};
use super::llama::{kv_dtype_bytes, rope_from_config};
use super::{eos_ids, ModelInfo};
use crate::loader::{LoadError, Weights};

type Result<T> = std::result::Result<T, Exception>;

/// The parameters of a model in a fixed order, for [`crate::loader::materialize`].
#[derive(Default)]
pub(crate) struct Params<'a>(Vec<&'a Array>);

impl<'a> Params<'a> {
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

    pub fn rms(&mut self, n: &'a RmsNorm) {
        self.0.push(&n.weight);
    }

    pub fn layer_norm(&mut self, n: &'a LayerNorm) {
        self.0.extend(n.weight.iter());
        self.0.extend(n.bias.iter());
    }

    pub fn array(&mut self, a: &'a Array) {
        self.0.push(a);
    }

    pub fn attention(&mut self, p: &'a AttnProjections) {
        for l in [&p.q_proj, &p.k_proj, &p.v_proj, &p.o_proj] {
            self.linear(l);
        }
    }

    pub fn gated_mlp(&mut self, m: &'a GatedMlp) {
        for l in [&m.gate_proj, &m.up_proj, &m.down_proj] {
            self.linear(l);
        }
    }

    /// Evaluates every parameter, reporting the bytes read; returns the bytes held.
    pub fn materialize(
        &self,
        reporter: Option<&crate::loader::LoadReporter>,
    ) -> std::result::Result<usize, LoadError> {
        crate::loader::materialize(&self.0, reporter)
    }
}

/// The query, key, value and output projections of one attention layer.
pub(crate) struct AttnProjections {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub heads: i32,
    pub kv_heads: i32,
}

impl AttnProjections {
    /// Loads `<prefix>.{q,k,v,o}_proj`; the families differ in which of them carry a bias.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        heads: i32,
        kv_heads: i32,
        qkv_bias: bool,
        o_bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), qkv_bias)?,
            k_proj: Linear::load(w, &format!("{prefix}.k_proj"), qkv_bias)?,
            v_proj: Linear::load(w, &format!("{prefix}.v_proj"), qkv_bias)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), o_bias)?,
            heads,
            kv_heads,
        })
    }

    /// Queries, keys and values of `x` `[B, L, hidden]`, each `[B, heads, L, head_dim]`.
    pub fn project(&self, x: &Array) -> Result<(Array, Array, Array)> {
        Ok((
            split_heads(&self.q_proj.forward(x)?, self.heads)?,
            split_heads(&self.k_proj.forward(x)?, self.kv_heads)?,
            split_heads(&self.v_proj.forward(x)?, self.kv_heads)?,
        ))
    }
}

/// `down(silu(gate(x)) * up(x))`, with separate gate and up matrices.
pub(crate) struct GatedMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl GatedMlp {
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), bias)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), bias)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), bias)?,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.down_proj.forward(&swiglu(
            &self.gate_proj.forward(x)?,
            &self.up_proj.forward(x)?,
        )?)
    }
}

/// A rotary embedding as mlx-lm's `initialize_rope` builds it: the rotation, and for YaRN the
/// factor its rotated dimensions are multiplied by first (`mscale / mscale_all_dim`).
pub(crate) struct ScaledRope {
    pub rope: Rope,
    pub input_scale: Option<f32>,
}

impl ScaledRope {
    /// `x` with its first `rope.dims` features multiplied by the YaRN input scale (unchanged
    /// without one), in `x`'s dtype, as YaRN does before rotating.
    pub fn prescale(&self, x: &Array) -> Result<Array> {
        let Some(s) = self.input_scale else {
            return Ok(x.clone());
        };
        let factor = Array::from_f32(s).as_dtype(x.dtype())?;
        let width = x.shape()[x.ndim() - 1];
        if self.rope.dims >= width {
            return x.multiply(&factor);
        }
        let parts = x.split_at_indices(&[self.rope.dims], -1)?;
        concatenate(&[parts[0].multiply(&factor)?, parts[1].clone()], -1)
    }
}

/// mlx-lm's `initialize_rope`: plain, linear, Llama 3 and YaRN scaling. The others it knows
/// (dynamic NTK, longrope, proportional, mrope) are refused, as is anything unknown.
pub(crate) fn initialize_rope(
    dims: i32,
    base: f32,
    traditional: bool,
    scaling: Option<&Value>,
) -> std::result::Result<ScaledRope, LoadError> {
    let scaling = scaling.filter(|s| !s.is_null());
    let kind = scaling
        .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let unscaled = |rope| ScaledRope {
        rope,
        input_scale: None,
    };
    match (kind, scaling) {
        ("yarn" | "deepseek_yarn" | "telechat3-yarn", Some(s)) => yarn(dims, base, traditional, s),
        ("default" | "linear" | "llama3", _) => {
            if kind != "default" && scaling.and_then(|s| s.get("factor")).is_none() {
                return Err(LoadError::Config(format!(
                    "rope scaling {kind:?} has no `factor`"
                )));
            }
            rope_from_config(dims, base, traditional, scaling).map(unscaled)
        }
        (other, _) => Err(LoadError::Config(format!(
            "unsupported rope scaling type {other:?}"
        ))),
    }
}

/// A number of the scaling config, or `default` when absent.
fn scaling_number(s: &Value, key: &str, default: f64) -> std::result::Result<f64, LoadError> {
    match s.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| LoadError::Config(format!("rope scaling `{key}` is not a number"))),
    }
}

/// mlx-lm's `YarnRoPE`: frequencies blended between interpolated and extrapolated by a linear
/// ramp over the correction range, computed with MLX ops in float32 as mlx-lm does.
fn yarn(
    dims: i32,
    base: f32,
    traditional: bool,
    s: &Value,
) -> std::result::Result<ScaledRope, LoadError> {
    let factor = s
        .get("factor")
        .and_then(Value::as_f64)
        .ok_or_else(|| LoadError::Config("yarn rope scaling has no numeric `factor`".into()))?;
    let original = scaling_number(s, "original_max_position_embeddings", 4096.0)?;
    let beta_fast = scaling_number(s, "beta_fast", 32.0)?;
    let beta_slow = scaling_number(s, "beta_slow", 1.0)?;
    let mscale = scaling_number(s, "mscale", 1.0)?;
    let mscale_all_dim = scaling_number(s, "mscale_all_dim", 0.0)?;

    let base64 = f64::from(base);
    let correction_dim = |rotations: f64| {
        f64::from(dims) * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base64.ln())
    };
    let low = correction_dim(beta_fast).floor().max(0.0);
    let high = correction_dim(beta_slow).ceil().min(f64::from(dims - 1));
    // A degenerate ramp is widened slightly, as mlx-lm does, to avoid dividing by zero.
    let span = if low == high { 0.001 } else { high - low };
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let input_scale = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim);

    let freqs = yarn_freqs(dims, base, factor as f32, low as f32, span as f32)?;
    Ok(ScaledRope {
        rope: Rope {
            dims,
            traditional,
            base,
            scale: 1.0,
            freqs: Some(freqs),
        },
        input_scale: (input_scale != 1.0).then_some(input_scale as f32),
    })
}

fn yarn_freqs(dims: i32, base: f32, factor: f32, low: f32, span: f32) -> Result<Array> {
    let f32s = |v: f32| Array::from_f32(v);
    let exponents = Array::arange::<_, f32>(0.0, dims as f32, 2.0)?.divide(f32s(dims as f32))?;
    let extra = f32s(base).power(&exponents)?;
    let inter = extra.multiply(f32s(factor))?;
    let ramp = Array::arange::<_, f32>(None, (dims / 2) as f32, None)?
        .subtract(f32s(low))?
        .divide(f32s(span))?;
    let ramp = clip(&ramp, (0.0f32, 1.0f32))?;
    let mask = f32s(1.0).subtract(&ramp)?;
    let numerator = inter.multiply(&extra)?;
    let denominator = inter
        .multiply(&mask)?
        .add(&extra.multiply(f32s(1.0).subtract(&mask)?)?)?;
    numerator.divide(&denominator)
}

/// The `ModelInfo` of a decoder whose every layer caches keys and values of `kv_heads` heads
/// of `head_dim` at every position (windowed layers included: the runtime's caches keep every
/// position and the window is applied by the mask).
pub(crate) fn decoder_info(
    config: &Value,
    vocab_size: usize,
    num_layers: usize,
    context_length: usize,
    kv_heads: i32,
    head_dim: i32,
    embed: &Matrix,
) -> ModelInfo {
    let dtype_bytes = kv_dtype_bytes(embed);
    ModelInfo {
        architecture: config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size,
        num_layers,
        context_length,
        weight_bytes: 0,
        kv_bytes_per_token: 2 * num_layers * (kv_heads * head_dim) as usize * dtype_bytes,
        kv_dtype_bytes: dtype_bytes,
        head_dim: head_dim as usize,
        eos_token_ids: eos_ids(config),
    }
}

/// Parses a family's config struct, naming the family in the error.
pub(crate) fn parse_config<T: serde::de::DeserializeOwned>(
    family: &str,
    config: &Value,
) -> std::result::Result<T, LoadError> {
    serde_json::from_value(config.clone())
        .map_err(|e| LoadError::Config(format!("{family} config: {e}")))
}

/// Multiplies `x` by a Python-float constant the way MLX does: the constant is first cast to
/// `x`'s dtype.
pub(crate) fn scale_by(x: &Array, factor: f32) -> Result<Array> {
    x.multiply(Array::from_f32(factor).as_dtype(x.dtype())?)
}
