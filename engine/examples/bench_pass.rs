//! The host cost of one forward pass over a long cached prompt, by what the pass does: where a
//! prefix hit's short prefill pass spends the ~6 ms of `async_eval` that a decode step over the
//! same cache does in ~2 (the step trace, H100, 2026-12-06).
//!
//! ```text
//! cargo run --release -p mlxd-engine --example bench_pass -- <model dir> [cached] [new] [reps]
//! ```
//!
//! A `cached`-token prompt (default 5000) is prefilled into one row's cache and copied out
//! once, as the prefix cache stores a row. Each repetition times one pass of `new` tokens
//! (default 15) in these cases:
//! - `hit`: on that copy, whose buffers must grow (as a prefix hit's pass does);
//! - `roomy`: on the prompt prefilled afresh, whose buffers have room (no growth);
//! - `roomy-1`: one token on a fresh prefill (a decode step's forward, no sampler);
//! - `hit-1`: one token on the copy (growth, one token).
//!
//! Prints one JSON line per case: the medians of graph building, `async_eval` and the wait, and
//! the pass's ops by primitive (counted on the first repetition, outside the timings).
//! Run it with `MLX_CUDA_USE_CUDNN_SDPA=0` too, to see cuDNN's share.
use std::path::PathBuf;

use anyhow::Context;
use mlx_rs::Array;
use mlxd_engine::cache::{BatchKv, LayerCache, SeqLayer, Stored};

#[path = "common/timed_pass.rs"]
mod timed_pass;
use timed_pass::{median, timed_pass};

fn main() -> anyhow::Result<()> {
    let usage = "usage: bench_pass <model dir> [cached] [new] [reps]";
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().context(usage)?);
    let cached: usize = args.next().map_or(Ok(5000), |a| a.parse()).context(usage)?;
    let new: usize = args.next().map_or(Ok(15), |a| a.parse()).context(usage)?;
    let reps: usize = args.next().map_or(Ok(10), |a| a.parse()).context(usage)?;
    let model = mlxd_engine::models::load(&dir)?;
    let vocab = model.info().vocab_size as u32;
    let prompt: Vec<u32> = (0..cached as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 100))
        .collect();
    // The prompt prefilled afresh, into buffers with room to spare.
    let prefilled = || -> anyhow::Result<Vec<LayerCache>> {
        let mut layers: Vec<LayerCache> = model
            .layer_kinds()
            .into_iter()
            .map(|kind| kind.fresh(vec![0], None))
            .collect();
        for chunk in prompt.chunks(2048) {
            let input = Array::from_slice(chunk, &[1, chunk.len() as i32]);
            model.forward(&input, &mut layers)?;
            mlx_rs::transforms::eval(layers.iter().flat_map(LayerCache::state))?;
        }
        Ok(layers)
    };
    let base = prefilled()?;
    // The row as the prefix cache keeps it: exactly `cached` positions.
    let rows: Vec<(Stored, Stored)> = base
        .iter()
        .map(|layer| match layer.row_copy(0)? {
            Some((SeqLayer::Kv(k, v), 0)) => Ok((k, v)),
            _ => anyhow::bail!("bench_pass reads plain attention caches only"),
        })
        .collect::<anyhow::Result<_>>()?;
    mlx_rs::transforms::eval(
        rows.iter()
            .flat_map(|(k, v)| [k.arrays(), v.arrays()])
            .flatten(),
    )?;
    // `roomy`: prefilled afresh; `hit`: the copied row as a hit finds it (the pass grows it
    // into new buffers, leaving the copy as it was).
    let layers_for = |roomy: bool| -> anyhow::Result<Vec<LayerCache>> {
        if roomy {
            return prefilled();
        }
        Ok(rows
            .iter()
            .map(|(k, v)| LayerCache::Batched(BatchKv::from_row(k.clone(), v.clone(), 0, None)))
            .collect())
    };
    let cudnn = std::env::var("MLX_CUDA_USE_CUDNN_SDPA").unwrap_or_else(|_| "default".into());
    let question: Vec<u32> = (0..new as u32).map(|i| 200 + i).collect();
    for (case, roomy, n) in [
        ("hit", false, new),
        ("roomy", true, new),
        ("roomy-1", true, 1),
        ("hit-1", false, 1),
    ] {
        let (mut graph, mut queue, mut wait) = (Vec::new(), Vec::new(), Vec::new());
        let mut ops = None;
        for rep in 0..=reps {
            let mut layers = layers_for(roomy)?;
            let input = Array::from_slice(&question[..n], &[1, n as i32]);
            let (t, counted) = timed_pass(&mut layers, ops.is_none(), |layers| {
                Ok(model.forward(&input, layers)?)
            })?;
            ops = ops.or(counted);
            if rep > 0 {
                graph.push(t.graph_us);
                queue.push(t.async_eval_us);
                wait.push(t.wait_us);
            }
        }
        println!(
            "{}",
            serde_json::json!({
                "case": case,
                "cached": cached,
                "tokens": n,
                "graph_us": median(graph),
                "async_eval_us": median(queue),
                "wait_us": median(wait),
                "ops": ops.as_ref().map(|o| o.total()),
                "computing": ops.as_ref().map(|o| o.computing()),
                "by_primitive": ops.map(|o| o.by_primitive),
                "cudnn_sdpa": cudnn,
            })
        );
    }
    Ok(())
}
