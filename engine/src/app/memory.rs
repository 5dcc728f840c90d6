//! The engine's memory: the bound on MLX's cache of freed buffers, set at start-up from the
//! KV budget, and the figures each `Stats` carries (`Stats.memory`), so that a growing engine
//! shows which part grows.
//!
//! MLX keeps the buffers of freed arrays for reuse, up to its cache limit. Its default limit
//! is its memory limit on a GPU (on CUDA 80 % of the device: an engine that served a burst
//! kept tens of GB it no longer used, which the supervisor's memory-fit policy does not see),
//! and 32 MiB on the CPU. The buffers worth keeping are those the next steps allocate again:
//! KV growing and activations, both of a size set by the KV budget, so the limit follows it:
//! first the configured budget (while the weights load), then the budget in force once the
//! runtime has derived it from the GPU's free memory ([`follow_kv_budget`]). Too low a limit
//! costs every decode step on CUDA: at the limit MLX frees each released buffer at once, and
//! its managed-memory buffers go back with a `cudaFree` that waits for the device.
//! The C heap around MLX (the tokenizer's and the server's allocations) is bounded by
//! `mlxd_ipc::heap`.
use std::sync::atomic::{AtomicU64, Ordering};

use mlxd_protocol::control::MemoryStats;

/// The smallest cache limit derived from a KV budget: below it, a step's activations would
/// be allocated afresh each time.
pub const MIN_CACHE_LIMIT: u64 = 64 << 20;

/// The cache limit without a KV budget (a device that does not report its free memory,
/// without a configured budget: the KV cache may grow to the context of every sequence, so
/// no size is given): as much as a budget of 4 GiB would give.
pub const UNBUDGETED_CACHE_LIMIT: u64 = 1 << 30;

/// The share of the KV budget that MLX may keep in freed buffers.
pub const CACHE_SHARE_OF_KV_BUDGET: u64 = 4;

/// MLX's cache limit for a KV budget: a quarter of the budget, at least [`MIN_CACHE_LIMIT`];
/// [`UNBUDGETED_CACHE_LIMIT`] without a budget; never above MLX's own default (`mlx_default`),
/// which is the lower bound already on the CPU.
pub fn cache_limit_for(kv_budget: Option<u64>, mlx_default: u64) -> u64 {
    let wanted = match kv_budget {
        Some(budget) => (budget / CACHE_SHARE_OF_KV_BUDGET).max(MIN_CACHE_LIMIT),
        None => UNBUDGETED_CACHE_LIMIT,
    };
    wanted.min(mlx_default)
}

/// The cache limit in force (MLX has no call that reads it back).
static CACHE_LIMIT: AtomicU64 = AtomicU64::new(0);

fn set_cache_limit(limit: u64) -> Result<u64, String> {
    let previous = mlx_rs::memory::set_cache_limit(limit as usize)
        .map_err(|e| format!("setting MLX's cache limit: {e}"))?;
    CACHE_LIMIT.store(limit, Ordering::Relaxed);
    Ok(previous as u64)
}

/// Sets MLX's cache limit from the configured KV budget; returns the limit set and MLX's
/// default. Call once the device is chosen (the default depends on it) and before the model
/// loads.
pub fn bound_mlx_cache(kv_budget: Option<u64>) -> Result<(u64, u64), String> {
    // Setting a limit returns the previous one: the default, at start-up.
    let default = set_cache_limit(u64::MAX)?;
    let limit = cache_limit_for(kv_budget, default);
    set_cache_limit(limit)?;
    Ok((limit, default))
}

/// Sets MLX's cache limit from the KV budget in force (the configured one, cut to what the
/// GPU holds, or derived from its free memory: `Runtime::in_force`), so that a GPU engine
/// without a configured budget keeps a quarter of its derived one rather than
/// [`UNBUDGETED_CACHE_LIMIT`]; `mlx_default` as [`bound_mlx_cache`] returned it. Returns the
/// limit now in force.
pub fn follow_kv_budget(kv_budget: Option<u64>, mlx_default: u64) -> Result<u64, String> {
    let limit = cache_limit_for(kv_budget, mlx_default);
    if limit != CACHE_LIMIT.load(Ordering::Relaxed) {
        set_cache_limit(limit)?;
    }
    Ok(limit)
}

/// The figures `Stats.memory` reports now. A figure MLX cannot give is an error: the
/// reporter logs it and sends none rather than a zero that reads as "nothing held".
pub fn snapshot() -> Result<MemoryStats, String> {
    let mlx = |what: &str, r: mlx_rs::error::Result<usize>| {
        r.map(|v| v as u64)
            .map_err(|e| format!("reading MLX's {what}: {e}"))
    };
    Ok(MemoryStats {
        rss_bytes: mlxd_ipc::heap::resident_bytes()
            .map_err(|e| format!("reading the resident set size: {e}"))?,
        mlx_active_bytes: mlx("active memory", mlx_rs::memory::active_memory())?,
        mlx_cache_bytes: mlx("cache memory", mlx_rs::memory::cache_memory())?,
        mlx_cache_limit_bytes: CACHE_LIMIT.load(Ordering::Relaxed),
        mlx_peak_bytes: mlx("peak memory", mlx_rs::memory::peak_memory())?,
        mlx_memory_limit_bytes: mlx("memory limit", mlx_rs::memory::memory_limit())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn the_cache_limit_follows_the_kv_budget() {
        // A GPU's default (CUDA: 80 % of an H200) is far above what a budget needs.
        let gpu_default = 113 * GIB;
        assert_eq!(cache_limit_for(Some(16 * GIB), gpu_default), 4 * GIB);
        assert_eq!(cache_limit_for(Some(GIB), gpu_default), 256 * MIB);
        // A budget derived from an H100's free memory once a 1B model is loaded
        // (`follow_kv_budget`): a quarter of it, below MLX's default of 80 % of the device.
        assert_eq!(cache_limit_for(Some(60 * GIB), 64 * GIB), 15 * GIB);
        // A small budget still keeps a step's activations.
        assert_eq!(cache_limit_for(Some(MIB), gpu_default), MIN_CACHE_LIMIT);
        assert_eq!(
            cache_limit_for(None, gpu_default),
            UNBUDGETED_CACHE_LIMIT,
            "without a budget the limit is still bounded"
        );
        // Never above MLX's default: the CPU's 32 MiB stays.
        assert_eq!(cache_limit_for(Some(16 * GIB), 32 * MIB), 32 * MIB);
        assert_eq!(cache_limit_for(None, 32 * MIB), 32 * MIB);
    }
}
