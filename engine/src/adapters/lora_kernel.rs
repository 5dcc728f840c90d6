//! A served LoRA update as two CUDA kernels: `y + ((x @ A) * mask) @ B`, cast to `y`'s dtype.
//!
//! The update's products are skinny: a decode pass has a few dozen rows, and `A` `[in, C]`
//! has a few dozen columns (rank × stacked projections × adapters mixed). As matmuls (`x`
//! cast up to the factors' float32, `x @ A`, the row mask, `@ B`, the cast and the add) a
//! site is four or five graph nodes, and cuBLAS walks the long `in` axis of such shapes in few
//! blocks: on an H200 one float32 adapter took the 1B base's decode of 32 rows from 12.0k to
//! 4.2k tok/s (BENCHMARKS.md). What the update needs is many blocks on the long axis, so:
//!
//! 1. `shrink` splits `in` into spans of [`SHRINK_SPAN`]: a block sums one span for up to
//!    [`SHRINK_ROWS`] rows and [`SHRINK_COLUMNS`] of `A`'s columns, writing float32 partial
//!    sums `[spans, M, C]`. Its threads first load the rows' span of `x` and the span's tile
//!    of `A` into shared memory, all their loads issued before any is used: a pass of a few
//!    dozen rows gives the device too few warps to hide a load's latency otherwise. A
//!    2 048-wide site of 32 rows is 16 blocks for each 32 columns, each walking 128 positions.
//! 2. `expand`: a block takes [`EXPAND_ROWS`] rows; its threads first sum the rows' partials
//!    over the spans in order (so the result does not depend on scheduling), round them to the
//!    factors' dtype as `x @ A` gives them, and apply each row's mask (one row of `[B, 1, W]`,
//!    repeated for each layer's block of `W` columns, as [`super::group`] lays them out) into
//!    shared memory; then each thread sums `h @ B` for one output column, rounds it to the
//!    factors' dtype and then to `y`'s (mlx-lm's `(scale * z).astype(x.dtype)`, the scale in
//!    `B` since the load) and adds it to `y`.
//!
//! On an H100 the engine core then decodes 32 rows over four float32 adapters at 8.2–8.8k
//! tok/s against the matmuls' 5.4k (the base alone: 13.2–13.6k), and a site's two nodes cost
//! what two plain nodes do in a chain of them (BENCHMARKS.md): what is left is the host's
//! cost per node, MLX's custom-kernel call path the larger part of it (which
//! [`crate::cuda_kernel`] trims by specialising each kernel once). A first version did all of
//! it in one kernel, each block recomputing `h` over the whole of `in`: one node, but its few
//! warps walked thousands of positions one after another, and the same decode fell to 1.6k.
//! A single launch whose expand blocks wait
//! on a count of finished shrink blocks (95d41bf, reverted) agreed with the matmuls but cost
//! 55–8 900 µs a site against these kernels' 32–62 (BENCHMARKS.md, session 39). Off CUDA, for other shapes, for passes
//! of many rows (prefill: cuBLAS's tiles pay off there), and with `MLXD_LORA_KERNEL=0` (see
//! [`available`]), the caller runs the matmuls.
use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::widened::Epilogue;
use crate::cuda_kernel::{CudaKernel, Launch, OutputSpec};

/// Threads per block of both kernels (eight warps).
const BLOCK: i32 = 256;
/// Positions of `in` a shrink block sums.
const SHRINK_SPAN: i32 = 128;
/// `A`'s columns a shrink block sums, a thread each (a warp's lanes: its reads of `A`
/// coalesce); [`BLOCK`] / this many threads share a column, each taking every so-many-th row.
const SHRINK_COLUMNS: i32 = 32;
/// Rows a shrink block sums (a multiple of [`BLOCK`] / [`SHRINK_COLUMNS`]).
const SHRINK_ROWS: i32 = 32;
/// Rows an expand block adds to (each read of `B` serves this many rows).
const EXPAND_ROWS: i32 = 8;
/// The widest `C` served: an expand block holds `EXPAND_ROWS × C` floats of `h` in shared
/// memory (16 KB).
const MAX_RANK_COLUMNS: i32 = 512;
/// The most rows (tokens) a pass may have: beyond this, cuBLAS's tiled products are faster.
const MAX_ROWS: i32 = 256;

// The kernels' loops assume these: whole loads per thread, whole row groups, and the
// shrink's two tiles and the expand's `h` within a block's 48 KB of static shared memory.
const _: () = assert!(SHRINK_ROWS * SHRINK_SPAN % BLOCK == 0);
const _: () = assert!(SHRINK_SPAN * SHRINK_COLUMNS % BLOCK == 0);
const _: () = assert!(BLOCK % SHRINK_COLUMNS == 0 && SHRINK_ROWS % (BLOCK / SHRINK_COLUMNS) == 0);
const _: () = assert!((SHRINK_ROWS + SHRINK_COLUMNS) * SHRINK_SPAN * 4 <= 48 * 1024);
const _: () = assert!(EXPAND_ROWS * MAX_RANK_COLUMNS * 4 <= 48 * 1024);

/// The shrink kernel's body. Inputs: `x` `[B, L, K]` (`XT`), `a` `[K, C]` (`FT`). Output `p`
/// `[⌈K / SPAN⌉, M, C]` (float32; `M = B·L`): span `s`'s partial sums of `x @ A`. Grid:
/// `(spans × NT, ⌈C / CT⌉, ⌈M / MR⌉)` threads, `NT` ([`BLOCK`]) a block, `CT` and `MR`
/// ([`SHRINK_COLUMNS`], [`SHRINK_ROWS`]) a block's columns and rows.
const SHRINK_SOURCE: &str = r#"
  constexpr int GROUPS = NT / CT;
  constexpr int RW = MR / GROUPS;
  const int M = x_shape[0] * x_shape[1];
  const int K = x_shape[2];
  const int C = a_shape[1];
  const int k0 = blockIdx.x * SPAN;
  const int span = min(SPAN, K - k0);
  const int c0 = blockIdx.y * CT;
  const int m0 = blockIdx.z * MR;
  const int col = threadIdx.x % CT;
  const int group = threadIdx.x / CT;
  // The rows' span of x and the span's tile of A into shared memory, every thread's loads
  // issued before any is used (the device hides their latency in few warps this way).
  __shared__ float xs[MR * SPAN];
  __shared__ float as[SPAN * CT];
#pragma unroll
  for (int j = 0; j < MR * SPAN / NT; ++j) {
    const int i = threadIdx.x + j * NT;
    const int r = i / SPAN;
    const int k = i % SPAN;
    xs[i] = (m0 + r < M && k < span) ? static_cast<float>(x[(size_t)(m0 + r) * K + k0 + k]) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < SPAN * CT / NT; ++j) {
    const int i = threadIdx.x + j * NT;
    const int k = i / CT;
    const int c = c0 + i % CT;
    as[i] = (k < span && c < C) ? static_cast<float>(a[(size_t)(k0 + k) * C + c]) : 0.0f;
  }
  __syncthreads();
  const int c = c0 + col;
  if (c < C) {
    float acc[RW];
    for (int j = 0; j < RW; ++j) acc[j] = 0.0f;
    for (int k = 0; k < span; ++k) {
      const float av = as[k * CT + col];
      for (int j = 0; j < RW; ++j) acc[j] += xs[(group + GROUPS * j) * SPAN + k] * av;
    }
    for (int j = 0; j < RW; ++j) {
      const int m = m0 + group + GROUPS * j;
      if (m < M) p[((size_t)blockIdx.x * M + m) * C + c] = acc[j];
    }
  }
"#;

/// The expand kernel's body. Inputs: `p` `[S, M, C]` (float32, the shrink's partials), `b`
/// `[C, N]` (`FT`), `y` `[B, L, N]` (`YT`), `mask` `[Bm, 1, W]` (`MT`, read only with
/// `HAS_MASK`: row `m` takes mask row `m / (M / Bm)`, column `c` its entry `c % W`). Output
/// `out` `[B, L, N]` (`YT`). Grid: `(⌈N / BLOCK⌉ × BLOCK, ⌈M / RB⌉)` threads, `RB`
/// ([`EXPAND_ROWS`]) a block's rows. With `WIDE` ([`super::widened`]) `y` is `[B, L, N + C]`,
/// the base product carrying `x @ A` as its last `C` columns, which the kernel reads instead of
/// summing `p` (then never read); `out` is `y`'s first `N` columns plus the update.
/// `EPILOGUE` ([`Epilogue`], widened only): 0 writes that sum, rounded to `YT` (the layer's
/// output); 1 adds it to `res` `[B, L, N]` (`YT`) and writes that, rounded again (the block's
/// residual add); 2 writes `silu(g) · u` `[B, L, N / 2]` of its halves `g` (columns below
/// `N / 2`) and `u`, each rounded to `YT` first and each op after, as the compiled SwiGLU
/// rounds them (the grid then covers `N / 2` columns). `res` is never read otherwise.
const EXPAND_SOURCE: &str = r#"
  const int C = b_shape[0];
  const int N = b_shape[1];
  const int M = y_shape[0] * y_shape[1];
  const int WIDTH = y_shape[2];
  const int OUT_N = (EPILOGUE == 2) ? N / 2 : N;
  const int m0 = blockIdx.y * RB;
  __shared__ float hs[RB * MAX_C];
  for (int i = threadIdx.x; i < RB * C; i += blockDim.x) {
    const int r = i / C;
    const int c = i % C;
    const int m = m0 + r;
    float v = 0.0f;
    if (m < M) {
      if (WIDE) {
        v = static_cast<float>(y[(size_t)m * WIDTH + N + c]);
      } else {
        const int S = p_shape[0];
#pragma unroll 16
        for (int s = 0; s < S; ++s) v += p[((size_t)s * M + m) * C + c];
        v = static_cast<float>(static_cast<FT>(v));
      }
      if (HAS_MASK) {
        const int mask_rows = mask_shape[0];
        const int W = mask_shape[2];
        v *= static_cast<float>(mask[(size_t)(m / (M / mask_rows)) * W + c % W]);
      }
    }
    hs[i] = v;
  }
  __syncthreads();
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= OUT_N) return;
  float acc[RB];
  float acc_up[RB];
  for (int r = 0; r < RB; ++r) { acc[r] = 0.0f; acc_up[r] = 0.0f; }
#pragma unroll 16
  for (int c = 0; c < C; ++c) {
    const float bv = static_cast<float>(b[(size_t)c * N + n]);
    for (int r = 0; r < RB; ++r) acc[r] += hs[r * C + c] * bv;
    if (EPILOGUE == 2) {
      const float bu = static_cast<float>(b[(size_t)c * N + OUT_N + n]);
      for (int r = 0; r < RB; ++r) acc_up[r] += hs[r * C + c] * bu;
    }
  }
  for (int r = 0; r < RB; ++r) {
    const int m = m0 + r;
    if (m < M) {
      const float z = static_cast<float>(static_cast<YT>(static_cast<float>(static_cast<FT>(acc[r]))));
      const YT v = static_cast<YT>(static_cast<float>(y[(size_t)m * WIDTH + n]) + z);
      if (EPILOGUE == 0) {
        out[(size_t)m * N + n] = v;
      } else if (EPILOGUE == 1) {
        out[(size_t)m * N + n] = static_cast<YT>(static_cast<float>(res[(size_t)m * N + n]) + static_cast<float>(v));
      } else {
        const float zu = static_cast<float>(static_cast<YT>(static_cast<float>(static_cast<FT>(acc_up[r]))));
        const float g = static_cast<float>(v);
        const float u = static_cast<float>(static_cast<YT>(static_cast<float>(y[(size_t)m * WIDTH + OUT_N + n]) + zu));
        const float sig = static_cast<float>(static_cast<YT>(1.0f / (1.0f + expf(-g))));
        const float t = static_cast<float>(static_cast<YT>(g * sig));
        out[(size_t)m * OUT_N + n] = static_cast<YT>(t * u);
      }
    }
  }
"#;

/// Whether the kernels run here: MLX's default device is a CUDA GPU and `MLXD_LORA_KERNEL`
/// is not `0` (the matmuls, kept for measuring). Their bodies also run under a CPU emulation
/// of the GPU's threads in `scripts/test.sh` (`scripts/emulate_cuda_kernels.py`, equal to
/// numpy's update to float rounding).
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::wanted("MLXD_LORA_KERNEL"))
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// The shapes and dtypes the kernels serve, apart from the device: `x` `[B, L, K]` of at most
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

/// The shapes and dtypes the expand serves widened (`WIDE`), apart from the device: `yw` `[B, L, N + C]`
/// of at most [`MAX_ROWS`] rows, float16 or bfloat16; `b` `[C, N]` of a float dtype, `C` at
/// most [`MAX_RANK_COLUMNS`]; a mask `[Bm, 1, W]` whose `Bm` divides the rows and `W` times
/// `layers` makes `C`; for the epilogue, a residual `[B, L, N]` of `yw`'s dtype, or for SwiGLU
/// an even `N`.
pub fn fits_widened(
    yw: (&[i32], Dtype),
    b: (&[i32], Dtype),
    mask: (&[i32], i32),
    epilogue: Epilogue<'_>,
) -> bool {
    let ((ys, yd), (bs, bd), (ms, layers)) = (yw, b, mask);
    let (&[by, l, width], &[c, n], &[bm, 1, w]) = (ys, bs, ms) else {
        return false;
    };
    let rows = i64::from(by) * i64::from(l);
    let epilogue_fits = match epilogue {
        Epilogue::None => true,
        Epilogue::Residual(r) => r.shape() == [by, l, n] && r.dtype() == yd,
        Epilogue::SwiGlu => n % 2 == 0,
    };
    epilogue_fits
        && matches!(yd, Dtype::Float16 | Dtype::Bfloat16)
        && is_float(bd)
        && n > 0
        && width == n + c
        && (1..=i64::from(MAX_ROWS)).contains(&rows)
        && (1..=MAX_RANK_COLUMNS).contains(&c)
        && bm > 0
        && rows % i64::from(bm) == 0
        && layers > 0
        && w * layers == c
}

/// Whether [`widened_update`] serves this update here: the device and [`fits_widened`].
pub fn serves_widened(yw: &Array, b: &Array, mask: (&Array, i32), epilogue: Epilogue<'_>) -> bool {
    available()
        && fits_widened(
            (yw.shape(), yw.dtype()),
            (b.shape(), b.dtype()),
            (mask.0.shape(), mask.1),
            epilogue,
        )
}

thread_local! {
    /// The two kernels, made once per thread (the model runs on one thread), and the mask
    /// given where there is none (never read; an evaluated array adds no node to a pass),
    /// which is also the widened expand's `p` (never read either).
    static KERNELS: RefCell<Option<Kernels>> = const { RefCell::new(None) };
}

struct Kernels {
    shrink: CudaKernel,
    expand: CudaKernel,
    no_mask: Array,
}

impl Kernels {
    fn new() -> Result<Self, Exception> {
        let no_mask = Array::from_f32(1.0).reshape(&[1, 1, 1])?;
        no_mask.eval()?;
        Ok(Self {
            shrink: CudaKernel::new("mlxd_lora_shrink", &["x", "a"], &["p"], SHRINK_SOURCE, true)?,
            expand: CudaKernel::new(
                "mlxd_lora_expand",
                &["p", "b", "y", "mask", "res"],
                &["out"],
                EXPAND_SOURCE,
                true,
            )?,
            no_mask,
        })
    }
}

/// Runs `f` with this thread's kernels, made on first use.
fn with_kernels<R>(f: impl FnOnce(&Kernels) -> Result<R, Exception>) -> Result<R, Exception> {
    KERNELS.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Kernels::new()?);
        }
        f(slot.as_ref().expect("made above"))
    })
}

fn ceil_div(a: i32, b: i32) -> i32 {
    (a + b - 1) / b
}

/// The shrink's grid in blocks for `rows` rows, `in` of `k` and `c` columns of `A`: spans of
/// `in`, column tiles, row tiles.
fn shrink_blocks(rows: i32, k: i32, c: i32) -> (i32, i32, i32) {
    (
        ceil_div(k, SHRINK_SPAN),
        ceil_div(c, SHRINK_COLUMNS),
        ceil_div(rows, SHRINK_ROWS),
    )
}

/// The expand's grid in blocks for `rows` rows and `n` output columns.
fn expand_blocks(rows: i32, n: i32) -> (i32, i32) {
    (ceil_div(n, BLOCK), ceil_div(rows, EXPAND_ROWS))
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
    let (k, c, n) = (x.shape()[2], a.shape()[1], b.shape()[1]);
    with_kernels(|kernels| {
        let (spans, column_tiles, row_tiles) = shrink_blocks(rows, k, c);
        let partials = kernels.shrink.apply(
            &[x, a],
            &[OutputSpec {
                shape: vec![spans, rows, c],
                dtype: Dtype::Float32,
            }],
            &Launch {
                grid: (spans * BLOCK, column_tiles, row_tiles),
                block: (BLOCK, 1, 1),
                dtypes: &[("XT", x.dtype()), ("FT", a.dtype())],
                ints: &[
                    ("SPAN", SHRINK_SPAN),
                    ("NT", BLOCK),
                    ("CT", SHRINK_COLUMNS),
                    ("MR", SHRINK_ROWS),
                ],
            },
        )?;
        let partials = partials
            .first()
            .ok_or_else(|| Exception::custom("the LoRA shrink kernel gave no output"))?;
        let (mask, has_mask) = match mask {
            Some((m, _)) => (m, 1),
            None => (&kernels.no_mask, 0),
        };
        let (column_blocks, row_blocks) = expand_blocks(rows, n);
        let out = kernels.expand.apply(
            &[partials, b, y, mask, &kernels.no_mask],
            &[OutputSpec {
                shape: y.shape().to_vec(),
                dtype: y.dtype(),
            }],
            &Launch {
                grid: (column_blocks * BLOCK, row_blocks, 1),
                block: (BLOCK, 1, 1),
                dtypes: &[("FT", a.dtype()), ("YT", y.dtype()), ("MT", mask.dtype())],
                ints: &[
                    ("HAS_MASK", has_mask),
                    ("WIDE", 0),
                    ("EPILOGUE", 0),
                    ("MAX_C", MAX_RANK_COLUMNS),
                    ("RB", EXPAND_ROWS),
                ],
            },
        )?;
        out.into_iter()
            .next()
            .ok_or_else(|| Exception::custom("the LoRA expand kernel gave no output"))
    })
}

/// The expand alone (`WIDE`): `yw`'s first `N` columns plus `cast(((x @ A) * mask) @ b)`,
/// `x @ A` being `yw`'s last `C` columns (`b` `[C, N]`; the mask `[Bm, 1, W]` for `layers`
/// blocks of `W` columns), then `epilogue`. Call only where [`serves_widened`] said yes.
pub fn widened_update(
    yw: &Array,
    b: &Array,
    mask: (&Array, i32),
    epilogue: Epilogue<'_>,
) -> Result<Array, Exception> {
    let (rows, n) = (yw.shape()[0] * yw.shape()[1], b.shape()[1]);
    let mask = mask.0;
    let (code, out_n) = match epilogue {
        Epilogue::None => (0, n),
        Epilogue::Residual(_) => (1, n),
        Epilogue::SwiGlu => (2, n / 2),
    };
    with_kernels(|kernels| {
        let res = match epilogue {
            Epilogue::Residual(r) => r,
            Epilogue::None | Epilogue::SwiGlu => &kernels.no_mask,
        };
        let (column_blocks, row_blocks) = expand_blocks(rows, out_n);
        let out = kernels.expand.apply(
            &[&kernels.no_mask, b, yw, mask, res],
            &[OutputSpec {
                shape: vec![yw.shape()[0], yw.shape()[1], out_n],
                dtype: yw.dtype(),
            }],
            &Launch {
                grid: (column_blocks * BLOCK, row_blocks, 1),
                block: (BLOCK, 1, 1),
                dtypes: &[("FT", b.dtype()), ("YT", yw.dtype()), ("MT", mask.dtype())],
                ints: &[
                    ("HAS_MASK", 1),
                    ("WIDE", 1),
                    ("EPILOGUE", code),
                    ("MAX_C", MAX_RANK_COLUMNS),
                    ("RB", EXPAND_ROWS),
                ],
            },
        )?;
        out.into_iter()
            .next()
            .ok_or_else(|| Exception::custom("the widened LoRA expand kernel gave no output"))
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
    fn the_widened_expand_takes_decode_sized_products_that_carry_c_more_columns() {
        // q/k/v (3 072 outputs) over four adapters of rank 8: 96 more columns.
        let yw: &[i32] = &[32, 1, 3072 + 96];
        let b: &[i32] = &[96, 3072];
        assert!(fits_widened(
            (yw, BF),
            (b, F32),
            (&[32, 1, 32], 3),
            Epilogue::None
        ));
        assert!(fits_widened(
            (yw, BF),
            (b, BF),
            (&[1, 1, 32], 3),
            Epilogue::None
        ));
        // Columns that do not add up, a mask that does not make C or divide the rows.
        assert!(!fits_widened(
            (&[32, 1, 3072 + 95], BF),
            (b, F32),
            (&[32, 1, 32], 3),
            Epilogue::None
        ));
        assert!(!fits_widened(
            (yw, BF),
            (b, F32),
            (&[32, 1, 30], 3),
            Epilogue::None
        ));
        assert!(!fits_widened(
            (yw, BF),
            (b, F32),
            (&[5, 1, 32], 3),
            Epilogue::None
        ));
        // A float32 product, a prefill pass of many tokens, too many factor columns.
        assert!(!fits_widened(
            (yw, F32),
            (b, F32),
            (&[32, 1, 32], 3),
            Epilogue::None
        ));
        assert!(!fits_widened(
            (&[4, 512, 3168], BF),
            (b, F32),
            (&[4, 1, 32], 3),
            Epilogue::None
        ));
        assert!(!fits_widened(
            (&[32, 1, 3072 + 600], BF),
            (&[600, 3072], F32),
            (&[32, 1, 200], 3),
            Epilogue::None
        ));
        // A residual of the output's shape and dtype; SwiGLU halves an even N.
        let mask: (&[i32], i32) = (&[32, 1, 32], 3);
        let residual =
            |shape: &[i32], dtype| Array::zeros::<f32>(shape).unwrap().as_dtype(dtype).unwrap();
        let res = residual(&[32, 1, 3072], BF);
        assert!(fits_widened(
            (yw, BF),
            (b, F32),
            mask,
            Epilogue::Residual(&res)
        ));
        let wide = residual(yw, BF);
        assert!(!fits_widened(
            (yw, BF),
            (b, F32),
            mask,
            Epilogue::Residual(&wide)
        ));
        let res32 = residual(&[32, 1, 3072], F32);
        assert!(!fits_widened(
            (yw, BF),
            (b, F32),
            mask,
            Epilogue::Residual(&res32)
        ));
        assert!(fits_widened((yw, BF), (b, F32), mask, Epilogue::SwiGlu));
        let odd: (&[i32], &[i32]) = (&[32, 1, 3071 + 96], &[96, 3071]);
        assert!(fits_widened(
            (odd.0, BF),
            (odd.1, F32),
            mask,
            Epilogue::None
        ));
        assert!(!fits_widened(
            (odd.0, BF),
            (odd.1, F32),
            mask,
            Epilogue::SwiGlu
        ));
    }

    #[test]
    fn the_long_axis_spreads_over_blocks_and_every_row_and_column_has_one() {
        // q/k/v of four adapters (C = 96) over 2 048 inputs, 32 rows: 16 spans × 3 tiles.
        assert_eq!(shrink_blocks(32, 2048, 96), (16, 3, 1));
        // down's 8 192 inputs: 64 spans; an `in` off the span and a C off the tile round up.
        assert_eq!(shrink_blocks(32, 8192, 32), (64, 1, 1));
        assert_eq!(shrink_blocks(33, 300, 20), (3, 1, 2));
        assert_eq!(shrink_blocks(1, 64, 8), (1, 1, 1));
        assert_eq!(shrink_blocks(MAX_ROWS, 2048, MAX_RANK_COLUMNS), (16, 16, 8));
        // The expand: a block per 256 output columns and per 8 rows.
        assert_eq!(expand_blocks(32, 3072), (12, 4));
        assert_eq!(expand_blocks(1, 2048), (8, 1));
        assert_eq!(expand_blocks(13, 257), (2, 2));
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
