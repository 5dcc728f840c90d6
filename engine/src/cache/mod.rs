//! KV caches: one layer-cache abstraction with its layouts, and the manager that owns the
//! KV budget and the prefix cache.
//!
//! A model's attention sees a [`LayerCache`] and asks it three things: the rotary offset of the
//! new positions, to append keys and values and fetch everything held, and the attention mask.
//! Each layout answers them its own way:
//! - [`DenseKv`]: one sequence, as mlx-lm's `KVCache` (the serial reference path);
//! - [`BatchKv`]: many sequences in one buffer, left-padded, with per-row offsets and masks,
//!   as mlx-lm's `BatchKVCache` (the runtime's decode batch and prefill groups), holding its
//!   keys and values plain or quantized ([`Stored`], `--kv-bits`), and bounded by the window
//!   for a sliding-window layer.
//!
//! A sequence's KV outside the batch (prefix cache, SSD tier, checkpoints) is a [`SeqKv`].
mod batched;
mod budget;
mod dense;
mod manager;
mod prefix;
mod seq_kv;
pub mod ssd;
mod stored;

pub use batched::{BatchKv, WINDOW_SLACK};
pub use budget::{KvBudget, Reservation};
pub use dense::DenseKv;
pub use manager::{CacheManager, PrefixHit};
pub use prefix::{PrefixCache, PrefixLookup};
pub use seq_kv::SeqKv;
pub use stored::{KvLayout, KvQuant, Stored};

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::Array;

use crate::models::layers::Rope;

/// Positions a cache buffer grows by (mlx-lm's `KVCache.step`).
pub(crate) const STEP: i32 = 256;

/// The cache of one layer, in one of its layouts.
#[derive(Debug)]
pub enum LayerCache {
    Dense(DenseKv),
    Batched(BatchKv),
}

/// An attention mask that a layout computed for the queries of one forward pass.
pub enum Mask {
    /// Every query sees every key (one query, no padding).
    None,
    /// Causal over the new positions, no padding.
    Causal,
    /// A boolean `[B, 1, L, T]` mask (true = attend): padding and causality together.
    Array(Array),
}

impl Mask {
    pub fn as_sdpa(&self) -> Option<ScaledDotProductAttentionMask<'_>> {
        match self {
            Mask::None => None,
            Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
            Mask::Array(a) => Some(ScaledDotProductAttentionMask::Array(a)),
        }
    }
}

/// The mask of `queries` new positions at the end of one sequence's `keys` positions.
fn dense_mask(keys: i32, queries: i32, window: Option<usize>) -> Result<Mask, Exception> {
    match window.map(|w| w as i32).filter(|&w| w < keys) {
        None if queries > 1 => Ok(Mask::Causal),
        None => Ok(Mask::None),
        Some(w) => {
            let k = Array::arange::<_, i32>(None, keys, None)?.reshape(&[1, 1, 1, keys])?;
            let q = Array::arange::<_, i32>(keys - queries, keys, None)?
                .reshape(&[1, 1, queries, 1])?;
            let distance = q.subtract(&k)?;
            let mask = distance
                .ge(Array::from_int(0))?
                .logical_and(&distance.lt(Array::from_int(w))?)?;
            Ok(Mask::Array(mask))
        }
    }
}

impl LayerCache {
    /// Applies the rotary embedding to `[B, heads, L, head_dim]` at the positions the new
    /// tokens will take (per row for a batch).
    pub fn rope(&self, rope: &Rope, x: &Array) -> Result<Array, Exception> {
        match self {
            LayerCache::Dense(c) => rope.forward(x, c.offset() as i32),
            LayerCache::Batched(c) => c.rope(rope, x),
        }
    }

    /// Appends `[B, kv_heads, L, head_dim]` keys and values; returns all held so far, as the
    /// layout stores them.
    pub fn update_and_fetch(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(Stored, Stored), Exception> {
        match self {
            LayerCache::Dense(c) => c.update_and_fetch(keys, values),
            LayerCache::Batched(c) => c.update_and_fetch(keys, values),
        }
    }

    /// The mask for `queries` new positions, called after [`Self::update_and_fetch`]; with a
    /// `window`, each query sees at most that many keys, itself included (mlx-lm's
    /// `RotatingKVCache` with `max_size = window`, and its windowed causal mask).
    pub fn mask(&self, queries: i32, window: Option<usize>) -> Result<Mask, Exception> {
        match self {
            LayerCache::Dense(c) => dense_mask(c.offset() as i32, queries, window),
            LayerCache::Batched(c) => c.mask(queries, window),
        }
    }

    /// Whether the last `window` positions held are valid for every row (see
    /// [`BatchKv::whole_window`]); for one sequence, whether it holds that many.
    pub fn whole_window(&self, window: usize) -> bool {
        match self {
            LayerCache::Dense(c) => c.offset() >= window,
            LayerCache::Batched(c) => c.whole_window(window),
        }
    }

    /// Drops the last `drop[r]` positions of each row `r` (speculative rollback).
    pub fn rollback(&mut self, drop: &[usize]) -> Result<(), Exception> {
        match self {
            LayerCache::Dense(c) => match drop {
                [n] if *n <= c.offset() => {
                    c.trim(*n);
                    Ok(())
                }
                _ => Err(Exception::custom(format!(
                    "rollback of {drop:?} positions in a one-sequence cache of {}",
                    c.offset()
                ))),
            },
            LayerCache::Batched(c) => c.rollback(drop),
        }
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        match self {
            LayerCache::Dense(c) => c.nbytes(),
            LayerCache::Batched(c) => c.nbytes(),
        }
    }

    /// The arrays to evaluate to materialise the cache.
    pub fn state(&self) -> Vec<&Array> {
        match self {
            LayerCache::Dense(c) => c.state(),
            LayerCache::Batched(c) => c.state(),
        }
    }

    pub fn into_batched(self) -> Option<BatchKv> {
        match self {
            LayerCache::Batched(c) => Some(c),
            LayerCache::Dense(_) => None,
        }
    }

    pub fn as_batched_mut(&mut self) -> Option<&mut BatchKv> {
        match self {
            LayerCache::Batched(c) => Some(c),
            LayerCache::Dense(_) => None,
        }
    }
}
