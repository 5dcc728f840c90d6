//! One forward pass timed as the step trace splits a step's host time, shared by the pass
//! benchmarks (`bench_pass`, `bench_adapter_pass`).
use std::time::Instant;

use mlx_rs::Array;
use mlxd_engine::cache::LayerCache;
use mlxd_engine::graph_ops::{op_counts, OpCounts};

/// Host microseconds of one pass: building its graph, queueing it (`async_eval`), waiting for
/// the device.
pub struct PassTimes {
    pub graph_us: u128,
    pub async_eval_us: u128,
    pub wait_us: u128,
}

/// Builds a pass with `build` (its logits, written into `layers`), then queues it with the
/// caches and waits for them. With `count`, also the graph's ops, counted outside the timings.
pub fn timed_pass(
    layers: &mut Vec<LayerCache>,
    count: bool,
    build: impl FnOnce(&mut Vec<LayerCache>) -> anyhow::Result<Array>,
) -> anyhow::Result<(PassTimes, Option<OpCounts>)> {
    let t0 = Instant::now();
    let logits = build(layers)?;
    let graph_us = t0.elapsed().as_micros();
    let ops = count.then(|| op_counts(&logits));
    let mut outs: Vec<&Array> = layers.iter().flat_map(LayerCache::state).collect();
    outs.push(&logits);
    let t1 = Instant::now();
    mlx_rs::transforms::async_eval(outs.iter().copied())?;
    let t2 = Instant::now();
    mlx_rs::transforms::eval(outs)?;
    let times = PassTimes {
        graph_us,
        async_eval_us: (t2 - t1).as_micros(),
        wait_us: t2.elapsed().as_micros(),
    };
    Ok((times, ops))
}

/// The median of `v` (0 when empty).
pub fn median(mut v: Vec<u128>) -> u128 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}
