//! Rotary embeddings as the families' configs ask for them: mlx-lm's `nn.RoPE`, the Llama
//! `rope_scaling` kinds (linear, Llama 3), `initialize_rope` with YaRN, and DeepSeek's YaRN,
//! which is the same computation. YaRN also scales the rotated features before rotating
//! them, which [`ScaledRope`] carries next to the rotation.
use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::Array;
use serde_json::Value;

use super::layers::Rope;
use super::scalar::scale_by;
use crate::cache::LayerCache;
use crate::loader::LoadError;

/// `nn.RoPE(dims, traditional, base)`: no scaling, no precomputed frequencies.
pub(crate) fn plain_rope(dims: i32, base: f32, traditional: bool) -> Rope {
    Rope {
        dims,
        traditional,
        base,
        scale: 1.0,
        freqs: None,
    }
}

/// A rotary embedding and, for YaRN (and Phi-3's SuScaledRoPE), the factor its rotated
/// features are multiplied by before rotation (`None`: unchanged).
#[derive(Debug)]
pub(crate) struct ScaledRope {
    pub rope: Rope,
    pub input_scale: Option<f32>,
}

impl Clone for ScaledRope {
    /// A copy for another layer; precomputed frequencies are shared, not recomputed.
    fn clone(&self) -> Self {
        let r = &self.rope;
        Self {
            rope: Rope {
                dims: r.dims,
                traditional: r.traditional,
                base: r.base,
                scale: r.scale,
                freqs: r.freqs.clone(),
            },
            input_scale: self.input_scale,
        }
    }
}

impl ScaledRope {
    /// `nn.RoPE(dims, traditional, base)`, without input scaling.
    pub fn plain(dims: i32, base: f32, traditional: bool) -> Self {
        Self::unscaled(plain_rope(dims, base, traditional))
    }

    /// A rotation without input scaling.
    pub fn unscaled(rope: Rope) -> Self {
        Self {
            rope,
            input_scale: None,
        }
    }

    /// `x` with its first `rope.dims` features multiplied by the input scale (unchanged
    /// without one), in `x`'s dtype, as `x.at[..., :dims].multiply(scale)` does.
    pub fn prescale(&self, x: &Array) -> Result<Array, Exception> {
        let Some(s) = self.input_scale else {
            return Ok(x.clone());
        };
        let width = x.shape()[x.ndim() - 1];
        if self.rope.dims >= width {
            return scale_by(x, s);
        }
        let parts = x.split_at_indices(&[self.rope.dims], -1)?;
        concatenate(&[scale_by(&parts[0], s)?, parts[1].clone()], -1)
    }

    /// `x` `[B, heads, L, D]` prescaled and rotated at the positions the cache gives the new
    /// tokens.
    pub fn apply(&self, cache: &LayerCache, x: &Array) -> Result<Array, Exception> {
        cache.rope(&self.rope, &self.prescale(x)?)
    }
}

/// The scaling kind a `rope_scaling` names (`type`, else `rope_type`, else `default`).
pub(crate) fn rope_kind(scaling: &Value) -> &str {
    scaling
        .get("type")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .or_else(|| scaling.get("rope_type").and_then(Value::as_str))
        .unwrap_or("default")
}

/// Builds the rotary embedding a config asks for: plain or linear scaling, or Llama 3's
/// frequency smoothing. Other schemes are refused rather than silently ignored.
pub fn rope_from_config(
    dims: i32,
    base: f32,
    traditional: bool,
    scaling: Option<&Value>,
) -> Result<Rope, LoadError> {
    let plain = |scale: f32| Rope {
        dims,
        traditional,
        base,
        scale,
        freqs: None,
    };
    let Some(scaling) = scaling.filter(|s| !s.is_null()) else {
        return Ok(plain(1.0));
    };
    let kind = scaling
        .get("type")
        .or_else(|| scaling.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str, default: f64| {
        scaling.get(key).and_then(Value::as_f64).unwrap_or(default) as f32
    };
    match kind {
        "default" => Ok(plain(1.0)),
        "linear" => Ok(plain(1.0 / num("factor", 1.0))),
        "llama3" => {
            let factor = num("factor", 1.0);
            let low = num("low_freq_factor", 1.0);
            let high = num("high_freq_factor", 4.0);
            let old_len = num("original_max_position_embeddings", 8192.0);
            let low_wavelen = old_len / low;
            let high_wavelen = old_len / high;
            let freqs: Vec<f32> = (0..dims / 2)
                .map(|i| {
                    let freq = base.powf((2 * i) as f32 / dims as f32);
                    let wavelen = 2.0 * std::f32::consts::PI * freq;
                    let scaled = if wavelen > low_wavelen {
                        freq * factor
                    } else {
                        freq
                    };
                    if wavelen > high_wavelen && wavelen < low_wavelen {
                        let smooth = (old_len / wavelen - low) / (high - low);
                        scaled / ((1.0 - smooth) / factor + smooth)
                    } else {
                        scaled
                    }
                })
                .collect();
            Ok(Rope {
                dims,
                traditional,
                base,
                scale: 1.0,
                freqs: Some(Array::from_slice(&freqs, &[dims / 2])),
            })
        }
        other => Err(LoadError::Config(format!(
            "unsupported rope_scaling type {other:?}"
        ))),
    }
}

/// mlx-lm's `initialize_rope`: plain, linear, Llama 3 and YaRN scaling. The others it knows
/// (dynamic NTK, longrope, proportional, mrope) are refused, as is anything unknown.
pub(crate) fn initialize_rope(
    dims: i32,
    base: f32,
    traditional: bool,
    scaling: Option<&Value>,
) -> Result<ScaledRope, LoadError> {
    let scaling = scaling.filter(|s| !s.is_null());
    let kind = scaling
        .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match (kind, scaling) {
        ("yarn" | "deepseek_yarn" | "telechat3-yarn", Some(s)) => {
            yarn(dims, f64::from(base), traditional, s)
        }
        ("default" | "linear" | "llama3", _) => {
            if kind != "default" && scaling.and_then(|s| s.get("factor")).is_none() {
                return Err(LoadError::Config(format!(
                    "rope scaling {kind:?} has no `factor`"
                )));
            }
            rope_from_config(dims, base, traditional, scaling).map(ScaledRope::unscaled)
        }
        (other, _) => Err(LoadError::Config(format!(
            "unsupported rope scaling type {other:?}"
        ))),
    }
}

/// Refuses a `rope_scaling` that the family's mlx-lm implementation does not apply (it builds
/// a plain `nn.RoPE`): serving it unscaled would silently differ from the checkpoint's
/// training, and scaling it would differ from mlx-lm. `null` or a `default` type is fine.
pub(crate) fn refuse_rope_scaling(family: &str, config: &Value) -> Result<(), LoadError> {
    let Some(scaling) = config.get("rope_scaling").filter(|s| !s.is_null()) else {
        return Ok(());
    };
    let kind = scaling
        .get("type")
        .or_else(|| scaling.get("rope_type"))
        .and_then(Value::as_str);
    if kind == Some("default") {
        return Ok(());
    }
    Err(LoadError::Config(format!(
        "{family}: rope_scaling {scaling} is not supported (mlx-lm applies no RoPE scaling to \
         this architecture)"
    )))
}

/// A number of `rope_scaling`: `None` when absent or `null`, refused when not a number.
pub(crate) fn scaling_number(scaling: &Value, key: &str) -> Result<Option<f64>, LoadError> {
    match scaling.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| LoadError::Config(format!("rope_scaling.{key} {v} is not a number"))),
    }
}

/// YaRN's attention-magnitude correction `0.1 * m * ln(scale) + 1` (1 without stretching).
pub(crate) fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// mlx-lm's `YarnRoPE` (DeepSeek's `DeepseekV2YarnRotaryEmbedding` computes the same): the
/// frequencies blend interpolated and original ones over a linear ramp between the correction
/// dimensions of `beta_fast` and `beta_slow`, computed with MLX ops in float32 as mlx-lm does,
/// and the rotated features are first multiplied by `mscale / mscale_all_dim`'s correction
/// ratio when it is not 1. `base` stays a Python float (f64) for the correction range.
pub(crate) fn yarn(
    dims: i32,
    base: f64,
    traditional: bool,
    scaling: &Value,
) -> Result<ScaledRope, LoadError> {
    let get = |key: &str, default: f64| scaling_number(scaling, key).map(|v| v.unwrap_or(default));
    let factor = scaling_number(scaling, "factor")?
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
    Ok(ScaledRope {
        rope: Rope {
            dims,
            traditional,
            base: base as f32,
            scale: 1.0,
            freqs: Some(freqs),
        },
        input_scale: (ratio != 1.0).then_some(ratio as f32),
    })
}

/// YaRN's blended frequencies over `dims / 2` rotation pairs, op for op as mlx-lm.
fn yarn_freqs(dims: i32, base: f64, factor: f64, low: f64, high: f64) -> Result<Array, LoadError> {
    let f32_scalar = |v: f64| Array::from_f32(v as f32);
    let exponents = Array::arange::<_, f32>(0, dims, 2)?.divide(f32_scalar(dims as f64))?;
    let freq_extra = mlx_rs::ops::power(f32_scalar(base), &exponents)?;
    let freq_inter = f32_scalar(factor).multiply(&freq_extra)?;
    // A degenerate ramp is widened slightly, as mlx-lm does, to avoid dividing by zero.
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
