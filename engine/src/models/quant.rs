//! MLX's quantization modes, and the quantized ops in any mode.
//!
//! mlx-rs 0.33 wraps `quantized_matmul`, `dequantize` and `gather_qmm` in the `affine` mode
//! only. mlx-community ships gpt-oss's experts in MLX's `mxfp4` mode (4-bit floats, groups of
//! 32, one shared power-of-two scale per group and no biases), so these call the MLX C API
//! with the mode named, in every mode alike.
use std::ffi::CStr;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

/// How a matrix's elements are quantized (`quantization.mode` in config.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantMode {
    /// A scale and a bias per group (`mlx.nn.quantize`'s default).
    #[default]
    Affine,
    /// OCP microscaling FP4: a shared 8-bit exponent per group of 32, no biases.
    Mxfp4,
}

impl QuantMode {
    /// The mode named in a config; unknown modes are refused with the ones this build reads.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "affine" => Ok(QuantMode::Affine),
            "mxfp4" => Ok(QuantMode::Mxfp4),
            other => Err(format!(
                "quantization mode {other:?} is not supported (supported: affine, mxfp4)"
            )),
        }
    }

    fn c_name(self) -> &'static CStr {
        match self {
            QuantMode::Affine => c"affine",
            QuantMode::Mxfp4 => c"mxfp4",
        }
    }
}

/// The packed parts of a quantized matrix and how they were packed.
#[derive(Debug, Clone, Copy)]
pub struct Packed<'a> {
    pub weight: &'a Array,
    pub scales: &'a Array,
    pub biases: Option<&'a Array>,
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

fn optional_int(v: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int {
        value: v,
        has_value: true,
    }
}

/// Runs one MLX C op that fills `res`, turning a failure into an error naming `what`.
///
/// SAFETY (of the callers): every handle passed to `op` is live for the call; `res` is a fresh
/// handle the op fills, owned by the returned Array on success and freed here on failure.
fn run(
    what: &str,
    op: impl FnOnce(*mut mlx_sys::mlx_array, mlx_sys::mlx_stream) -> std::os::raw::c_int,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = op(&mut res, stream.as_ref().as_ptr());
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!("MLX {what} failed")));
        }
        Ok(Array::from_ptr(res))
    }
}

fn biases_ptr(b: Option<&Array>) -> mlx_sys::mlx_array {
    // SAFETY: an empty handle is how the C API spells "no biases".
    b.map_or_else(|| unsafe { mlx_sys::mlx_array_new() }, Array::as_ptr)
}

/// `x @ W.T` (or `x @ W` without `transpose`) against a packed matrix. The affine mode goes
/// through mlx-rs, whose errors carry MLX's message.
pub fn quantized_matmul(x: &Array, p: Packed<'_>, transpose: bool) -> Result<Array, Exception> {
    if p.mode == QuantMode::Affine {
        return mlx_rs::ops::quantized_matmul(
            x,
            p.weight,
            p.scales,
            p.biases,
            transpose,
            p.group_size,
            p.bits,
        );
    }
    run("quantized_matmul", |res, s| unsafe {
        mlx_sys::mlx_quantized_matmul(
            res,
            x.as_ptr(),
            p.weight.as_ptr(),
            p.scales.as_ptr(),
            biases_ptr(p.biases),
            transpose,
            optional_int(p.group_size),
            optional_int(p.bits),
            p.mode.c_name().as_ptr(),
            s,
        )
    })
}

/// The packed matrix unpacked to floats (the scales' dtype). The affine mode goes through
/// mlx-rs.
pub fn dequantize(p: Packed<'_>) -> Result<Array, Exception> {
    if p.mode == QuantMode::Affine {
        return mlx_rs::ops::dequantize(p.weight, p.scales, p.biases, p.group_size, p.bits);
    }
    run("dequantize", |res, s| unsafe {
        mlx_sys::mlx_dequantize(
            res,
            p.weight.as_ptr(),
            p.scales.as_ptr(),
            biases_ptr(p.biases),
            optional_int(p.group_size),
            optional_int(p.bits),
            p.mode.c_name().as_ptr(),
            mlx_sys::mlx_array_new(),
            mlx_sys::mlx_optional_dtype {
                value: mlx_sys::mlx_dtype__MLX_FLOAT32,
                has_value: false,
            },
            s,
        )
    })
}

/// `gather_qmm`: `x` against the experts `rhs_indices` selects from a packed `[E, out, in]`
/// stack (MoE layers).
pub fn gather_qmm(
    x: &Array,
    p: Packed<'_>,
    rhs_indices: &Array,
    transpose: bool,
    sorted_indices: bool,
) -> Result<Array, Exception> {
    run("gather_qmm", |res, s| unsafe {
        mlx_sys::mlx_gather_qmm(
            res,
            x.as_ptr(),
            p.weight.as_ptr(),
            p.scales.as_ptr(),
            biases_ptr(p.biases),
            mlx_sys::mlx_array_new(),
            rhs_indices.as_ptr(),
            transpose,
            optional_int(p.group_size),
            optional_int(p.bits),
            p.mode.c_name().as_ptr(),
            sorted_indices,
            s,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::test_arrays::{max_abs_diff, normal};

    #[test]
    fn affine_mode_agrees_with_mlx_rs() {
        let w = normal(&[64, 128], 1);
        let x = normal(&[3, 128], 2);
        let (wq, scales, biases) = mlx_rs::ops::quantize(&w, 64, 4).unwrap();
        let p = Packed {
            weight: &wq,
            scales: &scales,
            biases: Some(&biases),
            group_size: 64,
            bits: 4,
            mode: QuantMode::Affine,
        };
        let ours = quantized_matmul(&x, p, true).unwrap();
        let theirs = mlx_rs::ops::quantized_matmul(&x, &wq, &scales, &biases, true, 64, 4).unwrap();
        assert_eq!(max_abs_diff(&ours, &theirs), 0.0);
        let back = dequantize(p).unwrap();
        assert_eq!(back.shape(), &[64, 128]);
        assert!(max_abs_diff(&back, &w) < 0.5);
    }

    #[test]
    fn mxfp4_matmul_matches_its_dequantized_matrix() {
        let w = normal(&[64, 128], 3);
        let x = normal(&[2, 128], 4);
        // Quantize in mxfp4 through the C API (mlx-rs quantizes only in affine mode).
        let packed = unsafe {
            let mut res = mlx_sys::mlx_vector_array_new();
            let stream = Stream::thread_local_or_default();
            let status = mlx_sys::mlx_quantize(
                &mut res,
                w.as_ptr(),
                optional_int(32),
                optional_int(4),
                c"mxfp4".as_ptr(),
                mlx_sys::mlx_array_new(),
                stream.as_ref().as_ptr(),
            );
            assert_eq!(status, 0);
            let n = mlx_sys::mlx_vector_array_size(res);
            let parts: Vec<Array> = (0..n)
                .map(|i| {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, res, i);
                    Array::from_ptr(a)
                })
                .collect();
            mlx_sys::mlx_vector_array_free(res);
            parts
        };
        let p = Packed {
            weight: &packed[0],
            scales: &packed[1],
            biases: None,
            group_size: 32,
            bits: 4,
            mode: QuantMode::Mxfp4,
        };
        let dense = dequantize(p).unwrap();
        let via_packed = quantized_matmul(&x, p, true).unwrap();
        let via_dense = x.matmul(dense.t()).unwrap();
        assert!(max_abs_diff(&via_packed, &via_dense) < 1e-3);
        assert!(QuantMode::parse("nvfp4").is_err());
    }
}
