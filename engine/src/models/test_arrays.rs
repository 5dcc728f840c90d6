//! Arrays the models' unit tests compare: seeded normal samples and the largest difference.
use mlx_rs::Array;

/// Standard-normal samples of `shape`, the same for the same `seed`.
pub(crate) fn normal(shape: &[i32], seed: u64) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, None, Some(&key)).unwrap()
}

/// The largest absolute element-wise difference of `a` and `b`.
pub(crate) fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
    d.item_exact::<f32>()
}
