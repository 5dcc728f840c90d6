//! The per-token cross-entropy of a training or validation pass, as MLX's
//! `nn.losses.cross_entropy` computes it for mlx-lm's `default_loss` on each device.
//!
//! **Decision: MLX's fused kernel on the GPU, the plain ops elsewhere — mlx-lm's own choice.**
//! On the GPU, `nn.losses.cross_entropy` calls `mx.fast.cross_entropy`, one kernel that reduces
//! each row in float32 and whose gradient is one array of the logits' shape. The plain ops
//! (log-sum-exp minus the target's logit) keep more logit-sized arrays alive around the
//! backward pass: the log-sum-exp's gradient, the gather's scattered gradient and their sum,
//! each `[B, T, vocab]` (262 M values at Llama 3.2 1B's vocabulary, batch 4 × 512: 0.5 GB
//! apiece in bf16). With them mlxd's peak stood above mlx-lm's on an H100 (12.27 GB against
//! 9.67 GB, `scripts/bench/lora_train.py`). On the CPU MLX has no such kernel (its fallback
//! upcasts, which `nn.losses.cross_entropy` does not do there), so the plain ops stay, and the
//! losses stay mlx-lm's on both devices.
//!
//! `MLXD_TRAIN_CROSS_ENTROPY=plain` (or `fused`) overrides the device's choice, for A/B runs of
//! the training's memory and speed (`scripts/bench/lora_train.py`); any other value is refused.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::{Array, Dtype, Stream};

/// The cross-entropy of each of `logits`' rows `[B, T, vocab]` against `targets` `[B, T]`
/// (integers), in the logits' dtype: `[B, T]`.
pub(super) fn cross_entropy(logits: &Array, targets: &Array) -> Result<Array, Exception> {
    let targets = targets.as_dtype(Dtype::Int32)?;
    if uses_fused_kernel()? {
        fused(logits, &targets)?.as_dtype(logits.dtype())
    } else {
        let score = take_along_axis(logits, &targets.expand_dims(-1)?, -1)?.squeeze_axes(&[-1])?;
        logits.logsumexp_axis(-1, None)?.subtract(&score)
    }
}

/// Whether this process's passes take the fused kernel: `MLXD_TRAIN_CROSS_ENTROPY` when set,
/// else [`fused_on_this_device`].
fn uses_fused_kernel() -> Result<bool, Exception> {
    match std::env::var(CROSS_ENTROPY_ENV).as_deref() {
        Err(_) => Ok(fused_on_this_device()),
        Ok("fused") => Ok(true),
        Ok("plain") => Ok(false),
        Ok(other) => Err(Exception::custom(format!(
            "{CROSS_ENTROPY_ENV}={other:?}: expected fused or plain (unset: the device's choice)"
        ))),
    }
}

/// The switch between the fused kernel and the plain ops (A/B runs).
const CROSS_ENTROPY_ENV: &str = "MLXD_TRAIN_CROSS_ENTROPY";

/// mlx-lm's condition for the fused kernel: the default device is the GPU (a Metal or CUDA
/// build alike).
fn fused_on_this_device() -> bool {
    mlx_rs::Device::try_default()
        .and_then(|d| d.get_type())
        .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu))
}

/// `mx.fast.cross_entropy` (mlx-rs does not wrap it): float32 losses `[B, T]`.
fn fused(logits: &Array, targets: &Array) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: `res` is a fresh handle that the op fills; `logits`, `targets` and the stream
    // are live handles held by the caller for the duration of the call; on success the
    // handle is owned by the returned Array, on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_fast_cross_entropy(
            &mut res,
            logits.as_ptr(),
            targets.as_ptr(),
            stream.as_ref().as_ptr(),
        );
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!(
                "MLX fast cross_entropy failed on logits {:?} and targets {:?}",
                logits.shape(),
                targets.shape()
            )));
        }
        Ok(Array::from_ptr(res))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the plain ops run: log-sum-exp minus the target's logit, in the logits'
    /// dtype, exactly as before the fused path existed.
    #[test]
    fn the_cpu_path_is_log_sum_exp_minus_the_target_logit() {
        let logits = Array::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 1.0, 1.0], &[1, 2, 3]);
        let targets = Array::from_slice(&[2u32, 0], &[1, 2]);
        let ce = cross_entropy(&logits, &targets).unwrap();
        assert_eq!(ce.shape(), &[1, 2]);
        let lse = |v: &[f32]| v.iter().map(|x| x.exp()).sum::<f32>().ln();
        let want = [lse(&[0.0, 1.0, 2.0]) - 2.0, lse(&[3.0, 1.0, 1.0]) - 3.0];
        for (got, want) in ce.as_slice::<f32>().iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{got} against {want}");
        }
    }

    /// The fused kernel's wrapper (MLX's fallback on the CPU) gives float32 losses equal to
    /// the plain ops', and a gradient with respect to the logits.
    #[test]
    fn the_fused_kernel_gives_the_plain_losses_and_a_gradient() {
        let logits = Array::from_slice(&[0.5f32, -1.0, 2.0, 3.0, 1.0, 0.25], &[1, 2, 3]);
        let targets = Array::from_slice(&[2i32, 1], &[1, 2]);
        let fused_ce = fused(&logits, &targets).unwrap();
        assert_eq!(fused_ce.dtype(), Dtype::Float32);
        let plain = cross_entropy(&logits, &targets).unwrap();
        for (a, b) in fused_ce
            .as_slice::<f32>()
            .iter()
            .zip(plain.as_slice::<f32>())
        {
            assert!((a - b).abs() < 1e-5, "{a} against {b}");
        }
        let total = |x: &[Array]| -> Result<Vec<Array>, Exception> {
            Ok(vec![fused(&x[0], &targets)?.sum(None)?])
        };
        let (_, grads) =
            mlx_rs::transforms::value_and_grad(total)(std::slice::from_ref(&logits)).unwrap();
        assert_eq!(grads[0].shape(), logits.shape());
        // Each row's gradient is its softmax minus the target's one-hot: it sums to zero.
        let sums = grads[0].sum_axis(-1, None).unwrap();
        assert!(sums.as_slice::<f32>().iter().all(|s| s.abs() < 1e-5));
    }
}
