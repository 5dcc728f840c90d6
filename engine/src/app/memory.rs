//! The engine's memory: the bound on MLX's cache of freed buffers, set at start-up from the
//! KV budget, and the figures each `Stats` carries (`Stats.memory`), so that a growing engine
//! shows which part grows.
//!
//! MLX keeps the buffers of freed arrays for reuse, up to its cache limit. Its default limit
//! is its memory limit on a GPU (on CUDA 80 % of the device: an engine that served a burst
//! kept tens of GB it no longer used, which the supervisor's memory-fit policy does not see),
//! and 32 MiB on the CPU. The buffers worth keeping are those the next steps allocate again:
//! KV growing and activations, both of a size set by the KV budget, so the limit follows it.
//! The C heap around MLX (the tokenizer's and the server's allocations) is bounded by
//! `mlxd_ipc::heap`.
use std::sync::atomic::{AtomicU64, Ordering};

use mlxd_protocol::control::MemoryStats;

/// The smallest cache limit derived from a KV budget: below it, a step's activations would
/// be allocated afresh each time.
pub const MIN_CACHE_LIMIT: u64 = 64 << 20;

/// The cache limit without a KV budget (the KV cache may grow to the context of every
/// sequence, so the budget gives no size): as much as a budget of 4 GiB would give. Not a
/// cost to serving: on an H100 an engine whose limit was a quarter of its device-derived
/// budget (18.6 GB, of which it kept 7.6 GB) served 32 streams no faster than at this limit
/// (session 48, `scripts/bench/cache_limit.sh`).
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

/// Sets MLX's cache limit from the KV budget; returns the limit set and MLX's default.
/// Call once the device is chosen (the default depends on it) and before the model loads.
pub fn bound_mlx_cache(kv_budget: Option<u64>) -> Result<(u64, u64), String> {
    let mlx_err = |e: mlx_rs::error::Exception| format!("setting MLX's cache limit: {e}");
    // Setting a limit returns the previous one: the default, at start-up.
    let default = mlx_rs::memory::set_cache_limit(usize::MAX).map_err(mlx_err)? as u64;
    let limit = cache_limit_for(kv_budget, default);
    mlx_rs::memory::set_cache_limit(limit as usize).map_err(mlx_err)?;
    CACHE_LIMIT.store(limit, Ordering::Relaxed);
    Ok((limit, default))
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
