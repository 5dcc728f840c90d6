//! Python-float operands as MLX types them. In mlx-lm, `x * 0.5` casts the float to `x`'s
//! dtype (a weak scalar), so a bfloat16 activation stays bfloat16 where a float32 array
//! operand would promote it. Every scalar multiplier of the families (Granite's and Cohere's
//! multipliers, YaRN's input scale, routers' scaling factors) goes through here.
use mlx_rs::error::Exception;
use mlx_rs::Array;

/// The Python float `v` as a scalar of `x`'s dtype.
pub(crate) fn weak_scalar(x: &Array, v: f32) -> Result<Array, Exception> {
    Array::from_f32(v).as_dtype(x.dtype())
}

/// `x * v`, as MLX computes `array * python_float`.
pub(crate) fn scale_by(x: &Array, v: f32) -> Result<Array, Exception> {
    x.multiply(weak_scalar(x, v)?)
}

/// `x / v`, as MLX computes `array / python_float`.
pub(crate) fn divide_by(x: &Array, v: f32) -> Result<Array, Exception> {
    x.divide(weak_scalar(x, v)?)
}
