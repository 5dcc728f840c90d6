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
//! with `MLXD_DELTA_KERNEL=0` (to measure the ops path), the ops path runs.
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

use crate::device::gpu_backend;
use mlxd_protocol::control::Backend;

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
    *ON.get_or_init(|| {
        let on_gpu = mlx_rs::Device::try_default()
            .and_then(|d| d.get_type())
            .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu));
        let wanted = std::env::var("MLXD_DELTA_KERNEL").map_or(true, |v| v != "0");
        on_gpu && wanted && gpu_backend() == Some(Backend::Cuda)
    })
}

/// Whether the kernel serves these inputs: a scalar decay per head and a key head that fits
/// a thread's registers.
pub(crate) fn serves(g: &Array, key_dim: i32) -> bool {
    available() && g.ndim() == 3 && key_dim <= MAX_KEY_DIM
}

/// An MLX custom kernel handle, compiled on first use per shape by MLX.
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

impl Kernel {
    fn new() -> Result<Self, Exception> {
        let c = |s: &str| CString::new(s).map_err(|e| Exception::custom(e.to_string()));
        let name = c("mlxd_gated_delta")?;
        let inputs: Vec<CString> = ["q", "k", "v", "g", "beta", "state_in", "mask"]
            .iter()
            .map(|s| c(s))
            .collect::<Result<_, _>>()?;
        let outputs: Vec<CString> = ["y", "state_out"]
            .iter()
            .map(|s| c(s))
            .collect::<Result<_, _>>()?;
        let source = c(SOURCE)?;
        let header = c("")?;
        let mut input_ptrs: Vec<*const c_char> = inputs.iter().map(|s| s.as_ptr()).collect();
        let mut output_ptrs: Vec<*const c_char> = outputs.iter().map(|s| s.as_ptr()).collect();
        // SAFETY: every pointer is a live NUL-terminated string for the calls; the vectors
        // are copied by MLX and freed here; the kernel handle is owned by the result.
        unsafe {
            let input_names =
                mlx_sys::mlx_vector_string_new_data(input_ptrs.as_mut_ptr(), input_ptrs.len());
            let output_names =
                mlx_sys::mlx_vector_string_new_data(output_ptrs.as_mut_ptr(), output_ptrs.len());
            let kernel = mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                input_names,
                output_names,
                source.as_ptr(),
                header.as_ptr(),
                true,
                0,
            );
            mlx_sys::mlx_vector_string_free(input_names);
            mlx_sys::mlx_vector_string_free(output_names);
            if kernel.ctx.is_null() {
                return Err(Exception::custom(
                    "MLX could not make the gated delta kernel",
                ));
            }
            Ok(Self(kernel))
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: the handle is owned here and freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

thread_local! {
    /// The kernel, made once per thread (the model runs on one thread).
    static KERNEL: RefCell<Option<Kernel>> = const { RefCell::new(None) };
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
    let inputs = [q, k, v, g, beta, state, &mask];
    let raw: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
    let y_shape = [b, t, hv, dv];
    let s_shape = state.shape().to_vec();
    let stream = Stream::thread_local_or_default();
    KERNEL.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Kernel::new()?);
        }
        let kernel = slot.as_ref().expect("made above");
        let c = |s: &str| CString::new(s).map_err(|e| Exception::custom(e.to_string()));
        let (in_t, st_t) = (c("InT")?, c("StT")?);
        let ints = [("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)]
            .iter()
            .map(|(n, v)| Ok((c(n)?, *v)))
            .collect::<Result<Vec<_>, Exception>>()?;
        // SAFETY: every handle passed is live for the calls (the arrays through `inputs`, the
        // config and vectors until freed below); `outputs` is filled by MLX with owned arrays
        // that are taken out before the vector is freed.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut status = 0;
            status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                config,
                y_shape.as_ptr(),
                y_shape.len(),
                q.dtype() as mlx_sys::mlx_dtype,
            );
            status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                config,
                s_shape.as_ptr(),
                s_shape.len(),
                state.dtype() as mlx_sys::mlx_dtype,
            );
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, b * hv * dv, 1, 1);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, BLOCK, 1, 1);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                config,
                in_t.as_ptr(),
                q.dtype() as mlx_sys::mlx_dtype,
            );
            status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                config,
                st_t.as_ptr(),
                state.dtype() as mlx_sys::mlx_dtype,
            );
            for (name, value) in &ints {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                    config,
                    name.as_ptr(),
                    *value,
                );
            }
            let input_vec = mlx_sys::mlx_vector_array_new_data(raw.as_ptr(), raw.len());
            let mut outputs = mlx_sys::mlx_vector_array_new();
            if status == 0 {
                status = mlx_sys::mlx_fast_cuda_kernel_apply(
                    &mut outputs,
                    kernel.0,
                    input_vec,
                    config,
                    stream.as_ref().as_ptr(),
                );
            }
            let mut taken = Vec::with_capacity(2);
            if status == 0 {
                for i in 0..mlx_sys::mlx_vector_array_size(outputs) {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, outputs, i);
                    taken.push(Array::from_ptr(a));
                }
            }
            mlx_sys::mlx_vector_array_free(outputs);
            mlx_sys::mlx_vector_array_free(input_vec);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            if status != 0 {
                return Err(Exception::custom(
                    "MLX could not run the gated delta kernel",
                ));
            }
            let mut taken = taken.into_iter();
            match (taken.next(), taken.next()) {
                (Some(y), Some(s)) => Ok((y, s)),
                _ => Err(Exception::custom(
                    "the gated delta kernel gave other than two outputs",
                )),
            }
        }
    })
}
