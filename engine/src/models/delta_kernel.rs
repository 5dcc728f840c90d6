//! The gated delta recurrence as one CUDA kernel, for prefill and decode on NVIDIA GPUs.
//!
//! mlx-lm runs the recurrence as a Metal kernel on Apple GPUs and, everywhere else, as one
//! compiled step per position (`gated_delta_ops`, [`super::gated_delta`]): a 32k-token
//! prefill then launches 32k small steps per layer. Here one kernel walks the whole sequence:
//! a thread owns one row `dv` of one head's `[Dv, Dk]` state and keeps it in registers across
//! the positions, reading each position's key, query, decay and write strength once.
//!
//! The arithmetic is the step's (decay, read `kv = S·k`, `delta = (v - kv)·beta`, write
//! `S += k ⊗ delta`, output `S·q`) in float32, summed in order over `Dk`; the ops path sums
//! with MLX's reductions, so the two agree to float rounding, not bit for bit. Off CUDA, or
//! with `MLXD_DELTA_KERNEL=0` (to measure the ops path), the ops path runs. The body also runs
//! on the CPU under `scripts/emulate_cuda_kernels.py` (a `scripts/test.sh` phase), against
//! numpy's recurrence.
use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::{CudaKernel, Launch, OutputSpec};

/// Threads per block.
const BLOCK: i32 = 128;
/// The widest key head a thread's registers hold.
const MAX_KEY_DIM: i32 = 256;

/// The kernel's body (MLX writes the signature: `q`, `k`, `v`, `g`, `beta`, `state_in`,
/// `mask` in, `y`, `state_out` out; `k_shape` gives `B` and `T`).
const SOURCE: &str = r#"
  const int B = k_shape[0];
  const int T = k_shape[1];
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= B * Hv * Dv) {
    return;
  }
  const int dv = idx % Dv;
  const int n = idx / Dv;
  const int hv = n % Hv;
  const int b = n / Hv;
  const int hk = hv / (Hv / Hk);
  float s[Dk];
  const size_t row = (static_cast<size_t>(n) * Dv + dv) * Dk;
  for (int i = 0; i < Dk; ++i) {
    s[i] = static_cast<float>(state_in[row + i]);
  }
  for (int t = 0; t < T; ++t) {
    const size_t bt = static_cast<size_t>(b) * T + t;
    const size_t at = (bt * Hv + hv) * Dv + dv;
    if (!mask[bt]) {
      y[at] = static_cast<InT>(0.0f);
      continue;
    }
    const size_t head = (bt * Hk + hk) * Dk;
    const float decay = static_cast<float>(g[bt * Hv + hv]);
    const float strength = static_cast<float>(beta[bt * Hv + hv]);
    float kv = 0.0f;
    for (int i = 0; i < Dk; ++i) {
      s[i] *= decay;
      kv += s[i] * static_cast<float>(k[head + i]);
    }
    const float delta = (static_cast<float>(v[at]) - kv) * strength;
    float out = 0.0f;
    for (int i = 0; i < Dk; ++i) {
      s[i] += static_cast<float>(k[head + i]) * delta;
      out += s[i] * static_cast<float>(q[head + i]);
    }
    y[at] = static_cast<InT>(out);
  }
  for (int i = 0; i < Dk; ++i) {
    state_out[row + i] = static_cast<StT>(s[i]);
  }
"#;

/// Whether the kernel runs here: MLX's default device is a CUDA GPU, and the ops path was
/// not asked for.
pub(crate) fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::wanted("MLXD_DELTA_KERNEL"))
}

/// Whether the kernel serves these inputs: a scalar decay per head and a key head that fits
/// a thread's registers.
pub(crate) fn serves(g: &Array, key_dim: i32) -> bool {
    available() && g.ndim() == 3 && key_dim <= MAX_KEY_DIM
}

thread_local! {
    /// The kernel, made once per thread (the model runs on one thread).
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

/// The recurrence over `q`, `k` `[B, T, Hk, Dk]`, `v` `[B, T, Hv, Dv]`, decays `g` and write
/// strengths `beta` `[B, T, Hv]`, from `state` `[B, Hv, Dv, Dk]`, holding the state still
/// (and writing zeros) where the `[B, T]` `mask` is false. Returns `y` `[B, T, Hv, Dv]` in
/// `q`'s dtype and the new state in `state`'s.
pub(crate) fn run(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
    mask: Option<&Array>,
) -> Result<(Array, Array), Exception> {
    let (b, t, hk, dk) = (k.shape()[0], k.shape()[1], k.shape()[2], k.shape()[3]);
    let (hv, dv) = (v.shape()[2], v.shape()[3]);
    if hk <= 0 || hv % hk != 0 {
        return Err(Exception::custom(format!(
            "gated delta kernel: {hv} value heads over {hk} key heads"
        )));
    }
    let mask = match mask {
        Some(m) => m.as_dtype(Dtype::Bool)?,
        None => mlx_rs::ops::ones::<bool>(&[b, t])?,
    };
    let y_shape = vec![b, t, hv, dv];
    let s_shape = state.shape().to_vec();
    KERNEL.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(CudaKernel::new(
                "mlxd_gated_delta",
                &["q", "k", "v", "g", "beta", "state_in", "mask"],
                &["y", "state_out"],
                SOURCE,
                true,
            )?);
        }
        let kernel = slot.as_ref().expect("made above");
        let outputs = [
            OutputSpec {
                shape: y_shape,
                dtype: q.dtype(),
            },
            OutputSpec {
                shape: s_shape,
                dtype: state.dtype(),
            },
        ];
        let launch = Launch {
            grid: (b * hv * dv, 1, 1),
            block: (BLOCK, 1, 1),
            dtypes: &[("InT", q.dtype()), ("StT", state.dtype())],
            ints: &[("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)],
        };
        let mut out = kernel
            .apply(&[q, k, v, g, beta, state, &mask], &outputs, &launch)?
            .into_iter();
        match (out.next(), out.next()) {
            (Some(y), Some(s)) => Ok((y, s)),
            _ => Err(Exception::custom(
                "the gated delta kernel gave other than two outputs",
            )),
        }
    })
}
