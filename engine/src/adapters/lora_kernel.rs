//! A served LoRA update as one CUDA kernel: `y + ((x @ A) * mask) @ B`, cast to `y`'s dtype.
//!
//! A decode step is bound by the host's cost per graph node, not by the device: on an H200
//! the 1B base decodes 32 rows at 12.0k tok/s in the engine core; one float32 adapter's
//! update as matmuls (`x @ A` with its cast of `x`, `@ B`, the cast and the add: four nodes at
//! each of 64 sites a step) took that to 4.2k, and as two kernels with their reshapes to 5.5k
//! (BENCHMARKS.md). Here the whole update is one node. A block takes a few rows and a slice
//! of the output columns:
//!
//! 1. its warps compute the rows' `h = x @ A` (a warp per eight of `A`'s columns, its lanes
//!    splitting `in`, a shuffle sum per column), times each row's mask (one row of
//!    `[B, 1, W]`, repeated for each layer's block of `W` columns, as [`super::group`] lays
//!    them out), rounded to the factors' dtype as `x @ A` gives it, into shared memory;
//! 2. each thread sums `h @ B` for its columns, rounds it to the factors' dtype and then to
//!    `y`'s (mlx-lm's `(scale * z).astype(x.dtype)`, the scale in `B` since the load) and adds
//!    it to `y`.
//!
//! Every column block recomputes its rows' `h` (`A` is small and stays in L2): the device has
//! time to spare, the host has not. Off CUDA, for other shapes, for passes of many rows
//! (prefill: cuBLAS's tiles pay off there), and unless `MLXD_LORA_KERNEL=1` (see
//! [`available`]), the caller runs the matmuls.
use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::{CudaKernel, Launch, OutputSpec};

/// Threads per block.
const BLOCK: i32 = 128;
/// Rows a block updates (each read of `A` and `B` serves this many rows).
const ROWS: i32 = 8;
/// Blocks worth launching for a pass: about one per multiprocessor of a large GPU. Fewer
/// column blocks recompute `h` fewer times; more spread `@ B` wider.
const TARGET_BLOCKS: i32 = 128;
/// The widest `R` served: a block holds `ROWS × R` floats of `h` in shared memory (16 KB).
const MAX_RANK_COLUMNS: i32 = 512;
/// The most rows (tokens) a pass may have: beyond this, cuBLAS's tiled products are faster.
const MAX_ROWS: i32 = 256;

/// The kernel's body. Inputs: `x` `[B, L, K]` (`XT`), `a` `[K, C]`, `b` `[C, N]` (`FT`), `y`
/// `[B, L, N]` (`YT`), `mask` `[Bm, 1, W]` (`MT`, read only with `HAS_MASK`: row `m` of the
/// `M = B·L` takes mask row `m / (M / Bm)`, column `c` its entry `c % W`). Output `out`
/// `[B, L, N]` (`YT`). Grid: `(column blocks × 128, ⌈M / 8⌉)` threads.
const SOURCE: &str = r#"
  constexpr int RB = 8;
  constexpr int WARPS = 4;
  constexpr int CW = 8;
  const int M = x_shape[0] * x_shape[1];
  const int K = x_shape[2];
  const int C = a_shape[1];
  const int N = b_shape[1];
  const int m0 = blockIdx.y * RB;
  const int rows = min(RB, M - m0);
  const int per_block = (N + gridDim.x - 1) / gridDim.x;
  const int n0 = blockIdx.x * per_block;
  const int n1 = min(N, n0 + per_block);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __shared__ float hs[RB * MAX_C];

  // 1. h = (x @ A) * mask for this block's rows: warp w takes columns 8w..8w+7, then
  //    8(w + 4).., each lane every 32nd position of `in` (one sector of A's row per read).
  for (int c0 = warp * CW; c0 < C; c0 += WARPS * CW) {
    float acc[RB][CW];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < CW; ++j) acc[r][j] = 0.0f;
    for (int k = lane; k < K; k += 32) {
      float av[CW];
      for (int j = 0; j < CW; ++j)
        av[j] = (c0 + j < C) ? static_cast<float>(a[(size_t)k * C + c0 + j]) : 0.0f;
      for (int r = 0; r < RB; ++r) {
        if (r < rows) {
          const float xv = static_cast<float>(x[(size_t)(m0 + r) * K + k]);
          for (int j = 0; j < CW; ++j) acc[r][j] += xv * av[j];
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      for (int j = 0; j < CW; ++j) {
        float v = acc[r][j];
        for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
        const int c = c0 + j;
        v = static_cast<float>(static_cast<FT>(v));
        if (HAS_MASK && r < rows && c < C) {
          const int mask_rows = mask_shape[0];
          const int W = mask_shape[2];
          v *= static_cast<float>(mask[(size_t)((m0 + r) / (M / mask_rows)) * W + c % W]);
        }
        if (lane == 0 && c < C) hs[r * C + c] = v;
      }
    }
  }
  __syncthreads();

  // 2. out = y + cast(h @ B) for this block's columns.
  for (int n = n0 + threadIdx.x; n < n1; n += blockDim.x) {
    float acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = 0.0f;
    for (int c = 0; c < C; ++c) {
      const float bv = static_cast<float>(b[(size_t)c * N + n]);
      for (int r = 0; r < RB; ++r) acc[r] += hs[r * C + c] * bv;
    }
    for (int r = 0; r < rows; ++r) {
      const float z = static_cast<float>(static_cast<YT>(static_cast<float>(static_cast<FT>(acc[r]))));
      const size_t i = (size_t)(m0 + r) * N + n;
      out[i] = static_cast<YT>(static_cast<float>(y[i]) + z);
    }
  }
"#;

/// Whether the kernel runs here: MLX's default device is a CUDA GPU and `MLXD_LORA_KERNEL=1`.
/// **Off by default:** this one-node kernel has not run on a GPU yet. Its body runs under a
/// CPU emulation of the GPU's threads in `scripts/test.sh` (`scripts/emulate_cuda_kernels.py`,
/// equal to numpy's update to float rounding), and its two-kernel predecessor agreed with the
/// matmuls to bf16 rounding on an H200 (BENCHMARKS.md), but its speed is unmeasured: the
/// matmuls stay the default until `lora_kernel_check` and the adapters benchmark have run it.
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::asked("MLXD_LORA_KERNEL"))
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// The shapes and dtypes the kernel serves, apart from the device: `x` `[B, L, K]` of at most
/// [`MAX_ROWS`] rows (`B·L`); `a` `[K, C]` and `b` `[C, N]` of one dtype, float32 or `x`'s (so
/// that `x @ A` has the factors' dtype); `y` `[B, L, N]` in `x`'s dtype; `C` at most
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
    let (&[bx, l, k], &[ka, c], &[cb, n], &[by, ly, ny]) = (xs, as_, bs, ys) else {
        return false;
    };
    let rows = i64::from(bx) * i64::from(l);
    let mask_fits = match mask {
        None => true,
        Some((&[bm, 1, w], layers)) => {
            bm > 0 && rows % i64::from(bm) == 0 && layers > 0 && w * layers == c
        }
        Some(_) => false,
    };
    is_float(xd)
        && ad == bd
        && (ad == Dtype::Float32 || ad == xd)
        && yd == xd
        && k == ka
        && c == cb
        && (by, ly, ny) == (bx, l, n)
        && (1..=i64::from(MAX_ROWS)).contains(&rows)
        && (1..=MAX_RANK_COLUMNS).contains(&c)
        && n > 0
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
    /// The kernel, made once per thread (the model runs on one thread), and the mask it is
    /// given where there is none (never read; an evaluated array adds no node to a pass).
    static KERNEL: RefCell<Option<(CudaKernel, Array)>> = const { RefCell::new(None) };
}

/// Column blocks for a pass of `rows` rows and `columns` outputs: about [`TARGET_BLOCKS`]
/// blocks in all, each at least a block's width of columns.
fn column_blocks(rows: i32, columns: i32) -> i32 {
    let ceil = |a: i32, b: i32| (a + b - 1) / b;
    let row_blocks = ceil(rows, ROWS).max(1);
    ceil(TARGET_BLOCKS, row_blocks).clamp(1, ceil(columns, BLOCK).max(1))
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
    let rows = x.shape()[0] * x.shape()[1];
    let n = b.shape()[1];
    KERNEL.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            let kernel = CudaKernel::new(
                "mlxd_lora_update",
                &["x", "a", "b", "y", "mask"],
                &["out"],
                SOURCE,
                true,
            )?;
            let none = Array::from_f32(1.0).reshape(&[1, 1, 1])?;
            none.eval()?;
            *slot = Some((kernel, none));
        }
        let (kernel, none) = slot.as_ref().expect("made above");
        let (mask, has_mask) = match mask {
            Some((m, _)) => (m, 1),
            None => (none, 0),
        };
        let out = kernel.apply(
            &[x, a, b, y, mask],
            &[OutputSpec {
                shape: y.shape().to_vec(),
                dtype: y.dtype(),
            }],
            &Launch {
                grid: (column_blocks(rows, n) * BLOCK, (rows + ROWS - 1) / ROWS, 1),
                block: (BLOCK, 1, 1),
                dtypes: &[
                    ("XT", x.dtype()),
                    ("FT", a.dtype()),
                    ("YT", y.dtype()),
                    ("MT", mask.dtype()),
                ],
                ints: &[("HAS_MASK", has_mask), ("MAX_C", MAX_RANK_COLUMNS)],
            },
        )?;
        out.into_iter()
            .next()
            .ok_or_else(|| Exception::custom("the LoRA kernel gave no output"))
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
        // Inputs that are not [B, L, ·].
        assert!(!fits(
            (&[32, 2048], BF),
            (a, F32),
            (b, F32),
            (&[32, 3072], BF),
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
    fn a_pass_spreads_over_about_128_blocks_without_empty_ones() {
        // 32 rows: 4 row blocks and 32 column blocks, but q/k/v's 3 072 columns make 24 of 128.
        assert_eq!(column_blocks(32, 3072), 24);
        assert_eq!(column_blocks(32, 16_384), 32);
        // One row: every column block holds at least a block's width of columns.
        assert_eq!(column_blocks(1, 2048), 16);
        assert_eq!(column_blocks(1, 100), 1);
        // 256 rows: 32 row blocks of 4 column blocks.
        assert_eq!(column_blocks(256, 16_384), 4);
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
