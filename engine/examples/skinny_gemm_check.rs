//! The product of a few rows on CUDA: the engine's kernel (`mlxd_engine::models::skinny_gemm`)
//! against MLX's `x @ W.T` (cuBLASLt at more than one row).
//!
//! ```text
//! cargo run --release -p mlxd-engine --example skinny_gemm_check -- [iterations]
//! ```
//!
//! For the 1B shape's products (q/k/v stacked, o, gate/up stacked, down, the head; bf16) at 2
//! to 16 rows: one JSON line with the largest difference between the two (relative to the
//! mean magnitude of MLX's output) and microseconds per product of each, timed as
//! `iterations` products queued and evaluated at once (host and device, as in a forward
//! pass). Runs on a CUDA GPU only (the kernel is CUDA's).
use std::time::Instant;

use anyhow::{bail, Context};
use mlx_rs::{random, Array, Dtype};
use mlxd_engine::models::skinny_gemm;

/// Microseconds per product of `iterations` products `f(x)` built, then evaluated together.
fn per_product(
    iterations: usize,
    x: &Array,
    f: impl Fn(&Array) -> anyhow::Result<Array>,
) -> anyhow::Result<f64> {
    // Compiled, planned and cached before the timed run.
    f(x)?.eval()?;
    let start = Instant::now();
    let outs = (0..iterations)
        .map(|_| f(x))
        .collect::<anyhow::Result<Vec<_>>>()?;
    mlx_rs::transforms::eval(&outs)?;
    Ok(start.elapsed().as_secs_f64() * 1e6 / iterations as f64)
}

fn main() -> anyhow::Result<()> {
    let iterations: usize = match std::env::args().nth(1) {
        Some(n) => n.parse().context("usage: skinny_gemm_check [iterations]")?,
        None => 200,
    };
    if !mlxd_engine::cuda_kernel::wanted(skinny_gemm::SWITCH) {
        bail!("skinny_gemm_check runs on a CUDA GPU (and not with MLXD_SKINNY_GEMM=0)");
    }
    // (product, in, out): the 1B shape (hidden 2048, 32 heads over 8 of width 64, MLP 8192,
    // SmolLM2's vocabulary).
    let products: [(&str, i32, i32); 5] = [
        ("qkv", 2048, 3072),
        ("o", 2048, 2048),
        ("gate_up", 2048, 16384),
        ("down", 8192, 2048),
        ("head", 2048, 49152),
    ];
    for (name, k, n) in products {
        let w = random::normal::<f32>(&[n, k], None, None, None)?
            .multiply(Array::from_f32(0.02))?
            .as_dtype(Dtype::Bfloat16)?;
        w.eval()?;
        for rows in [2, 4, 8, 15, 16] {
            let x = random::normal::<f32>(&[rows, 1, k], None, None, None)?
                .as_dtype(Dtype::Bfloat16)?;
            x.eval()?;
            let ours = skinny_gemm::matmul_t(&x, &w)?;
            let theirs = x.matmul(w.t())?;
            let (a, b) = (
                ours.as_dtype(Dtype::Float32)?,
                theirs.as_dtype(Dtype::Float32)?,
            );
            let largest = a.subtract(&b)?.abs()?.max(None)?.item_exact::<f32>();
            let mean = b.abs()?.mean(None)?.item_exact::<f32>();
            let kernel_us = per_product(iterations, &x, |x| Ok(skinny_gemm::matmul_t(x, &w)?))?;
            let mlx_us = per_product(iterations, &x, |x| Ok(x.matmul(w.t())?))?;
            println!(
                "{{\"product\":\"{name}\",\"in\":{k},\"out\":{n},\"rows\":{rows},\
                 \"rel_diff\":{:.4},\"kernel_us\":{kernel_us:.1},\"mlx_us\":{mlx_us:.1}}}",
                largest / mean.max(f32::MIN_POSITIVE)
            );
        }
    }
    Ok(())
}
