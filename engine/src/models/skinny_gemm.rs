//! A dense product of a few rows, `x @ W.T`, as one CUDA kernel instead of a cuBLASLt call
//! (`MLXD_SKINNY_GEMM=1`; off by default until it is measured on a GPU).
//!
//! MLX 0.32 sends a product of one row to its matrix-vector kernel and every product of more
//! rows to cuBLASLt, making new descriptors, asking cuBLASLt's heuristic for an algorithm and
//! stream-capturing the call into a child CUDA graph at every call (`gemm_and_bias` in
//! `mlx/backend/cuda/matmul.cpp`). A decode step of the 1B makes 65 products; on an H100 a
//! one-row step costs ~2.1 ms of host and an eight-row step ~3.3 ms, and a 15-row prefill
//! pass's products ~37 µs each (BENCHMARKS.md, sessions 46 and 49): at a few rows the step is
//! bound by the host, and cuBLAS is the larger part of what separates it from one row. MLX's
//! grouped GEMM (`gather_mm`) was tried for the same reason and cost 3–5× the device time
//! (its 256-row tiles; session 52).
//!
//! Here a product of 2 to [`MAX_ROWS`] rows reads each row of `W` once for every row of `x`,
//! as a matrix-vector kernel does for one: a warp owns [`OUT_PER_WARP`] output columns (rows
//! of `W`) over the whole inner axis, each lane loading eight consecutive elements (one
//! 16-byte load) of each of them and of each row of `x` per step, so a warp's loads of a row
//! of `W` are 512 contiguous bytes, [`UNROLL`] steps of them issued before any is used. Each
//! lane keeps `M × OUT_PER_WARP` float32 sums over its share of the inner axis; the lanes merge
//! by shuffles (a few per output, against a split of the inner axis over a block's warps,
//! whose merge cost more than the products at these sizes) and lane 0 rounds each sum to the
//! inputs' dtype (cuBLAS's float32 accumulation and one rounding; the order of the sums
//! differs). `x` is read by every warp, from the L1 and L2 caches (a few dozen KB). The
//! kernel is specialised per row count `M` ([`crate::cuda_kernel`]), so its loops over rows
//! are unrolled.
//!
//! `scripts/emulate_cuda_kernels.py` runs the body on the CPU against numpy (a
//! `scripts/test.sh` phase); `examples/skinny_gemm_check.rs` checks and times it on a GPU
//! against MLX's product. Off CUDA, for other shapes and dtypes, or without the switch, the
//! caller runs MLX's matmul.
use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::{CudaKernel, Launch, OutputSpec};

/// The switch: `1` sends products of a few rows through the kernel on CUDA.
pub const SWITCH: &str = "MLXD_SKINNY_GEMM";
/// Threads per block (four warps).
const BLOCK: i32 = 128;
/// Output columns (rows of `W`) a warp computes.
const OUT_PER_WARP: i32 = 2;
/// Steps of a warp's loads issued together (each 512 bytes of each of its rows of `W`).
const UNROLL: i32 = 4;
/// The most rows a product may have to take the kernel: each lane holds `M × OUT_PER_WARP`
/// sums in registers. One row takes MLX's matrix-vector kernel.
pub const MAX_ROWS: i32 = 16;
/// Elements of a row a lane loads at once (16 bytes of a 2-byte dtype).
const PER_LOAD: i32 = 8;

/// The kernel's body. Inputs: `x` `[..., K]` (`M` rows, row-contiguous), `w` `[N, K]`, both
/// `T`, `K` a multiple of [`PER_LOAD`]. Output `out` `[..., N]` (`T`). Grid: `⌈N / (NT / 32 ·
/// R)⌉ × NT` threads in blocks of `NT` ([`BLOCK`]); `R` ([`OUT_PER_WARP`]), `U` ([`UNROLL`])
/// and `M` are constants.
const SOURCE: &str = r#"
  constexpr int WARPS = NT / 32;
  constexpr int STEP = 32 * 8;
  const int K = w_shape[1];
  const int N = w_shape[0];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * WARPS + warp) * R;
  if (n0 >= N) return;
  // Eight consecutive elements into floats: one 16-byte load of a 2-byte dtype.
  auto load8 = [](const T* p, float* v) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(h[j]);
    } else {
      for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(p[j]);
    }
  };
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  for (int k0 = lane * 8; k0 < K; k0 += STEP * U) {
    // U steps of the warp's rows of W loaded before any is used: their loads in flight at once.
    float wv[U][R][8];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int k = k0 + u * STEP;
        if (k < K && n0 + r < N) {
          load8(w + (size_t)(n0 + r) * K + k, wv[u][r]);
        } else {
          for (int j = 0; j < 8; ++j) wv[u][r][j] = 0.0f;
        }
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * STEP;
      if (k >= K) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xv[8];
        load8(x + (size_t)m * K + k, xv);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[m][r] += xv[j] * wv[u][r][j];
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = acc[m][r];
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
      if (lane == 0 && n0 + r < N) out[(size_t)m * N + n0 + r] = static_cast<T>(s);
    }
"#;

/// Whether the switch asks for the kernel and MLX's default device is a CUDA GPU.
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var(SWITCH).is_ok_and(|v| v == "1") && crate::cuda_kernel::wanted(SWITCH)
    })
}

/// The shapes and dtypes the kernel serves, apart from the device: `x` `[..., K]` of 2 to
/// [`MAX_ROWS`] rows (the product of its leading axes) and `w` `[N, K]`, both float16 or both
/// bfloat16, `K` a positive multiple of eight.
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
        && k % PER_LOAD == 0
        && n > 0
        && (2..=i64::from(MAX_ROWS)).contains(&rows)
}

/// Whether [`matmul_t`] serves `x @ w.T` here: the switch, the device and [`fits`].
pub fn serves(x: &Array, w: &Array) -> bool {
    available() && fits((x.shape(), x.dtype()), (w.shape(), w.dtype()))
}

thread_local! {
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

/// `x @ w.T` through the kernel (`x` `[..., K]`, `w` `[N, K]`) → `[..., N]` in `x`'s dtype.
/// Call only where [`fits`] holds, on a CUDA GPU.
pub fn matmul_t(x: &Array, w: &Array) -> Result<Array, Exception> {
    let shape = x.shape();
    let lead = &shape[..shape.len() - 1];
    let rows: i32 = lead.iter().product();
    let n = w.shape()[0];
    let mut out_shape = lead.to_vec();
    out_shape.push(n);
    let per_block = BLOCK / 32 * OUT_PER_WARP;
    let blocks = (n + per_block - 1) / per_block;
    KERNEL.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            *cell = Some(CudaKernel::new(
                "mlxd_skinny_gemm",
                &["x", "w"],
                &["out"],
                SOURCE,
                true,
            )?);
        }
        let kernel = cell.as_ref().expect("made above");
        let mut outs = kernel.apply(
            &[x, w],
            &[OutputSpec {
                shape: out_shape,
                dtype: x.dtype(),
            }],
            &Launch {
                grid: (blocks * BLOCK, 1, 1),
                block: (BLOCK, 1, 1),
                dtypes: &[("T", x.dtype())],
                ints: &[
                    ("M", rows),
                    ("R", OUT_PER_WARP),
                    ("U", UNROLL),
                    ("NT", BLOCK),
                ],
            },
        )?;
        outs.pop()
            .ok_or_else(|| Exception::custom("the skinny product gave no output"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BF: Dtype = Dtype::Bfloat16;

    #[test]
    fn products_of_a_few_half_precision_rows_fit() {
        let w: &[i32] = &[3072, 2048];
        assert!(fits((&[8, 1, 2048], BF), (w, BF)));
        assert!(fits((&[2, 2048], Dtype::Float16), (w, Dtype::Float16)));
        assert!(
            fits((&[1, 15, 2048], BF), (w, BF)),
            "a prefix hit's 15 tokens"
        );
        assert!(fits((&[16, 1, 2048], BF), (w, BF)));
        // One row (MLX's matrix-vector kernel), more rows than the sums held, float32, mixed.
        assert!(!fits((&[1, 1, 2048], BF), (w, BF)));
        assert!(!fits((&[17, 1, 2048], BF), (w, BF)));
        assert!(!fits((&[8, 1, 2048], Dtype::Float32), (w, Dtype::Float32)));
        assert!(!fits((&[8, 1, 2048], BF), (w, Dtype::Float16)));
        // An inner axis the 16-byte loads do not cover, shapes that do not chain, a stack.
        assert!(!fits((&[8, 1, 2044], BF), (&[3072, 2044], BF)));
        assert!(!fits((&[8, 1, 1024], BF), (w, BF)));
        assert!(!fits((&[2048], BF), (w, BF)));
        assert!(!fits((&[8, 1, 2048], BF), (&[8, 3072, 2048], BF)));
    }

    #[test]
    fn nothing_changes_unless_asked_on_cuda() {
        let x = crate::models::test_arrays::normal(&[4, 1, 64], 1)
            .as_dtype(BF)
            .unwrap();
        let w = crate::models::test_arrays::normal(&[32, 64], 2)
            .as_dtype(BF)
            .unwrap();
        if std::env::var(SWITCH).map_or(true, |v| v != "1") {
            assert!(!serves(&x, &w));
        }
        // Off CUDA the switch alone does not turn it on.
        if !crate::cuda_kernel::wanted(SWITCH) {
            assert!(!serves(&x, &w));
        }
    }
}
