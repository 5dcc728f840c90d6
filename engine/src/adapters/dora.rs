//! DoRA's arithmetic, as mlx-lm's `DoRALinear` (`mlx_lm/tuner/dora.py`) does it, op for op:
//!
//! - the layer's output is LoRA's, `y + (scale * (x @ A) @ B)`, rescaled per output row by
//!   `m / ‖W + (scale·Bᵀ) @ Aᵀ‖` (the row norms of the adapted weight), the bias added after;
//! - the rescale depends on the adapter and the base weight only, never on the input: serving
//!   computes it once per adapter and layer ([`rescale`]) and multiplies each DoRA row's
//!   output by it; training recomputes it each step, the norm cut from the gradient as
//!   mlx-lm's `stop_gradient` cuts it;
//! - `m` starts as the row norms of the base weight in float32 ([`initial_magnitude`]);
//! - fusing bakes the rescale into the weight ([`fuse`]).
use mlx_rs::error::Exception;
use mlx_rs::linalg::{norm_l2, NormOptions};
use mlx_rs::{Array, Axes, Dtype};

use crate::models::layers::Matrix;
use crate::models::quant;

/// The base weight `[out, in]` as DoRA reads it: dense as stored, a quantized one dequantized
/// with its own settings (`DoRALinear._dequantized_weight`).
pub fn dense_weight(matrix: &Matrix) -> Result<Array, Exception> {
    match matrix {
        Matrix::Dense(w) => Ok(w.clone()),
        Matrix::Quantized(q) => quant::dequantize(q.packed()),
    }
}

/// The norm of each row of a matrix (`mx.linalg.norm(w, axis=1)`).
fn row_norms(w: &Array) -> Result<Array, Exception> {
    norm_l2(
        w,
        NormOptions {
            axes: Axes::Axis(1),
            keep_dims: false,
        },
    )
}

/// `W + (scale * Bᵀ) @ Aᵀ`: the scale a Python float in mlx-lm, so it takes `B`'s dtype.
fn adapted(weight: &Array, a: &Array, b: &Array, scale: f32) -> Result<Array, Exception> {
    let scaled = b
        .t()
        .multiply(Array::from_f32(scale).as_dtype(b.dtype())?)?;
    weight.add(scaled.matmul(a.t())?)
}

/// `m / ‖W + (scale·Bᵀ) @ Aᵀ‖` per output row `[out]`, in the dtype the ops give (float32 for
/// float32 factors); callers cast it to the input's dtype as mlx-lm does. In training the
/// norm is a constant of the gradient (`stop_gradient`), as in mlx-lm.
pub fn rescale(
    m: &Array,
    weight: &Array,
    a: &Array,
    b: &Array,
    scale: f32,
) -> Result<Array, Exception> {
    let denom = mlx_rs::stop_gradient(row_norms(&adapted(weight, a, b, scale)?)?)?;
    m.divide(&denom)
}

/// DoRA's starting magnitude: the base weight's row norms in float32 (`DoRALinear.set_linear`).
pub fn initial_magnitude(weight: &Array) -> Result<Array, Exception> {
    row_norms(&weight.as_dtype(Dtype::Float32)?)
}

/// The fused weight (`DoRALinear.fuse`): `W' = W + ((scale·Bᵀ) @ Aᵀ).astype(W.dtype)`, then
/// each row scaled by `m / ‖W'‖`.
pub fn fuse(
    weight: &Array,
    a: &Array,
    b: &Array,
    m: &Array,
    scale: f32,
) -> Result<Array, Exception> {
    let scaled = b
        .t()
        .multiply(Array::from_f32(scale).as_dtype(b.dtype())?)?;
    let merged = weight.add(scaled.matmul(a.t())?.as_dtype(weight.dtype())?)?;
    let norm_scale = m.divide(row_norms(&merged)?)?;
    norm_scale.expand_dims(1)?.multiply(&merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rescale_is_one_while_m_is_the_base_norm_and_b_is_zero() {
        let w = Array::from_slice(&[3.0f32, 4.0, 0.0, 2.0], &[2, 2]);
        let a = Array::from_slice(&[0.5f32, -0.5], &[2, 1]);
        let b = Array::from_slice(&[0.0f32, 0.0], &[1, 2]);
        let m = initial_magnitude(&w).unwrap();
        assert_eq!(m.as_slice::<f32>(), &[5.0, 2.0]);
        let r = rescale(&m, &w, &a, &b, 2.0).unwrap();
        assert_eq!(r.as_slice::<f32>(), &[1.0, 1.0]);
        // A non-zero update: the fused rows keep the magnitudes m.
        let b = Array::from_slice(&[1.0f32, -1.0], &[1, 2]);
        let fused = fuse(&w, &a, &b, &m, 2.0).unwrap();
        let norms = row_norms(&fused).unwrap();
        for (n, want) in norms.as_slice::<f32>().iter().zip([5.0, 2.0]) {
            assert!((n - want).abs() < 1e-5, "{n} vs {want}");
        }
    }
}
