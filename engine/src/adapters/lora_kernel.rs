//! A served LoRA update as two CUDA kernels: `y + ((x @ A) * mask) @ B`, cast to `y`'s dtype.
//!
//! The update's products are skinny: a decode pass has a few dozen rows, and `A` `[in, R]` has
//! a few dozen columns. MLX sends them to cuBLAS, whose kernels for such shapes walk `in`
//! (2 048 to 8 192) in few blocks; with float32 factors on a bf16 base (as `mlx_lm.lora` writes
//! them) the update also casts `x` up and the result back. That is four or five launches per
//! site or stacked group, which took the 1B base's decode of 32 rows from 6.1k to 3.3k tok/s on
//! an H100 (BENCHMARKS.md). Here:
//!
//! 1. `shrink`: a block takes a few rows and eight of `A`'s columns and splits `in` over its
//!    threads, reading `x` in its own dtype; the partial sums meet in shared memory. A pass of
//!    rows of different adapters multiplies each row's sums by its mask (one row of `[B, W]`,
//!    repeated for each layer's block of `W` columns, as [`super::group`] lays them out).
//!    `h` is rounded to the factors' dtype, as `x @ A` gives it.
//! 2. `expand`: a thread takes one output column for a few rows, sums `h @ B` over `R` (the
//!    rows' `h` in shared memory), rounds it to the factors' dtype and then to `y`'s (mlx-lm's
//!    `(scale * z).astype(x.dtype)`, the scale in `B` since the load) and adds it to `y`.
//!
//! Off CUDA, for other shapes, for passes of many rows (prefill: cuBLAS's tiles pay off there)
//! or with `MLXD_LORA_KERNEL=0` (to measure the ops path), the caller runs the matmuls.
use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::{CudaKernel, Launch, OutputSpec};

/// Threads per block of both kernels.
const BLOCK: i32 = 128;
/// `A`'s columns a shrink block sums.
const SHRINK_COLUMNS: i32 = 8;
/// Rows a shrink block sums (each of its reads of `A` serves this many rows).
const SHRINK_ROWS: i32 = 4;
/// Rows an expand block adds to (each read of `B` serves this many rows).
const EXPAND_ROWS: i32 = 8;
/// The widest `R` served: an expand block holds `EXPAND_ROWS × R` floats of `h` in shared
/// memory (16 KB).
const MAX_RANK_COLUMNS: i32 = 512;
/// The most rows (tokens) a pass may have: beyond this, cuBLAS's tiled products are faster.
const MAX_ROWS: i32 = 256;

/// The shrink kernel's body. Inputs: `x` `[M, K]` (`XT`), `a` `[K, C]` (`FT`), `mask`
/// `[Bm, W]` (`MT`, read only with `HAS_MASK`: row `m` takes mask row `m / (M / Bm)`, column
/// `c` its entry `c % W`). Output `h` `[M, C]` (float32). Grid: `(⌈C / 8⌉ × 128, ⌈M / 4⌉)`.
const SHRINK_SOURCE: &str = r#"
  constexpr int CPB = 8;
  constexpr int RPB = 4;
  constexpr int WARPS = 4;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int C = a_shape[1];
  const int c0 = blockIdx.x * CPB;
  const int m0 = blockIdx.y * RPB;
  const int t = threadIdx.x;
  float acc[RPB][CPB];
  for (int r = 0; r < RPB; ++r)
    for (int c = 0; c < CPB; ++c) acc[r][c] = 0.0f;
  for (int k = t; k < K; k += blockDim.x) {
    float av[CPB];
    for (int c = 0; c < CPB; ++c)
      av[c] = (c0 + c < C) ? static_cast<float>(a[(size_t)k * C + c0 + c]) : 0.0f;
    for (int r = 0; r < RPB; ++r) {
      if (m0 + r < M) {
        const float xv = static_cast<float>(x[(size_t)(m0 + r) * K + k]);
        for (int c = 0; c < CPB; ++c) acc[r][c] += xv * av[c];
      }
    }
  }
  __shared__ float part[WARPS][RPB * CPB];
  const int warp = t / 32;
  const int lane = t % 32;
  for (int r = 0; r < RPB; ++r) {
    for (int c = 0; c < CPB; ++c) {
      float v = acc[r][c];
      for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
      if (lane == 0) part[warp][r * CPB + c] = v;
    }
  }
  __syncthreads();
  if (t < RPB * CPB) {
    const int m = m0 + t / CPB;
    const int col = c0 + t % CPB;
    if (m < M && col < C) {
      float v = 0.0f;
      for (int w = 0; w < WARPS; ++w) v += part[w][t];
      v = static_cast<float>(static_cast<FT>(v));
      if (HAS_MASK) {
        const int rows = mask_shape[0];
        const int W = mask_shape[1];
        v *= static_cast<float>(mask[(size_t)(m / (M / rows)) * W + col % W]);
      }
      h[(size_t)m * C + col] = v;
    }
  }
"#;

/// The expand kernel's body. Inputs: `h` `[M, C]` (float32), `b` `[C, N]` (`FT`), `y` `[M, N]`
/// (`YT`). Output `out` `[M, N]` (`YT`). Grid: `(⌈N / 128⌉ × 128, ⌈M / 8⌉)`.
const EXPAND_SOURCE: &str = r#"
  constexpr int RB = 8;
  const int M = y_shape[0];
  const int N = y_shape[1];
  const int C = h_shape[1];
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  const int m0 = blockIdx.y * RB;
  __shared__ float hs[RB * MAX_C];
  for (int i = threadIdx.x; i < RB * C; i += blockDim.x) {
    const int r = i / C;
    hs[i] = (m0 + r < M) ? h[(size_t)(m0 + r) * C + i % C] : 0.0f;
  }
  __syncthreads();
  if (n >= N) return;
  float acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = 0.0f;
  for (int c = 0; c < C; ++c) {
    const float bv = static_cast<float>(b[(size_t)c * N + n]);
    for (int r = 0; r < RB; ++r) acc[r] += hs[r * C + c] * bv;
  }
  for (int r = 0; r < RB; ++r) {
    const int m = m0 + r;
    if (m < M) {
      const float z = static_cast<float>(static_cast<YT>(static_cast<float>(static_cast<FT>(acc[r]))));
      const size_t i = (size_t)m * N + n;
      out[i] = static_cast<YT>(static_cast<float>(y[i]) + z);
    }
  }
"#;

/// Whether the kernels run here: MLX's default device is a CUDA GPU, and the ops path was not
/// asked for.
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::wanted("MLXD_LORA_KERNEL"))
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// The shapes and dtypes the kernels serve, apart from the device: `x` `[..., K]` of at most
/// [`MAX_ROWS`] rows; `a` `[K, C]` and `b` `[C, N]` of one dtype, float32 or `x`'s (so that
/// `x @ A` has the factors' dtype); `y` `[..., N]` in `x`'s dtype with `x`'s rows; `C` at most
/// [`MAX_RANK_COLUMNS`]; a mask `[Bm, 1, W]` whose `Bm` divides the rows and `W` times the
/// layers makes `C`.
pub fn fits(
    x: (&[i32], Dtype),
    a: (&[i32], Dtype),
    b: (&[i32], Dtype),
    y: (&[i32], Dtype),
    mask: Option<(&[i32], i32)>,
) -> bool {
    let ((xs, xd), (as_, ad), (bs, bd), (ys, yd)) = (x, a, b, y);
    let ([k, c], [c2, n]) = (as_, bs) else {
        return false;
    };
    let (Some((&xk, x_lead)), Some((&yn, y_lead))) = (xs.split_last(), ys.split_last()) else {
        return false;
    };
    let rows: i64 = x_lead.iter().map(|&d| i64::from(d)).product();
    let mask_fits = match mask {
        None => true,
        Some((&[bm, 1, w], layers)) => {
            bm > 0 && rows % i64::from(bm) == 0 && layers > 0 && w * layers == *c
        }
        Some(_) => false,
    };
    is_float(xd)
        && ad == bd
        && (ad == Dtype::Float32 || ad == xd)
        && yd == xd
        && xk == *k
        && c == c2
        && yn == *n
        && x_lead == y_lead
        && (1..=i64::from(MAX_ROWS)).contains(&rows)
        && (1..=MAX_RANK_COLUMNS).contains(c)
        && *n > 0
        && mask_fits
}

/// Whether [`add_update`] serves this update here: the device and [`fits`].
pub fn serves(x: &Array, a: &Array, b: &Array, y: &Array, mask: Option<(&Array, i32)>) -> bool {
    available()
        && fits(
            (x.shape(), x.dtype()),
            (a.shape(), a.dtype()),
            (b.shape(), b.dtype()),
            (y.shape(), y.dtype()),
            mask.map(|(m, layers)| (m.shape(), layers)),
        )
}

thread_local! {
    /// The two kernels, made once per thread (the model runs on one thread).
    static KERNELS: RefCell<Option<(CudaKernel, CudaKernel)>> = const { RefCell::new(None) };
}

/// `y + cast(((x @ a) * mask) @ b)`, the mask (`[Bm, 1, W]`, for `layers` blocks of `W`
/// columns) keeping each row's own adapter's columns. Call only where [`serves`] said yes.
pub fn add_update(
    x: &Array,
    a: &Array,
    b: &Array,
    y: &Array,
    mask: Option<(&Array, i32)>,
) -> Result<Array, Exception> {
    let (k, c, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let rows = x.size() as i32 / k;
    let x2 = x.reshape(&[rows, k])?;
    let y2 = y.reshape(&[rows, n])?;
    let (mask, has_mask, mask_dtype) = match mask {
        Some((m, _)) => {
            let (bm, w) = (m.shape()[0], m.shape()[2]);
            (m.reshape(&[bm, w])?, 1, m.dtype())
        }
        None => (Array::from_f32(1.0).reshape(&[1, 1])?, 0, Dtype::Float32),
    };
    KERNELS.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            let shrink = CudaKernel::new(
                "mlxd_lora_shrink",
                &["x", "a", "mask"],
                &["h"],
                SHRINK_SOURCE,
                true,
            )?;
            let expand = CudaKernel::new(
                "mlxd_lora_expand",
                &["h", "b", "y"],
                &["out"],
                EXPAND_SOURCE,
                true,
            )?;
            *slot = Some((shrink, expand));
        }
        let (shrink, expand) = slot.as_ref().expect("made above");
        let ceil = |a: i32, b: i32| (a + b - 1) / b;
        let h = shrink.apply(
            &[&x2, a, &mask],
            &[OutputSpec {
                shape: vec![rows, c],
                dtype: Dtype::Float32,
            }],
            &Launch {
                grid: (ceil(c, SHRINK_COLUMNS) * BLOCK, ceil(rows, SHRINK_ROWS), 1),
                block: (BLOCK, 1, 1),
                dtypes: &[("XT", x.dtype()), ("FT", a.dtype()), ("MT", mask_dtype)],
                ints: &[("HAS_MASK", has_mask)],
            },
        )?;
        let out = expand.apply(
            &[&h[0], b, &y2],
            &[OutputSpec {
                shape: vec![rows, n],
                dtype: y.dtype(),
            }],
            &Launch {
                grid: (ceil(n, BLOCK) * BLOCK, ceil(rows, EXPAND_ROWS), 1),
                block: (BLOCK, 1, 1),
                dtypes: &[("FT", b.dtype()), ("YT", y.dtype())],
                ints: &[("MAX_C", MAX_RANK_COLUMNS)],
            },
        )?;
        out.into_iter()
            .next()
            .ok_or_else(|| Exception::custom("the LoRA expand kernel gave no output"))?
            .reshape(y.shape())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::gpu_backend;
    use mlxd_protocol::control::Backend;

    const BF: Dtype = Dtype::Bfloat16;
    const F32: Dtype = Dtype::Float32;

    #[test]
    fn the_kernels_take_decode_sized_passes_with_float32_or_matching_factors() {
        let x: &[i32] = &[32, 1, 2048];
        let y: &[i32] = &[32, 1, 3072];
        let (a, b): (&[i32], &[i32]) = (&[2048, 24], &[24, 3072]);
        assert!(fits((x, BF), (a, F32), (b, F32), (y, BF), None));
        assert!(fits((x, BF), (a, BF), (b, BF), (y, BF), None));
        // Four adapters of rank 8 over three layers: a mask of 32 columns, repeated three times.
        let (a4, b4): (&[i32], &[i32]) = (&[2048, 96], &[96, 3072]);
        assert!(fits(
            (x, BF),
            (a4, F32),
            (b4, F32),
            (y, BF),
            Some((&[32, 1, 32], 3))
        ));
        // A mask whose columns do not make R, or whose rows do not divide the pass's.
        assert!(!fits(
            (x, BF),
            (a4, F32),
            (b4, F32),
            (y, BF),
            Some((&[32, 1, 30], 3))
        ));
        assert!(!fits(
            (x, BF),
            (a4, F32),
            (b4, F32),
            (y, BF),
            Some((&[5, 1, 32], 3))
        ));
        // Factors in a third dtype, of two dtypes, or an output in another dtype.
        assert!(!fits(
            (x, BF),
            (a, Dtype::Float16),
            (b, Dtype::Float16),
            (y, BF),
            None
        ));
        assert!(!fits((x, BF), (a, F32), (b, BF), (y, BF), None));
        assert!(!fits((x, BF), (a, F32), (b, F32), (y, F32), None));
        // Shapes that do not chain.
        assert!(!fits((x, BF), (&[1024, 24], F32), (b, F32), (y, BF), None));
        assert!(!fits((x, BF), (a, F32), (&[16, 3072], F32), (y, BF), None));
        assert!(!fits(
            (x, BF),
            (a, F32),
            (b, F32),
            (&[16, 1, 3072], BF),
            None
        ));
        // A prefill pass of many tokens, and more factor columns than shared memory holds.
        assert!(!fits(
            (&[4, 512, 2048], BF),
            (a, F32),
            (b, F32),
            (&[4, 512, 3072], BF),
            None
        ));
        assert!(!fits(
            (x, BF),
            (&[2048, 600], F32),
            (&[600, 3072], F32),
            (y, BF),
            None
        ));
    }

    #[test]
    fn nothing_runs_off_cuda() {
        let x = Array::zeros::<f32>(&[2, 1, 64]).unwrap();
        let a = Array::zeros::<f32>(&[64, 8]).unwrap();
        let b = Array::zeros::<f32>(&[8, 32]).unwrap();
        let y = Array::zeros::<f32>(&[2, 1, 32]).unwrap();
        if gpu_backend() != Some(Backend::Cuda) {
            assert!(!serves(&x, &a, &b, &y, None));
        }
    }
}
