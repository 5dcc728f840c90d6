//! Decode-sized dense products on CUDA through MLX's grouped GEMM instead of cuBLASLt
//! (`MLXD_DECODE_GEMM=1`; off by default until it is measured on a GPU).
//!
//! MLX 0.32 sends every product of more than one row to cuBLASLt, and at every call it makes
//! a new set of cuBLASLt descriptors, asks cuBLASLt's heuristic for an algorithm and captures
//! the call into a child CUDA graph (`gemm_and_bias` in `mlx/backend/cuda/matmul.cpp`,
//! `CublasMatmulBase::execute_matmul` in `cublas_utils.cpp`): nothing is kept between calls.
//! A decode step of a 16-layer model makes ~65 such products (q/k/v, o, gate/up, down per
//! layer and the head), and on an H100 a 15-row product cost ~37 µs of host in the profile of
//! session 46 (BENCHMARKS.md), where the step's host time is what bounds it.
//!
//! `gather_mm` with one row per batch entry, one right-hand matrix and its indices sorted
//! computes the same `x @ W.T` through MLX's CUTLASS grouped GEMM (`GatherMM::eval_gpu`:
//! `M == 1` and sorted right-hand indices), which is compiled ahead of time: two kernel
//! launches (the groups' offsets, then the GEMM), no heuristic, no capture. Whether its
//! device time (a 256-row tile, unaligned loads) costs less than the host time it saves is
//! what `MLXD_DECODE_GEMM=1` against the default measures (`bench_generate`, served streams);
//! the products are the same up to the order of the float32 sums.
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::ops::gather_mm;
use mlx_rs::{Array, Dtype};

/// The most rows (tokens) a product may have to take this path: one tile of the grouped
/// GEMM. Prefill chunks keep cuBLAS, whose per-call host cost is small beside their work; one
/// row already takes MLX's matrix-vector kernel.
pub const MAX_ROWS: i32 = 256;

/// Whether `MLXD_DECODE_GEMM=1` asks for this path and MLX's default device is a CUDA GPU.
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("MLXD_DECODE_GEMM").is_ok_and(|v| v == "1")
            && crate::cuda_kernel::wanted("MLXD_DECODE_GEMM")
    })
}

/// The shapes and dtypes this path serves, apart from the device: `x` `[..., K]` of 2 to
/// [`MAX_ROWS`] rows (the product of its leading axes) and a dense `w` `[N, K]`, both float16
/// or both bfloat16 (float32 products may use TF32 in the grouped GEMM, never in cuBLAS).
pub fn fits(x: (&[i32], Dtype), w: (&[i32], Dtype)) -> bool {
    let ((xs, xd), (ws, wd)) = (x, w);
    let (Some((&k, lead)), &[n, kw]) = (xs.split_last(), ws) else {
        return false;
    };
    let rows: i64 = lead.iter().map(|&d| i64::from(d)).product();
    matches!(xd, Dtype::Float16 | Dtype::Bfloat16)
        && wd == xd
        && k == kw
        && k > 0
        && n > 0
        && (2..=i64::from(MAX_ROWS)).contains(&rows)
}

/// Whether [`matmul_t`] serves `x @ w.T` here: the switch, the device and [`fits`].
pub fn serves(x: &Array, w: &Array) -> bool {
    available() && fits((x.shape(), x.dtype()), (w.shape(), w.dtype()))
}

thread_local! {
    /// The right-hand indices (all zero, `uint32`) for each row count, made and evaluated once
    /// (an evaluated array adds no node to a pass). The model runs on one thread.
    static INDICES: RefCell<HashMap<i32, Array>> = RefCell::new(HashMap::new());
}

fn zero_indices(rows: i32) -> Result<Array, Exception> {
    INDICES.with(|cell| {
        if let Some(a) = cell.borrow().get(&rows) {
            return Ok(a.clone());
        }
        let a = Array::from_slice(&vec![0u32; rows as usize], &[rows]);
        a.eval()?;
        cell.borrow_mut().insert(rows, a.clone());
        Ok(a)
    })
}

/// `x @ w.T` as one sorted group of `gather_mm`: `x` `[..., K]` as `[rows, 1, K]`, `w` `[N, K]`
/// as `[1, K, N]` (a transposed view, no copy), every row taking matrix 0; the result is
/// reshaped back to `[..., N]`. Runs on any device (the CPU tests check it against the
/// plain product); [`serves`] says where it is wanted.
pub fn matmul_t(x: &Array, w: &Array) -> Result<Array, Exception> {
    let shape = x.shape();
    let (k, lead) = shape
        .split_last()
        .ok_or_else(|| Exception::custom("a product of a scalar"))?;
    let rows: i32 = lead.iter().product();
    let n = w.shape()[0];
    let per_row = x.reshape(&[rows, 1, *k])?;
    let right = w.t().expand_dims(0)?;
    let out = gather_mm(&per_row, &right, None, &zero_indices(rows)?, true)?;
    let mut out_shape = lead.to_vec();
    out_shape.push(n);
    out.reshape(&out_shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::test_arrays::{max_abs_diff, normal};

    const BF: Dtype = Dtype::Bfloat16;

    #[test]
    fn decode_sized_products_of_half_precision_matrices_fit() {
        let w: &[i32] = &[3072, 2048];
        assert!(fits((&[32, 1, 2048], BF), (w, BF)));
        assert!(fits((&[2, 2048], Dtype::Float16), (w, Dtype::Float16)));
        assert!(fits((&[4, 64, 2048], BF), (w, BF)), "256 rows");
        // One row (MLX's matrix-vector kernel), a prefill chunk, float32, mixed dtypes.
        assert!(!fits((&[1, 1, 2048], BF), (w, BF)));
        assert!(!fits((&[1, 512, 2048], BF), (w, BF)));
        assert!(!fits((&[32, 1, 2048], Dtype::Float32), (w, Dtype::Float32)));
        assert!(!fits((&[32, 1, 2048], BF), (w, Dtype::Float16)));
        // Shapes that do not chain, and inputs that are not [..., K] / [N, K].
        assert!(!fits((&[32, 1, 1024], BF), (w, BF)));
        assert!(!fits((&[2048], BF), (w, BF)));
        assert!(!fits((&[32, 1, 2048], BF), (&[8, 3072, 2048], BF)));
    }

    #[test]
    fn the_grouped_product_is_the_plain_product() {
        for (lead, k, n) in [
            (vec![5, 1], 64, 48),
            (vec![2, 3], 96, 40),
            (vec![7], 32, 16),
        ] {
            let mut xs = lead.clone();
            xs.push(k);
            let x = normal(&xs, 1);
            let w = normal(&[n, k], 2);
            let got = matmul_t(&x, &w).unwrap();
            let mut want_shape = lead.clone();
            want_shape.push(n);
            assert_eq!(got.shape(), want_shape.as_slice());
            let want = x.matmul(w.t()).unwrap();
            assert!(max_abs_diff(&got, &want) < 1e-4, "{lead:?} {k} {n}");
        }
    }

    #[test]
    fn nothing_changes_unless_asked_on_cuda() {
        let x = normal(&[4, 1, 64], 1).as_dtype(BF).unwrap();
        let w = normal(&[32, 64], 2).as_dtype(BF).unwrap();
        if std::env::var("MLXD_DECODE_GEMM").map_or(true, |v| v != "1") {
            assert!(!serves(&x, &w));
        }
    }
}
