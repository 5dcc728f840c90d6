//! A served LoRA update on CUDA: the shrink and expand kernels
//! (`mlxd_engine::adapters::lora_kernel`) against the matmuls the engine runs elsewhere
//! (`x @ A`, the row mask, `@ B`, cast and add).
//!
//! ```text
//! cargo run --release -p mlxd-engine --example lora_kernel_check -- [iterations]
//! ```
//!
//! First the chain's cost of one plain node (an add). Then, for a tiny site and the 1B
//! shape's update sites (q/k/v stacked, o, gate/up stacked, down; rank 8), one adapter or four
//! mixed (a row mask), float32 or bf16 factors, on a bf16 base, at 1 to 128 rows: one JSON
//! line with the largest and mean absolute difference between the two paths (relative to the
//! mean update) and microseconds per update of each, timed as a chain of `iterations` updates
//! evaluated once (device time, as in a forward pass). Runs only where the kernels serve: a
//! CUDA GPU, unless `MLXD_LORA_KERNEL=0`. Each such line is followed by one for the widened
//! path (`mlxd_engine::adapters::widened`, `"path":"widened"`): its difference from the ops,
//! its epilogues' (a residual add: `residual_rel_diff`; SwiGLU of the gate/up halves:
//! `swiglu_rel_diff`; largest difference relative to the mean output), and for the sites
//! whose output is as wide as their input, a chain of widened sites against a chain of base
//! products each with the two kernels, and a chain of widened sites that add their residual
//! in the kernel against one that adds it as a node of its own.
use std::time::Instant;

use anyhow::{bail, Context};
use mlx_rs::{random, Array, Dtype};
use mlxd_engine::adapters::lora_kernel;
use mlxd_engine::adapters::widened::Epilogue;

/// The plain ops path: `y + cast(((x @ a) * mask) @ b)`.
fn ops(
    x: &Array,
    a: &Array,
    b: &Array,
    y: &Array,
    mask: Option<(&Array, i32)>,
) -> anyhow::Result<Array> {
    let mut h = x.matmul(a)?;
    if let Some((m, layers)) = mask {
        let s = h.shape().to_vec();
        let (rows, w) = (m.shape()[0], m.shape()[2]);
        h = h
            .reshape(&[s[0], s[1], layers, w])?
            .multiply(m.reshape(&[rows, 1, 1, w])?)?
            .reshape(&s)?;
    }
    Ok(y.add(h.matmul(b)?.as_dtype(y.dtype())?)?)
}

/// Microseconds per update of a chain of `n` updates, each adding to the last one's output.
fn chained(
    n: usize,
    y: &Array,
    mut f: impl FnMut(&Array) -> anyhow::Result<Array>,
) -> anyhow::Result<f64> {
    let mut out = y.clone();
    for _ in 0..3 {
        out = f(&out)?;
    }
    out.eval()?;
    let start = Instant::now();
    let mut out = y.clone();
    for _ in 0..n {
        out = f(&out)?;
    }
    out.eval()?;
    Ok(start.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// The widened path (`mlxd_engine::adapters::widened`) at one site: the product by the base
/// weight widened by `Aᵀ` (bf16), then the one expand kernel, against the base product plus
/// the ops' update (`mask`: a one-adapter pass's is all ones). For sites whose output feeds
/// their input (`tiny`, `o`), microseconds per site of a chain of widened products against a
/// chain of base products each followed by the two kernels.
#[allow(clippy::too_many_arguments)]
fn widened(
    site: &str,
    factors: Dtype,
    adapters: i32,
    rows: i32,
    (k, n, w, layers): (i32, i32, i32, i32),
    x: &Array,
    a: &Array,
    b: &Array,
    mask: Option<(&Array, i32)>,
    iterations: usize,
) -> anyhow::Result<()> {
    let ones = mlx_rs::ops::ones::<f32>(&[1, 1, w])?;
    let mask = mask.unwrap_or((&ones, layers));
    let weight =
        (random::normal::<f32>(&[n, k], None, None, None)? * 0.02).as_dtype(Dtype::Bfloat16)?;
    let wide = mlx_rs::ops::concatenate(&[&weight, &a.t().as_dtype(Dtype::Bfloat16)?], 0)?;
    mlx_rs::transforms::eval([&weight, &wide])?;
    let yw = x.matmul(wide.t())?;
    if !lora_kernel::serves_widened(&yw, b, mask, Epilogue::None) {
        return Ok(());
    }
    let got = lora_kernel::widened_update(&yw, b, mask, Epilogue::None)?;
    let base = x.matmul(weight.t())?;
    let want = ops(x, a, b, &base, Some(mask))?;
    let f32 = |v: &Array| v.as_dtype(Dtype::Float32);
    let diff = f32(&got)?.subtract(f32(&want)?)?.abs()?;
    let update = f32(&want)?
        .subtract(f32(&base)?)?
        .abs()?
        .mean(None)?
        .item_exact::<f32>();
    let (max, mean) = (
        diff.max(None)?.item_exact::<f32>(),
        diff.mean(None)?.item_exact::<f32>(),
    );
    // The epilogues against the same ops after the ops' output.
    let rel = |got: &Array, want: &Array| -> anyhow::Result<f32> {
        let scale = f32(want)?.abs()?.mean(None)?.item_exact::<f32>();
        let diff = f32(got)?.subtract(f32(want)?)?.abs()?.max(None)?;
        Ok(diff.item_exact::<f32>() / scale)
    };
    let mut epilogues = String::new();
    let residual = random::normal::<f32>(base.shape(), None, None, None)?.as_dtype(base.dtype())?;
    if lora_kernel::serves_widened(&yw, b, mask, Epilogue::Residual(&residual)) {
        let got = lora_kernel::widened_update(&yw, b, mask, Epilogue::Residual(&residual))?;
        let r = rel(&got, &residual.add(&want)?)?;
        epilogues += &format!(",\"residual_rel_diff\":{r:.5}");
    }
    if layers == 2 && lora_kernel::serves_widened(&yw, b, mask, Epilogue::SwiGlu) {
        let got = lora_kernel::widened_update(&yw, b, mask, Epilogue::SwiGlu)?;
        let halves = want.split_equal(2, -1)?;
        let (g, u) = (&halves[0], &halves[1]);
        let swiglu = g.multiply(mlx_rs::ops::sigmoid(g)?)?.multiply(u)?;
        let r = rel(&got, &swiglu)?;
        epilogues += &format!(",\"swiglu_rel_diff\":{r:.5}");
    }
    let mut times = String::new();
    if n == k {
        let one_node = chained(iterations, x, |x| {
            Ok(lora_kernel::widened_update(
                &x.matmul(wide.t())?,
                b,
                mask,
                Epilogue::None,
            )?)
        })?;
        let with_add = chained(iterations, x, |x| {
            Ok(lora_kernel::widened_update(
                &x.matmul(wide.t())?,
                b,
                mask,
                Epilogue::Residual(x),
            )?)
        })?;
        let add_apart = chained(iterations, x, |x| {
            Ok(x.add(lora_kernel::widened_update(
                &x.matmul(wide.t())?,
                b,
                mask,
                Epilogue::None,
            )?)?)
        })?;
        let two_nodes = chained(iterations, x, |x| {
            Ok(lora_kernel::add_update(
                x,
                a,
                b,
                &x.matmul(weight.t())?,
                Some(mask),
            )?)
        })?;
        times = format!(
            ",\"widened_site_us\":{one_node:.1},\"two_kernel_site_us\":{two_nodes:.1},\"residual_in_kernel_us\":{with_add:.1},\"residual_apart_us\":{add_apart:.1}"
        );
    }
    println!(
        "{{\"site\":\"{site}\",\"path\":\"widened\",\"factors\":\"{factors:?}\",\"adapters\":{adapters},\"rows\":{rows},\"max_diff\":{max:.5},\"mean_diff\":{mean:.6},\"mean_update\":{update:.4}{epilogues}{times}}}"
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let iterations: usize = match std::env::args().nth(1) {
        Some(n) => n.parse().context("usage: lora_kernel_check [iterations]")?,
        None => 200,
    };
    // (site, in, layers' outputs): the 1B shape (hidden 2048, 32 heads over 8 of width 64, MLP 8192).
    // "tiny": next to no work, so its time is what a chain pays per update for the nodes alone.
    let sites: [(&str, i32, &[i32]); 5] = [
        ("tiny", 128, &[128]),
        ("qkv", 2048, &[2048, 512, 512]),
        ("o", 2048, &[2048]),
        ("gate_up", 2048, &[8192, 8192]),
        ("down", 8192, &[2048]),
    ];
    // The chain's cost of one plain node (an add), to read the updates' times against.
    let y = random::normal::<f32>(&[32, 1, 2048], None, None, None)?.as_dtype(Dtype::Bfloat16)?;
    y.eval()?;
    let one = Array::from_f32(1.0).as_dtype(Dtype::Bfloat16)?;
    let add_us = chained(iterations, &y, |y| Ok(y.add(&one)?))?;
    println!("{{\"site\":\"one_add\",\"node_us\":{add_us:.1}}}");
    let rank = 8;
    let mut served = 0;
    for factors in [Dtype::Float32, Dtype::Bfloat16] {
        for adapters in [1, 4] {
            for (site, k, outs) in sites {
                let layers = outs.len() as i32;
                let n: i32 = outs.iter().sum();
                let w = rank * adapters;
                let c = w * layers;
                let a =
                    (random::normal::<f32>(&[k, c], None, None, None)? * 0.05).as_dtype(factors)?;
                let b =
                    (random::normal::<f32>(&[c, n], None, None, None)? * 0.05).as_dtype(factors)?;
                for rows in [1, 8, 32, 64, 128] {
                    let x = random::normal::<f32>(&[rows, 1, k], None, None, None)?
                        .as_dtype(Dtype::Bfloat16)?;
                    let y = random::normal::<f32>(&[rows, 1, n], None, None, None)?
                        .as_dtype(Dtype::Bfloat16)?;
                    // Row r takes adapter r mod 4 (its rank's columns of each layer's block).
                    let mask = (adapters > 1).then(|| {
                        let v: Vec<f32> = (0..rows * w)
                            .map(|i| f32::from((i % w) / rank == (i / w) % adapters))
                            .collect();
                        Array::from_slice(&v, &[rows, 1, w])
                    });
                    let mask = mask.as_ref().map(|m| (m, layers));
                    mlx_rs::transforms::eval([&a, &b, &x, &y])?;
                    if !lora_kernel::serves(&x, &a, &b, &y, mask) {
                        continue;
                    }
                    served += 1;
                    let got = lora_kernel::add_update(&x, &a, &b, &y, mask)?;
                    let want = ops(&x, &a, &b, &y, mask)?;
                    let f32 = |v: &Array| v.as_dtype(Dtype::Float32);
                    let diff = f32(&got)?.subtract(f32(&want)?)?.abs()?;
                    let update = f32(&want)?
                        .subtract(f32(&y)?)?
                        .abs()?
                        .mean(None)?
                        .item_exact::<f32>();
                    let max = diff.max(None)?.item_exact::<f32>();
                    let mean = diff.mean(None)?.item_exact::<f32>();
                    let kernel_us = chained(iterations, &y, |y| {
                        Ok(lora_kernel::add_update(&x, &a, &b, y, mask)?)
                    })?;
                    let ops_us = chained(iterations, &y, |y| ops(&x, &a, &b, y, mask))?;
                    println!(
                        "{{\"site\":\"{site}\",\"factors\":\"{factors:?}\",\"adapters\":{adapters},\"rows\":{rows},\"max_diff\":{max:.5},\"mean_diff\":{mean:.6},\"mean_update\":{update:.4},\"kernel_us\":{kernel_us:.1},\"ops_us\":{ops_us:.1}}}"
                    );
                    widened(
                        site,
                        factors,
                        adapters,
                        rows,
                        (k, n, w, layers),
                        &x,
                        &a,
                        &b,
                        mask,
                        iterations,
                    )?;
                }
            }
        }
    }
    if served == 0 {
        bail!(
            "the LoRA kernels serve nothing here (they run on a CUDA GPU, unless MLXD_LORA_KERNEL=0)"
        );
    }
    Ok(())
}
