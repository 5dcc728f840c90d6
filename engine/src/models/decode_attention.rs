//! Decode attention over a quantized KV cache as two CUDA kernels, reading the packed keys and
//! values directly.
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
//! The cache's views are read in place through their strides (no copy of a sliced buffer).
//! `scripts/emulate_cuda_kernels.py` runs both bodies on the CPU under a SIMT emulation against
//! numpy's dequantized attention (a `scripts/test.sh` phase); `examples/quant_attention_check.rs`
//! checks and times them on a GPU.
//! Off CUDA, for other shapes, or with `MLXD_QUANT_ATTENTION=0` (to measure the dequantizing
//! path), the caller dequantizes and runs MLX's fused attention as before.
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
/// with 32 spans, 0.19 ms with 128, 0.37 ms with 512; `quant_attention_check`).
const MIN_BLOCKS: i32 = 256;

/// The split kernel's body. Inputs: `q` `[B, H, 1, D]`; `kw`, `vw` packed `[B, Hkv, T, W]`
/// (uint32); `ks`, `kb`, `vs`, `vb` `[B, Hkv, T, D / GS]`, each read through its own strides;
/// `mask` `[B | 1, 1, 1, T]` (bool, read only with `HAS_MASK`). Outputs per `(b, h, span)`:
/// the partial output `acc` `[B, H, S, D]` (float32, not normalized), the running maximum `m`
/// and the sum `l` `[B, H, S]`. Grid: `(S × 128, Hkv, B)` threads.
///
/// A lane holds `EPL` consecutive elements of a head (whole 32-bit words of the packed cache,
/// all in one quantization group), so `LP = D / EPL` lanes cover a position and a warp walks
/// `32 / LP` positions at once: a key's dot product is summed over `LP` lanes (`log2(LP)`
/// shuffles), not 32. Each group of `LP` lanes keeps its own running softmax; the groups of a
/// warp merge by shuffles at the end, then the warps in shared memory.
const SPLIT_SOURCE: &str = r#"
  constexpr int WARPS = 4;
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = EPL / PER_WORD;
  constexpr int LP = D / EPL;
  constexpr int PPW = 32 / LP;
  constexpr unsigned int LOW = (1u << BITS) - 1u;
  const float scale = __int_as_float(SCALE_BITS);
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int span = blockIdx.x;
  const int spans = gridDim.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int kv_heads = gridDim.y;
  const int heads = kv_heads * R;
  const int T = kw_shape[2];
  const int per_span = (T + spans - 1) / spans;
  const int start = span * per_span;
  const int end = min(T, start + per_span);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // This lane's slice of the head (`sub`) and its position among the warp's `PPW` (`slot`).
  const int sub = lane % LP;
  const int slot = lane / LP;
  const int i0 = sub * EPL;
  const int word0 = i0 / PER_WORD;
  const int g = i0 / GS;

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

  const int64_t k_row = b * kw_strides[0] + hk * kw_strides[1];
  const int64_t ks_row = b * ks_strides[0] + hk * ks_strides[1];
  const int64_t kb_row = b * kb_strides[0] + hk * kb_strides[1];
  const int64_t v_row = b * vw_strides[0] + hk * vw_strides[1];
  const int64_t vs_row = b * vs_strides[0] + hk * vs_strides[1];
  const int64_t vb_row = b * vb_strides[0] + hk * vb_strides[1];
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

/// Whether the kernels run here: MLX's default device is a CUDA GPU, and the dequantizing
/// path was not asked for.
fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::wanted("MLXD_QUANT_ATTENTION"))
}

/// Elements of a head one lane holds: whole 32-bit words of the packed cache, at least 8.
fn elements_per_lane(bits: i32) -> i32 {
    (32 / bits).max(8)
}

/// The most `heads per KV head × elements per lane` a lane holds (its queries and partial
/// outputs stay in registers).
const MAX_LANE_ELEMENTS: i32 = 64;

/// The shapes the kernels serve, apart from the device: one query; keys and values quantized
/// alike with 2, 4 or 8 bits (a whole number of elements per 32-bit word) in groups that split
/// `head_dim` and hold whole lanes' slices; a head width that a power of two of lanes (up to a
/// warp) covers; query heads grouped evenly over the KV heads, few enough that a lane's
/// registers and a block's shared memory hold their partial outputs.
pub(crate) fn fits(
    queries: &[i32],
    kv_heads: i32,
    keys: Option<KvQuant>,
    values: Option<KvQuant>,
) -> bool {
    let (Some(kq), Some(vq)) = (keys, values) else {
        return false;
    };
    let [_, heads, l, d] = queries else {
        return false;
    };
    let (heads, l, d) = (*heads, *l, *d);
    if kq != vq || !matches!(kq.bits, 2 | 4 | 8) || l != 1 || kv_heads <= 0 {
        return false;
    }
    let epl = elements_per_lane(kq.bits);
    let lanes = d / epl;
    let group = heads / kv_heads;
    d % epl == 0
        && lanes > 0
        && lanes <= 32
        && (lanes & (lanes - 1)) == 0
        && kq.group_size > 0
        && kq.group_size % epl == 0
        && d % kq.group_size == 0
        && heads % kv_heads == 0
        && group * epl <= MAX_LANE_ELEMENTS
        && group * d <= MAX_GROUP_ELEMENTS
}

/// Whether [`decode`] serves this pass here: [`fits`], and keys and values as wide as the
/// queries (the kernels read one head width for all three).
pub fn serves(queries: &Array, keys: &Stored, values: &Stored) -> bool {
    let (k, v) = (keys.arrays()[0].shape(), values.arrays()[0].shape());
    let packed_width = |q: KvQuant| queries.shape().last().map(|d| d * q.bits / 32);
    available()
        && fits(queries.shape(), k[1], keys.quant(), values.quant())
        && keys.quant().and_then(packed_width) == k.last().copied()
        && k.last() == v.last()
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

thread_local! {
    /// The two kernels, made once per thread (the model runs on one thread).
    static KERNELS: RefCell<Option<(CudaKernel, CudaKernel)>> = const { RefCell::new(None) };
}

/// Attention of one query per row over quantized `keys` and `values` (`[B, kv_heads, T, ·]`
/// views of a cache), `queries` `[B, heads, 1, D]` scaled by `scale`, positions hidden by
/// `mask` (`[B, 1, 1, T]`, true = attend) left out → `[B, heads, 1, D]` in the queries' dtype.
/// Call only where [`serves`] said yes.
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
    let (Some([kw, ks, kb]), Some([vw, vs, vb]), Some(quant)) =
        (keys.packed(), values.packed(), keys.quant())
    else {
        return Err(Exception::custom(
            "quantized decode attention over a plain cache",
        ));
    };
    let (b, heads, d) = (queries.shape()[0], queries.shape()[1], queries.shape()[3]);
    let (kv_heads, positions) = (kw.shape()[1], kw.shape()[2]);
    let spans = spans.clamp(1, positions.max(1));
    let (mask, has_mask) = match mask {
        // One query: causal hides nothing. The kernel never reads this placeholder.
        Mask::None | Mask::Causal => (Array::from_bool(true).reshape(&[1, 1, 1, 1])?, 0),
        Mask::Array(m) => (m.as_dtype(Dtype::Bool)?, 1),
    };
    let scale_bits = scale.to_bits() as i32;
    KERNELS.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            let split = CudaKernel::new(
                "mlxd_quant_attention_split",
                &["q", "kw", "ks", "kb", "vw", "vs", "vb", "mask"],
                &["part_acc", "part_m", "part_l"],
                SPLIT_SOURCE,
                false,
            )?;
            let merge = CudaKernel::new(
                "mlxd_quant_attention_merge",
                &["part_acc", "part_m", "part_l"],
                &["out"],
                MERGE_SOURCE,
                true,
            )?;
            *slot = Some((split, merge));
        }
        let (split, merge) = slot.as_ref().expect("made above");
        let parts = split.apply(
            &[queries, kw, ks, kb, vw, vs, vb, &mask],
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
                ints: &[
                    ("D", d),
                    ("R", heads / kv_heads),
                    ("EPL", elements_per_lane(quant.bits)),
                    ("BITS", quant.bits),
                    ("GS", quant.group_size),
                    ("HAS_MASK", has_mask),
                    ("SCALE_BITS", scale_bits),
                ],
            },
        )?;
        let out = merge.apply(
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
        assert!(fits(&q, 8, Some(Q8), Some(Q8)));
        let q4 = KvQuant { bits: 4, ..Q8 };
        assert!(fits(&q, 8, Some(q4), Some(q4)));
        // Prefill, plain sides, sides quantized differently.
        assert!(!fits(&[4, 32, 2, 128], 8, Some(Q8), Some(Q8)));
        assert!(!fits(&q, 8, None, Some(Q8)));
        assert!(!fits(&q, 8, Some(Q8), Some(q4)));
        // Bits that straddle 32-bit words, groups that do not split the head.
        let q3 = KvQuant { bits: 3, ..Q8 };
        assert!(!fits(&q, 8, Some(q3), Some(q3)));
        let g48 = KvQuant {
            group_size: 48,
            ..Q8
        };
        assert!(!fits(&q, 8, Some(g48), Some(g48)));
        // Heads the lanes cannot share evenly, or too many query heads per KV head.
        assert!(!fits(&[1, 8, 1, 80], 8, Some(Q8), Some(Q8)));
        assert!(!fits(&[1, 64, 1, 256], 4, Some(Q8), Some(Q8)));
        assert!(!fits(&[1, 30, 1, 128], 8, Some(Q8), Some(Q8)));
        // The 1B shape (head width 64: eight lanes a position), 2 bits in groups of 32.
        assert!(fits(&[4, 32, 1, 64], 8, Some(Q8), Some(Q8)));
        let q2 = KvQuant {
            bits: 2,
            group_size: 32,
        };
        assert!(fits(&[4, 32, 1, 64], 8, Some(q2), Some(q2)));
        // Sixteen query heads per KV head: more partial outputs than a lane's registers hold.
        assert!(!fits(&[1, 64, 1, 64], 4, Some(Q8), Some(Q8)));
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
        // This machine's tests run on the CPU: the caller dequantizes.
        let q = Array::zeros::<f32>(&[1, 8, 1, 64]).unwrap();
        let x = Array::zeros::<f32>(&[1, 2, 4, 64]).unwrap();
        let k = Stored::new(&x, Some(Q8)).unwrap();
        if gpu_backend() != Some(Backend::Cuda) {
            assert!(!serves(&q, &k, &k));
        }
    }
}
