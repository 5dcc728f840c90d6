//! The host cost of decode passes with adapters, by what changes from one pass to the next:
//! the set of adapters the rows take, or the number of rows. Served rounds over four adapters
//! showed passes costing 60–160 ms of `async_eval` where a base pass costs 5–7 (H100,
//! 2026-12-06); this separates a new set of adapters from a new shape.
//!
//! ```text
//! cargo run --release -p mlxd-engine --example bench_adapter_pass -- <model dir> <adapter dir>[,<adapter dir>...] [reps]
//! ```
//!
//! Each case prefills 8 tokens into fresh caches (untimed), then times `reps` one-token passes
//! (graph building, `async_eval`, the wait), printing the first pass and the median of the
//! others, with the first pass's op count:
//! - `base-32`, `all-32`: 32 rows without adapters, and row `i` taking adapter `i mod n`;
//! - `alternate-32`: passes alternating between rows over the first half of the adapters and
//!   rows over all of them (a set that changes every pass, as rows of other adapters join and
//!   leave a served batch);
//! - `rows-<B>` for B = 3, 5, 7, …: all adapters, each row count new to the process.
use std::path::PathBuf;

use anyhow::Context;
use mlx_rs::Array;
use mlxd_engine::adapters::AdapterId;
use mlxd_engine::cache::LayerCache;
use mlxd_engine::models::CausalLm;

#[path = "common/timed_pass.rs"]
mod timed_pass;
use timed_pass::{median, timed_pass};

/// Fresh caches for `rows` rows holding 8 prompt tokens each, prefilled with `adapters`.
fn prefilled(
    model: &dyn CausalLm,
    adapters: &[Option<AdapterId>],
) -> anyhow::Result<Vec<LayerCache>> {
    let rows = adapters.len();
    let mut layers: Vec<LayerCache> = model
        .layer_kinds()
        .into_iter()
        .map(|kind| kind.fresh(vec![0; rows], None))
        .collect();
    let tokens: Vec<u32> = (0..rows as u32 * 8).map(|i| 100 + i % 500).collect();
    let input = Array::from_slice(&tokens, &[rows as i32, 8]);
    let _selected = mlxd_engine::adapters::select(model, adapters.iter().copied())?;
    model.forward(&input, &mut layers)?;
    mlx_rs::transforms::eval(layers.iter().flat_map(LayerCache::state))?;
    Ok(layers)
}

/// Times `reps` one-token passes on caches prefilled for `first`, pass `k` taking the rows'
/// adapters `pass(k)`; prints one JSON line.
fn case(
    model: &dyn CausalLm,
    name: &str,
    first: &[Option<AdapterId>],
    reps: usize,
    pass: impl Fn(usize) -> Vec<Option<AdapterId>>,
) -> anyhow::Result<()> {
    let rows = first.len();
    let mut layers = prefilled(model, first)?;
    let (mut graph, mut queue, mut wait) = (Vec::new(), Vec::new(), Vec::new());
    let mut ops = None;
    for k in 0..reps {
        let tokens: Vec<u32> = (0..rows as u32).map(|i| 700 + i + k as u32).collect();
        let input = Array::from_slice(&tokens, &[rows as i32, 1]);
        let (t, counted) = timed_pass(&mut layers, ops.is_none(), |layers| {
            let _selected = mlxd_engine::adapters::select(model, pass(k))?;
            Ok(model.forward(&input, layers)?)
        })?;
        ops = ops.or(counted);
        graph.push(t.graph_us);
        queue.push(t.async_eval_us);
        wait.push(t.wait_us);
    }
    let first_and_rest = |v: Vec<u128>| (v[0], median(v[1..].to_vec()));
    let (g0, g) = first_and_rest(graph);
    let (q0, q) = first_and_rest(queue);
    let (w0, w) = first_and_rest(wait);
    println!(
        "{}",
        serde_json::json!({
            "case": name,
            "rows": rows,
            "first": {"graph_us": g0, "async_eval_us": q0, "wait_us": w0},
            "median": {"graph_us": g, "async_eval_us": q, "wait_us": w},
            "ops": ops.as_ref().map(|o| o.total()),
            "lora_kernel": std::env::var("MLXD_LORA_KERNEL").unwrap_or_else(|_| "default".into()),
        })
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let usage = "usage: bench_adapter_pass <model dir> <adapter dir>[,<adapter dir>...] [reps]";
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().context(usage)?);
    let dirs: Vec<PathBuf> = args
        .next()
        .context(usage)?
        .split(',')
        .map(PathBuf::from)
        .collect();
    let reps: usize = args.next().map_or(Ok(8), |a| a.parse()).context(usage)?;
    anyhow::ensure!(reps >= 2, "{usage}: at least 2 reps");
    let model = mlxd_engine::models::load(&dir)?;
    let table = model
        .adapters()
        .context("this model holds no adapter table")?
        .clone();
    let ids: Vec<AdapterId> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| table.load(&format!("a{i}"), d))
        .collect::<Result<_, _>>()?;
    let over = |n: usize, rows: usize| -> Vec<Option<AdapterId>> {
        (0..rows).map(|i| Some(ids[i % n])).collect()
    };
    let all = ids.len();
    let half = all.div_ceil(2);
    // Warm-up: kernels built and loaded, buffers cached, for the timed cases' shapes.
    case(&*model, "warm-up", &over(all, 32), reps, |_| over(all, 32))?;
    case(&*model, "base-32", &[None; 32], reps, |_| vec![None; 32])?;
    case(&*model, "all-32", &over(all, 32), reps, |_| over(all, 32))?;
    case(&*model, "alternate-32", &over(all, 32), reps, |k| {
        over(if k % 2 == 0 { half } else { all }, 32)
    })?;
    for rows in [3, 5, 7, 9, 11, 13] {
        case(
            &*model,
            &format!("rows-{rows}"),
            &over(all, rows),
            reps,
            |_| over(all, rows),
        )?;
    }
    Ok(())
}
