//! Decode attention as two CUDA kernels that read the KV cache in place, packed or plain.
//!
//! MLX 0.32's fused attention has no quantized variant, and its quantized matmuls refuse the
//! cache's views on CUDA (BENCHMARKS.md, "quantized KV attention on CUDA"), so the cache was
//! dequantized every step: 8-bit KV at 16k then read its keys and values once packed and
//! wrote and read them again in bf16. Here a decode query attends straight over the packed
//! cache, split over the positions as flash-decoding does:
//!
//! 1. `split`: a block owns one row, one KV head (all of its query heads, so each key is read
//!    once) and one span of positions. A lane dequantizes a few whole words of a key and a
//!    value (8 elements at 4 and 8 bits), so a few lanes cover a position and each warp walks
//!    several positions at once (four at head width 64), summing a dot product over those
//!    lanes only; the running softmax is float32. The position groups merge by shuffles, the
//!    warps in shared memory, and the result is written per span.
//! 2. `merge`: one thread per output element merges the spans' partial sums.
//!
//! **A plain cache takes the same kernels over long contexts** (the split's walk reads 8
//! elements a lane instead of dequantizing them, [`PLAIN_LOAD`]). MLX's own decode kernel reads
//! the keys and values once per query head, which at many rows over thousands of positions
//! costs four to five times what reading them once per KV head does; below
//! [`PLAIN_MIN_POSITIONS`] and at one row ([`PLAIN_MIN_ROWS`]) it stays MLX's, unless the pass
//! has an array mask (rows at different positions), which MLX's vector kernel refuses
//! ([`plain_threshold`]).
//!
//! The cache's views are read in place through their strides (no copy of a sliced buffer).
//! `scripts/emulate_cuda_kernels.py` runs both bodies on the CPU under a SIMT emulation against
//! numpy's attention (a `scripts/test.sh` phase); `examples/decode_attention_check.rs` checks
//! and times them on a GPU. Off CUDA, for other shapes, or with `MLXD_QUANT_ATTENTION=0` (packed:
//! the dequantizing path) or `MLXD_PLAIN_DECODE_ATTENTION=0` (plain: MLX's attention), the
//! caller runs MLX's fused attention as before.
use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cache::Mask;
use crate::cache::{KvQuant, Stored};
use crate::cuda_kernel::{CudaKernel, Launch, OutputSpec};

/// Threads per block of the split kernel: four warps.
const SPLIT_BLOCK: i32 = 128;
/// Threads per block of the merge kernel.
const MERGE_BLOCK: i32 = 128;
/// The most floats a block's query heads hold per warp (`heads per KV head × head_dim`): four
/// warps' partial outputs must fit a block's 48 KB of static shared memory.
const MAX_GROUP_ELEMENTS: i32 = 2048;
/// Positions a block walks at most; more spans beyond this many positions per span.
const MAX_SPAN: i32 = 1024;
/// Positions a block walks at least (eight per warp), however few blocks that makes.
const MIN_SPAN: i32 = 32;
/// Blocks worth launching at least: two per multiprocessor of a large GPU. More spans than
/// that cost more in the merge than they gain (an H100 at one row and 16k positions: 0.16 ms
/// with 32 spans, 0.19 ms with 128, 0.37 ms with 512; `decode_attention_check`).
const MIN_BLOCKS: i32 = 256;

/// The split kernel's body is put together from pieces ([`split_source`]): [`SPLIT_PROLOGUE`],
/// the cache's rows ([`PACKED_ROWS`] or [`PLAIN_ROWS`]), [`SPLIT_WALK`] over the span's
/// positions, the load of a position's key and value ([`PACKED_LOAD`] or [`PLAIN_LOAD`]), and
/// [`SPLIT_EPILOGUE`], which closes the walk's loop. Inputs: `q` `[B, H, 1, D]`; the cache's
/// keys and values (the walk's); `mask` `[B | 1, 1, 1, T]` (bool, read only with `HAS_MASK`).
/// Outputs per `(b, h, span)`: the partial output `acc` `[B, H, S, D]` (float32, not
/// normalized), the running maximum `m` and the sum `l` `[B, H, S]`. Grid: `(S × 128, Hkv, B)`
/// threads.
///
/// A lane holds `EPL` consecutive elements of a head (packed: whole 32-bit words, all in one
/// quantization group), so `LP = D / EPL` lanes cover a position and a warp walks `32 / LP`
/// positions at once: a key's dot product is summed over `LP` lanes (`log2(LP)` shuffles), not
/// 32. Each group of `LP` lanes keeps its own running softmax; the groups of a warp merge by
/// shuffles at the end, then the warps in shared memory.
///
/// The start: indices, this lane's slice of its query heads (scaled) and its running softmax.
const SPLIT_PROLOGUE: &str = r#"
  constexpr int WARPS = 4;
  constexpr int LP = D / EPL;
  constexpr int PPW = 32 / LP;
  const float scale = __int_as_float(SCALE_BITS);
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int span = blockIdx.x;
  const int spans = gridDim.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int kv_heads = gridDim.y;
  const int heads = kv_heads * R;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // This lane's slice of the head (`sub`) and its position among the warp's `PPW` (`slot`).
  const int sub = lane % LP;
  const int slot = lane / LP;
  const int i0 = sub * EPL;

  float qv[R][EPL];
  for (int r = 0; r < R; ++r) {
    const int h = hk * R + r;
    for (int e = 0; e < EPL; ++e) {
      qv[r][e] = static_cast<float>(
          q[b * q_strides[0] + h * q_strides[1] + (i0 + e) * q_strides[3]]) * scale;
    }
  }
  float m[R];
  float l[R];
  float acc[R][EPL];
  for (int r = 0; r < R; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.0f;
    for (int e = 0; e < EPL; ++e) {
      acc[r][e] = 0.0f;
    }
  }

"#;

/// A packed cache's rows: `kw`, `vw` `[B, Hkv, T, W]` (uint32 words), `ks`, `kb`, `vs`, `vb`
/// `[B, Hkv, T, D / GS]` (scales and biases), each read through its own strides.
const PACKED_ROWS: &str = r#"
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = EPL / PER_WORD;
  constexpr unsigned int LOW = (1u << BITS) - 1u;
  const int word0 = i0 / PER_WORD;
  const int g = i0 / GS;
  const int T = kw_shape[2];
  const int64_t k_row = b * kw_strides[0] + hk * kw_strides[1];
  const int64_t ks_row = b * ks_strides[0] + hk * ks_strides[1];
  const int64_t kb_row = b * kb_strides[0] + hk * kb_strides[1];
  const int64_t v_row = b * vw_strides[0] + hk * vw_strides[1];
  const int64_t vs_row = b * vs_strides[0] + hk * vs_strides[1];
  const int64_t vb_row = b * vb_strides[0] + hk * vb_strides[1];
"#;

/// A plain cache's rows: `k`, `v` `[B, Hkv, T, D]` in any float dtype, each read through its
/// own strides.
const PLAIN_ROWS: &str = r#"
  const int T = k_shape[2];
  const int64_t k_row = b * k_strides[0] + hk * k_strides[1];
  const int64_t v_row = b * v_strides[0] + hk * v_strides[1];
"#;

/// The walk over this span's positions, up to loading a visible position's key and value.
const SPLIT_WALK: &str = r#"
  const int per_span = (T + spans - 1) / spans;
  const int start = span * per_span;
  const int end = min(T, start + per_span);
  // A mask of one row applies to every row.
  const int64_t mask_row = mask_shape[0] == 1 ? 0 : b * mask_strides[0];
  // Every lane runs every iteration (the shuffles need the whole warp); a lane whose position
  // is past the span or masked out reads nothing and keeps its state.
#pragma unroll 2
  for (int base = start + warp * PPW; base < end; base += WARPS * PPW) {
    const int t = base + slot;
    const bool valid = t < end && (!HAS_MASK || mask[mask_row + t * mask_strides[3]]);
    float kval[EPL];
    float vval[EPL];
    if (valid) {
"#;

/// A packed position: a lane dequantizes `EPL` elements of its key and its value.
const PACKED_LOAD: &str = r#"
      const float k_scale = static_cast<float>(ks[ks_row + t * ks_strides[2] + g * ks_strides[3]]);
      const float k_bias = static_cast<float>(kb[kb_row + t * kb_strides[2] + g * kb_strides[3]]);
      const float v_scale = static_cast<float>(vs[vs_row + t * vs_strides[2] + g * vs_strides[3]]);
      const float v_bias = static_cast<float>(vb[vb_row + t * vb_strides[2] + g * vb_strides[3]]);
      for (int w = 0; w < WORDS; ++w) {
        const unsigned int kword = kw[k_row + t * kw_strides[2] + (word0 + w) * kw_strides[3]];
        const unsigned int vword = vw[v_row + t * vw_strides[2] + (word0 + w) * vw_strides[3]];
        for (int j = 0; j < PER_WORD; ++j) {
          kval[w * PER_WORD + j] = k_scale * static_cast<float>((kword >> (j * BITS)) & LOW) + k_bias;
          vval[w * PER_WORD + j] = v_scale * static_cast<float>((vword >> (j * BITS)) & LOW) + v_bias;
        }
      }
"#;

/// A plain position: a lane reads `EPL` elements of its key and its value.
const PLAIN_LOAD: &str = r#"
      const int64_t kt = k_row + t * k_strides[2] + i0 * k_strides[3];
      const int64_t vt = v_row + t * v_strides[2] + i0 * v_strides[3];
      for (int e = 0; e < EPL; ++e) {
        kval[e] = static_cast<float>(k[kt + e * k_strides[3]]);
        vval[e] = static_cast<float>(v[vt + e * v_strides[3]]);
      }
"#;

/// The end of the split kernel: a hidden position's zeros, each position's score and softmax
/// update (closing the walk's loop), then the merges of the lanes' and the warps' states into
/// one partial result per span.
const SPLIT_EPILOGUE: &str = r#"
    } else {
      for (int e = 0; e < EPL; ++e) {
        kval[e] = 0.0f;
        vval[e] = 0.0f;
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int e = 0; e < EPL; ++e) {
        s += qv[r][e] * kval[e];
      }
      for (int offset = LP / 2; offset > 0; offset /= 2) {
        s += __shfl_xor_sync(0xffffffffu, s, offset);
      }
      if (valid) {
        const float top = fmaxf(m[r], s);
        const float keep = expf(m[r] - top);
        const float p = expf(s - top);
        l[r] = l[r] * keep + p;
        for (int e = 0; e < EPL; ++e) {
          acc[r][e] = acc[r][e] * keep + p * vval[e];
        }
        m[r] = top;
      }
    }
  }
  // The warp's position groups merge: lanes of one `sub` across the slots.
  for (int offset = LP; offset < 32; offset *= 2) {
    for (int r = 0; r < R; ++r) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[r], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[r], offset);
      const float top = fmaxf(m[r], m_other);
      const float mine = m[r] == NEG_INF ? 0.0f : expf(m[r] - top);
      const float theirs = m_other == NEG_INF ? 0.0f : expf(m_other - top);
      for (int e = 0; e < EPL; ++e) {
        const float a_other = __shfl_xor_sync(0xffffffffu, acc[r][e], offset);
        acc[r][e] = acc[r][e] * mine + a_other * theirs;
      }
      l[r] = l[r] * mine + l_other * theirs;
      m[r] = top;
    }
  }

  __shared__ float warp_m[WARPS][R];
  __shared__ float warp_l[WARPS][R];
  __shared__ float warp_acc[WARPS][R * D];
  if (slot == 0) {
    for (int r = 0; r < R; ++r) {
      if (lane == 0) {
        warp_m[warp][r] = m[r];
        warp_l[warp][r] = l[r];
      }
      for (int e = 0; e < EPL; ++e) {
        warp_acc[warp][r * D + i0 + e] = acc[r][e];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
    const int r = idx / D;
    const int i = idx % D;
    float top = NEG_INF;
    for (int w = 0; w < WARPS; ++w) {
      top = fmaxf(top, warp_m[w][r]);
    }
    float sum = 0.0f;
    float out = 0.0f;
    if (top != NEG_INF) {
      for (int w = 0; w < WARPS; ++w) {
        const float f = expf(warp_m[w][r] - top);
        sum += warp_l[w][r] * f;
        out += warp_acc[w][idx] * f;
      }
    }
    const int h = hk * R + r;
    const int64_t n = (static_cast<int64_t>(b) * heads + h) * spans + span;
    part_acc[n * D + i] = out;
    if (i == 0) {
      part_m[n] = top;
      part_l[n] = sum;
    }
  }
"#;

/// The merge kernel's body: `part_acc` `[B, H, S, D]`, `part_m`, `part_l` `[B, H, S]` →
/// `out` `[B, H, 1, D]` in `OutT`; a row with no visible position gives zeros.
const MERGE_SOURCE: &str = r#"
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int spans = part_m_shape[2];
  const int64_t total = static_cast<int64_t>(part_m_shape[0]) * part_m_shape[1] * D;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) {
    return;
  }
  const int64_t n = idx / D;
  const int i = idx % D;
  float top = NEG_INF;
  for (int s = 0; s < spans; ++s) {
    top = fmaxf(top, part_m[n * spans + s]);
  }
  float sum = 0.0f;
  float value = 0.0f;
  if (top != NEG_INF) {
    for (int s = 0; s < spans; ++s) {
      const float f = expf(part_m[n * spans + s] - top);
      sum += part_l[n * spans + s] * f;
      value += part_acc[(n * spans + s) * D + i] * f;
    }
  }
  out[idx] = static_cast<OutT>(sum > 0.0f ? value / sum : 0.0f);
"#;

/// Whether the kernels run over packed caches here: MLX's default device is a CUDA GPU, and
/// the dequantizing path was not asked for (`MLXD_QUANT_ATTENTION=0`).
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::wanted("MLXD_QUANT_ATTENTION"))
}

/// The fewest positions at which a decode step over a plain cache takes these kernels rather
/// than MLX's own vector kernel, unless `MLXD_PLAIN_DECODE_ATTENTION` says otherwise.
///
/// MLX's kernel reads the keys and values once per query head; these once per KV head. On an
/// H100 (32 query heads over 8 KV heads, bf16, `decode_attention_check --plain`), one layer's
/// call at head width 64 took 0.18 ms against MLX's 0.77 at 64 rows over 1 024 positions,
/// 0.40 against 1.80 over 3 128, 0.79 against 4.13 over 8 000, and 0.28 against 1.11 at 8
/// rows over 16 384; the engine core decoded 64 rows over 3 000-token prompts at 7.5k tok/s
/// against 2.0k (BENCHMARKS.md, session 43). Shorter contexts were not measured with these
/// kernels; there MLX's kernel is fast (0.12 ms at 32 rows over 300) and the merge is a second
/// graph node a step pays for on the host.
const PLAIN_MIN_POSITIONS: i32 = 1024;

/// The fewest positions at which decode over a plain cache takes these kernels on this
/// machine, or `None` where they never do: off a CUDA GPU, or with
/// `MLXD_PLAIN_DECODE_ATTENTION=0`. Another number sets the threshold (for measuring); a value
/// that is not a number is reported once and the default kept.
fn plain_min_positions() -> Option<i32> {
    static MIN: OnceLock<Option<i32>> = OnceLock::new();
    *MIN.get_or_init(|| {
        const SWITCH: &str = "MLXD_PLAIN_DECODE_ATTENTION";
        if !crate::cuda_kernel::wanted(SWITCH) {
            return None;
        }
        match std::env::var(SWITCH) {
            Err(_) => Some(PLAIN_MIN_POSITIONS),
            Ok(v) => match v.parse::<i32>() {
                Ok(n) if n > 0 => Some(n),
                _ => {
                    tracing::warn!(
                        "{SWITCH}={v:?} is not a positive number of positions (0 turns the \
                         kernels off); using {PLAIN_MIN_POSITIONS}"
                    );
                    Some(PLAIN_MIN_POSITIONS)
                }
            },
        }
    })
}

/// The fewest rows for which a plain cache takes these kernels. At one row MLX's kernel was
/// the faster (0.067 against 0.092 ms over 4 096 positions, 0.097 against 0.11 over 16 384):
/// its cost grows with the rows and these kernels' far less (8 rows over 16 384: 1.11 against
/// 0.28 ms), so from two rows on these read less.
const PLAIN_MIN_ROWS: i32 = 2;

thread_local! {
    /// Set while the engine warms up ([`warming_up`]).
    static WARMING_UP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a plain cache takes these kernels on this machine (from some number of positions).
pub fn serves_plain_caches() -> bool {
    plain_min_positions().is_some()
}

/// Runs `f` (the engine's warm-up) with the plain-cache kernels taking every pass of two or
/// more rows whatever its length, so that MLX compiles them, for this model's head shapes and
/// scale, before the engine reports ready: the warm-up's prompts are far shorter than
/// [`PLAIN_MIN_POSITIONS`], and the first long context would otherwise compile them in the
/// middle of a request (on an H100 where they had never run, a 64-row decode over 3 000
/// positions took more than 20 s longer the first time). Does nothing where the kernels are off.
pub fn warming_up<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            WARMING_UP.with(|w| w.set(false));
        }
    }
    WARMING_UP.with(|w| w.set(true));
    let _reset = Reset;
    f()
}

/// Elements of a head one lane holds: whole 32-bit words of the packed cache, at least 8 (a
/// plain cache: 8).
fn elements_per_lane(quant: Option<KvQuant>) -> i32 {
    quant.map_or(8, |q| (32 / q.bits).max(8))
}

/// The most `heads per KV head × elements per lane` a lane holds (its queries and partial
/// outputs stay in registers).
const MAX_LANE_ELEMENTS: i32 = 64;

/// The query and head shapes the kernels serve with `epl` elements a lane: one query; a head
/// width that a power of two of lanes (up to a warp) covers; query heads grouped evenly over
/// the KV heads, few enough that a lane's registers and a block's shared memory hold their
/// partial outputs.
fn heads_fit(queries: &[i32], kv_heads: i32, epl: i32) -> bool {
    let [_, heads, l, d] = queries else {
        return false;
    };
    let (heads, l, d) = (*heads, *l, *d);
    if l != 1 || kv_heads <= 0 || heads % kv_heads != 0 {
        return false;
    }
    let lanes = d / epl;
    let group = heads / kv_heads;
    d % epl == 0
        && lanes > 0
        && lanes <= 32
        && (lanes & (lanes - 1)) == 0
        && group * epl <= MAX_LANE_ELEMENTS
        && group * d <= MAX_GROUP_ELEMENTS
}

/// The packed shapes the kernels serve, apart from the device: keys and values quantized alike
/// with 2, 4 or 8 bits (a whole number of elements per 32-bit word) in groups that split
/// `head_dim` and hold whole lanes' slices, and [`heads_fit`].
pub(crate) fn fits_packed(
    queries: &[i32],
    kv_heads: i32,
    keys: Option<KvQuant>,
    values: Option<KvQuant>,
) -> bool {
    let (Some(kq), Some(vq)) = (keys, values) else {
        return false;
    };
    let Some(&d) = queries.last() else {
        return false;
    };
    let epl = elements_per_lane(Some(kq));
    kq == vq
        && matches!(kq.bits, 2 | 4 | 8)
        && kq.group_size > 0
        && kq.group_size % epl == 0
        && d % kq.group_size == 0
        && heads_fit(queries, kv_heads, epl)
}

/// The plain shapes the kernels serve, apart from the device: at least [`PLAIN_MIN_ROWS`] rows
/// of keys and values `[B, Hkv, T, D]` as wide as the queries, in a float dtype, over at least
/// `min_positions` positions, and [`heads_fit`].
pub(crate) fn fits_plain(
    queries: &[i32],
    keys: (&[i32], Dtype),
    values: (&[i32], Dtype),
    min_positions: i32,
) -> bool {
    let is_float = |d: Dtype| matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16);
    let (&[b, kv_heads, t, dk], &[vb, vh, vt, dv]) = (keys.0, values.0) else {
        return false;
    };
    queries.first() == Some(&b)
        && b >= PLAIN_MIN_ROWS
        && (vb, vh, vt) == (b, kv_heads, t)
        && queries.last() == Some(&dk)
        && dv == dk
        && is_float(keys.1)
        && is_float(values.1)
        && t >= min_positions
        && heads_fit(queries, kv_heads, elements_per_lane(None))
}

/// The fewest positions at which a plain pass takes the kernels, given the unmasked
/// threshold `min`: one while warming up, and one for a pass with an array mask (rows at
/// different positions, as every served batch of different prompts has). MLX 0.32's CUDA
/// vector kernel refuses an array mask (`supports_sdpa_vector`), so a masked decode step does
/// not get MLX's fast kernel but its unfused fallback: a score matmul, the mask, a softmax and
/// a second matmul per layer, each its own graph node and launch, where the kernels are two.
/// On an H100 the engine core's 32 ragged rows decoded 23–26% faster this way and a served
/// 32-stream step fell from ~5.0 to ~4.2 ms (BENCHMARKS.md, session 49); unmasked passes
/// below the threshold keep MLX's kernel, the faster there.
fn plain_threshold(min: i32, masked: bool, warming_up: bool) -> i32 {
    if masked || warming_up {
        1
    } else {
        min
    }
}

/// Whether [`decode`] serves this pass here: a packed cache ([`fits_packed`], keys and values
/// as wide as the queries: the kernels read one head width for all three), or a plain one over
/// enough positions ([`fits_plain`], [`plain_min_positions`], [`plain_threshold`]); `masked`:
/// the pass has an array mask.
pub fn serves(queries: &Array, keys: &Stored, values: &Stored, masked: bool) -> bool {
    let (k, v) = (keys.arrays()[0], values.arrays()[0]);
    match (keys.quant(), values.quant()) {
        (None, None) => plain_min_positions().is_some_and(|min| {
            let min = plain_threshold(min, masked, WARMING_UP.with(|w| w.get()));
            fits_plain(
                queries.shape(),
                (k.shape(), k.dtype()),
                (v.shape(), v.dtype()),
                min,
            )
        }),
        (kq, vq) => {
            let packed_width = |q: KvQuant| queries.shape().last().map(|d| d * q.bits / 32);
            available()
                && fits_packed(queries.shape(), k.shape()[1], kq, vq)
                && kq.and_then(packed_width) == k.shape().last().copied()
                && k.shape().last() == v.shape().last()
        }
    }
}

/// How many spans a row's `positions` are split into, for `rows × kv_heads` blocks per span:
/// spans of at most [`MAX_SPAN`] positions, more while fewer than [`MIN_BLOCKS`] blocks, but
/// no span under [`MIN_SPAN`] positions.
pub fn spans(positions: i32, rows: i32, kv_heads: i32) -> i32 {
    let ceil = |a: i32, b: i32| (a + b - 1) / b;
    let blocks_per_span = (rows * kv_heads).max(1);
    let wanted = ceil(positions, MAX_SPAN).max(ceil(MIN_BLOCKS, blocks_per_span));
    wanted.min(ceil(positions, MIN_SPAN)).max(1)
}

/// The split kernel's whole body over a packed or a plain cache.
fn split_source(packed: bool) -> String {
    let (rows, load) = if packed {
        (PACKED_ROWS, PACKED_LOAD)
    } else {
        (PLAIN_ROWS, PLAIN_LOAD)
    };
    [SPLIT_PROLOGUE, rows, SPLIT_WALK, load, SPLIT_EPILOGUE].concat()
}

/// The kernels, made once per thread (the model runs on one thread).
struct Kernels {
    packed_split: CudaKernel,
    plain_split: CudaKernel,
    merge: CudaKernel,
}

impl Kernels {
    fn new() -> Result<Self, Exception> {
        let split = |name: &str, kv: &[&str], packed: bool| {
            let inputs: Vec<&str> = ["q"]
                .into_iter()
                .chain(kv.iter().copied())
                .chain(["mask"])
                .collect();
            CudaKernel::new(
                name,
                &inputs,
                &["part_acc", "part_m", "part_l"],
                &split_source(packed),
                false,
            )
        };
        Ok(Self {
            packed_split: split(
                "mlxd_quant_attention_split",
                &["kw", "ks", "kb", "vw", "vs", "vb"],
                true,
            )?,
            plain_split: split("mlxd_plain_attention_split", &["k", "v"], false)?,
            merge: CudaKernel::new(
                "mlxd_decode_attention_merge",
                &["part_acc", "part_m", "part_l"],
                &["out"],
                MERGE_SOURCE,
                true,
            )?,
        })
    }
}

thread_local! {
    static KERNELS: RefCell<Option<Kernels>> = const { RefCell::new(None) };
}

/// Attention of one query per row over the cache's `keys` and `values` (`[B, kv_heads, T, ·]`
/// views, packed or plain), `queries` `[B, heads, 1, D]` scaled by `scale`, positions hidden
/// by `mask` (`[B, 1, 1, T]`, true = attend) left out → `[B, heads, 1, D]` in the queries'
/// dtype. Call only where [`serves`] said yes.
pub fn decode(
    queries: &Array,
    keys: &Stored,
    values: &Stored,
    scale: f32,
    mask: &Mask,
) -> Result<Array, Exception> {
    let (rows, kv_heads, positions) = {
        let k = keys.arrays()[0].shape();
        (k[0], k[1], k[2])
    };
    decode_in_spans(
        queries,
        keys,
        values,
        scale,
        mask,
        spans(positions, rows, kv_heads),
    )
}

/// [`decode`] with the positions split into `spans` spans (the benchmark's tuning knob).
pub fn decode_in_spans(
    queries: &Array,
    keys: &Stored,
    values: &Stored,
    scale: f32,
    mask: &Mask,
    spans: i32,
) -> Result<Array, Exception> {
    let quant = keys.quant();
    if quant != values.quant() {
        return Err(Exception::custom(
            "decode attention over keys and values stored differently",
        ));
    }
    let cache: Vec<&Array> = match (keys.packed(), values.packed()) {
        (Some([kw, ks, kb]), Some([vw, vs, vb])) => vec![kw, ks, kb, vw, vs, vb],
        _ => vec![keys.arrays()[0], values.arrays()[0]],
    };
    let (b, heads, d) = (queries.shape()[0], queries.shape()[1], queries.shape()[3]);
    let (kv_heads, positions) = (cache[0].shape()[1], cache[0].shape()[2]);
    let spans = spans.clamp(1, positions.max(1));
    let (mask, has_mask) = match mask {
        // One query: causal hides nothing. The kernel never reads this placeholder.
        Mask::None | Mask::Causal => (Array::from_bool(true).reshape(&[1, 1, 1, 1])?, 0),
        Mask::Array(m) => (m.as_dtype(Dtype::Bool)?, 1),
    };
    let scale_bits = scale.to_bits() as i32;
    let mut ints = vec![
        ("D", d),
        ("R", heads / kv_heads),
        ("EPL", elements_per_lane(quant)),
        ("HAS_MASK", has_mask),
        ("SCALE_BITS", scale_bits),
    ];
    if let Some(q) = quant {
        ints.extend([("BITS", q.bits), ("GS", q.group_size)]);
    }
    KERNELS.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Kernels::new()?);
        }
        let kernels = slot.as_ref().expect("made above");
        let split = if quant.is_some() {
            &kernels.packed_split
        } else {
            &kernels.plain_split
        };
        let inputs: Vec<&Array> = std::iter::once(queries)
            .chain(cache.iter().copied())
            .chain(std::iter::once(&mask))
            .collect();
        let parts = split.apply(
            &inputs,
            &[
                OutputSpec {
                    shape: vec![b, heads, spans, d],
                    dtype: Dtype::Float32,
                },
                OutputSpec {
                    shape: vec![b, heads, spans],
                    dtype: Dtype::Float32,
                },
                OutputSpec {
                    shape: vec![b, heads, spans],
                    dtype: Dtype::Float32,
                },
            ],
            &Launch {
                grid: (spans * SPLIT_BLOCK, kv_heads, b),
                block: (SPLIT_BLOCK, 1, 1),
                dtypes: &[],
                ints: &ints,
            },
        )?;
        let out = kernels.merge.apply(
            &[&parts[0], &parts[1], &parts[2]],
            &[OutputSpec {
                shape: vec![b, heads, 1, d],
                dtype: queries.dtype(),
            }],
            &Launch {
                grid: (b * heads * d, 1, 1),
                block: (MERGE_BLOCK, 1, 1),
                dtypes: &[("OutT", queries.dtype())],
                ints: &[("D", d)],
            },
        )?;
        out.into_iter()
            .next()
            .ok_or_else(|| Exception::custom("the merge kernel gave no output"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::gpu_backend;
    use mlxd_protocol::control::Backend;

    use crate::cache::stored::Q8;

    #[test]
    fn the_kernels_take_one_query_over_keys_and_values_quantized_alike() {
        let q = [4, 32, 1, 128];
        assert!(fits_packed(&q, 8, Some(Q8), Some(Q8)));
        let q4 = KvQuant { bits: 4, ..Q8 };
        assert!(fits_packed(&q, 8, Some(q4), Some(q4)));
        // Prefill, plain sides, sides quantized differently.
        assert!(!fits_packed(&[4, 32, 2, 128], 8, Some(Q8), Some(Q8)));
        assert!(!fits_packed(&q, 8, None, Some(Q8)));
        assert!(!fits_packed(&q, 8, Some(Q8), Some(q4)));
        // Bits that straddle 32-bit words, groups that do not split the head.
        let q3 = KvQuant { bits: 3, ..Q8 };
        assert!(!fits_packed(&q, 8, Some(q3), Some(q3)));
        let g48 = KvQuant {
            group_size: 48,
            ..Q8
        };
        assert!(!fits_packed(&q, 8, Some(g48), Some(g48)));
        // Heads the lanes cannot share evenly, or too many query heads per KV head.
        assert!(!fits_packed(&[1, 8, 1, 80], 8, Some(Q8), Some(Q8)));
        assert!(!fits_packed(&[1, 64, 1, 256], 4, Some(Q8), Some(Q8)));
        assert!(!fits_packed(&[1, 30, 1, 128], 8, Some(Q8), Some(Q8)));
        // The 1B shape (head width 64: eight lanes a position), 2 bits in groups of 32.
        assert!(fits_packed(&[4, 32, 1, 64], 8, Some(Q8), Some(Q8)));
        let q2 = KvQuant {
            bits: 2,
            group_size: 32,
        };
        assert!(fits_packed(&[4, 32, 1, 64], 8, Some(q2), Some(q2)));
        // Sixteen query heads per KV head: more partial outputs than a lane's registers hold.
        assert!(!fits_packed(&[1, 64, 1, 64], 4, Some(Q8), Some(Q8)));
    }

    #[test]
    fn a_plain_cache_takes_the_kernels_over_enough_positions_as_wide_as_the_queries() {
        const BF: Dtype = Dtype::Bfloat16;
        let q = [64, 32, 1, 64];
        let kv: &[i32] = &[64, 8, 3128, 64];
        assert!(fits_plain(&q, (kv, BF), (kv, BF), 1024));
        assert!(fits_plain(
            &q,
            (kv, Dtype::Float16),
            (kv, Dtype::Float16),
            1024
        ));
        // Too few positions for the threshold, or one row: MLX's own kernel.
        assert!(!fits_plain(&q, (kv, BF), (kv, BF), 4096));
        let one: &[i32] = &[1, 8, 3128, 64];
        assert!(!fits_plain(&[1, 32, 1, 64], (one, BF), (one, BF), 1024));
        let two: &[i32] = &[2, 8, 3128, 64];
        assert!(fits_plain(&[2, 32, 1, 64], (two, BF), (two, BF), 1024));
        // Prefill, integer caches, values of another width (latent attention), other rows.
        assert!(!fits_plain(&[64, 32, 2, 64], (kv, BF), (kv, BF), 1));
        assert!(!fits_plain(&q, (kv, Dtype::Uint32), (kv, Dtype::Uint32), 1));
        assert!(!fits_plain(&q, (kv, BF), (&[64, 8, 3128, 128], BF), 1));
        assert!(!fits_plain(
            &q,
            (&[32, 8, 3128, 64], BF),
            (&[32, 8, 3128, 64], BF),
            1
        ));
        // Head width 128 (16 lanes a position) and 256 (a warp); 80 is no power of two of lanes.
        let kv128: &[i32] = &[4, 8, 2000, 128];
        assert!(fits_plain(&[4, 32, 1, 128], (kv128, BF), (kv128, BF), 1024));
        let kv80: &[i32] = &[4, 8, 2000, 80];
        assert!(!fits_plain(&[4, 32, 1, 80], (kv80, BF), (kv80, BF), 1024));
        // Sixteen query heads per KV head: more than a lane's registers hold.
        let kv4: &[i32] = &[4, 4, 2000, 64];
        assert!(!fits_plain(&[4, 64, 1, 64], (kv4, BF), (kv4, BF), 1024));
    }

    #[test]
    fn a_masked_pass_takes_the_kernels_at_any_length() {
        assert_eq!(plain_threshold(PLAIN_MIN_POSITIONS, false, false), 1024);
        assert_eq!(
            plain_threshold(PLAIN_MIN_POSITIONS, true, false),
            1,
            "MLX's vector kernel refuses an array mask: its fallback is unfused"
        );
        assert_eq!(plain_threshold(PLAIN_MIN_POSITIONS, false, true), 1);
        // A ragged batch of 32 rows over 300 positions fits the kernels from one position.
        const BF: Dtype = Dtype::Bfloat16;
        let kv: &[i32] = &[32, 8, 300, 64];
        let q = [32, 32, 1, 64];
        assert!(fits_plain(
            &q,
            (kv, BF),
            (kv, BF),
            plain_threshold(1024, true, false)
        ));
        assert!(!fits_plain(
            &q,
            (kv, BF),
            (kv, BF),
            plain_threshold(1024, false, false)
        ));
    }

    #[test]
    fn spans_keep_every_multiprocessor_busy_without_tiny_spans() {
        // One row: many short spans (256 blocks), none under 32 positions.
        assert_eq!(spans(16_384, 1, 8), 32);
        assert_eq!(spans(512, 1, 8), 16);
        assert_eq!(spans(1, 1, 8), 1);
        // Many rows: spans of at most 1024 positions.
        assert_eq!(spans(16_384, 32, 8), 16);
        assert_eq!(spans(100, 64, 8), 1);
    }

    #[test]
    fn nothing_runs_off_cuda() {
        // This machine's tests run on the CPU: the caller dequantizes, or runs MLX's attention.
        let q = Array::zeros::<f32>(&[1, 8, 1, 64]).unwrap();
        let x = Array::zeros::<f32>(&[1, 2, 4096, 64]).unwrap();
        let k = Stored::new(&x, Some(Q8)).unwrap();
        let plain = Stored::new(&x, None).unwrap();
        if gpu_backend() != Some(Backend::Cuda) {
            assert!(!serves(&q, &k, &k, true));
            assert!(!serves(&q, &plain, &plain, true));
        }
    }
}
