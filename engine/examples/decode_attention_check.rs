//! Decode attention on CUDA: the split/merge kernels (`mlxd_engine::models::decode_attention`)
//! over a quantized KV cache against dequantizing and MLX's fused attention (what the engine
//! did before) and against bf16 attention over the unquantized keys; then over a plain bf16
//! cache against MLX's fused attention over the same views.
//!
//! ```text
//! cargo run --release -p mlxd-engine --example decode_attention_check -- [iterations] [--plain]
//! ```
//!
//! For each head width (64: the 1B shape, 128: the 8B), bit width and `(rows, positions)`
//! shape (32 query heads over 8 KV heads, groups of 64, bf16): random queries, keys and values in a
//! buffer longer than the positions (so the cache's views are strided, as in the engine),
//! rows left-padded by different amounts (a mask, as a batch of different lengths has), then
//! one JSON line: the largest and mean absolute difference between the kernels and the
//! dequantizing path over the same quantized values, and milliseconds per call of each path.
//! The plain lines (`"bits": 0`) compare the kernels with MLX's attention over the same bf16
//! views (MLX's vector kernel: buffers one position past a multiple of 256, as the engine's)
//! and time both (`--plain`: only those). Runs only where the kernels serve (a CUDA GPU).
use std::time::Instant;

use anyhow::{bail, Context};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, Array, Dtype};
use mlxd_engine::cache::{KvQuant, Mask, Stored};
use mlxd_engine::models::{decode_attention, layers};

const HEADS: i32 = 32;
const KV_HEADS: i32 = 8;
const GROUP: i32 = 64;

fn timed(iterations: usize, mut f: impl FnMut() -> anyhow::Result<Array>) -> anyhow::Result<f64> {
    for _ in 0..3 {
        f()?.eval()?;
    }
    let start = Instant::now();
    for _ in 0..iterations {
        f()?.eval()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1000.0 / iterations as f64)
}

/// Random bf16 values of `shape`.
fn normal(shape: &[i32]) -> anyhow::Result<Array> {
    Ok(mlx_rs::random::normal::<f32>(shape, None, None, None)?.as_dtype(Dtype::Bfloat16)?)
}

/// The mask of `rows` rows over `positions`, row r starting at position 97 r (left padding, as
/// a batch of different lengths has), the rest visible; none for one row.
fn left_padded(rows: i32, positions: i32) -> anyhow::Result<Mask> {
    if rows == 1 {
        return Ok(Mask::None);
    }
    let starts: Vec<i32> = (0..rows).map(|r| (97 * r) % (positions / 2)).collect();
    let starts = Array::from_slice(&starts, &[rows, 1, 1, 1]);
    let pos = Array::arange::<_, i32>(None, positions, None)?.reshape(&[1, 1, 1, positions])?;
    Ok(Mask::Array(pos.ge(&starts)?))
}

/// The largest and mean absolute difference of `got` from `reference`, and the reference's
/// mean magnitude.
fn differences(got: &Array, reference: &Array) -> anyhow::Result<(f32, f32, f32)> {
    let (a, b) = (
        got.as_dtype(Dtype::Float32)?,
        reference.as_dtype(Dtype::Float32)?,
    );
    let diff = a.subtract(&b)?.abs()?;
    Ok((
        diff.max(None)?.item_exact::<f32>(),
        diff.mean(None)?.item_exact::<f32>(),
        b.abs()?.mean(None)?.item_exact::<f32>(),
    ))
}

/// MLX's fused attention, what the engine runs where the kernels do not serve.
fn mlx_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Mask,
) -> anyhow::Result<Array> {
    Ok(fast::scaled_dot_product_attention(
        q,
        k,
        v,
        scale,
        mask.as_sdpa(),
        None,
    )?)
}

fn main() -> anyhow::Result<()> {
    let usage = "usage: decode_attention_check [iterations] [--plain]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let plain_only = args.iter().any(|a| a == "--plain");
    let iterations: usize = match args.iter().find(|a| *a != "--plain") {
        Some(n) => n.parse().context(usage)?,
        None => 50,
    };
    if plain_only {
        return plain(iterations);
    }
    for (head_dim, bits) in [(64, 8), (64, 4), (128, 8), (128, 4)] {
        let scale = 1.0 / (head_dim as f32).sqrt();
        let quant = KvQuant {
            bits,
            group_size: GROUP,
        };
        for (rows, positions) in [
            (1, 4096),
            (1, 16_384),
            (8, 16_384),
            (32, 4096),
            (32, 16_384),
        ] {
            let capacity = positions + 256;
            let q = normal(&[rows, HEADS, 1, head_dim])?;
            let k_buf = normal(&[rows, KV_HEADS, capacity, head_dim])?;
            let v_buf = normal(&[rows, KV_HEADS, capacity, head_dim])?;
            let view = |s: &Stored| s.map(|a| Ok(a.index((.., .., ..positions, ..))));
            let keys = view(&Stored::new(&k_buf, Some(quant))?)?;
            let values = view(&Stored::new(&v_buf, Some(quant))?)?;
            let mask = left_padded(rows, positions)?;
            let mut all: Vec<&Array> = vec![&q, &k_buf, &v_buf];
            all.extend(keys.arrays());
            all.extend(values.arrays());
            mlx_rs::transforms::eval(all)?;
            if !decode_attention::serves(&q, &keys, &values, true) {
                bail!("the quantized attention kernels do not serve here (a CUDA GPU is needed)");
            }
            let plain = |s: &Stored| layers::dequantized(s, Dtype::Bfloat16);
            let fused = || -> anyhow::Result<Array> {
                Ok(decode_attention::decode(&q, &keys, &values, scale, &mask)?)
            };
            let dequantizing = || -> anyhow::Result<Array> {
                let (k, v) = (plain(&keys)?, plain(&values)?);
                mlx_attention(&q, &k, &v, scale, &mask)
            };
            let (k16, v16) = (
                k_buf.index((.., .., ..positions, ..)),
                v_buf.index((.., .., ..positions, ..)),
            );
            let bf16 = || -> anyhow::Result<Array> { mlx_attention(&q, &k16, &v16, scale, &mask) };
            let (max_diff, mean_diff, reference_mean) = differences(&fused()?, &dequantizing()?)?;
            let ms_fused = timed(iterations, fused)?;
            // The same kernels with other span counts than the default's.
            let chosen = decode_attention::spans(positions, rows, KV_HEADS);
            let mut by_spans = Vec::new();
            for factor in [0.25, 0.5, 2.0, 4.0] {
                let n = ((chosen as f64 * factor).round() as i32).max(1);
                let ms = timed(iterations, || {
                    Ok(decode_attention::decode_in_spans(
                        &q, &keys, &values, scale, &mask, n,
                    )?)
                })?;
                by_spans.push(format!("\"{n}\": {ms:.4}"));
            }
            let ms_dequantizing = timed(iterations, dequantizing)?;
            let ms_bf16 = timed(iterations, bf16)?;
            println!(
                "{{\"head_dim\": {head_dim}, \"bits\": {bits}, \"rows\": {rows}, \"positions\": {positions}, \
                 \"max_abs_diff\": {max_diff:.5}, \"mean_abs_diff\": {mean_diff:.6}, \
                 \"reference_mean_abs\": {reference_mean:.5}, \"ms_fused\": {ms_fused:.4}, \
                 \"ms_dequantize_sdpa\": {ms_dequantizing:.4}, \"ms_bf16_sdpa\": {ms_bf16:.4}, \
                 \"spans\": {chosen}, \"ms_fused_by_spans\": {{{}}}}}",
                by_spans.join(", ")
            );
        }
    }
    plain(iterations)
}

/// The kernels over a plain bf16 cache against MLX's fused attention over the same views.
fn plain(iterations: usize) -> anyhow::Result<()> {
    for head_dim in [64, 128] {
        let scale = 1.0 / (head_dim as f32).sqrt();
        for (rows, positions) in [
            (1, 4096),
            (1, 16_384),
            (8, 16_384),
            (32, 1024),
            (32, 3128),
            (64, 1024),
            (64, 3128),
            (128, 3128),
            (64, 8000),
        ] {
            // One position past a multiple of 256, as the engine's buffers are.
            let capacity = (positions / 256 + 1) * 256 + 1;
            let q = normal(&[rows, HEADS, 1, head_dim])?;
            let k_buf = normal(&[rows, KV_HEADS, capacity, head_dim])?;
            let v_buf = normal(&[rows, KV_HEADS, capacity, head_dim])?;
            let (k, v) = (
                k_buf.index((.., .., ..positions, ..)),
                v_buf.index((.., .., ..positions, ..)),
            );
            let (keys, values) = (Stored::new(&k, None)?, Stored::new(&v, None)?);
            let mask = left_padded(rows, positions)?;
            mlx_rs::transforms::eval([&q, &k_buf, &v_buf, &k, &v])?;
            // One row stays on MLX's kernel in the engine (the faster there); it is timed
            // here to keep that choice measured.
            if !decode_attention::serves_plain_caches()
                || (rows > 1 && !decode_attention::serves(&q, &keys, &values, true))
            {
                bail!("the decode attention kernels do not serve a plain cache of {rows} rows over {positions} positions here");
            }
            let kernels = || -> anyhow::Result<Array> {
                Ok(decode_attention::decode(&q, &keys, &values, scale, &mask)?)
            };
            let sdpa = || -> anyhow::Result<Array> { mlx_attention(&q, &k, &v, scale, &mask) };
            let (max_diff, mean_diff, reference_mean) = differences(&kernels()?, &sdpa()?)?;
            let ms_kernels = timed(iterations, kernels)?;
            let ms_sdpa = timed(iterations, sdpa)?;
            println!(
                "{{\"head_dim\": {head_dim}, \"bits\": 0, \"rows\": {rows}, \"positions\": {positions}, \
                 \"max_abs_diff\": {max_diff:.5}, \"mean_abs_diff\": {mean_diff:.6}, \
                 \"reference_mean_abs\": {reference_mean:.5}, \"ms_kernels\": {ms_kernels:.4}, \
                 \"ms_sdpa\": {ms_sdpa:.4}, \"spans\": {}}}",
                decode_attention::spans(positions, rows, KV_HEADS)
            );
        }
    }
    Ok(())
}
